"""Sliding-window layers paged as such: the window group (jaxpage.engine.kv_groups) holds only
each sequence's window, and generation through the engine still equals HF transformers,
under chunked prefill, prefix hits, preemption and n > 1 forks.

Models: a tiny Mistral with a 16-token window (every layer sliding: only the window group has
a pool), and tiny Gemma 2 (alternating sliding and global layers, soft-caps) and Gemma 3 (five
sliding layers, then a global one) with the same window: both groups, moved in lockstep.
Prompts reach 90 tokens and outputs run 20 past them, far past the window."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import hf_greedy, slow_unless

from jaxpage import LLM, SamplingParams
from jaxpage.engine.block_allocator import NULL_BLOCK
from jaxpage.engine.kv_groups import WindowedAllocator, window_blocks_per_seq

WINDOW, BLOCK = 16, 4
MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
BACKENDS = ["reference", "jnp", "cpp"]
MODELS = ["mistral", "gemma2", "gemma3"]
# the Pallas kernels in interpret mode: slow on CPU, with the kernel tests. Through the engine
# they run 3 of the prompts (16, 40, 61 tokens), which still preempt and hit: all 6 took
# 13 minutes a kernel on a 2-core Zen 3 (81 steps at block 8, every one interpreted)
PALLAS = [pytest.param(b, marks=[pytest.mark.slow, pytest.mark.kernels])
          for b in ("pallas_gpu", "pallas_tpu")]
PALLAS_PROMPTS = [1, 3, 4]


def model_backend_cases(backends) -> list:
    """(model, backend) params: the cpp kernel (the CPU's own path) on every model, the other
    backends on Mistral in the default suite and on the Gemmas in the slow one (~85 s of the
    default suite on a 2-core Zen 3)."""
    return [slow_unless(backend == "cpp" or name == "mistral", name, backend)
            for name in MODELS for backend in backends]


@pytest.fixture(scope="module")
def hf_models(hf_model_dir):
    """name -> (HF directory, HF model), each built once (Mistral with the 16-token window)."""
    return lambda name: hf_model_dir(name, **({"sliding_window": WINDOW}
                                              if name == "mistral" else {}))


@pytest.fixture(scope="module")
def mistral(hf_models):
    return hf_models("mistral")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(3, 97, size=n).tolist() for n in (5, 16, 17, 40, 61, 90)]


@pytest.fixture(scope="module")
def expected(hf_models, prompts):
    """name -> HF greedy continuations of the prompts."""
    cache = {}

    def get(name):
        if name not in cache:
            model = hf_models(name)[1]
            cache[name] = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
        return cache[name]

    return get


def held_blocks(num_tokens: int) -> int:
    """The arithmetic: a sequence with n computed tokens holds the window blocks from the
    one holding position n - WINDOW + 1 to its last."""
    return -(-num_tokens // BLOCK) - max(0, (num_tokens - WINDOW + 1) // BLOCK)


def check(llm, prompts, expected):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (out, exp) in enumerate(zip(outs, expected, strict=True)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} (len {len(prompts[i])})"
    llm.engine.allocator.check_invariants()
    stats = llm.stats()
    assert stats["kv_window_blocks_used"] == 0, "window blocks leaked"
    return stats


@pytest.mark.parametrize(("name", "backend"), model_backend_cases(BACKENDS))
def test_greedy_equals_hf_past_the_window(hf_models, prompts, expected, name, backend):
    llm = LLM(hf_models(name)[0], block_size=BLOCK, attention_backend=backend,
              max_num_batched_tokens=256, max_num_seqs=8, debug_nan_pool=True)
    stats = check(llm, prompts, expected(name))
    assert stats["sliding_window"] == WINDOW
    config = llm.engine.model.config
    per_layer = 2 * config.num_kv_heads * config.head_dim * 4  # K and V, float32
    sliding = sum(1 for w in config.layer_windows if w)
    expected_bytes = {"full_attention": (config.num_layers - sliding) * per_layer,
                      "sliding_attention": sliding * per_layer}
    assert stats["kv_bytes_per_token"] == {k: v for k, v in expected_bytes.items() if v}
    assert sliding == {"mistral": 2, "gemma2": 2, "gemma3": 5}[name]


@pytest.mark.parametrize(("name", "backend"), [
    *model_backend_cases(("jnp", "cpp")),
    *(pytest.param("gemma2", *p.values, marks=p.marks) for p in PALLAS),  # both groups
])
def test_chunked_prefill_prefix_hits_and_preemption(hf_models, prompts, expected, name,
                                                    backend):
    """A 12-token budget chunks every long prompt across window boundaries; a window pool of
    3 sequences' worst case preempts; every prompt runs twice so the second copy hits the
    prefix cache wherever the window group still holds the blocks."""
    block = 8 if backend == "pallas_tpu" else BLOCK  # Mosaic: blocks of whole sublanes
    per_seq = window_blocks_per_seq(WINDOW, block, 12, 512)
    pallas = backend.startswith("pallas")
    # interpreted, the Pallas kernels copy the full group's pool: the CPU's default 1 GiB pool
    # took the TPU case to 16 GB; 512 blocks hold every request and its cached prefix
    llm = LLM(hf_models(name)[0], block_size=block, attention_backend=backend,
              kernel_interpret=pallas, max_num_batched_tokens=12,
              max_num_seqs=6, num_window_blocks=3 * per_seq + 1, debug_nan_pool=True,
              **({"num_blocks": 512} if pallas else {}))
    chosen = PALLAS_PROMPTS if pallas else range(len(prompts))
    run, wanted = [prompts[i] for i in chosen], [expected(name)[i] for i in chosen]
    stats = check(llm, run * 2, wanted * 2)
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0


def test_window_blocks_follow_the_arithmetic_and_are_reused(mistral):
    """A 200-token sequence holds exactly the window blocks the arithmetic says after every
    step (and the next token's block where a decode that runs ahead took it a step early),
    and the blocks it releases serve a second request (the window pool is too small for both
    sequences' whole lengths); outputs equal each request run alone."""
    rng = np.random.default_rng(5)
    long_prompt = rng.integers(3, 97, size=150).tolist()
    other = rng.integers(3, 97, size=120).tolist()
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    per_seq = window_blocks_per_seq(WINDOW, BLOCK, 32, 512)
    llm = LLM(mistral[0], block_size=BLOCK, attention_backend="reference",
              max_num_batched_tokens=32, max_num_seqs=2, num_window_blocks=2 * per_seq + 1)
    assert 2 * per_seq + 1 < 2 * 200 // BLOCK  # whole sequences would not fit
    engine = llm.engine
    engine.add_request("long", long_prompt, params)
    engine.add_request("other", other, params)
    group = engine.allocator.window_group
    outputs, served = {}, {}  # block id -> the (sequence, block index) pairs it held
    while engine.has_unfinished_requests():
        for out in engine.step():  # streamed deltas
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        for request in engine.scheduler.running:
            n = request.num_computed_tokens
            table = group.table(request.seq_id)
            # a decode that runs ahead takes its next token's block a step early: after a step
            # that filled a block, the table may already cover position n
            early = n % BLOCK == 0 and len(table) * BLOCK > n
            assert group.num_held(request.seq_id) == held_blocks(n) + early, (
                request.seq_id, n, table)
            assert table[: max(0, (n - WINDOW + 1) // BLOCK)] == [NULL_BLOCK] * max(
                0, (n - WINDOW + 1) // BLOCK)
            for index, block in enumerate(table):
                if block != NULL_BLOCK:
                    served.setdefault(block, set()).add((request.seq_id, index))
        engine.allocator.check_invariants()
    assert held_blocks(200) == 4
    # released blocks were handed out again: some block held both sequences' K/V in turn
    assert any(len({seq for seq, _ in pairs}) == 2 for pairs in served.values()), served
    alone = LLM(mistral[0], block_size=BLOCK, attention_backend="reference")
    for name, prompt in (("long", long_prompt), ("other", other)):
        assert outputs[name] == alone.generate([prompt], params,
                                               use_tqdm=False)[0].outputs[0].token_ids


def test_n_samples_fork_window_blocks(mistral, prompts):
    """n = 3 samples share the prompt's window blocks and copy the partly filled one on
    write; every token each sample drew has the log-probability HF gives it after that
    sample's own tokens (so each sample read its own K/V through the shared and copied
    window blocks)."""
    import torch

    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True,
                            logprobs=1)
    llm = LLM(mistral[0], block_size=BLOCK, attention_backend="reference",
              debug_nan_pool=True)
    prompt = prompts[4]
    outs = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    llm.engine.allocator.check_invariants()
    assert len({tuple(o.token_ids) for o in outs}) > 1
    for out in outs:
        tokens = prompt + out.token_ids
        with torch.no_grad():
            logits = mistral[1](torch.tensor([tokens])).logits[0].double()
        expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
        got = [entry[t] for entry, t in zip(out.logprobs, out.token_ids, strict=True)]
        want = [float(expected[i, t]) for i, t in enumerate(out.token_ids)]
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_prefix_hit_never_reuses_a_released_and_rewritten_block():
    """Allocator level, worked by hand: a sequence's window blocks that left its window
    stay findable until handed out again; a hit needs exactly the window blocks its next
    queries read, and none that were rewritten."""
    alloc = WindowedAllocator(64, BLOCK, window=WINDOW, num_window_blocks=12)  # 11 usable
    group = alloc.window_group
    tokens = list(range(100, 140))  # 10 blocks
    assert alloc.allocate("a", 40)
    alloc.commit("a", tokens)
    table = group.table("a")
    assert group.first_needed(40) == (40 - WINDOW + 1) // BLOCK == 6
    assert table[:6] == [NULL_BLOCK] * 6 and group.num_held("a") == 4
    alloc.check_invariants()
    hit = alloc.lookup(tokens + [1])  # while "a" lives: its window blocks 6..9
    assert hit.num_tokens == 40 and hit.window_block_ids == tuple(table[6:])
    # "c" (other content, 5 blocks) takes the one never-used block (11), then evicts the
    # LRU released blocks 1..4 (a's indices 0..3); its commit releases its own index 0
    # (block 11): the LRU is a's 5, 6, then 11
    assert alloc.allocate("c", 20)
    alloc.commit("c", list(range(500, 520)))
    assert group.table("c") == [NULL_BLOCK, 1, 2, 3, 4]
    alloc.free("a")  # a's 10, 9, 8, 7 join the LRU, tail first
    hit = alloc.lookup(tokens + [1])
    assert hit.num_tokens == 40 and hit.window_block_ids == tuple(table[6:])
    # "d" takes 4 more: evicts 5, 6, 11 and 10 (a's index 9); now no hit of a's prompt has
    # its window (10 blocks need indices 6..9, 9 need 5..8, 5 need 1..4, 1 needs 0)
    assert alloc.allocate("d", 16)
    alloc.commit("d", list(range(600, 616)))
    assert group.table("d") == [5, 6, 11, 10]
    hit = alloc.lookup(tokens + [1])
    assert hit.num_tokens == 0 and hit.window_block_ids == ()
    alloc.check_invariants()
