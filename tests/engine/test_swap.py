"""Preemption by swapping, and the host tier of the prefix cache, through the whole engine.

The oracle is the same workload on a pool big enough that nothing is preempted: every
request (greedy, n > 1 forks sharing blocks, seeded samples, beams, a shared prefix) must
produce the same tokens when a small pool preempts it by recompute, by swapping, or as the
cost model decides. Pools start as NaN and released blocks are refilled with NaN
(`debug_nan_pool`, the host pool too), so a block read before its copy arrived, or read
from the wrong place, turns tokens to garbage and shows as a mismatch.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import add_due, hf_greedy

from jaxpage import LLM, BeamSearchParams, EngineConfig, SamplingParams
from jaxpage.attention import kv_bytes_per_block
from jaxpage.engine.request import RequestStatus
from jaxpage.engine.swap_cost import (
    DEFAULT_COPY_BANDWIDTH,
    DEFAULT_PREFILL_SECONDS_PER_TOKEN,
    SwapCostModel,
)
from jaxpage.llm import merge_delta

PREFIX = list(range(40, 56))  # 16 tokens shared by the "p" requests: 4 full blocks
BLOCK = 4
# one block of the tiny llama: 2 layers x (K, V) x 2 KV heads x 4 tokens x head_dim 8, fp32
BLOCK_BYTES = kv_bytes_per_block(2, BLOCK, 2, 8, np.float32)
SMALL = dict(block_size=BLOCK, num_blocks=20, max_num_batched_tokens=32, max_num_seqs=8,
             debug_nan_pool=True)
SWAP = dict(swap_space=64 * BLOCK_BYTES)


def workload():
    """(request_id, prompt, params, step to add it at)."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    return [
        ("g0", list(range(3, 10)), SamplingParams(max_tokens=14, **greedy), 0),
        ("n3", list(range(11, 20)), SamplingParams(n=3, max_tokens=10, temperature=1.0,
                                                   seed=5, ignore_eos=True), 0),
        ("n2", list(range(81, 91)), SamplingParams(n=2, max_tokens=10, **greedy), 0),
        ("beam", list(range(21, 32)), BeamSearchParams(beam_width=3, max_tokens=8,
                                                       ignore_eos=True), 0),
        ("p0", PREFIX + [60, 61], SamplingParams(max_tokens=12, **greedy), 0),
        ("g1", list(range(62, 75)), SamplingParams(max_tokens=12, **greedy), 1),
        ("p1", PREFIX + [70, 71, 72], SamplingParams(max_tokens=10, **greedy), 4),
    ]


def serve(llm, before_step=None, after_step=None):
    """Serve the workload, checking both tiers' invariants after every step. Returns
    {request_id: [token ids of each completion]}; the pools end quiescent."""
    engine = llm.engine
    pending = workload()
    merged, final = {}, {}
    for step in range(2000):
        add_due(engine, pending, step)
        if not pending and not engine.has_unfinished_requests():
            break
        state = before_step(engine) if before_step else None
        outputs = engine.step()
        if after_step:
            after_step(engine, state)
        engine.allocator.check_invariants()
        for out in outputs:
            completions = merge_delta(merged.setdefault(out.request_id, {}), out)
            if out.finished:
                assert out.error is None and out.request_id not in final
                final[out.request_id] = [c.token_ids for c in completions]
    else:
        raise AssertionError("the workload did not finish")
    usage = engine.allocator.usage()
    assert usage["used"] == 0 and usage["host_used"] == 0 and not engine.requests
    return final


@pytest.fixture(scope="module")
def path(hf_model_dir):
    return hf_model_dir("llama")[0]


@pytest.fixture(scope="module")
def reference(path):
    """The workload on a pool where nothing is preempted."""
    llm = LLM(path, **{**SMALL, "num_blocks": 200})
    final = serve(llm)
    assert llm.stats()["num_preemptions"] == 0
    return final


# swap_bandwidth and prefill rate chosen so that "auto" swaps every group (a measured rate
# depends on the machine: test_auto_follows_the_cost_model covers both decisions)
MODES = {
    "recompute": dict(preemption_mode="recompute"),
    "swap": dict(preemption_mode="swap"),
    "auto": dict(preemption_mode="auto", swap_bandwidth=1e12, prefill_seconds_per_token=1e-3),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_tokens_match_a_run_without_preemption(path, reference, mode):
    llm = LLM(path, **SMALL, **SWAP, **MODES[mode])
    assert serve(llm) == reference
    stats = llm.stats()
    assert stats["num_preemptions"] > 0, "the small pool should preempt"
    if mode == "recompute":
        assert stats["num_swapped_preemptions"] == 0
    else:
        assert stats["num_swapped_preemptions"] > 0
        assert stats["swap_out_blocks"] > 0 and stats["swap_in_blocks"] > 0
    assert stats["compiles"] <= llm.engine.runner.max_compiles


def test_oracle_policy_swaps_forks_and_beams(path, reference):
    """Under "oracle" only a fork's copy-on-write can run the pool dry: swapped forks and
    beams come back with their reservations."""
    llm = LLM(path, **SMALL, **SWAP, preemption_mode="swap", reservation_policy="oracle")
    assert serve(llm) == reference
    assert llm.stats()["num_swapped_preemptions"] > 0


def test_beams_split_by_the_token_budget_swap_without_their_waiting_draws(path, reference):
    """A budget of 4 tokens serves a beam group over several steps, so some beams have
    drawn and wait for their siblings when they are swapped out: they keep the K/V of all
    but their last token and draw again when they are back."""
    llm = LLM(path, **{**SMALL, "max_num_batched_tokens": 4, "num_blocks": 16}, **SWAP,
              preemption_mode="swap")
    allocator = llm.engine.allocator
    swap_out, rewound = allocator.swap_out, []

    def recording_swap_out(seqs, pending_copies=None):
        rewound.extend(s for s, keep in seqs if keep < allocator.num_computed_tokens(s))
        return swap_out(seqs, pending_copies)

    allocator.swap_out = recording_swap_out
    assert serve(llm) == reference
    assert rewound and all(s.startswith("beam#") for s in rewound)


def test_a_group_preempted_mid_copy_on_write_is_read_at_the_copy_sources(path, hf_model_dir):
    """Three greedy samples share a partly filled prompt block. In their first decode step
    the first one's copy-on-write copy is planned, then the second finds the pool empty and
    the group is swapped out before the copy was made: the swap-out reads the source."""
    rng = np.random.default_rng(0)
    long, prompt = rng.integers(3, 97, size=62).tolist(), rng.integers(3, 97, size=6).tolist()
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm = LLM(path, **SMALL, **SWAP, preemption_mode="swap")
    engine, allocator = llm.engine, llm.engine.allocator
    swap_out, pending = allocator.swap_out, []

    def recording_swap_out(seqs, pending_copies=None):
        pending.extend((pending_copies or {}).items())
        return swap_out(seqs, pending_copies)

    allocator.swap_out = recording_swap_out
    # "long" holds 16 of the 19 blocks; the forks' prompt takes 2 more, leaving one
    engine.add_request("long", long, SamplingParams(max_tokens=8, **greedy))
    merged, final = {}, {}
    for step in range(100):
        if step == 2:
            engine.add_request("fork", prompt, SamplingParams(n=3, max_tokens=6, **greedy))
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            completions = merge_delta(merged.setdefault(out.request_id, {}), out)
            if out.finished:
                final[out.request_id] = [c.token_ids for c in completions]
        allocator.check_invariants()
    assert pending, "no group was swapped out with a copy-on-write copy pending"
    model = hf_model_dir("llama")[1]
    assert final["fork"] == [hf_greedy(model, prompt, 6)] * 3
    assert final["long"] == [hf_greedy(model, long, 8)]


def bits(array) -> np.ndarray:
    return np.ascontiguousarray(array).view(np.uint32)


def test_swaps_copy_blocks_bit_for_bit_and_share_them_once(path, reference):
    """Every swap-out copies exactly the device blocks its sequences held (read through
    the runner's kv_pool when it starts; the copy lands after the step's forward, which
    starts while it is in flight), one host block per distinct device block, so
    forks and beams share host blocks; every swap-in puts the host block back unchanged and
    restores the sharing of full blocks. Prefix caching is off: no other copies happen."""
    llm = LLM(path, **SMALL, **SWAP, preemption_mode="swap", enable_prefix_caching=False)
    runner, alloc = llm.engine.runner, llm.engine.allocator
    seen = {"out": [], "in": [], "shared": 0}

    def device_block(block_id):  # [num_layers, 2, num_kv_heads, block_size, head_dim]
        return np.stack([np.stack([np.asarray(k[:, block_id]), np.asarray(v[:, block_id])])
                         for k, v in runner.kv_pool])

    swap_out, swap_in, finish_swaps, execute = (runner.swap_out, runner.swap_in,
                                                runner.finish_swaps, runner.execute)
    landing = {}  # host block -> the device block's contents when its swap-out started

    def checked_swap_out(copies):
        landing.update({host_id: device_block(device_id) for device_id, host_id in copies})
        swap_out(copies)
        seen["out"].append(copies)

    def checked_finish_swaps():  # the host copies land after the forward (or a swap-in)
        finish_swaps()
        for host_id, block in landing.items():
            assert np.array_equal(bits(runner.host_kv[host_id]), bits(block)), host_id
        landing.clear()

    def traced_execute(seqs):  # the forward starts while the host copies are in flight
        seen["forward_during_swap"] = seen.get("forward_during_swap", 0) + bool(
            runner.swaps_in_flight())
        return execute(seqs)

    def checked_swap_in(copies):
        swap_in(copies)
        for host_id, device_id in copies:
            assert np.array_equal(bits(device_block(device_id)), bits(runner.host_kv[host_id]))
        seen["in"].append(copies)

    runner.swap_out, runner.swap_in = checked_swap_out, checked_swap_in
    runner.finish_swaps, runner.execute = checked_finish_swaps, traced_execute

    def before_step(engine):
        running = {r.seq_id: (alloc.block_table(r.seq_id), r) for r in engine.scheduler.running}
        swapped = {r.seq_id: alloc.swapped_table(r.seq_id) for r in engine.scheduler.waiting
                   if r.status is RequestStatus.SWAPPED}
        return running, swapped, len(seen["out"])

    def after_step(engine, state):
        running, swapped, num_out = state
        copies = [c for step in seen["out"][num_out:] for c in step]
        host_of = dict(copies)  # device block -> host block, this step
        now_swapped = [(seq_id, table, r) for seq_id, (table, r) in running.items()
                       if r.status is RequestStatus.SWAPPED]
        kept_blocks = set()
        for seq_id, table, request in now_swapped:
            host_table = alloc.swapped_table(seq_id)
            assert host_table == [host_of[b] for b in table[:len(host_table)]]
            assert len(host_table) == -(-request.num_computed_tokens // BLOCK)
            kept_blocks.update(table[:len(host_table)])
        assert len(copies) == len(kept_blocks), "a shared block was copied more than once"
        seen["shared"] += sum(1 for h in set(host_of.values()) if alloc.host.ref_count(h) > 1)
        back = [(seq_id, host_table) for seq_id, host_table in swapped.items()
                if seq_id in alloc]  # swapped in this step
        device_of = {}
        for seq_id, host_table in back:
            table = alloc.block_table(seq_id)
            for i, host_id in enumerate(host_table[:alloc.num_computed_tokens(seq_id) // BLOCK]):
                assert device_of.setdefault(host_id, table[i]) == table[i], "sharing lost"

    assert serve(llm, before_step, after_step) == reference
    assert seen["out"] and seen["in"] and seen["shared"] > 0
    assert seen["forward_during_swap"] > 0 and not landing
    usage = alloc.usage()
    assert usage["host_used"] == usage["host_cached"] == usage["used"] == 0


def test_host_tier_serves_a_prefix_evicted_from_the_device(path):
    """A conversation's blocks are evicted from the device by other requests and kept in
    the host tier; its next turn hits them there, prefills only the rest, and generates
    what it generates without any caching. Another tenant's salt gets no hit."""
    rng = np.random.default_rng(3)
    conversation = rng.integers(3, 97, size=30).tolist()
    fillers = [rng.integers(3, 97, size=40).tolist() for _ in range(3)]
    question = rng.integers(3, 97, size=6).tolist()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def turns(llm, check=None):
        answer = llm.generate([conversation], params, use_tqdm=False)[0].outputs[0].token_ids
        for filler in fillers:  # each takes 11 of the 19 blocks: the device cache turns over
            llm.generate([filler], params, use_tqdm=False)
        prompt = conversation + answer + question
        if check:
            check(llm, prompt)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return answer, out

    no_cache = LLM(path, **SMALL, enable_prefix_caching=False)
    expected_answer, expected = turns(no_cache)
    llm = LLM(path, **SMALL, **SWAP)  # the host tier is on with any swap_space
    full_blocks = (len(conversation) + len(expected_answer) - 1) // BLOCK  # K/V computed

    def check(llm, prompt):
        hit = llm.engine.allocator.lookup(prompt)
        assert hit.block_ids == () and len(hit.host_block_ids) == full_blocks

    inputs = []
    execute = llm.engine.runner.execute
    llm.engine.runner.execute = lambda seqs: (inputs.append(seqs), execute(seqs))[1]
    before = llm.stats()
    answer, out = turns(llm, check)
    assert answer == expected_answer
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    cached = full_blocks * BLOCK
    stats = llm.stats()
    assert out.metrics.num_cached_tokens == cached
    assert stats["prefix_cache_host_hits"] - before["prefix_cache_host_hits"] == cached
    assert stats["swap_in_blocks"] == full_blocks
    first = inputs[-4][0]  # the last request's first chunk: only what was not cached
    assert first.num_computed == cached and first.token_ids == out.prompt_token_ids[cached:]

    salted = llm.generate([{"prompt_token_ids": out.prompt_token_ids, "cache_salt": "other"}],
                          params, use_tqdm=False)[0]
    assert salted.metrics.num_cached_tokens == 0
    assert salted.outputs[0].token_ids == expected.outputs[0].token_ids


@pytest.mark.parametrize("host_blocks,caching", [(5, True), (3, False)])
def test_a_full_host_pool_degrades_to_recompute(path, reference, host_blocks, caching):
    """A host pool of a few blocks (with prefix caching on, shared with evicted cached
    blocks) takes only some groups: the others are recomputed, and every request still
    finishes with its tokens."""
    llm = LLM(path, **SMALL, swap_space=host_blocks * BLOCK_BYTES, preemption_mode="swap",
              enable_prefix_caching=caching)
    assert serve(llm) == reference
    stats = llm.stats()
    assert stats["host_blocks_total"] == host_blocks
    assert 0 < stats["num_swapped_preemptions"] < stats["num_preemptions"]


def test_auto_follows_the_cost_model(path, reference):
    """With copies configured to cost far more than prefills, "auto" recomputes every
    group; without configured rates it measures both as it runs (and swaps)."""
    dear = LLM(path, **SMALL, **SWAP, preemption_mode="auto", swap_bandwidth=1.0,
               prefill_seconds_per_token=1e-9)
    assert serve(dear) == reference
    stats = dear.stats()
    assert stats["num_preemptions"] > 0 and stats["num_swapped_preemptions"] == 0
    measured = LLM(path, **SMALL, **SWAP, preemption_mode="auto")
    assert serve(measured) == reference
    assert measured.stats()["num_swapped_preemptions"] > 0
    cost, runner = measured.engine.swap_cost, measured.engine.runner
    assert cost.prefilled_tokens > 0 and cost.prefill_seconds > 0
    assert cost.seconds_per_token == cost.prefill_seconds / cost.prefilled_tokens
    # the swap-outs that did not compile, timed: the bandwidth it decides with
    assert cost.copied_bytes == runner.swap_out_bytes_timed > 0
    assert cost.copy_seconds == runner.swap_out_seconds_timed > 0
    assert cost.bandwidth == cost.copied_bytes / cost.copy_seconds


def test_swap_cost_formula():
    cost = SwapCostModel(block_bytes=1000)
    assert cost.bandwidth == DEFAULT_COPY_BANDWIDTH
    assert cost.seconds_per_token == DEFAULT_PREFILL_SECONDS_PER_TOKEN
    cost.observe_copies(4_000, 2.0)  # 2,000 bytes/s measured
    cost.record_prefill(100, 1.0)  # 10 ms per token measured
    assert cost.swap_seconds(3) == 2 * 3 * 1000 / 2000  # 3 s: out and back in
    assert cost.recompute_seconds(200) == pytest.approx(2.0)
    assert not cost.prefer_swap(3, 200) and cost.prefer_swap(3, 400)
    # a sliding-window model's window blocks move too: 3 full + 2 window blocks of 500 bytes
    windowed = SwapCostModel(block_bytes=1000, window_block_bytes=500)
    windowed.observe_copies(4_000, 2.0)
    windowed.record_prefill(100, 1.0)
    assert windowed.swap_seconds(3, 2) == 2 * (3 * 1000 + 2 * 500) / 2000  # 4 s
    assert windowed.prefer_swap(3, 400) and not windowed.prefer_swap(3, 400, 2)
    fixed = SwapCostModel(block_bytes=1000, copy_bandwidth=1e6, prefill_seconds_per_token=1.0)
    fixed.observe_copies(1, 1.0)
    fixed.record_prefill(1, 1e-9)
    assert (fixed.bandwidth, fixed.seconds_per_token) == (1e6, 1.0)  # configured wins


@pytest.mark.parametrize("kwargs,message", [
    (dict(swap_space=-1), "swap_space"),
    (dict(swap_space=1.5), "swap_space"),
    (dict(swap_space="4GB"), "swap_space"),
    (dict(swap_space=True), "swap_space"),
    (dict(preemption_mode="evict"), "preemption_mode"),
    (dict(preemption_mode="swap"), "preemption_mode.*swap_space"),
    (dict(preemption_mode="auto", swap_space=0), "preemption_mode"),
    (dict(enable_host_prefix_cache=1), "enable_host_prefix_cache"),
    (dict(swap_bandwidth=0.0), "swap_bandwidth"),
    (dict(swap_bandwidth=float("nan")), "swap_bandwidth"),
    (dict(prefill_seconds_per_token=-1e-3), "prefill_seconds_per_token"),
])
def test_bad_swap_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_a_swap_space_smaller_than_a_block_is_refused(path):
    with pytest.raises(ValueError, match="smaller than one KV block"):
        LLM(path, **SMALL, swap_space=BLOCK_BYTES - 1)
    assert LLM(path, **SMALL, swap_space=BLOCK_BYTES).stats()["host_blocks_total"] == 1
