"""Where a small decode step's layer call spends its time, stage by stage.

Lab probe of the fused layer call (docs/cpu_decode_history.md). A decode step of at most
`jaxpage.layers.FUSED_LAYER_ROWS` tokens runs each layer as one call of the kernel library
(`cpu_ops.decoder_layer`): the qkv matmul, rope, the pool writes, attention, the o matmul,
add + norm, gate_up, SiLU, down, add + norm. This script builds the library with its stage
clock (JAXPAGE_CPU_KERNEL_STAGE_CLOCK=1: a build of its own, ~35 s the first time) and
prints, per batch and dtype of the default model (SmolLM2-135M, every sequence at the same
context):
- each stage's wall time on the calling thread per layer call (µs), beside the bytes it must
  read (a matmul its packed weight, attention the K/V of every sequence's context and new
  token) and the rate that makes (GB/s), against the machine's read bandwidth (a C loop, a
  thread a core, measured once before);
- the helper threads: how late they started after the call scheduled them (a helper that
  starts late leaves the first stages to the calling thread alone): the median, 90th and
  99th percentiles (a few helpers kept off their core for milliseconds set the mean).
Twice per batch: the runner alone, one step at a time (what the layer call costs), and the
whole engine while requests decode, small steps run ahead (`decode_lookahead_rows`): there
the host's Python thread shares the cores with the step, and the helpers' lateness shows how
often it took one.

    python scripts/lab/profile_layer_stages.py                       # bfloat16, 1 and 8 rows
    python scripts/lab/profile_layer_stages.py --batches 8 --dtypes float32,bfloat16 --steps 40
    python scripts/lab/profile_layer_stages.py --batches 1 --quantization int8
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["JAXPAGE_CPU_KERNEL_STAGE_CLOCK"] = "1"  # before the library is first built

from bench_common import (  # noqa: E402
    decode_seqs,
    kv_bytes_per_token,
    make_llm,
    read_gbps,
    start_decoding,
)

from pallas_kernels import cpu_library  # noqa: E402


def runner_steps(llm, batch: int, context: int, steps: int) -> float:
    """`steps` decode steps of the runner alone, one at a time, after one that compiles; their
    wall time (s)."""
    runner = llm.engine.runner
    seqs = decode_seqs(runner, batch, context)
    runner.execute(seqs)
    _clock(reset=True)
    start = time.perf_counter()
    for _ in range(steps):
        runner.execute(seqs)
    return time.perf_counter() - start


def engine_steps(llm, batch: int, context: int, steps: int) -> float:
    """`batch` requests of `context` random prompt tokens decoding `steps` greedy tokens each
    through the engine (its decode steps run ahead where they may), after a round that
    compiles; the clock counts the decode steps only. Their wall time (s)."""
    import numpy as np

    engine = llm.engine
    rng = np.random.default_rng(0)
    for round_ in range(2):
        start_decoding(engine, f"stages-{round_}", batch, context, steps, rng)
        _clock(reset=True)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
    return time.perf_counter() - start


def _clock(reset: bool = False) -> dict:
    clock = cpu_library.stage_clock(reset)
    if clock is None:
        raise SystemExit("the kernel library has no stage clock: JAXPAGE_CPU_KERNEL_LIB names a "
                         "library built without it, or there is no C++ compiler")
    return clock


def stage_bytes(llm, batch: int, context: int) -> dict[str, float]:
    """Bytes each stage of one layer's call must read: its packed weight (the matmuls), the
    K/V its sequences attend over (attention)."""
    runner = llm.engine.runner
    layer = runner.params["layers"][0]
    per_token = kv_bytes_per_token(llm) / len(runner.kv_pool)  # one layer's
    import jax

    out = {stage: float(sum(w.nbytes for w in jax.tree.leaves(layer[stage])))
           for stage in ("qkv", "o", "gate_up", "down")}  # an int8 weight's scales included
    out["attention"] = batch * (context + 1) * per_token
    return out


def report(title: str, clock: dict, nbytes: dict[str, float], read: float, seconds: float,
           layers: int) -> None:
    calls = max(clock["calls"], 1)
    per_call = {s: t / calls * 1e6 for s, t in clock["seconds"].items()}
    total = sum(per_call.values())
    steps = calls / layers
    step_ms, in_layers_ms = seconds / steps * 1e3, total * layers / 1e3
    print(f"{title}: {clock['calls']} layer calls, {total:.1f} us a call; a step {step_ms:.2f} "
          f"ms, its {layers} layer calls {in_layers_ms:.2f} ({in_layers_ms / step_ms:.0%}), the "
          f"rest {step_ms - in_layers_ms:.2f} (LM head, sampling, the host's work)")
    print(f"  {'stage':<12}{'us':>8}{'share':>7}{'KB read':>9}{'GB/s':>7}{'of read':>9}")
    for stage, us in per_call.items():
        line = f"  {stage:<12}{us:>8.1f}{us / total:>7.0%}"
        if stage in nbytes:
            rate = nbytes[stage] / (us * 1e-6) / 1e9 if us else 0.0
            line += f"{nbytes[stage] / 1024:>9.0f}{rate:>7.1f}{rate / read:>9.0%}"
        print(line)
    matmul = sum(per_call[s] for s in ("qkv", "o", "gate_up", "down"))
    weights = sum(nbytes[s] for s in ("qkv", "o", "gate_up", "down")) / (read * 1e9) * 1e6
    print(f"  matmuls {matmul:.1f} us against {weights:.1f} us to read their weights; "
          f"attention {per_call['attention']:.1f} us against "
          f"{nbytes['attention'] / (read * 1e9) * 1e6:.1f} us for its K/V; the rest "
          f"{total - matmul - per_call['attention']:.1f} us")
    joins = max(clock["joins"], 1)
    quantiles = ", ".join(
        f"{q:.0%} within {cpu_library.join_quantile(clock['join_buckets'], q) * 1e6:.3g}"
        for q in (0.5, 0.9, 0.99))
    print(f"  helpers: {clock['joins']} started after being scheduled: {quantiles} us (upper "
          f"edges of powers of 2 ns), {clock['late_joins']} ({clock['late_joins'] / joins:.0%}) "
          f"later than 50 us, {clock['join_seconds'] / joins * 1e6:.1f} us on average",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8", help="decode rows per step (at most "
                    "FUSED_LAYER_ROWS, 64: the steps that run fused layers)")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30, help="decode steps clocked per batch")
    ap.add_argument("--quantization", default="", help="int8: the weights quantized on load")
    args = ap.parse_args()

    from jaxpage import layers

    batches = [int(b) for b in args.batches.split(",")]
    if max(batches) > layers.FUSED_LAYER_ROWS:
        raise SystemExit(f"batches must be at most {layers.FUSED_LAYER_ROWS} rows (a larger "
                         "step runs no fused layer)")
    read = read_gbps()
    print(f"read bandwidth {read:.1f} GB/s (before the steps); context {args.context}")
    for dtype in [d for d in args.dtypes.split(",") if d]:
        llm = make_llm(max(batches), dtype=dtype, quantization=args.quantization or None)
        layers = len(llm.engine.runner.params["layers"])
        for batch in batches:
            nbytes = stage_bytes(llm, batch, args.context)
            seconds = runner_steps(llm, batch, args.context, args.steps)
            report(f"{dtype}, {batch} rows, the runner alone", _clock(), nbytes, read, seconds,
                   layers)
            seconds = engine_steps(llm, batch, args.context, args.steps)
            report(f"{dtype}, {batch} rows, the engine (run ahead)", _clock(), nbytes, read,
                   seconds, layers)
        del llm


if __name__ == "__main__":
    main()
