"""Decode steps run ahead (`EngineConfig.decode_lookahead_rows`, ModelRunner._run_ahead): the
runner starts the next decode step, its tokens taken from the device, before it reads the
draws of the step it follows. The engine must not be able to tell: every request's tokens and
finish reasons are those of the engine stepping one step at a time, and greedy ones HF
transformers'; so are the log-probabilities, bit for bit on the cpp backend (the C++ library
computes each row alone) and to float32 rounding on the jnp and Pallas ones (a row dropped or
run beside changes the batch the others are computed in, and XLA's matmuls round by shape).
The next step takes each row of the run-ahead step that is the same computation; rows of
sequences that ended (a stop, an abort, a preemption) are dropped, rows it lacks (a request
that arrived) run in a call of their own beside it, and a step it serves less than half of is
run anew. The K/V that unused rows wrote harms nobody: the pool
starts as NaN and every released block is refilled with NaN (`debug_nan_pool`), so a read of
a slot nobody wrote would turn tokens to garbage."""

from __future__ import annotations

import pytest
from conftest import byte_bpe_llm, hf_greedy
from test_fault_injection import Once, run

import jaxpage.engine.runner as runner_module
from jaxpage import LLM, BeamSearchParams, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(hf_model_dir):
    return hf_model_dir("llama")


@pytest.fixture(scope="module")
def stop_case(tiny):
    """A prompt, its HF greedy continuation, and a stop token that ends it part way."""
    prompt = list(range(30, 41))
    greedy = hf_greedy(tiny[1], prompt, 24)
    return prompt, greedy, greedy[6]


def workload(stop_case):
    """(request_id, prompt, params, step to add it at): requests arriving while others
    decode; ones that end part way (a stop token, after min_tokens, an abort, length); rows
    the scheduler never lets run ahead (penalties, n > 1 forks at the prompt's end, beams)."""
    prompt, _, stop = stop_case
    return [
        ("g0", list(range(3, 10)), SamplingParams(max_tokens=30, **GREEDY), 0),
        ("s0", list(range(11, 18)), SamplingParams(max_tokens=25, temperature=1.0, top_p=0.9,
                                                   seed=3, logprobs=2, ignore_eos=True), 0),
        ("stop", prompt, SamplingParams(max_tokens=24, temperature=0.0,
                                        stop_token_ids=[stop]), 2),
        ("min", prompt, SamplingParams(max_tokens=16, temperature=0.0, min_tokens=10,
                                       stop_token_ids=[stop]), 2),
        ("late", list(range(80, 90)), SamplingParams(max_tokens=20, **GREEDY), 20),
        # later, beside the last of the others
        ("pen", list(range(50, 57)), SamplingParams(max_tokens=12, presence_penalty=1.5,
                                                    **GREEDY), 34),
        ("n2", list(range(60, 66)), SamplingParams(n=2, max_tokens=14, temperature=0.9,
                                                   seed=9, ignore_eos=True), 40),
        ("beam", list(range(70, 77)), BeamSearchParams(beam_width=2, max_tokens=6,
                                                       ignore_eos=True), 44),
        ("abort", list(range(20, 26)), SamplingParams(max_tokens=40, **GREEDY), 0),
    ]


def serve(llm, items, abort_at=12, before_step=None):
    """Serve `items` step by step (test_fault_injection.run: invariants checked each step,
    nothing left behind), aborting "abort" at step `abort_at` and calling `before_step(step)`
    before each step when given; returns ({request_id: final output}, engine stats, steps
    that raised an injected failure)."""
    def fault(engine, step):
        if step == abort_at:
            engine.abort_request("abort")
        if before_step is not None:
            before_step(step)

    final, raised = run(llm, fault, items)
    return final, llm.stats(), raised


def outcome(out):
    return [(c.token_ids, c.cumulative_logprob, c.finish_reason) for c in out.outputs]


def same_up_to_rounding(a, b) -> None:
    """The same tokens and finish reasons; log-probabilities within float32 rounding."""
    assert [(c.token_ids, c.finish_reason) for c in a.outputs] == [
        (c.token_ids, c.finish_reason) for c in b.outputs], a.request_id
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, rel=1e-5, abs=1e-5)
        for lx, ly in zip(x.logprobs or (), y.logprobs or (), strict=True):
            assert lx.keys() == ly.keys() and all(
                lx[t] == pytest.approx(ly[t], rel=1e-5, abs=1e-5) for t in lx)


PALLAS = [pytest.param(b, marks=[pytest.mark.slow, pytest.mark.kernels])
          for b in ("pallas_gpu", "pallas_tpu")]


@pytest.mark.parametrize("backend", ["cpp", pytest.param("jnp", marks=pytest.mark.slow),
                                     *PALLAS])
@pytest.mark.parametrize("block_size,num_blocks,swap", [(4, 48, 0), (4, 20, 0), (4, 20, 64),
                                                        (16, 24, 0)],
                         ids=["blocks-of-4", "preempting", "swapping", "blocks-of-16"])
def test_run_ahead_changes_no_request(tiny, stop_case, backend, block_size, num_blocks, swap):
    path, model = tiny
    items = workload(stop_case)
    if backend == "pallas_tpu" and block_size < 8:  # Mosaic: blocks of whole sublanes
        num_blocks, swap, block_size = num_blocks // 2, swap // 2, 8
    runs = {}
    for rows in (8, 0):
        llm = LLM(path, block_size=block_size, num_blocks=num_blocks,
                  max_num_batched_tokens=32, max_num_seqs=8, debug_nan_pool=True,
                  decode_lookahead_rows=rows, attention_backend=backend,
                  kernel_interpret=backend.startswith("pallas"),
                  swap_space=swap * llm_block_bytes(path, block_size),
                  preemption_mode="swap" if swap else "recompute")
        runs[rows] = serve(llm, items)
    (ahead, stats, raised), (apart, apart_stats, _) = runs[8], runs[0]
    assert raised == 0
    assert apart_stats["lookahead_hits"] == apart_stats["lookahead_misses"] == 0
    # every path taken: steps found run ahead, some with rows of ended sequences dropped and
    # some with arrivals' rows run beside them, and on the ragged backends steps run anew (a
    # prompt chunk beside the decodes: the call that reads the weights once takes them all;
    # on jnp a prompt chunk is a call of its own, and a step runs anew only where the step
    # run ahead serves less than half of it)
    assert stats["lookahead_hits"] >= 15, stats
    assert backend == "jnp" or stats["lookahead_misses"] >= 1, stats
    assert stats["lookahead_dropped"] >= 2 and stats["lookahead_split"] >= 1, stats
    if num_blocks == 20:
        assert stats["num_preemptions"] > 0
    if swap:
        assert stats["num_swapped_preemptions"] > 0
    assert set(ahead) == set(apart) == {item[0] for item in items}
    for request_id in apart:
        if backend == "cpp":  # each row computed alone: bit for bit whatever the batch
            assert outcome(ahead[request_id]) == outcome(apart[request_id]), request_id
            assert (ahead[request_id].outputs[0].logprobs
                    == apart[request_id].outputs[0].logprobs), request_id
        else:  # XLA's matmuls round by the batch's shape: a row in another batch differs
            same_up_to_rounding(ahead[request_id], apart[request_id])
    # the independent oracle: HF transformers' greedy tokens
    for request_id, prompt, params, _ in items:
        if request_id in ("g0", "late"):
            assert ahead[request_id].outputs[0].token_ids == hf_greedy(model, prompt,
                                                                       params.max_tokens)
    prompt, greedy, stop = stop_case
    stopped = ahead["stop"].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop
    assert stopped.token_ids == greedy[:len(stopped.token_ids)] and len(stopped.token_ids) <= 7
    assert len(ahead["min"].outputs[0].token_ids) >= 10
    assert ahead["abort"].outputs[0].finish_reason == "abort"


@pytest.mark.parametrize("name,num_blocks,swap", [
    pytest.param("mistral", None, 0, id="mistral"),
    pytest.param("gemma2", 20, 0, id="gemma2-preempting"),
    # ~10 s: the slow suite's (windows under swap stay in the default one: test_window_swap)
    pytest.param("gemma2", 20, 64, id="gemma2-swapping", marks=pytest.mark.slow)])
def test_run_ahead_changes_no_request_past_a_sliding_window(hf_model_dir, name, num_blocks,
                                                            swap):
    """The same past a sliding window of 8 tokens (Mistral: every layer sliding, one pool;
    Gemma 2: sliding and global layers, both groups, preempted by recompute and by swap):
    the window group takes its next block a step early as the full group does, and the
    blocks it releases as the window moves on lie before what the step run ahead reads, so
    a row run ahead is the same computation as long as its table agrees from its window's
    first block on."""
    path, model = hf_model_dir(name, sliding_window=8)
    prompt = list(range(30, 41))
    greedy = hf_greedy(model, prompt, 24)
    items = workload((prompt, greedy, greedy[6]))
    runs = {}
    for rows in (8, 0):
        llm = LLM(path, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=32,
                  max_num_seqs=8, debug_nan_pool=True, decode_lookahead_rows=rows,
                  swap_space=swap * llm_block_bytes(path, 4),
                  preemption_mode="swap" if swap else "recompute")
        runs[rows] = serve(llm, items)
    (ahead, stats, raised), (apart, _, _) = runs[8], runs[0]
    assert raised == 0
    assert stats["sliding_window"] == 8
    assert stats["lookahead_hits"] >= 15 and stats["lookahead_dropped"] >= 1, stats
    assert (stats["num_preemptions"] > 0) == (num_blocks is not None)
    assert (stats["num_swapped_preemptions"] > 0) == bool(swap)
    assert set(ahead) == set(apart) == {item[0] for item in items}
    for request_id in apart:  # the sampler's reductions round by its batch's shape
        same_up_to_rounding(ahead[request_id], apart[request_id])
    for request_id, prompt, params, _ in items:  # past the window: HF's greedy tokens
        if request_id in ("g0", "late"):
            assert ahead[request_id].outputs[0].token_ids == hf_greedy(model, prompt,
                                                                       params.max_tokens)


def llm_block_bytes(path, block_size):
    """Bytes of one KV block of the tiny model in float32 (swap_space is given in bytes)."""
    import json
    import os

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
            * block_size * 4)


@pytest.mark.parametrize("backend,split,misses", [("jnp", 2, 0), ("cpp", 0, 2)])
def test_a_step_run_ahead_serves_what_it_can(tiny, backend, split, misses):
    """Hand-worked: "a" and "b" decode, running ahead; "c" arrives at step 6, "d" and "e" a
    few steps after b has stopped. On the jnp backend a prompt chunk is a call of its own,
    so the decodes beside it come from the run-ahead step; the step of c's first decode
    takes a's and b's rows from it and runs c's beside it (a split step); from the next on
    all three run ahead; likewise when d and e join (2 of 4 rows taken): 2 split steps, no
    miss. On the ragged
    cpp backend a prompt chunk and the decodes are one call (the weights read once): the
    two steps with a prompt chunk run anew (2 misses) and the next run ahead of all. "b"
    ends on a stop token, which the host sees only after its next step was started: that
    row is dropped. A sequence ending by length is left out of the step run ahead of its
    last (`SeqInput.ends`), so the others still run ahead. Every request's tokens are those
    of stepping one step at a time, and greedy ones HF's."""
    path, model = tiny
    greedy = dict(temperature=0.0, ignore_eos=True)
    b_tokens = hf_greedy(model, [8, 9], 16)
    # a token first seen at b's 9th or later, drawn at step 8 or later: after c's arrival,
    # and d and e arrive 3 steps after it (the test's steps are "step 6" and "step 12" when
    # b stops on its 9th)
    k, stop = next((k, t) for k, t in enumerate(b_tokens) if k >= 8 and t not in b_tokens[:k])
    items = [("a", [5, 6, 7], SamplingParams(max_tokens=24, **greedy), 0),
             ("b", [8, 9], SamplingParams(max_tokens=16, stop_token_ids=[stop], **greedy), 0),
             ("c", [10, 11, 12], SamplingParams(max_tokens=16, **greedy), 6),
             ("d", [13, 14], SamplingParams(max_tokens=6, **greedy), k + 4),
             ("e", [15, 16], SamplingParams(max_tokens=6, **greedy), k + 4)]
    runs = {}
    for rows in (8, 0):
        llm = LLM(path, block_size=4, num_blocks=64, max_num_seqs=8, debug_nan_pool=True,
                  decode_lookahead_rows=rows, attention_backend=backend)
        final, stats, raised = serve(llm, items, abort_at=None)
        assert raised == 0
        runs[rows] = (final, stats)
    (ahead, stats), (apart, _) = runs[8], runs[0]
    assert set(ahead) == set(apart) == {item[0] for item in items}
    for request_id in ahead:
        if backend == "cpp":
            assert outcome(ahead[request_id]) == outcome(apart[request_id])
        else:
            same_up_to_rounding(ahead[request_id], apart[request_id])
    b = ahead["b"].outputs[0]
    assert b.token_ids == b_tokens[:b_tokens.index(stop) + 1] and b.finish_reason == "stop"
    for request_id, prompt, params, _ in items:
        if request_id != "b":
            assert ahead[request_id].outputs[0].token_ids == hf_greedy(model, prompt,
                                                                       params.max_tokens)
    assert stats["lookahead_split"] == split and stats["lookahead_dropped"] == 1, stats
    assert stats["lookahead_misses"] == misses and stats["lookahead_hits"] >= 15, stats


def test_a_step_run_ahead_serves_less_than_half_of_runs_anew(tiny):
    """"a" decodes, running ahead; "b" and "c" arrive together (on the jnp backend, whose
    prompt chunks are calls of their own): their first decodes are two of the three rows of
    the next step, which the run-ahead step (a's alone) serves less than half of, so that
    step runs anew (a miss) and its tokens are a clean run's."""
    path, _ = tiny
    greedy = dict(temperature=0.0, ignore_eos=True)
    items = [("a", [5, 6, 7], SamplingParams(max_tokens=16, **greedy), 0),
             ("b", [8, 9], SamplingParams(max_tokens=8, **greedy), 5),
             ("c", [10, 11], SamplingParams(max_tokens=8, **greedy), 5)]
    runs = {}
    for rows in (8, 0):
        llm = LLM(path, block_size=4, num_blocks=64, max_num_seqs=8, debug_nan_pool=True,
                  decode_lookahead_rows=rows, attention_backend="jnp")
        final, stats, _ = serve(llm, items, abort_at=None)
        runs[rows] = (final, stats)
    (ahead, stats), (apart, _) = runs[8], runs[0]
    assert set(ahead) == set(apart) == {"a", "b", "c"}
    for request_id in ahead:
        same_up_to_rounding(ahead[request_id], apart[request_id])
    assert stats["lookahead_misses"] == 1 and stats["lookahead_split"] == 0, stats


def run_ahead_flags(llm):
    """run(prompt, params, beam=False): serve one request on `llm`'s engine alone; returns
    (tokens, draws, may_run_ahead) of each of its SeqInputs, in step order."""
    engine, runner = llm.engine, llm.engine.runner
    flags = []
    execute = runner.execute
    runner.execute = lambda seqs: (flags.append([(len(s.token_ids), len(s.sampling),
                                                 s.may_run_ahead) for s in seqs]),
                                   execute(seqs))[1]

    def run(prompt, params, beam=False, *more):
        """`more`: (prompt, params) of requests added after it, at once."""
        flags.clear()
        (engine.add_beam_request if beam else engine.add_request)("r", prompt, params)
        for k, (other, other_params) in enumerate(more):
            engine.add_request(f"more{k}", other, other_params)
        while engine.has_unfinished_requests():
            engine.step()
        return [f for step in flags for f in step]
    return run


def test_only_sequences_that_go_on_as_they_are_may_run_ahead(tiny, tmp_path):
    """The scheduler's word (SeqInput.may_run_ahead), hand-worked per request: a decode, or a
    prompt's last chunk while no request waits, whose draw is not its last by length, with
    one row (penalties' too: the device adds the draw to their token history); never a
    prompt chunk before its last, a prompt's last chunk while another request waits or with
    prompt scores, a forking prompt's end, a beam, or bad words (their bans are made on the
    host from the tokens drawn)."""
    path, _ = tiny
    run = run_ahead_flags(LLM(path, block_size=4, num_blocks=64, max_num_seqs=8))

    # 3-token prompt, 5 tokens: the prompt draws the first, four decodes the rest; the last
    # decode's draw is the fifth token (length): it does not go on
    assert run([5, 6, 7], SamplingParams(max_tokens=5, **GREEDY)) == [
        (3, 1, True), (1, 1, True), (1, 1, True), (1, 1, True), (1, 1, False)]
    assert run([5, 6, 7], SamplingParams(max_tokens=4, presence_penalty=1.0, **GREEDY)) == [
        (3, 1, True), (1, 1, True), (1, 1, True), (1, 1, False)]
    # prompt scores among the prompt's draws (two scores, one draw)
    assert run([5, 6, 7], SamplingParams(max_tokens=2, prompt_logprobs=1, **GREEDY)) == [
        (3, 3, False), (1, 1, False)]
    # n = 2: the prompt's end draws twice (no), then each sample decodes on its own
    assert run([5, 6, 7], SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=1,
                                         ignore_eos=True)) == [
        (3, 2, False), (1, 1, True), (1, 1, True), (1, 1, False), (1, 1, False)]
    beam = run([5, 6, 7], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True),
               beam=True)
    assert beam and not any(flag for _, _, flag in beam)
    words = run_ahead_flags(byte_bpe_llm(tmp_path, block_size=4, num_blocks=64))(
        [5, 6, 7], SamplingParams(max_tokens=4, bad_words=["the"], **GREEDY))
    assert words == [(3, 1, False), (1, 1, False), (1, 1, False), (1, 1, False)]

    # a prompt in chunks of 4 tokens: only its last chunk may go on; one sequence at a time,
    # so the second request waits while the first runs: the first's prompt may not go on
    # (the next step admits the other), its decodes may
    run = run_ahead_flags(LLM(path, block_size=4, num_blocks=64, max_num_seqs=1,
                              max_num_batched_tokens=4))
    assert run(list(range(5, 15)), SamplingParams(max_tokens=2, **GREEDY)) == [
        (4, 0, False), (4, 0, False), (2, 1, True), (1, 1, False)]
    assert run([5, 6, 7], SamplingParams(max_tokens=3, **GREEDY), False,
               ([8, 9], SamplingParams(max_tokens=2, **GREEDY))) == [
        (3, 1, False), (1, 1, True), (1, 1, False), (2, 1, True), (1, 1, False)]


@pytest.mark.parametrize("prompt", [[5, 6, 7], list(range(5, 13))], ids=["3", "8"])
def test_a_lone_request_runs_ahead_at_every_step_but_its_last(tiny, prompt):
    """One request of 20 tokens in blocks of 4: its prompt and 18 of its 19 decodes go on
    (not the last), and each step after one that goes on is found run ahead (19 hits, no
    misses), across block boundaries too: where the next token starts a block (after the
    8-token prompt too) the scheduler takes that block a step early. Its tokens are HF's."""
    path, model = tiny
    llm = LLM(path, block_size=4, num_blocks=64, max_num_seqs=8, debug_nan_pool=True)
    out = llm.generate([prompt], SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(model, prompt, 20)
    stats = llm.stats()
    assert (stats["lookahead_hits"], stats["lookahead_misses"]) == (19, 0)
    assert stats["kv_blocks_used"] == 0


def test_penalized_decodes_run_ahead_with_their_history_on_the_device(tiny):
    """Penalties run ahead: the run-ahead step's sampler adds the token the step before drew
    to each penalized row's history on the device. Every penalty at once, sampled; n = 2
    samples (each its own history); a prompt longer than the first history width (the
    prompt sets it); and an output that outgrows that width (128 tokens) part way, where the
    run-ahead step is packed anew on the host: every request's tokens and log-probs are
    those of stepping one at a time, bit for bit (cpp), with most steps found run ahead."""
    path, _ = tiny
    penalties = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3)
    items = [
        ("long", [5, 6, 7], SamplingParams(max_tokens=150, temperature=1.0, seed=1,
                                           logprobs=1, ignore_eos=True, **penalties), 0),
        ("n2", list(range(20, 26)), SamplingParams(n=2, max_tokens=40, temperature=0.8,
                                                   seed=2, ignore_eos=True,
                                                   frequency_penalty=1.0), 0),
        ("prompt", [3 + i % 90 for i in range(140)],
         SamplingParams(max_tokens=24, repetition_penalty=1.5, **GREEDY), 5),
        ("plain", list(range(40, 46)), SamplingParams(max_tokens=60, **GREEDY), 0),
    ]
    runs = {}
    for rows in (8, 0):
        llm = LLM(path, block_size=4, num_blocks=160, max_num_seqs=8, max_model_len=512,
                  debug_nan_pool=True, decode_lookahead_rows=rows)
        runs[rows] = serve(llm, items, abort_at=None)
    (ahead, stats, raised), (apart, _, _) = runs[8], runs[0]
    assert raised == 0 and set(ahead) == set(apart) == {item[0] for item in items}
    for request_id in apart:
        assert outcome(ahead[request_id]) == outcome(apart[request_id]), request_id
        assert [c.logprobs for c in ahead[request_id].outputs] == [
            c.logprobs for c in apart[request_id].outputs], request_id
    assert len(ahead["long"].outputs[0].token_ids) == 150
    assert stats["lookahead_hits"] >= 120, stats


@pytest.mark.parametrize("part", ["NEXT_TOKENS", "APPEND_HISTORY"])
def test_a_failed_run_ahead_loses_nothing(tiny, monkeypatch, part):
    """Starting the run-ahead step fails once (taking its token ids, or writing a penalized
    row's last token into its history): that step raises (the engine puts itself back as
    before it), the next redoes it, and every request ends as in a clean run."""
    path, _ = tiny
    items = [("a", list(range(3, 10)), SamplingParams(max_tokens=16, **GREEDY), 0),
             ("b", list(range(11, 15)), SamplingParams(max_tokens=12, temperature=1.0,
                                                       seed=4, ignore_eos=True,
                                                       frequency_penalty=0.7), 0)]

    def run(fault_step=None):
        def arm(step):
            if step == fault_step:
                monkeypatch.setattr(runner_module, part, once)

        llm = LLM(path, block_size=4, num_blocks=48, max_num_seqs=8, debug_nan_pool=True)
        final, stats, raised = serve(llm, items, abort_at=None, before_step=arm)
        return {r: outcome(out) for r, out in final.items()}, raised, stats

    once = Once(getattr(runner_module, part))
    clean, raised, _ = run()
    assert raised == 0
    faulted, raised, stats = run(fault_step=4)
    assert once.fired and raised == 1 and stats["lookahead_hits"] > 0
    assert faulted == clean


def test_a_decode_step_is_not_run_inline_by_the_host(tiny, monkeypatch):
    """XLA:CPU runs an executable its cost model counts under 1,000 FLOPs on the calling
    thread (PJRT's cheap computation), and custom calls count none: a float32 step whose
    matmuls are all the kernel library's would block the host for the whole step, and no step
    would ever run ahead of it. The step function adds an identity over the logits that
    counts (`_counted`: a max with a -inf XLA cannot see): its logits are the model's, bit for
    bit, NaN and -0.0 included."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import lowering

    path, _ = tiny
    llm = LLM(path, block_size=4, num_blocks=64, max_num_seqs=8)
    runner = llm.engine.runner
    calls = []
    forward = runner_module._FORWARD

    def spy(*args):
        calls.append(args)
        return forward(*args)

    monkeypatch.setattr(runner_module, "_FORWARD", spy)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    model, platform, params, _, token_ids, positions, attn_md = calls[-1]  # a 1-row decode
    args = (params, runner.kv_pool, token_ids, positions, attn_md)

    def flops(fn):
        cost = jax.jit(fn, static_argnums=0).lower(model, *args).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    logits, _ = model.forward(params, token_ids, positions, runner.kv_pool, attn_md)
    # one counted FLOP per logit: past 1,000 for any vocabulary of 1,000 tokens or more (the
    # tiny model's has 97)
    def alone_fn(m, p, kv, t, pos, md):
        with lowering.for_platform(platform):  # as the runner traces it
            return m.forward(p, t, pos, kv, md)

    alone = flops(alone_fn)
    assert flops(lambda m, *a: runner_module._forward_fn(m, platform, *a)
                 ) >= alone + logits.size
    ours, _ = runner_module._forward_fn(model, platform, params, runner.kv_pool, token_ids,
                                        positions, attn_md)
    assert np.array_equal(np.asarray(ours).view(np.uint32), np.asarray(logits).view(np.uint32))
    special = jnp.array([np.nan, -np.nan, -np.inf, -0.0, 0.0, 1e-45, 1.5, np.inf])
    for dtype, bits in ((jnp.float32, np.uint32), (jnp.bfloat16, np.uint16)):
        x = special.astype(dtype)
        same = jax.jit(runner_module._counted)(x)
        assert same.dtype == dtype
        assert np.array_equal(np.asarray(same).view(bits), np.asarray(x).view(bits))


@pytest.mark.parametrize("value", [-1, 1.5, "8", True, "auto"])
def test_bad_lookahead_rows_are_refused(value):
    from jaxpage import EngineConfig

    with pytest.raises(ValueError, match=f"decode_lookahead_rows.*{value!r}"):
        EngineConfig(decode_lookahead_rows=value)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_a_step_run_ahead_is_made_on_the_device_as_the_host_would_build_it(hf_model_dir, name):
    """Where every row of a decode step goes on, the runner makes the step after it from that
    step's inputs kept on the device (`ModelRunner._advance`): positions, slots and lengths
    one on, the draws' counters one on, the block tables as they were except the rows whose
    table changed since (a block taken for the next tokens; in Gemma 2's window group also
    blocks freed as they left the window), packed and uploaded again. Each such step's
    arrays equal the ones `build_metadata` and the sampler's counters make from the step's
    sequences on the host; with blocks of 4 and prompts of staggered lengths, rows' tables
    change at most steps. Tokens: HF's."""
    import jax
    import numpy as np

    from jaxpage.attention import build_metadata

    overrides = {"sliding_window": 8} if name == "gemma2" else {}
    path, hf = hf_model_dir(name, **overrides)
    llm = LLM(path, block_size=4, max_num_seqs=6, max_num_batched_tokens=64,
              enable_prefix_caching=False, debug_nan_pool=True)
    runner = llm.engine.runner
    advance, made, changed = runner._advance, [], []

    def checked(prev, seqs, token_ids, *rest):
        step = advance(prev, seqs, token_ids, *rest)
        inputs, width = step.inputs, step.inputs.width
        windowed = runner.window is not None
        positions, md = build_metadata(
            [s.block_table[:width] for s in seqs], [s.num_computed for s in seqs],
            [1] * len(seqs), runner.block_size, max_blocks_per_seq=width,
            num_tokens=inputs.key[1], num_seqs=inputs.key[3], max_query_len=1,
            logits_indices=list(range(len(seqs))), num_logits=step.num_rows,
            backend=runner.backend, interpret=runner.interpret,
            window_block_tables=[s.window_block_table[:width] for s in seqs] if windowed
            else None)
        got_positions, got = jax.device_get((inputs.positions, inputs.attn_md))
        np.testing.assert_array_equal(got_positions, positions)
        for field in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                      "logits_indices", "num_logits", "window_slot_mapping",
                      "window_block_tables"):
            if getattr(md, field) is None:
                assert getattr(got, field) is None, field
            else:
                np.testing.assert_array_equal(getattr(got, field), getattr(md, field), field)
        steps = np.zeros(step.num_rows, np.int32)
        steps[:len(seqs)] = [s.sampling[0].step for s in seqs]
        np.testing.assert_array_equal(jax.device_get(inputs.sampling_md.steps), steps)
        made.append(len(seqs))
        changed.append(any(a != b for a, b in zip(inputs.tables[0], prev.inputs.tables[0],
                                                  strict=True)))
        return step

    runner._advance = checked
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 90, size=n).tolist() for n in (3, 5, 6, 9, 12, 14)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)
    assert len(made) > 15 and max(made) == 6
    assert sum(changed) > len(changed) // 2
