"""A/B probes of the CPU decode step: the step against the same step with one thing changed.

The runner's step and its variant alternate step by step in one process, beside the step's
bound.

Lab probe: each mode served one investigation of the CPU decode step
(docs/cpu_decode_history.md); scripts/bench_decode_step.py is the step's table itself. Per
dtype and batch it prints the runner's step (context 128 by default) beside its bound (the
weights and K/V read at the read probe's rate, or the matmuls at the dot instructions' peak:
bench_common), then one line per mode asked:

- `--vs-bucket 8`: each smaller batch in its own decode bucket against padded to 8 rows, the
  smallest bucket before 2026-12-03 (XLA:CPU splits a step's elementwise ops over threads from
  8 rows on, and the sampler reads every padded row);
- `--vs-xla-glue`: a layer's elementwise glue (residual adds and norms, SiLU, rope) as the
  kernel library's calls against XLA's loop fusions;
- `--vs-prefetch 4096`: the packed matmuls prefetching at the kernel's distance for the rows
  of a pass against 4 KB ahead in each panel (the one distance before 2026-12-04);
- `--vs-uncut-attention`: the attention kernel cutting a sequence's keys among the threads
  where a step has few sequences over long contexts, against never
  (`paged_attention_cpu(key_splits=1)`);
- `--vs-unfused`: each layer as one kernel call (`cpu_ops.decoder_layer`, taken by steps of
  at most `jaxpage.layers.FUSED_LAYER_ROWS` tokens) against its eleven calls
  (`LlamaModel(fuse_layers=False)`);
- `--vs-4k-pool`: the step over blocks spread across the whole pool (as a pool long in use
  hands them out) on the runner's pool, backed by huge pages (`huge_pages.advise_zeroed`),
  against a pool of 4 KiB pages, where each block's K or V tile is a page and a TLB miss of
  its own;
- `--vs-per-layer`: the runner's step and the engine's with the layers stacked, one array a
  param name read in place (`jaxpage.layers.stacked`), against a dict of arrays a layer (the
  host dispatching ~180 more arrays a step);
- `--vs-lookahead`: the whole engine's step while the batch decodes (scheduling, the runner,
  the update, detokenizing: what a user waits for per token) with small decode steps run
  ahead (`EngineConfig.decode_lookahead_rows`: the next step started before the draws of the
  one before are read) and without, over the step's bound;
- `--vs-burst 4`: the engine's step against the same forward chained on the device one step a
  call and four steps a call (greedy draws fed to the next step; the host only dispatching):
  what the engine's host work costs beyond a dispatch a step, and what one dispatch and
  launch a step costs;
- `--by-placement 240`: the runner's and the engine's steps for 240 s a batch by where the
  step's two threads ran, a round trip of a cache line between two threads alongside (`near`:
  cores sharing a cache; `far`: not), each beside the bound at the read rate of its own
  rounds: on a 2-core AMD EPYC (Zen 4) VM the fast reads come only with far placements, where
  every handoff between the step's threads costs ~6x a near one's.

    python scripts/lab/decode_step_ab.py --batches 1,2,4,8 --vs-bucket 8
    python scripts/lab/decode_step_ab.py --batches 1,8,64 --vs-xla-glue
    python scripts/lab/decode_step_ab.py --batches 1,2,4,8 --vs-prefetch 4096
    python scripts/lab/decode_step_ab.py --batches 1,2 --context 1000 --vs-uncut-attention
    python scripts/lab/decode_step_ab.py --batches 1,2,4,8 --vs-unfused
    python scripts/lab/decode_step_ab.py --batches 8,32 --vs-4k-pool
    python scripts/lab/decode_step_ab.py --batches 1,2,4,8 --vs-lookahead
    python scripts/lab/decode_step_ab.py --batches 1,8,64 --dtypes bfloat16 --vs-per-layer
    python scripts/lab/decode_step_ab.py --batches 1,8 --dtypes bfloat16 --quantization int8 \
        --vs-per-layer
    python scripts/lab/decode_step_ab.py --batches 1,8 --dtypes bfloat16 --vs-burst 4
    python scripts/lab/decode_step_ab.py --batches 1,8 --by-placement 240
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import (  # noqa: E402
    NEAR_NS,
    alternating_step_seconds,
    bound_ms,
    cores,
    decode_seqs,
    decode_step_seconds,
    fma_peak_gflops,
    forward_args,
    make_llm,
    matmul_peak_gflops,
    probes,
    read_probe,
    step_and_read,
    step_bytes_and_flops,
)


def padded_step_seconds(llm, batch: int, context: int, rows: int, rounds: int = 25):
    """Median seconds of a decode step of `batch` sequences in the runner's own bucket for it
    and padded to a bucket of `rows` (the smallest decode bucket before 2026-12-03 was 8)."""
    own = llm.engine.runner.decode_buckets
    return alternating_step_seconds(llm, batch, context, "decode_buckets",
                                    (own, [b for b in own if b >= rows]), rounds)


def _traced_apart_seconds(llm, batch: int, context: int, module, name: str, value,
                          rounds: int):
    """Median seconds of a decode step of the runner's model and of the same step traced
    with `module.name` set to `value`, alternating: an equal model of another class, which the
    jitted step compiles apart from the runner's, is traced once with the patch (its compiled
    steps keep it after)."""
    import dataclasses

    model = llm.engine.runner.model
    other = dataclasses.make_dataclass(f"Other{name}", [], bases=(type(model),), frozen=True)(
        *(getattr(model, f.name) for f in dataclasses.fields(model)))
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        llm.engine.runner.model = other
        llm.engine.runner.execute(decode_seqs(llm.engine.runner, batch, context))
    finally:
        setattr(module, name, before)
        llm.engine.runner.model = model
    return alternating_step_seconds(llm, batch, context, "model", (model, other), rounds)


def glue_step_seconds(llm, batch: int, context: int, rounds: int = 30):
    """Median seconds of a decode step with the layer glue in the kernel library's calls
    (`jaxpage.layers.add_rms_norm`, `silu_mul`, `split_rotate` on CPU) and as XLA's
    fusions (the same model traced with the glue's jnp path), alternating."""
    from jaxpage.layers import dispatch

    return _traced_apart_seconds(llm, batch, context, dispatch, "cpu_glue",
                                 lambda cpu, default, *args: default(*args), rounds)


def uncut_attention_step_seconds(llm, batch: int, context: int, rounds: int = 40):
    """Median seconds of a decode step with the attention kernel cutting few sequences' keys
    among the threads as it chooses (`paged_attention_cpu(key_splits=0)`) and never
    (`key_splits=1`), alternating."""
    from pallas_kernels import cpu_ops

    return _traced_apart_seconds(
        llm, batch, context, cpu_ops, "paged_attention_cpu",
        functools.partial(cpu_ops.paged_attention_cpu, key_splits=1), rounds)


def prefetch_step_seconds(llm, batch: int, context: int, prefetch_bytes: int,
                          rounds: int = 40):
    """Median seconds of a decode step with the packed matmuls prefetching as the kernel
    chooses (by the rows of a pass) and `prefetch_bytes` ahead in each panel, alternating."""
    from pallas_kernels import cpu_ops

    return _traced_apart_seconds(
        llm, batch, context, cpu_ops, "packed_matmul",
        functools.partial(cpu_ops.packed_matmul, prefetch_bytes=prefetch_bytes), rounds)


def unfused_step_seconds(llm, batch: int, context: int, rounds: int = 40):
    """Median seconds of a decode step with each layer in one kernel call (the runner's model:
    `cpu_ops.decoder_layer`) and with the same model unfused (`fuse_layers=False`: a
    layer's eleven calls), alternating."""
    import dataclasses

    model = llm.engine.runner.model
    return alternating_step_seconds(llm, batch, context, "model",
                                    (model, dataclasses.replace(model, fuse_layers=False)),
                                    rounds)


def per_layer_step_seconds(llm, batch: int, context: int, rounds: int = 40,
                           engine_rounds: int = 6, tokens: int = 24) -> tuple:
    """Median seconds of (1) a runner's decode step with its layers stacked (the runner's
    params: `jaxpage.layers.stacked`, one array a param name read in place) and with the same
    weights as a dict of arrays a layer (a step's call then hands the host ~180 more arrays to
    dispatch), alternating step by step; (2) the engine's step while `batch` requests decode
    `tokens` tokens each (run ahead, so a step's dispatch overlaps the step before), the two
    layouts alternating round by round."""
    import numpy as np

    from jaxpage.layers import StackedLayers

    engine, runner = llm.engine, llm.engine.runner
    stacked = runner.params
    if not isinstance(stacked["layers"], StackedLayers):
        raise SystemExit("--vs-per-layer: the runner's layers are not stacked "
                         "(JAXPAGE_CPU_STACKED_LAYERS=0, or a model the kernel does not fuse)")
    per_layer = dict(stacked, layers=list(stacked["layers"]))
    runner_times = alternating_step_seconds(llm, batch, context, "params",
                                            (stacked, per_layer), rounds)
    rng, times = np.random.default_rng(0), ([], [])
    try:
        for r in range(engine_rounds + 1):  # the first round compiles
            for i, params in enumerate((stacked, per_layer)):
                runner.params = params
                step = np.median(decode_step_seconds(engine, f"layout-{r}-{i}", batch, context,
                                                     tokens, rng))
                if r:
                    times[i].append(step)
    finally:
        runner.params = stacked
    return runner_times + tuple(float(np.median(t)) for t in times)


def lookahead_step_seconds(llm, batch: int, context: int, rounds: int = 6,
                           tokens: int = 48) -> tuple[float, float, float]:
    """Median seconds of an engine step while `batch` requests decode (prompts of `context`
    random tokens, `tokens` greedy tokens each, ignore_eos) with the runner starting each small
    decode step before the one it follows is read back (`lookahead_rows`, the engine's
    default) and without (0), alternating batch by batch; and the share of the steps so
    started. Unlike the other figures here it is the whole engine's step: scheduling, the
    runner, the draws' update and detokenizing, what a user waits for per token."""
    import numpy as np

    engine, runner = llm.engine, llm.engine.runner
    ahead = runner.lookahead_rows
    rng = np.random.default_rng(0)
    times: dict[int, list[float]] = {ahead: [], 0: []}
    hits = steps = 0
    try:
        for r in range(rounds + 1):  # the first round compiles
            for value, out in times.items():
                runner.lookahead_rows = engine.scheduler.lookahead_rows = value
                before = runner.lookahead_hits
                decoded = decode_step_seconds(engine, f"lookahead-{r}-{value}", batch, context,
                                              tokens, rng)
                if r:
                    out += decoded
                    if value:
                        steps += len(decoded)
                        hits += runner.lookahead_hits - before
    finally:
        runner.lookahead_rows = engine.scheduler.lookahead_rows = ahead
    return float(np.median(times[ahead])), float(np.median(times[0])), hits / max(steps, 1)


def pool_pages_step_seconds(llm, batch: int, context: int, rounds: int = 40):
    """Median seconds of a decode step whose sequences' blocks are spread over the whole pool
    (`decode_seqs(spread=True)`), on the runner's pool (2 MiB pages where Linux gives them:
    `huge_pages.advise_zeroed`) and on a second pool made as before 2026-12-04 (4 KiB pages),
    alternating."""
    from unittest import mock

    runner = llm.engine.runner
    with mock.patch.dict(os.environ, {"JAXPAGE_CPU_HUGE_PAGES": "0"}):
        small_pages = runner._new_pool()
    return alternating_step_seconds(llm, batch, context, "kv_pool",
                                    (runner.kv_pool, small_pages), rounds, spread=True)


def placement_steps(llm, batch: int, context: int, seconds: float,
                    tokens: int = 16) -> dict[str, tuple]:
    """Where the two threads run, and what it does to a step: rounds for `seconds`, each a
    round trip of a cache line between two threads (`round_trip_ns`, 5,000 times), a read of
    `read_probe`, a runner step, the engine's median step while `batch` requests decode
    `tokens` tokens (run ahead) and a round trip again; by placement, `near` (both round trips
    under NEAR_NS: cores sharing a cache) and `far` (both over; a round whose two disagree, the
    threads moved, is dropped), the medians (rounds, round trip ns, read GB/s, runner step s,
    engine step s). On a 2-core AMD EPYC (Zen 4) VM the hypervisor moves the two vCPUs between cores
    of one CCX (~57 ns round trips; one CCD's link, reads ~35 GB/s) and of two (~350 ns; two
    links, ~50-58 GB/s) within minutes: the fast reads come with slow handoffs between the
    threads, which a step makes at every stage of every layer."""
    import numpy as np

    lib = probes()
    if lib is None or cores() < 2:
        raise SystemExit("--by-placement needs the C probes and two cores")
    engine, runner = llm.engine, llm.engine.runner
    seqs = decode_seqs(runner, batch, context)
    runner.execute(seqs)
    rng = np.random.default_rng(0)
    decode_step_seconds(engine, "placement-warm", batch, context, tokens, rng)
    probe, rounds = read_probe(), {"near": [], "far": []}
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        before = lib.round_trip_ns(5000)
        read = probe()
        start = time.perf_counter()
        runner.execute(seqs)
        step = time.perf_counter() - start
        engine_step = float(np.median(decode_step_seconds(
            engine, f"placement-{len(rounds['near']) + len(rounds['far'])}", batch, context,
            tokens, rng)))
        after = lib.round_trip_ns(5000)
        if (before < NEAR_NS) == (after < NEAR_NS):
            rounds["near" if before < NEAR_NS else "far"].append(
                ((before + after) / 2, read, step, engine_step))
    return {name: (len(r), *np.median(np.array(r), axis=0)) for name, r in rounds.items() if r}


def burst_step_seconds(llm, batch: int, context: int, steps: int, rounds: int = 6,
                       tokens: int = 24) -> tuple[float, float, float]:
    """Median seconds a decode step of `batch` sequences takes (1) in the engine (as
    `lookahead_step_seconds` runs it, run ahead), (2) as a chain of jitted one-step calls,
    each the runner's forward and a greedy draw fed to the next call on the device (the host
    only dispatching), and (3) as a chain of jitted calls of `steps` such steps each (one
    dispatch, one pool donation and one launch for all of them), alternating round by round.
    (2) against (1) is what the engine's host work costs beyond dispatching a step; (3)
    against (2) what dispatching and launching one executable a step costs: what running
    several decode steps a call (vLLM's multi-step scheduling) could save at most."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    engine, runner = llm.engine, llm.engine.runner
    from jaxpage.engine.runner import _forward_fn

    model, platform, params, _, token_ids, positions, attn_md = forward_args(
        runner, decode_seqs(runner, batch, context))

    def run(params, pool, token_ids, positions, attn_md, n):
        drawn = []
        for _ in range(n):
            logits, pool = _forward_fn(model, platform, params, pool, token_ids, positions,
                                       attn_md)
            token_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            drawn.append(token_ids)
        return jnp.stack(drawn), pool

    call = jax.jit(run, static_argnums=5, donate_argnums=1)

    def chain(n: int) -> float:
        start, ids = time.perf_counter(), token_ids
        for _ in range(tokens // n):
            drawn, runner.kv_pool = call(params, runner.kv_pool, ids, positions, attn_md, n)
            ids = drawn[-1]
        jax.block_until_ready(drawn)
        return (time.perf_counter() - start) / (tokens // n * n)

    rng = np.random.default_rng(0)

    def engine_step() -> float:
        return float(np.median(decode_step_seconds(engine, f"burst-{rng.integers(1 << 30)}",
                                                   batch, context, tokens, rng)))

    times = {"engine": [], 1: [], steps: []}
    for r in range(rounds + 1):  # the first round compiles
        for key, fn in (("engine", engine_step), (1, lambda: chain(1)),
                        (steps, lambda: chain(steps))):
            seconds = fn()
            if r:
                times[key].append(seconds)
    return tuple(float(np.median(t)) for t in times.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--vs-bucket", type=int, default=0, metavar="ROWS",
                    help="for batches below ROWS, the step padded to a ROWS-row bucket "
                         "(alternating with the step in its own bucket, 25 each)")
    ap.add_argument("--vs-xla-glue", action="store_true",
                    help="the step with the layer glue as XLA's fusions instead of the "
                         "kernel library's calls (alternating, 30 each)")
    ap.add_argument("--vs-prefetch", type=int, default=0, metavar="BYTES",
                    help="the step with the packed matmuls prefetching BYTES ahead in a "
                         "panel instead of the kernel's distance for the rows (alternating, 40 "
                         "each)")
    ap.add_argument("--vs-uncut-attention", action="store_true",
                    help="the step with the attention kernel never cutting a sequence's "
                         "keys among the threads (alternating, 40 each)")
    ap.add_argument("--vs-unfused", action="store_true",
                    help="the step with each layer as its eleven kernel calls instead of "
                         "one (alternating, 40 each)")
    ap.add_argument("--quantization", default=None, choices=["int8", "fp8"],
                    help="the weights quantized so (EngineConfig.quantization)")
    ap.add_argument("--vs-per-layer", action="store_true",
                    help="the runner's and the engine's step with the layers stacked (one "
                         "array a param name) against a dict of arrays a layer")
    ap.add_argument("--vs-lookahead", action="store_true",
                    help="the engine's step while the batch decodes, with the runner "
                         "starting each small decode step before reading the one before "
                         "(decode_lookahead_rows) and without (alternating, 6 x 47 steps each)")
    ap.add_argument("--vs-burst", type=int, default=0, metavar="STEPS",
                    help="the engine's step against a chain of one-step jitted calls and "
                         "of STEPS-step calls (greedy draws fed on the device; alternating, 6 "
                         "rounds of 24 steps each)")
    ap.add_argument("--vs-4k-pool", action="store_true",
                    help="the step over blocks spread across the pool, on the runner's "
                         "pool (huge pages) and on one of 4 KiB pages (alternating, 40 each)")
    ap.add_argument("--by-placement", type=float, default=0, metavar="SECONDS",
                    help="for SECONDS a batch, the runner's and the engine's steps by where "
                         "the two threads ran (a round trip between them alongside: cores "
                         "sharing a cache or not), each beside the bound at its read rate")
    args = ap.parse_args()
    if args.vs_burst == 1 or args.vs_burst < 0:
        ap.error(f"--vs-burst takes 2 steps a call or more, got {args.vs_burst}")
    if not (args.vs_bucket or args.vs_xla_glue or args.vs_prefetch or args.vs_uncut_attention
            or args.vs_unfused or args.vs_lookahead or args.vs_burst or args.vs_4k_pool
            or args.vs_per_layer or args.by_placement):
        ap.error("name at least one comparison (--vs-... or --by-placement); the step's own "
                 "table is scripts/bench_decode_step.py")
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = [d for d in args.dtypes.split(",") if d]

    peak = fma_peak_gflops()
    print(f"FMA peak {peak:.1f} GFLOP/s (every core); context {args.context}")
    print(f"{'dtype':>9}{'batch':>6}{'ms/step':>9}{'read':>6}{'bound':>7}{'x bound':>9}"
          "   (read: GB/s alongside the steps; bound in ms)")
    for dtype in dtypes:
        dtype_peak = matmul_peak_gflops(peak, dtype)
        quantized = {"quantization": args.quantization} if args.quantization else {}
        llm = make_llm(max(batches + [args.vs_bucket]), dtype=dtype, **quantized)
        print(f"{dtype}: decode buckets {llm.engine.runner.decode_buckets}")
        for batch in batches:
            seconds, read, _ = step_and_read(llm, batch, args.context)
            weight_bytes, kv_bytes, flops = step_bytes_and_flops(llm, batch, args.context)
            bound = bound_ms(weight_bytes + kv_bytes, flops, dtype_peak, read)
            print(f"{dtype:>9}{batch:>6}{seconds * 1e3:>9.1f}{read:>6.1f}{bound:>7.1f}"
                  f"{seconds * 1e3 / bound:>9.2f}", flush=True)
            if batch < args.vs_bucket:
                own, padded = padded_step_seconds(llm, batch, args.context, args.vs_bucket)
                print(f"{'':>15}in its own bucket {own * 1e3:.1f} ms, padded to "
                      f"{args.vs_bucket} rows {padded * 1e3:.1f} ms: {padded / own:.2f}x",
                      flush=True)
            if args.vs_xla_glue:
                kernels, fusions = glue_step_seconds(llm, batch, args.context)
                print(f"{'':>15}glue in kernel calls {kernels * 1e3:.1f} ms, as XLA's fusions "
                      f"{fusions * 1e3:.1f} ms: {fusions / kernels:.2f}x", flush=True)
            if args.vs_prefetch:
                by_rows, fixed = prefetch_step_seconds(llm, batch, args.context,
                                                       args.vs_prefetch)
                print(f"{'':>15}packed prefetch by rows {by_rows * 1e3:.1f} ms, "
                      f"{args.vs_prefetch} bytes ahead {fixed * 1e3:.1f} ms: "
                      f"{fixed / by_rows:.2f}x", flush=True)
            if args.vs_uncut_attention:
                cut, uncut = uncut_attention_step_seconds(llm, batch, args.context)
                print(f"{'':>15}attention keys cut as the kernel chooses {cut * 1e3:.1f} ms, "
                      f"never {uncut * 1e3:.1f} ms: {uncut / cut:.2f}x", flush=True)
            if args.vs_unfused:
                fused, apart = unfused_step_seconds(llm, batch, args.context)
                print(f"{'':>15}layers in one call each {fused * 1e3:.1f} ms, unfused "
                      f"{apart * 1e3:.1f} ms: {apart / fused:.2f}x", flush=True)
            if args.vs_per_layer:
                runner_stacked, runner_apart, engine_stacked, engine_apart = \
                    per_layer_step_seconds(llm, batch, args.context)
                print(f"{'':>15}layers stacked: runner step {runner_stacked * 1e3:.2f} ms, "
                      f"engine step {engine_stacked * 1e3:.2f} ms; a dict a layer "
                      f"{runner_apart * 1e3:.2f} / {engine_apart * 1e3:.2f} ms: "
                      f"{runner_apart / runner_stacked:.2f}x / "
                      f"{engine_apart / engine_stacked:.2f}x", flush=True)
            if args.vs_lookahead:
                ahead, apart, share = lookahead_step_seconds(llm, batch, args.context)
                print(f"{'':>15}engine step run ahead {ahead * 1e3:.1f} ms, not "
                      f"{apart * 1e3:.1f} ms: {apart / ahead:.2f}x ({share:.0%} of steps run "
                      f"ahead; {ahead * 1e3 / bound:.2f}x the bound)", flush=True)
            if args.vs_burst:
                in_engine, one, burst = burst_step_seconds(llm, batch, args.context,
                                                           args.vs_burst)
                print(f"{'':>15}engine step {in_engine * 1e3:.1f} ms; one step a call "
                      f"{one * 1e3:.1f} ms, {args.vs_burst} a call {burst * 1e3:.1f} ms a step: "
                      f"{one / burst:.2f}x ({burst * 1e3 / bound:.2f}x the bound)", flush=True)
            if args.vs_4k_pool:
                huge, small = pool_pages_step_seconds(llm, batch, args.context)
                print(f"{'':>15}blocks spread over the pool: huge pages {huge * 1e3:.1f} ms, "
                      f"4 KiB pages {small * 1e3:.1f} ms: {small / huge:.2f}x", flush=True)
            if args.by_placement:
                for name, (n, trip, rate, step, engine_step) in placement_steps(
                        llm, batch, args.context, args.by_placement).items():
                    at_rate = bound_ms(weight_bytes + kv_bytes, flops, dtype_peak, rate) / 1e3
                    print(f"{'':>15}{name} ({n} rounds, round trip {trip:.0f} ns, read "
                          f"{rate:.1f} GB/s, bound {at_rate * 1e3:.1f} ms): runner step "
                          f"{step * 1e3:.1f} ms ({step / at_rate:.2f}x), engine step "
                          f"{engine_step * 1e3:.1f} ms ({engine_step / at_rate:.2f}x)",
                          flush=True)
        del llm


if __name__ == "__main__":
    main()
