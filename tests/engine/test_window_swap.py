"""Swap preemption and the host prefix tier for sliding-window models (jaxpage.engine.kv_groups):
both KV groups go to the host and back.

The oracle is the same workload with nothing preempted (and HF transformers' greedy tokens):
tiny Gemma 2 (alternating sliding and global layers) and Gemma 3 (five sliding layers, then a
global one) with a 16-token window, 4-token blocks and prompts of 17 to 40 tokens, so every
window slides and releases blocks before and after a swap. Pools start as NaN and released
blocks are refilled with NaN (`debug_nan_pool`, the host pools too): a window block read
before its copy arrived, or from the wrong group, turns tokens to garbage.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import add_due, hf_greedy

from jaxpage import LLM, BeamSearchParams, SamplingParams
from jaxpage.engine.block_allocator import NULL_BLOCK
from jaxpage.engine.kv_groups import WindowedAllocator, window_host_blocks
from jaxpage.llm import merge_delta

WINDOW, BLOCK = 16, 4  # the tiny Gemmas' window (tests/models/gemma_models.py)
# a 16-token budget: a window holds at most ceil((15 + 16) / 4) + 1 = 9 blocks of a sequence
COMMON = dict(block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=8, debug_nan_pool=True)
SWAP = dict(swap_space=1 << 20, preemption_mode="swap")  # room for every swapped group
GREEDY = dict(temperature=0.0, ignore_eos=True)


def workload():
    """(request_id, prompt, params, step to add it at): greedy, n > 1 forks (greedy and
    seeded), a beam search, all past the window."""
    rng = np.random.default_rng(1)
    prompt = [rng.integers(3, 97, size=n).tolist() for n in (30, 21, 25, 40, 19)]
    return [
        ("g0", prompt[0], SamplingParams(max_tokens=12, **GREEDY), 0),
        ("n2", prompt[1], SamplingParams(n=2, max_tokens=10, **GREEDY), 0),
        ("n3", prompt[2], SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5,
                                         ignore_eos=True), 0),
        ("g1", prompt[3], SamplingParams(max_tokens=12, **GREEDY), 1),
        ("beam", prompt[4], BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True), 0),
    ]


def serve(llm, held=None):
    """Serve the workload, checking both groups' invariants (device and host) after every
    step (and appending to `held` the window host blocks swapped-out sequences hold after
    it). Returns {request_id: [token ids of each completion]}; every pool ends quiescent."""
    engine = llm.engine
    pending, merged, final = workload(), {}, {}
    for step in range(3000):
        add_due(engine, pending, step)
        if not pending and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            completions = merge_delta(merged.setdefault(out.request_id, {}), out)
            if out.finished:
                assert out.error is None and out.request_id not in final
                final[out.request_id] = [c.token_ids for c in completions]
        engine.allocator.check_invariants()
        if held is not None:
            held.append(engine.allocator.usage()["window_host_used"])
    else:
        raise AssertionError("the workload did not finish")
    usage = engine.allocator.usage()
    assert usage["used"] == usage["window_used"] == 0
    assert usage["host_used"] == usage["window_host_used"] == 0
    return final


@pytest.fixture(scope="module")
def gemma(hf_model_dir):
    return lambda name: hf_model_dir(name)


@pytest.fixture(scope="module")
def reference(gemma):
    """name -> the workload's tokens with pools where nothing is preempted (checked against
    HF's greedy tokens)."""
    cache = {}

    def get(name):
        if name not in cache:
            path, model = gemma(name)
            llm = LLM(path, **COMMON)
            cache[name] = serve(llm)
            assert llm.stats()["num_preemptions"] == 0
            for request_id, prompt, params, _ in workload():
                if request_id.startswith("g"):
                    assert cache[name][request_id] == [hf_greedy(model, prompt,
                                                                 params.max_tokens)]
        return cache[name]

    return get


# Pools where the workload preempts (the first of a model pays its compilations, ~10 s; the
# other reuses them): prefix caching off, so every swapped block comes back from the host;
# on, so swap-ins take what the device still caches.
POOLS = [dict(num_blocks=28, num_window_blocks=32, enable_prefix_caching=False),
         dict(num_blocks=30, num_window_blocks=40)]


@pytest.mark.parametrize(("name", "pools"), [
    # with the slow tests (6-15 s each): the default suite swaps windows in the allocator's
    # hand-worked cases and serves a window prefix from the host tier
    *(pytest.param(name, pools, marks=pytest.mark.slow)
      for name in ("gemma2", "gemma3") for pools in POOLS),
])
def test_swap_gives_the_tokens_of_a_run_without_preemption(gemma, reference, name, pools):
    llm = LLM(gemma(name)[0], **COMMON, **SWAP, **pools)
    runner = llm.engine.runner
    window_pairs = {"out": 0, "in": 0}  # host ids from num_host_blocks on: the window group's
    swap_out, swap_in = runner.swap_out, runner.swap_in

    def counted(kind, call):
        def run(copies):
            host_at = 1 if kind == "out" else 0
            window_pairs[kind] += sum(1 for c in copies if c[host_at] >= runner.num_host_blocks)
            return call(copies)
        return run

    runner.swap_out, runner.swap_in = counted("out", swap_out), counted("in", swap_in)
    held = []
    assert serve(llm, held) == reference(name)
    stats = llm.stats()
    assert stats["num_swapped_preemptions"] > 0 and stats["swap_in_blocks"] > 0
    assert window_pairs["out"] > 0 and max(held) > 0  # swapped sequences' windows on the host
    if not pools.get("enable_prefix_caching", True):  # nothing to take from a device cache
        assert window_pairs["in"] > 0
    assert stats["compiles"] <= runner.max_compiles


def test_host_tier_serves_a_window_prefix_evicted_from_the_device(gemma):
    """A conversation's blocks of both groups are evicted from the device by other requests
    and kept in the host tiers; its next turn hits them there (the full group's 8 blocks
    and the 4 window blocks its next queries read), prefills only the rest, and generates
    what it generates without any caching."""
    path = gemma("gemma2")[0]
    rng = np.random.default_rng(3)
    conversation = rng.integers(3, 97, size=30).tolist()
    fillers = [rng.integers(3, 97, size=40).tolist() for _ in range(3)]
    question = rng.integers(3, 97, size=6).tolist()
    params = SamplingParams(max_tokens=4, **GREEDY)
    pools = dict(COMMON, num_blocks=20, num_window_blocks=12)

    def turns(llm, check=None):
        answer = llm.generate([conversation], params, use_tqdm=False)[0].outputs[0].token_ids
        for filler in fillers:  # each takes 11 of the 19 full blocks, 11 window ones in turn
            llm.generate([filler], params, use_tqdm=False)
        prompt = conversation + answer + question
        if check:
            check(llm, prompt)
        return answer, llm.generate([prompt], params, use_tqdm=False)[0]

    expected_answer, expected = turns(LLM(path, **pools, enable_prefix_caching=False))
    llm = LLM(path, **pools, swap_space=1 << 20)  # the host tier is on with any swap_space
    full_blocks = (len(conversation) + len(expected_answer) - 1) // BLOCK  # K/V computed
    # a hit of 8 blocks: the window's next queries read from position 32 - 15 on
    window_levels = list(range((full_blocks * BLOCK - WINDOW + 1) // BLOCK, full_blocks))

    def check(llm, prompt):
        inputs.clear()  # the next turn's steps from here on
        hit = llm.engine.allocator.lookup(prompt)
        assert hit.block_ids == () and len(hit.host_block_ids) == full_blocks
        assert hit.window_block_ids == (NULL_BLOCK,) * len(window_levels)
        assert len(hit.window_host_block_ids) == len(window_levels) == 4
        assert all(h >= 0 for h in hit.window_host_block_ids)

    inputs = []
    execute = llm.engine.runner.execute
    llm.engine.runner.execute = lambda seqs: (inputs.append(seqs), execute(seqs))[1]
    before, window_before = llm.stats(), llm.engine.allocator.usage()["window_host_hits"]
    answer, out = turns(llm, check)
    assert answer == expected_answer
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    cached = full_blocks * BLOCK
    stats = llm.stats()
    assert out.metrics.num_cached_tokens == cached
    assert stats["prefix_cache_host_hits"] - before["prefix_cache_host_hits"] == cached
    usage = llm.engine.allocator.usage()
    assert usage["window_host_hits"] - window_before == len(window_levels)
    first = inputs[0][0]  # the next turn's first chunk: only what was not cached
    assert first.num_computed == cached
    assert first.token_ids == out.prompt_token_ids[cached:cached + len(first.token_ids)]
    # its window table: null before the window, the host copies in it
    assert first.window_block_table[:window_levels[0]] == [NULL_BLOCK] * window_levels[0]
    assert NULL_BLOCK not in first.window_block_table[window_levels[0]:]
    llm.engine.allocator.check_invariants()


def test_swapped_windows_by_hand():
    """Allocator level, worked by hand (prefix caching off, so every block comes back from
    the host): two forks of a 30-token sequence keep 29 tokens each; their window (indices
    3 to 7: positions 14 on) goes to one host block per distinct device block and comes
    back after the null entries, the full blocks shared again, the partly filled one
    copied for each."""
    alloc = WindowedAllocator(64, BLOCK, window=WINDOW, num_window_blocks=12,
                              num_host_blocks=32, enable_prefix_caching=False)
    group, offset = alloc.window_group, alloc.host.num_blocks
    assert group.host.num_blocks == window_host_blocks(32, 64, 12) == 6  # ceil(32 * 11 / 63)
    assert alloc.allocate("a", 30)
    alloc.commit("a", list(range(100, 130)))
    alloc.fork("a", "b")
    assert group.table("b") == [NULL_BLOCK] * 3 + [4, 5, 6, 7, 8]
    # the "auto" mode's count: 5 distinct window blocks (8 full ones), as the swap moves
    assert alloc.window_blocks_to_swap_out([("a", 29), ("b", 29)]) == 5
    assert alloc.blocks_to_swap_out([("a", 29), ("b", 29)]) == 8
    assert alloc.swap_out([("a", 29), ("b", 29)])
    swap_out, swap_in = alloc.take_swaps()
    assert swap_out[8:] == [(4, offset), (5, offset + 1), (6, offset + 2), (7, offset + 3),
                            (8, offset + 4)]  # after the full group's 8
    assert [group.host.ref_count(h) for h in range(5)] == [2] * 5 and not swap_in
    alloc.check_invariants()
    # the window free queue now: 9, 10, 11, then 1, 2, 3 (left the window at commit), then
    # 8, 7, 6, 5, 4 (freed tail first)
    assert alloc.swap_in([("a", 30, None), ("b", 30, None)])
    assert group.table("a") == [NULL_BLOCK] * 3 + [9, 10, 11, 1, 2]
    assert group.table("b") == [NULL_BLOCK] * 3 + [9, 10, 11, 1, 3]
    _, swap_in = alloc.take_swaps()
    assert swap_in[-6:] == [(offset, 9), (offset + 1, 10), (offset + 2, 11), (offset + 3, 1),
                            (offset + 4, 2), (offset + 4, 3)]
    assert all(host_id < offset for host_id, _ in swap_in[:-6])  # the full group's
    alloc.check_invariants()
    assert alloc.usage()["window_host_used"] == 0


def test_a_window_that_lost_a_needed_block_is_not_swapped():
    """At 31 computed tokens a sequence's window starts at index 4 (position 16): kept at
    30 tokens it would need index 3, released at commit, so the swap is refused and
    changes nothing; kept at 31 it goes out, and a pool lost before its window's host copy
    was written drops it (it recomputes)."""
    alloc = WindowedAllocator(64, BLOCK, window=WINDOW, num_window_blocks=12,
                              num_host_blocks=32)
    assert alloc.allocate("a", 31)
    alloc.commit("a", list(range(100, 131)))
    assert alloc.window_table("a")[:4] == [NULL_BLOCK] * 4
    assert not alloc.swap_out([("a", 30)])
    assert "a" in alloc and not alloc.is_swapped("a")
    assert alloc.usage()["host_used"] == alloc.usage()["window_host_used"] == 0
    alloc.check_invariants()
    assert alloc.swap_out([("a", 31)])
    swap_out, _ = alloc.take_swaps()
    window_hosts = [h for _, h in swap_out if h >= alloc.host.num_blocks]
    assert len(window_hosts) == 4  # indices 4..7
    assert alloc.pool_lost(window_hosts[:1]) == ["a"]
    assert not alloc.is_swapped("a") and alloc.usage()["window_host_used"] == 0
    alloc.check_invariants()
