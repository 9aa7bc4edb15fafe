"""A step is all or nothing: a failure raised inside each stage of `step()` in turn, in the
middle of a mixed workload (n > 1 forks, beams, prefix hits, preemption), ends only the
request at fault or leaves the engine as it was; every surviving request produces the
tokens a clean run produces. The pool starts as NaN and released blocks are refilled with
NaN (`debug_nan_pool`), so a read of K/V a sequence does not own turns its tokens to
garbage and shows here as a mismatch."""

from __future__ import annotations

import jax
import pytest
from conftest import add_due, hf_greedy

import jaxpage.engine.runner as runner_module
from jaxpage import LLM, BeamSearchParams, SamplingParams
from jaxpage.llm import merge_delta

PREFIX = list(range(40, 56))  # 16 tokens shared by the "p" requests: 4 full blocks


def workload():
    """(request_id, prompt, params, step to add it at)."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    return [
        ("g0", list(range(3, 10)), SamplingParams(max_tokens=14, **greedy), 0),
        ("n3", list(range(11, 20)), SamplingParams(n=3, max_tokens=10, temperature=1.0,
                                                   seed=5, ignore_eos=True), 0),
        ("beam", list(range(21, 32)), BeamSearchParams(beam_width=3, max_tokens=8,
                                                       ignore_eos=True), 0),
        ("p0", PREFIX + [60, 61], SamplingParams(max_tokens=12, **greedy), 0),
        ("g1", list(range(62, 75)), SamplingParams(max_tokens=12, **greedy), 1),
        ("p1", PREFIX + [70, 71, 72], SamplingParams(max_tokens=10, **greedy), 4),
        ("n2", list(range(76, 81)), SamplingParams(n=2, max_tokens=9, temperature=0.9,
                                                   seed=9, ignore_eos=True), 5),
    ]


def make_llm(path, **overrides):
    # a pool small enough that the workload preempts
    return LLM(path, block_size=4, num_blocks=20, max_num_batched_tokens=32, max_num_seqs=8,
               debug_nan_pool=True, **overrides)


# preemption by swapping, with a host pool of 64 blocks (each 1 KiB for the tiny llama)
SWAP = dict(swap_space=64 * 1024, preemption_mode="swap")


def run(llm, fault=None, items=None):
    """Serve the workload (or `items`, the same kind of list), calling `fault(engine, step)`
    before each step (it may arm a failure, or abort a request). Returns ({request_id: final
    output}, number of steps that raised)."""
    engine = llm.engine
    pending = workload() if items is None else list(items)
    merged, final, raised = {}, {}, 0
    for step in range(2000):
        add_due(engine, pending, step)
        if not pending and not engine.has_unfinished_requests():
            break
        if fault is not None:
            fault(engine, step)
        try:
            outputs = engine.step()
        except RuntimeError as exc:
            assert "injected" in str(exc)
            raised += 1
            outputs = []
        engine.allocator.check_invariants()
        for out in outputs:
            completions = merge_delta(merged.setdefault(out.request_id, {}), out)
            if out.finished:
                assert out.request_id not in final, f"{out.request_id} finished twice"
                out.outputs = completions
                final[out.request_id] = out
    else:
        raise AssertionError("the workload did not finish")
    usage = engine.allocator.usage()
    assert usage["used"] == usage["host_used"] == 0 and not engine.requests, "not quiescent"
    return final, raised


def tokens(out):
    return [c.token_ids for c in out.outputs]


@pytest.fixture(scope="module")
def path(hf_model_dir):
    return hf_model_dir("llama")[0]


@pytest.fixture(scope="module")
def clean(path, hf_model_dir):
    """The workload without faults; its greedy requests equal HF transformers' tokens."""
    llm = make_llm(path)
    final, raised = run(llm)
    assert raised == 0
    stats = llm.stats()
    assert stats["num_preemptions"] > 0, "the workload should preempt"
    assert stats["prefix_cache_hits"] > 0, "the workload should hit the prefix cache"
    assert all(out.error is None for out in final.values())
    _, model = hf_model_dir("llama")
    for request_id, prompt, params, _ in workload():
        if isinstance(params, SamplingParams) and params.temperature == 0:
            assert tokens(final[request_id]) == [hf_greedy(model, prompt, params.max_tokens)]
    return final


def _raise(*args, **kwargs):
    raise RuntimeError("injected failure")


class Once:
    """Wraps `original`: the first call that `when` accepts runs `fail` instead (by default
    it raises RuntimeError("injected failure")); every other call is the original's."""

    def __init__(self, original, when=lambda *args, **kwargs: True, fail=_raise):
        self.original, self.when, self.fail, self.fired = original, when, fail, False

    def __call__(self, *args, **kwargs):
        if not self.fired and self.when(*args, **kwargs):
            self.fired = True
            return self.fail(*args, **kwargs)
        return self.original(*args, **kwargs)


def fault_at(step, install):
    """A `fault` for run(): at `step`, `install(engine)` arms a one-shot failure."""
    armed = []

    def fault(engine, current):
        if current == step:
            armed.append(install(engine))
    fault.armed = armed
    return fault


def admission(engine):  # admitting "g1" fails: only g1 ends
    allocator = engine.allocator
    allocator.allocate = Once(allocator.allocate, lambda seq_id, *a, **k: seq_id == "g1#0")
    return allocator.allocate


def grow(engine):  # growing a running n3 sample fails: only n3 ends
    allocator = engine.allocator
    allocator.grow = Once(allocator.grow, lambda seq_id, *a, **k: seq_id.startswith("n3#"))
    return allocator.grow


def copy_on_write(engine):  # the step's block copies fail
    runner = engine.runner
    runner.copy_blocks = Once(runner.copy_blocks, lambda copies: bool(copies))
    return runner.copy_blocks


def runner_call(engine):  # the whole device call fails before it starts
    runner = engine.runner
    runner.execute = Once(runner.execute)
    return runner.execute


def sampler(engine, monkeypatch):  # the forward ran (K/V written), the sampler fails
    once = Once(runner_module._SAMPLE)
    monkeypatch.setattr(runner_module, "_SAMPLE", once)
    return once


def pool_lost(engine):  # the device call fails after freeing the donated pool
    runner = engine.runner

    def delete_pool_and_raise(seqs):
        for leaf in jax.tree.leaves(runner.kv_pool):
            leaf.delete()
        raise RuntimeError("injected failure after donation")
    runner.execute = Once(runner.execute, fail=delete_pool_and_raise)
    return runner.execute


def transfer(name, lose_pool=False):
    """The first non-empty swap transfer (`name`: "swap_out" or "swap_in") fails; with
    `lose_pool`, after freeing the donated pool (a swap-out can lose it only through a
    device fault: its gather donates nothing)."""
    def install(engine):
        runner = engine.runner

        def fail(copies):
            if lose_pool:
                for leaf in jax.tree.leaves(runner.kv_pool):
                    leaf.delete()
            raise RuntimeError(f"injected failure in {name}")
        setattr(runner, name, Once(getattr(runner, name), lambda copies: bool(copies), fail))
        return getattr(runner, name)
    return install


def landing(engine):
    """The first landing of swap-outs in flight fails (their transfer to the host broke
    after the forward ran): their host copies are lost with the blocks the forward may have
    rewritten, so the engine rebuilds as for a lost pool."""
    runner = engine.runner
    runner.finish_swaps = Once(runner.finish_swaps, lambda: bool(runner.swaps_in_flight()))
    return runner.finish_swaps


def detokenize(engine):  # appending p0's text fails: only p0 ends
    engine._detokenize = Once(engine._detokenize, lambda sample: sample.request_id == "p0")
    return engine._detokenize


STAGES = {  # stage: (installer, step, requests it ends)
    "admission": (admission, 1, {"g1"}),
    "grow": (grow, 3, {"n3"}),
    "copy_on_write": (copy_on_write, 1, set()),
    "runner": (runner_call, 6, set()),
    "sampler": (sampler, 7, set()),
    "pool_lost": (pool_lost, 9, set()),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_fault_in_each_stage_leaves_the_others_untouched(path, clean, stage, monkeypatch):
    install, step, ended = STAGES[stage]
    if stage == "sampler":
        fault = fault_at(step, lambda engine: sampler(engine, monkeypatch))
    else:
        fault = fault_at(step, install)
    llm = make_llm(path)
    final, raised = run(llm, fault)
    assert fault.armed and fault.armed[0].fired, f"the {stage} fault never fired"
    assert raised == (0 if ended else 1)
    assert set(final) == set(clean)
    for request_id, out in final.items():
        if request_id in ended:
            assert out.error is not None and "injected" in out.error
            assert all(c.finish_reason == "abort" for c in out.outputs)
        else:
            assert out.error is None
            assert tokens(out) == tokens(clean[request_id]), request_id


@pytest.fixture(scope="module")
def clean_swap(path, clean):
    """The workload preempting by swapping, without faults: it swaps, and every request
    produces what it produces under recompute."""
    llm = make_llm(path, **SWAP)
    final, raised = run(llm)
    assert raised == 0 and llm.stats()["num_swapped_preemptions"] > 0
    assert {r: tokens(out) for r, out in final.items()} == {
        r: tokens(out) for r, out in clean.items()}
    return final


SWAP_STAGES = {  # stage: (installer, step it is armed at)
    "swap_out": (transfer("swap_out"), 0),  # redone first by the next step
    "swap_in": (transfer("swap_in"), 0),
    # the pool is lost with the swap-out still to run: its host copies never arrive and the
    # requests holding them recompute; the rest of the host pool stays valid
    "swap_out_pool_lost": (transfer("swap_out", lose_pool=True), 0),
    "swap_in_pool_lost": (transfer("swap_in", lose_pool=True), 0),
    "swap_out_landing": (landing, 0),
    "copy_on_write": (copy_on_write, 1),
    "runner": (runner_call, 6),
    "pool_lost": (pool_lost, 9),  # swapped-out requests keep their host copies
}


@pytest.mark.parametrize("stage", list(SWAP_STAGES))
def test_a_fault_around_a_swap_leaves_every_request_untouched(path, clean_swap, stage):
    """A failed swap transfer (or another device failure while requests are swapped out)
    raises out of its step and loses nothing: every request produces its clean tokens."""
    install, step = SWAP_STAGES[stage]
    fault = fault_at(step, install)
    llm = make_llm(path, **SWAP)
    final, raised = run(llm, fault)
    assert fault.armed and fault.armed[0].fired, f"the {stage} fault never fired"
    assert raised == 1
    assert {r: tokens(out) for r, out in final.items()} == {
        r: tokens(out) for r, out in clean_swap.items()}
    assert llm.stats()["num_swapped_preemptions"] > 0


def test_a_fault_in_detokenization_ends_only_that_request(hf_model_dir):
    """Detokenization needs a tokenizer: a word-level one over the tiny model's vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(97)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    path, _ = hf_model_dir("llama")
    clean, _ = run(LLM(path, tokenizer=tokenizer, block_size=4, num_blocks=20,
                       max_num_batched_tokens=32, max_num_seqs=8, debug_nan_pool=True))
    llm = LLM(path, tokenizer=tokenizer, block_size=4, num_blocks=20,
              max_num_batched_tokens=32, max_num_seqs=8, debug_nan_pool=True)
    fault = fault_at(4, detokenize)
    final, raised = run(llm, fault)
    assert fault.armed[0].fired and raised == 0
    assert final["p0"].error is not None and "injected" in final["p0"].error
    for request_id, out in final.items():
        if request_id != "p0":
            assert tokens(out) == tokens(clean[request_id]), request_id
            assert [c.text for c in out.outputs] == [c.text for c in clean[request_id].outputs]


def test_failed_admission_keeps_the_steps_copy_on_write(path, hf_model_dir):
    """Defect 1: the running n=2 request grows first (copy-on-write of the prompt's partly
    filled last block), then admitting another request fails. The copies must still be made:
    dropped, the forked sample reads a block of NaN."""
    prompt = list(range(11, 17))  # 6 tokens: the second block is partly filled and shared
    params = SamplingParams(n=2, max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = hf_greedy(hf_model_dir("llama")[1], prompt, 8)  # both greedy samples

    engine = make_llm(path).engine
    merged, final = {}, {}

    def step():
        for out in engine.step():
            completions = merge_delta(merged.setdefault(out.request_id, {}), out)
            if out.finished:
                out.outputs = completions
                final[out.request_id] = out

    engine.add_request("fork", prompt, params)
    step()  # prefill; both samples draw their first token and share the prompt's blocks
    engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=4))
    copies = []
    original_copy = engine.runner.copy_blocks
    engine.runner.copy_blocks = lambda c: (copies.append(list(c)), original_copy(c))
    engine.allocator.allocate = Once(engine.allocator.allocate,
                                     lambda seq_id, *a, **k: seq_id == "bad#0")
    step()  # the samples grow (copy-on-write), then admitting "bad" fails
    assert engine.allocator.allocate.fired and copies[0], "no copy-on-write in that step"
    while engine.has_unfinished_requests():
        step()
    assert final["bad"].error is not None
    assert tokens(final["fork"]) == [expected, expected]
