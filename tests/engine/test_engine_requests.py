"""Request lifecycle: aborts anywhere, bad input refused at the boundary, and a soak."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from jaxpage import LLM, SamplingParams


@pytest.fixture(scope="module")
def path(hf_model_dir):
    return hf_model_dir("llama")[0]


def drain(engine, check=True):
    """Step until idle; returns {request_id: [outputs]}, checking invariants every step."""
    seen: dict[str, list] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return seen
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
        if check:
            engine.allocator.check_invariants()
    raise AssertionError("engine did not drain")


def test_abort_running_waiting_and_preempted(path):
    llm = LLM(path, block_size=4, num_blocks=24, max_num_batched_tokens=64, max_num_seqs=3,
              enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(0)
    for i in range(6):
        engine.add_request(f"r{i}", rng.integers(3, 97, size=12).tolist(), params)
    preempted = None
    for _ in range(200):  # run until some request was preempted back to waiting
        engine.step()
        preempted = next((r for r in engine.scheduler.waiting
                          if r.metrics.num_preemptions > 0), None)
        if preempted is not None:
            break
    assert preempted is not None, "the small pool should force a preemption"
    running = engine.scheduler.running[0]
    waiting = next(r for r in engine.scheduler.waiting
                   if r.metrics.num_preemptions == 0 and r is not preempted)
    targets = {running.request_id, waiting.request_id, preempted.request_id}
    for request_id in targets:
        engine.abort_request(request_id)
    engine.allocator.check_invariants()
    outputs = drain(engine)
    for request_id in targets:
        last = outputs[request_id][-1]
        assert last.finished and last.outputs[0].finish_reason == "abort"
    for request_id in {f"r{i}" for i in range(6)} - targets:
        last = outputs[request_id][-1]
        assert last.finished and last.outputs[0].finish_reason == "length"
    assert engine.allocator.usage()["used"] == 0


BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(n=0), "n"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=["ok", ""]), "stop"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_are_refused_and_others_finish(path):
    llm = LLM(path, block_size=4, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
              max_model_len=128)
    engine = llm.engine
    good = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.add_request("ok-1", [5, 6, 7], good)
    bad = [
        (("e", [], good), "empty"),
        (("neg", [5, -1], good), r"\[0, 97\)"),
        (("big", [5, 97], good), r"\[0, 97\)"),
        (("long", [5] * 100, SamplingParams(max_tokens=40)), "max_model_len"),
        (("ok-1", [5], good), "already in use"),
        (("text", "hello", good), "tokenizer"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request(*args)
    engine.add_request("ok-2", [8, 9], good)
    outputs = drain(engine)
    assert set(outputs) == {"ok-1", "ok-2"}
    assert all(outputs[r][-1].outputs[0].finish_reason == "length" for r in outputs)


def test_request_larger_than_the_pool_is_rejected(path):
    llm = LLM(path, block_size=4, num_blocks=8, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="pool has only 7"):
        llm.engine.add_request("x", list(range(3, 30)), SamplingParams(max_tokens=10))


def test_bad_engine_config_names_the_field(path):
    for kwargs, field in [(dict(block_size=0), "block_size"), (dict(num_blocks=1), "num_blocks"),
                          (dict(attention_backend="cuda"), "attention_backend"),
                          (dict(dtype="int8"), "dtype"), (dict(max_num_seqs=0), "max_num_seqs")]:
        with pytest.raises(ValueError, match=field):
            LLM(path, **kwargs)


def word_tokenizer():
    """A real (word-level) HF tokenizer over the tiny models' 97 ids: w0 ... w96."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(97)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w2")


@pytest.mark.parametrize("policy, num_requests, max_model_len, swap", [
    # the longest soaks run with the slow tests (57 and 38 s of the default suite on a 2-core
    # Zen 3 for oracle and max; paged is soaked by default with swap)
    pytest.param("paged", 400, 128, False, marks=pytest.mark.slow),
    pytest.param("oracle", 200, 128, False, marks=pytest.mark.slow),
    pytest.param("max", 160, 48, False, marks=pytest.mark.slow),
    ("oracle", 60, 128, False), ("max", 100, 48, False), ("paged", 300, 128, True)])
def test_soak(path, policy, num_requests, max_model_len, swap):
    """Random requests (sampling settings, n > 1, beams, stop strings and stop tokens) and
    aborts of live requests (running, waiting and preempted ones, and swapped-out ones when
    preempting by swapping into a host pool of 12 blocks, often full) on a small pool."""
    from jaxpage import BeamSearchParams
    from jaxpage.engine.request import RequestStatus

    rng = np.random.default_rng(2024)
    swapping = dict(swap_space=12 * 1024, preemption_mode="swap") if swap else {}
    llm = LLM(path, tokenizer=word_tokenizer(), block_size=4, num_blocks=96,
              max_num_batched_tokens=64, max_num_seqs=16, max_model_len=max_model_len,
              reservation_policy=policy, **swapping)
    engine = llm.engine
    max_prompt = max_model_len // 2
    finished: dict[str, int] = {}
    submitted, next_id, step = [], 0, 0
    aborted_where = {"running": 0, "waiting": 0, "preempted": 0} | ({"swapped": 0} if swap
                                                                      else {})
    while next_id < num_requests or engine.has_unfinished_requests():
        for _ in range(int(rng.integers(0, 6)) if next_id < num_requests else 0):
            prompt = rng.integers(0, 97, size=int(rng.integers(1, max_prompt))).tolist()
            request_id = f"s{next_id}"
            kind = rng.random()
            if kind < 0.1:
                params = BeamSearchParams(beam_width=int(rng.integers(1, 3)),
                                          max_tokens=int(rng.integers(1, 12)))
                if len(prompt) + params.max_tokens > max_model_len:
                    continue
                submit = functools.partial(engine.add_beam_request, request_id, prompt, params)
            else:
                max_tokens = int(rng.integers(1, min(40, max_model_len - len(prompt) + 1)))
                params = SamplingParams(
                    n=int(rng.choice([1, 1, 1, 2, 3])),
                    max_tokens=max_tokens,
                    temperature=float(rng.choice([0.0, 0.7, 1.0])),
                    top_p=float(rng.choice([1.0, 0.9])), top_k=int(rng.choice([-1, 5])),
                    min_p=float(rng.choice([0.0, 0.05])), seed=int(rng.integers(0, 5)),
                    presence_penalty=float(rng.choice([0.0, 0.5])),
                    logprobs=int(rng.choice([0, 3])) if rng.random() < 0.2 else None,
                    stop_token_ids=[int(rng.integers(0, 97))] if rng.random() < 0.3 else [],
                    stop=[f"w{rng.integers(0, 97)}"] if rng.random() < 0.3 else [],
                    min_tokens=min(int(rng.integers(0, 3)), max_tokens),
                )
                submit = functools.partial(engine.add_request, request_id, prompt, params,
                                           cache_salt=str(next_id % 2))
            try:
                submit()
            except ValueError as exc:  # only what cannot fit the pool under the policy
                assert "KV blocks" in str(exc) or "max_num_seqs" in str(exc), exc
                next_id += 1
                continue
            submitted.append(request_id)
            next_id += 1
        if submitted and rng.random() < 0.15:  # abort a live request, noting where it is
            scheduler = engine.scheduler
            live = {r.request_id: "running" for r in scheduler.running}
            for r in scheduler.waiting:
                live.setdefault(r.request_id, "swapped" if r.status is RequestStatus.SWAPPED
                                else "preempted" if r.metrics.num_preemptions else "waiting")
            if live:  # from the kind hit least so far, so that every kind gets hit
                kind = min(set(live.values()), key=lambda k: aborted_where[k])
                candidates = sorted(r for r, where in live.items() if where == kind)
                request_id = candidates[int(rng.integers(0, len(candidates)))]
                aborted_where[kind] += 1
                engine.abort_request(request_id)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, f"{out.request_id} ended twice"
                assert out.error is None
                finished[out.request_id] = 1
                for completion in out.outputs:
                    assert completion.finish_reason in ("stop", "length", "abort")
        engine.allocator.check_invariants()
        step += 1
        assert step < 30_000
    assert set(finished) == set(submitted)
    usage = engine.allocator.usage()
    assert usage["used"] == usage["host_used"] == 0 and not engine.requests
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert (stats["num_swapped_preemptions"] > 0) == swap
    assert all(aborted_where.values()), aborted_where
    assert stats["compiles"] <= engine.runner.max_compiles


def test_cpu_decode_steps_run_in_their_own_small_buckets(hf_model_dir):
    """On CPU a decode step of 1-4 sequences is not padded to 8 rows (XLA:CPU splits a padded
    step's elementwise ops over threads, and its sampler reads the padded rows): requests that
    finish one after another leave the batch at 3, 2 and 1 sequences, each step in the bucket
    of its size, and every request's greedy tokens are HF transformers'."""
    from conftest import hf_greedy

    path, model = hf_model_dir("llama")
    llm = LLM(path, block_size=4, num_blocks=96, max_model_len=160, max_num_seqs=16)
    runner = llm.engine.runner
    assert runner.decode_buckets[:4] == [1, 2, 4, 8]
    prompts = [list(range(3, 12)), list(range(20, 27)), list(range(40, 53))]
    lengths = [3, 7, 12]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                  for n in lengths], use_tqdm=False)
    for prompt, n, out in zip(prompts, lengths, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, n)
    # ("forward", num_tokens, max_query_len, num_seqs, width, logits rows); a decode step has
    # one query a sequence and as many tokens as sequences
    decode_rows = {key[3] for key in runner.compiled
                   if key[0] == "forward" and key[2] == 1 and key[1] == key[3]}
    assert decode_rows == {4, 2, 1}, decode_rows
