"""Multi-LoRA serving against HF PEFT: PEFT adapters of different ranks and target modules,
each request's tokens and log-probs those of PEFT's model with its adapter, alone and in
batches mixing adapters and base requests; more adapters than device slots; refusals."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
from conftest import hf_greedy

from jaxpage import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, alpha, target modules, rsLoRA): ranks 2-16, different target sets
ADAPTERS = [
    (4, 8, ["q_proj", "v_proj"], False),
    (8, 16, ALL, False),
    (2, 4, ["o_proj", "gate_proj", "up_proj", "down_proj"], True),
    (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
]
MAX_RANK = 16
NEW_TOKENS = 8
LOGPROB_TOL = 2e-4  # float32: the engine's top log-probs against PEFT's log_softmax


def make_adapters(base, directory, seed: int = 0) -> list[tuple[str, object]]:
    """PEFT adapters (random A and B, so each changes the model) saved under `directory`;
    returns [(path, the PEFT model with that adapter)]."""
    out = []
    for i, (rank, alpha, targets, rslora) in enumerate(ADAPTERS):
        torch.manual_seed(seed * 100 + i)
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                 use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0)
        model = peft.get_peft_model(copy.deepcopy(base), config)
        with torch.no_grad():  # large enough deltas that greedy tokens change
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.mul_(3.0)
        model.eval()
        path = os.path.join(directory, f"adapter{i}")
        model.save_pretrained(path)
        out.append((path, model))
    return out


@pytest.fixture(scope="module")
def family(request, hf_model_dir, tmp_path_factory):
    name = request.param
    path, base = hf_model_dir(name)
    adapters = make_adapters(base, str(tmp_path_factory.mktemp(f"lora_{name}")))
    return name, path, base, adapters


def prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(5, 30))).tolist() for _ in range(count)]


def peft_logprobs(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def check_against_peft(outputs, jobs, base) -> None:
    """Each output's greedy tokens are its model's (PEFT with its adapter, or the base),
    and its top log-probs PEFT's within LOGPROB_TOL."""
    for out, (prompt, adapter) in zip(outputs, jobs, strict=True):
        model = base if adapter is None else adapter
        completion = out.outputs[0]
        want = hf_greedy(model, prompt, NEW_TOKENS)
        assert completion.token_ids == want, (adapter is None, prompt)
        ref = peft_logprobs(model, prompt + want)
        for j, top in enumerate(completion.logprobs):
            row = ref[len(prompt) - 1 + j]
            for token, logprob in top.items():
                assert abs(logprob - row[token]) < LOGPROB_TOL, (j, token, logprob, row[token])


def lora_requests(adapters) -> list[LoRARequest]:
    return [LoRARequest(f"a{i}", i + 1, path) for i, (path, _) in enumerate(adapters)]


PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"], indirect=True)
def test_each_adapter_alone_and_mixed_equals_peft(family):
    """Four adapters of ranks 2-16 over different target sets (Qwen2: q/k/v biases; Gemma 2:
    its own norms, soft-caps and GELU MLP): alone, each request's greedy tokens and top
    log-probs are PEFT's with its adapter; then all four and base requests in one batch."""
    name, path, base, adapters = family
    llm = LLM(path, enable_lora=True, max_loras=4, max_lora_rank=MAX_RANK, num_blocks=128,
              max_num_seqs=16)
    requests = lora_requests(adapters)
    vocab = base.config.vocab_size
    for i, (lora, (_, model)) in enumerate(zip(requests, adapters, strict=True)):
        batch = prompts(vocab, 2, seed=i)
        outs = llm.generate(batch, PARAMS, lora_request=lora)
        check_against_peft(outs, [(p, model) for p in batch], base)
        # the adapter matters: the base model's tokens differ
        assert any(hf_greedy(base, p, NEW_TOKENS) != out.outputs[0].token_ids
                   for p, out in zip(batch, outs, strict=True))
    jobs = [(p, None if k % 5 == 4 else adapters[k % 5][1])
            for k, p in enumerate(prompts(vocab, 10, seed=99))]
    lora_list = [None if k % 5 == 4 else requests[k % 5] for k in range(len(jobs))]
    outs = llm.generate([p for p, _ in jobs], PARAMS, lora_request=lora_list)
    check_against_peft(outs, jobs, base)
    assert llm.stats()["compiles"] <= llm.engine.runner.max_compiles


POOLS = {"roomy": dict(num_blocks=128),
         # preempting by swap: a swapped-out request finds its adapter a slot to come back
         "swapping": dict(num_blocks=24, preemption_mode="swap", swap_space=1 << 20,
                          debug_nan_pool=True)}


@pytest.mark.parametrize("family", ["llama"], indirect=True)
@pytest.mark.parametrize("pool", sorted(POOLS))
def test_more_adapters_than_slots(family, pool):
    """Four adapters and base requests through 2 device slots (and 2 adapters in host
    memory): every request gets its own adapter's tokens, slots are written again as
    adapters take turns, and a prompt cached under one adapter is no hit for another."""
    _, path, base, adapters = family
    llm = LLM(path, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=MAX_RANK,
              max_num_seqs=8, block_size=4, **POOLS[pool])
    requests = lora_requests(adapters)
    vocab = base.config.vocab_size
    jobs, loras = [], []
    for k, p in enumerate(prompts(vocab, 12, seed=5)):
        which = k % 5
        jobs.append((p, None if which == 4 else adapters[which][1]))
        loras.append(None if which == 4 else requests[which])
    outs = llm.generate([p for p, _ in jobs], PARAMS, lora_request=loras)
    check_against_peft(outs, jobs, base)
    if pool == "swapping":
        assert llm.stats()["num_swapped_preemptions"] > 0
        return
    scheduler = llm.engine.scheduler
    # four adapters took turns in the 2 slots; 2 adapters stay read in host memory
    stats = llm.stats()["lora"]
    assert stats["known"] == 4 and stats["slot_writes"] >= 4 and len(stats["resident"]) == 2
    assert len(stats["in_host_memory"]) <= 2
    # the same prompt under adapter 0, again under adapter 0 (a hit), then adapter 1 (none)
    shared = prompts(vocab, 1, seed=77)[0] * 2
    first, = llm.generate([shared], PARAMS, lora_request=requests[0])
    again, = llm.generate([shared], PARAMS, lora_request=requests[0])
    compiles, loads = llm.stats()["compiles"], scheduler.loras.num_loads
    other, = llm.generate([shared], PARAMS, lora_request=requests[1])
    # adapter 1 was written into a slot, and `first`'s shapes ran it: nothing compiled
    assert scheduler.loras.num_loads == loads + 1
    assert llm.stats()["compiles"] == compiles
    base_out, = llm.generate([shared], PARAMS)
    assert first.metrics.num_cached_tokens == 0
    assert again.metrics.num_cached_tokens > 0
    assert other.metrics.num_cached_tokens == 0
    assert base_out.metrics.num_cached_tokens == 0
    check_against_peft([again, other, base_out],
                       [(shared, adapters[0][1]), (shared, adapters[1][1]), (shared, None)],
                       base)


def write_adapter(directory, config: dict, tensors: dict) -> str:
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    return str(directory)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_bad_adapters_are_refused_and_the_engine_goes_on(family, tmp_path):
    """A malformed adapter, an unsupported target module, a rank over max_lora_rank, an id
    reused for another adapter, LoRA with enable_lora off: each a ValueError naming it at
    the door, and the requests already running finish with their adapter's tokens."""
    _, path, base, adapters = family
    llm = LLM(path, enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=64)
    good = LoRARequest("good", 1, adapters[1][0])  # rank 8
    prompt = prompts(base.config.vocab_size, 1, seed=3)[0]
    llm.engine.add_request("running", prompt, PARAMS, lora_request=good)
    h = base.config.hidden_size
    rng = np.random.default_rng(0)
    cases = {
        "rank 16 \\(layer 0 [a-z]_proj\\) exceeds max_lora_rank 8":
            LoRARequest("big", 2, adapters[3][0]),
        "no adapter_config.json": LoRARequest("missing", 3, str(tmp_path / "nothing")),
        "target module 'lm_head'|not a LoRA weight": LoRARequest("head", 4, write_adapter(
            tmp_path / "head", {"peft_type": "LORA", "r": 2, "lora_alpha": 2},
            {"base_model.model.lm_head.lora_A.weight": rng.random((2, h), np.float32),
             "base_model.model.lm_head.lora_B.weight": rng.random((97, 2), np.float32)})),
        "target module 'embed_proj' is not supported": LoRARequest("odd", 5, write_adapter(
            tmp_path / "odd", {"peft_type": "LORA", "r": 2, "lora_alpha": 2},
            {"base_model.model.model.layers.0.mlp.embed_proj.lora_A.weight":
                rng.random((2, h), np.float32),
             "base_model.model.model.layers.0.mlp.embed_proj.lora_B.weight":
                rng.random((h, 2), np.float32)})),
        "lora_A \\(2, 5\\)": LoRARequest("shape", 6, write_adapter(
            tmp_path / "shape", {"peft_type": "LORA", "r": 2, "lora_alpha": 2},
            {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                rng.random((2, 5), np.float32),
             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                rng.random((h, 2), np.float32)})),
        "use_dora=True is not supported": LoRARequest("dora", 7, write_adapter(
            tmp_path / "dora", {"peft_type": "LORA", "r": 2, "use_dora": True}, {})),
        "is not JSON": LoRARequest("json", 8, write_adapter(tmp_path / "json", {}, {})),
        "lora_int_id 1 is already adapter 'good'": LoRARequest("other", 1, adapters[0][0]),
    }
    with open(tmp_path / "json" / "adapter_config.json", "w") as f:
        f.write("{not json")
    for message, lora in cases.items():
        with pytest.raises(ValueError, match=message):
            llm.engine.add_request(f"bad-{lora.lora_name}", prompt, PARAMS, lora_request=lora)
    tokens: dict[str, list[int]] = {}  # the engine's outputs are deltas
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert tokens == {"running": hf_greedy(adapters[1][1], prompt, NEW_TOKENS)}
    off = LLM(path, num_blocks=16)
    with pytest.raises(ValueError, match="enable_lora=True"):
        off.generate([prompt], PARAMS, lora_request=good)
    with pytest.raises(ValueError, match="max_cpu_loras must be None or an integer >= "
                                         "max_loras"):
        LLM(path, enable_lora=True, max_loras=4, max_cpu_loras=2)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_steps_under_adapters(family, method):
    """Drafts verified under each request's adapter (prompt lookup's, or a draft model's
    own, which proposes without adapters): PEFT's greedy tokens, some drafts accepted."""
    _, path, base, adapters = family
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        spec["model"] = path  # the base model drafts for its adapters
    llm = LLM(path, enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK, num_blocks=128,
              speculative_config=spec)
    requests = lora_requests(adapters)
    rng = np.random.default_rng(4)
    batch = [(rng.integers(3, 40, size=6).tolist() * 4) for _ in range(5)]  # lookups find
    jobs = [(p, None if k == 4 else adapters[k][1]) for k, p in enumerate(batch)]
    loras = [None if k == 4 else requests[k] for k in range(len(batch))]
    outs = llm.generate(batch, PARAMS, lora_request=loras)
    check_against_peft(outs, jobs, base)
    assert llm.stats()["spec_decode"]["num_accepted_tokens"] > 0


FAULTS = ("slot write", "slot write losing the slots", "forward losing the pool")


@pytest.mark.parametrize("family", ["llama"], indirect=True)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_failed_step_loses_no_adapter(family, fault):
    """A slot write that fails once (with the donated slot stacks freed, or not), or a
    forward under adapters that fails after freeing the donated KV pool: the step raises
    once, and every request still gets its adapter's tokens (the writes are made again, the
    slots rebuilt and rewritten where they were lost)."""
    import jax

    _, path, base, adapters = family
    llm = LLM(path, enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK, num_blocks=64,
              block_size=4, debug_nan_pool=True)
    engine, runner = llm.engine, llm.engine.runner
    requests = lora_requests(adapters)
    batch = prompts(base.config.vocab_size, 6, seed=11)
    jobs = [(p, None if k == 5 else adapters[k % 4][1]) for k, p in enumerate(batch)]
    for k, p in enumerate(batch):
        engine.add_request(f"r{k}", p, PARAMS, lora_request=None if k == 5 else requests[k % 4])
    fired = []

    def lose(tree):
        for leaf in jax.tree.leaves(tree):
            leaf.delete()

    if fault.startswith("slot write"):
        write = runner.load_lora

        def failing_write(slot, weights):
            if not fired and len(engine.scheduler.loras.resident()) == 2 and slot == 2:
                fired.append(slot)
                if "losing" in fault:
                    lose(runner.lora_stacks)
                raise RuntimeError("injected failure")
            return write(slot, weights)
        runner.load_lora = failing_write
    else:
        execute = runner.execute

        def failing_execute(seqs):
            if not fired and any(s.lora_slot for s in seqs) and engine.num_steps >= 3:
                fired.append(len(seqs))
                lose(runner.kv_pool)
                raise RuntimeError("injected failure")
            return execute(seqs)
        runner.execute = failing_execute
    tokens: dict[str, list[int]] = {}
    raised = 0
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        try:
            outputs = engine.step()
        except RuntimeError as exc:
            assert "injected" in str(exc)
            raised += 1
            continue
        for out in outputs:
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert raised == 1 and fired
    for k, (prompt, model) in enumerate(jobs):
        assert tokens[f"r{k}"] == hf_greedy(base if model is None else model, prompt,
                                            NEW_TOKENS), k


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_an_adapter_loaded_while_decodes_run_ahead(family):
    """A request's decode steps run ahead of the host, each made on the device from the one
    before (`ModelRunner._advance`), while a second request arrives with another adapter:
    writing its slot replaces the adapters' stacks (the old ones donated), and the steps made
    from before it take the new ones. On the jnp path the prompt runs in a call of its own, so
    the decode rows keep running ahead across the load. Both requests get their adapter's
    tokens (PEFT's)."""
    _, path, base, adapters = family
    llm = LLM(path, enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK, num_blocks=64,
              attention_backend="jnp")
    engine, requests = llm.engine, lora_requests(adapters)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first, second = prompts(base.config.vocab_size, 2, seed=21)
    engine.add_request("first", first, greedy, lora_request=requests[0])
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        if engine.num_steps == 4:
            engine.add_request("second", second, greedy, lora_request=requests[1])
        for out in engine.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert tokens["first"] == hf_greedy(adapters[0][1], first, NEW_TOKENS)
    assert tokens["second"] == hf_greedy(adapters[1][1], second, NEW_TOKENS)
    assert llm.stats()["lookahead_hits"] >= NEW_TOKENS
