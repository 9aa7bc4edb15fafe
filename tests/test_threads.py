"""`LLM` and `LLMEngine` may be called from many threads: every caller gets exactly its own
outputs, equal to the same calls made one at a time."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from jaxpage import LLM, SamplingParams

THREADS, CALLS = 8, 25


def call_spec(thread: int, call: int):
    """The prompts and params of one generate() call: 1-3 prompts, seeded sampling."""
    rng = np.random.default_rng(thread * 1000 + call)
    prompts = [rng.integers(3, 97, size=int(rng.integers(2, 20))).tolist()
               for _ in range(int(rng.integers(1, 4)))]
    params = SamplingParams(max_tokens=int(rng.integers(2, 8)), temperature=0.8,
                            seed=thread * 100 + call, n=int(rng.choice([1, 1, 2])))
    return prompts, params


def summary(outputs):
    return [(o.prompt_token_ids, [c.token_ids for c in o.outputs]) for o in outputs]


@pytest.fixture(scope="module")
def path(hf_model_dir):
    return hf_model_dir("llama")[0]


def make_llm(path):
    return LLM(path, block_size=4, num_blocks=128, max_num_batched_tokens=64, max_num_seqs=16)


def test_threads_get_exactly_their_own_outputs(path):
    sequential = make_llm(path)
    expected = {(t, c): summary(sequential.generate(*call_spec(t, c), use_tqdm=False))
                for t in range(THREADS) for c in range(CALLS)}

    llm = make_llm(path)
    got, errors = {}, []
    start = threading.Barrier(THREADS)

    def worker(thread: int) -> None:
        try:
            start.wait()
            for call in range(CALLS):
                got[thread, call] = summary(llm.generate(*call_spec(thread, call),
                                                         use_tqdm=False))
        except BaseException as exc:  # reported below, with the thread
            errors.append((thread, repr(exc)))

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=600)
    assert not any(w.is_alive() for w in workers), "a generate() call hung"
    assert not errors, errors
    assert got == expected
    engine = llm.engine
    assert not engine.requests and engine.allocator.usage()["used"] == 0
    assert llm.stats()["num_steps"] < sequential.stats()["num_steps"], \
        "concurrent calls should share steps"


def test_engine_calls_from_other_threads_while_it_steps(path):
    """add_request and abort_request from other threads while one thread steps."""
    llm = make_llm(path)
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list] = {}
    stop = threading.Event()

    def stepper():
        deadline = time.monotonic() + 300  # bounded: the test fails rather than hangs
        while time.monotonic() < deadline:
            if stop.is_set() and not engine.has_unfinished_requests():
                return
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)

    thread = threading.Thread(target=stepper)
    thread.start()
    for i in range(20):
        engine.add_request(f"r{i}", [3 + i, 4, 5], params)
        if i % 4 == 3:
            engine.abort_request(f"r{i - 1}")
    stop.set()
    thread.join(timeout=600)
    assert not thread.is_alive()
    reference = make_llm(path)
    for i in range(20):
        last = outputs[f"r{i}"][-1]
        assert last.finished and sum(o.finished for o in outputs[f"r{i}"]) == 1
        reason = last.outputs[0].finish_reason
        if i % 4 == 2 and reason == "abort":
            continue  # aborted while it ran (or before); an abort may also come too late
        assert reason == "length"
        tokens = [t for o in outputs[f"r{i}"] for t in o.outputs[0].token_ids]
        alone = reference.generate([[3 + i, 4, 5]], params, use_tqdm=False)[0]
        assert tokens == alone.outputs[0].token_ids
    assert engine.allocator.usage()["used"] == 0
