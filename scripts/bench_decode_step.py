"""Cost of one decode step against its batch size and dtype, beside the bounds that set it.

The default model (SmolLM2-135M) runs one decode step (every sequence at the same context,
greedy sampling included) at each batch size and dtype, in one process, 15 times, each step
after a read of 512 MiB by a C loop (a thread a core) that measures the machine's read
bandwidth alongside it (the `read` column, the median; on a shared machine it drifts), beside
its matmul rate per dtype (XLA's 2048^3 dot; a bfloat16 matmul accumulates in float32, as the
model's projections do).
Beside each step:
- the weight-read bound: every weight is read once per step (bytes of the params / read
  bandwidth), what a small batch cannot beat;
- `kv`: the K/V the step's attention reads at that bandwidth (every sequence's context and
  new token, each layer's K and V pools, their scales where quantized): the weights and these
  are the bytes a decode step cannot avoid reading (at 8 rows of context 128 bfloat16, 24 MB
  beside 270 MB of weights; at 64 rows 190 MB);
- the matmul bound: the step's FLOPs at the cores' multiply-add peak (bench_common's
  `fma_peak_gflops`: a C loop of independent FMAs on every core, measured here; twice that
  for bfloat16 where the kernels run AVX512-BF16's `vdpbf16ps`, two multiply-adds a lane; 16
  times it where they run on AMX tiles: `matmul_peak_gflops`), what a big batch cannot beat.
  Not XLA's dot rate: the packed kernels beat XLA's bfloat16 dot where the CPU has no bfloat16
  dot product (AVX2: XLA widens on the way, the kernels run float32 FMAs), and a bound they
  beat bounds nothing;
- `w+m`: the bytes' and the arithmetic's bounds added, what a step costs if reading and
  the arithmetic never overlap (at 8 rows on a 2-core AMD EPYC (Zen 3, AVX2) the two are about
  equal, and a step lands between the larger and the sum);
and the step's time over the larger of the two bounds (`bound`: weights and K/V read, or the
matmuls' arithmetic); then `stream`, the packed matmul kernel run over one contiguous weight
as large as the step's, at the step's rows, alongside too (`stream_probe`: the read and the
dot products overlapped as well as the kernel does, nothing else; where the runner packs its
weights), and the step's time over it (`x strm`: what the step costs beyond streaming its
weights through its own kernel). Then the same step, same process, with
the weights as a runner kept them before it packed them (`--no-unpacked` skips it): unpacked
(`cpu_ops.unpack_weight`) into new buffers that nobody advised to use huge pages, the
two alternating, and the packed step's speedup over it. As long as a step is bound by reading
the weights, rows are nearly free (the regime of the vLLM paper's GPUs); once bound by
arithmetic, each row adds its own cost.

    python scripts/bench_decode_step.py                      # context 128, float32 and bf16
    python scripts/bench_decode_step.py --context 256 --batches 8,64 --dtypes float32
    python scripts/bench_decode_step.py --no-unpacked --profile   # and where each step goes

With --profile each step's line is followed by where its time goes (`jax.profiler` over 5
steps): the forward's span, the sampler and the host's share (Python, dispatch), the matmuls
by shape (K -> N) beside the weight-read bound, attention, the pool writes and XLA's own ops.
The same step against its variants (buckets, glue, prefetch distance, fused layers, pool
pages, run-ahead, bursts, thread placement) is scripts/lab/decode_step_ab.py.
"""

from __future__ import annotations

import argparse
import os
import time

from bench_common import (
    alternating_step_seconds,
    bound_ms,
    decode_seqs,
    fma_peak_gflops,
    forward_args,
    make_llm,
    matmul_gflops,
    matmul_peak_gflops,
    read_gbps,
    step_and_read,
    step_bytes_and_flops,
)


def unpacked(params):
    """The params with every packed weight back in its own layout, in new buffers: the
    projections and an untied head [K, N], a tied embedding table [V, H] (SmolLM2's K are all
    even: no padding row to drop)."""
    import jax

    from jaxpage.layers import StackedLayers
    from pallas_kernels import cpu_ops

    def unpack(w):
        return cpu_ops.unpack_weight(w) + 0 if w.ndim == 4 else w

    if isinstance(params["layers"], StackedLayers):  # a dict a layer (unpacked: not stacked)
        params = dict(params, layers=list(params["layers"]))
    out = jax.tree.map(unpack, params)
    if params["embed"].ndim == 4:  # packed as the tied head, [H, V]
        out["embed"] = cpu_ops.unpack_weight(params["embed"]).T + 0
    return out


def paired_step_seconds(llm, batch: int, context: int, other_params, rounds: int = 7):
    """Median seconds of a decode step with the runner's params and with `other_params`,
    alternating."""
    return alternating_step_seconds(llm, batch, context, "params",
                                    (llm.engine.runner.params, other_params), rounds)


def stream_probe(llm):
    """A function timing the packed kernel (`cpu_ops.packed_matmul`) over one contiguous
    packed weight as large as the runner's weights, at a given count of rows, in seconds: what
    streaming the step's weight bytes through its own matmul kernel costs, the read and the
    dot products overlapped as well as the kernel overlaps them (one range of panels a thread,
    no other work between). A bound a step of few rows can reach only where nothing else costs;
    at 8 bfloat16 rows on a 2-core AMD EPYC (Zen 4) the dot products can bind it, not the read. None
    where the runner's weights are not packed. The weight is made once (and backed by huge
    pages, as the runner's are); each count of rows compiles on its first call."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpage.engine import huge_pages
    from pallas_kernels import cpu_ops

    params = llm.engine.runner.params
    qkv = params["layers"][0]["qkv"]
    if qkv.ndim != 4:
        return None
    _, pairs, columns, group = qkv.shape  # [panels, K / G, PANEL, G] of hidden K
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    panel_bytes = pairs * columns * group * qkv.dtype.itemsize
    w = jnp.full((weight_bytes // panel_bytes, pairs, columns, group), 0.01, qkv.dtype)
    huge_pages.advise([w])
    stream = jax.jit(cpu_ops.packed_matmul)
    xs = {}

    def seconds(rows: int) -> float:
        if rows not in xs:
            xs[rows] = jnp.asarray(
                np.random.default_rng(0).standard_normal((rows, pairs * group)), qkv.dtype)
        start = time.perf_counter()
        jax.block_until_ready(stream(xs[rows], w))
        return time.perf_counter() - start

    return seconds


def _op_kinds(hlo_text: str) -> dict[str, str]:
    """Each op of a compiled step's HLO text by name -> what it does: the kernel library's
    custom calls by target (a matmul named by its K and N, read from its operand and result
    shapes), everything else "XLA's own ops"."""
    import re

    kinds = {}
    for line in hlo_text.splitlines():
        op = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = (\S+) ", line)
        if op is None:
            continue
        target = re.search(r'custom_call_target="(\w+)"', line)
        if target is None:
            kinds[op.group(1)] = "XLA's own ops"
        elif "matmul" in target.group(1):
            x = re.search(r"operand_layout_constraints=\{\w+\[(\d+),(\d+)\]", line)
            n = re.match(r"f32\[\d+,(\d+)\]", op.group(2))
            kinds[op.group(1)] = (f"matmul {x.group(2)} -> {n.group(1)}" if x and n
                                  else "matmul")
        elif "attention" in target.group(1):
            kinds[op.group(1)] = "attention"
        elif "set_rows" in target.group(1):
            kinds[op.group(1)] = "pool writes"
        else:
            kinds[op.group(1)] = target.group(1)
    return kinds


def step_profile(llm, batch: int, context: int, steps: int = 5) -> dict[str, float]:
    """Milliseconds a decode step spends per kind of op (`_op_kinds`), the mean of `steps`
    steps under `jax.profiler` (which adds a little to each op), with "forward" (its first op's
    start to its last op's end), "sampler" and "step" (`runner.execute`, host work included)."""
    import collections
    import glob
    import gzip
    import json
    import tempfile

    import jax

    from jaxpage.engine import runner as runner_module

    runner = llm.engine.runner
    seqs = decode_seqs(runner, batch, context)
    kinds = _op_kinds(runner_module._FORWARD.lower(*forward_args(runner, seqs)).compile()
                      .as_text())
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            start = time.perf_counter()
            for _ in range(steps):
                runner.execute(seqs)
            wall = time.perf_counter() - start
        path, = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ms = collections.Counter({"step": wall * 1e6})  # microseconds, as the trace's
    spans = collections.defaultdict(list)  # the forward's ops by run
    for e in events:
        args = e.get("args", {})
        module, op = args.get("hlo_module", ""), args.get("hlo_op")
        if op is None or e["name"].startswith("end:"):
            continue
        if module.startswith("jit__forward_fn"):
            ms[kinds.get(op, "unmapped")] += e["dur"]
            spans[args.get("run_id")].append(e)
        elif module.startswith("jit_sample"):
            ms["sampler"] += e["dur"]
    ms["forward"] = sum(max(e["ts"] + e["dur"] for e in ops) - min(e["ts"] for e in ops)
                        for ops in spans.values())
    return {kind: us / steps / 1e3 for kind, us in ms.items()}


def print_profile(ms: dict[str, float], weights_ms: float) -> None:
    """step_profile's figures as lines under a step's: the matmuls by shape and together
    (beside the weight-read bound), the other ops by kind, and what no op accounts for."""
    matmuls = {kind: v for kind, v in ms.items() if kind.startswith("matmul")}
    total = sum(matmuls.values())
    others = {kind: v for kind, v in ms.items()
              if kind not in matmuls and kind not in ("step", "forward", "sampler")}
    print(f"{'':>15}profiled step {ms['step']:.2f} ms: forward {ms['forward']:.2f}, sampler "
          f"{ms.get('sampler', 0.0):.2f}, host and dispatch "
          f"{ms['step'] - ms['forward'] - ms.get('sampler', 0.0):.2f}")
    print(f"{'':>15}matmuls {total:.2f} ({total / weights_ms:.2f}x the weight-read bound): "
          + ", ".join(f"{kind[7:]} {v:.2f}" for kind, v in sorted(matmuls.items())))
    print(f"{'':>15}" + ", ".join(f"{kind} {v:.2f}" for kind, v in sorted(others.items())),
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--no-unpacked", action="store_true",
                    help="skip the same step on the unpacked [K, N] weights")
    ap.add_argument("--profile", action="store_true",
                    help="after each step's line, where its time goes by kind of op "
                         "(jax.profiler, 5 steps)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = [d for d in args.dtypes.split(",") if d]

    import jax

    print(f"read bandwidth {read_gbps():.1f} GB/s (before the steps); context {args.context}")
    peak = fma_peak_gflops()
    f32_rate = matmul_gflops("float32")
    print(f"FMA peak {peak:.1f} GFLOP/s (every core); XLA's float32 2048^3 dot {f32_rate:.1f}")
    print(f"{'dtype':>9}{'batch':>6}{'ms/step':>9}{'ms/seq':>8}{'read':>6}{'weights':>9}"
          f"{'kv':>6}{'matmul':>8}"
          f"{'w+m':>7}{'bound':>7}{'x bound':>9}{'stream':>8}{'x strm':>7}"
          + ("" if args.no_unpacked else f"{'unpacked':>10}{'speedup':>9}")
          + "   (read: GB/s alongside the steps; bounds, stream and unpacked in ms)")
    for dtype in dtypes:
        rate = f32_rate if dtype == "float32" else matmul_gflops(dtype)
        dtype_peak = matmul_peak_gflops(peak, dtype)
        llm = make_llm(max(batches), dtype=dtype)
        params = llm.engine.runner.params
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        packed = any(w.ndim == 4 for w in jax.tree.leaves(params))
        print(f"{dtype}: params {weight_bytes / 2**20:.0f} MiB "
              f"({'packed' if packed else 'not packed'}), XLA's 2048^3 dot {rate:.1f} GFLOP/s, "
              f"decode buckets {llm.engine.runner.decode_buckets}")
        compare = packed and not args.no_unpacked
        streamer = stream_probe(llm)
        other = unpacked(params) if compare else None
        for batch in batches:
            seconds, read, stream = step_and_read(llm, batch, args.context, streamer)
            weight_bytes, kv_bytes, flops = step_bytes_and_flops(llm, batch, args.context)
            weights_ms = weight_bytes / (read * 1e9) * 1e3
            kv_ms = kv_bytes / (read * 1e9) * 1e3
            matmul_ms = flops / (dtype_peak * 1e9) * 1e3
            bound = bound_ms(weight_bytes + kv_bytes, flops, dtype_peak, read)
            line = (f"{dtype:>9}{batch:>6}{seconds * 1e3:>9.1f}{seconds * 1e3 / batch:>8.2f}"
                    f"{read:>6.1f}{weights_ms:>9.1f}{kv_ms:>6.1f}{matmul_ms:>8.1f}"
                    f"{weights_ms + kv_ms + matmul_ms:>7.1f}"
                    f"{bound:>7.1f}"
                    f"{seconds * 1e3 / bound:>9.2f}"
                    + (f"{'-':>8}{'-':>7}" if stream is None else
                       f"{stream * 1e3:>8.1f}{seconds / stream:>7.2f}"))
            if compare:
                ours, theirs = paired_step_seconds(llm, batch, args.context, other)
                line += f"{theirs * 1e3:>10.1f}{theirs / ours:>8.2f}x"
            print(line, flush=True)
            if args.profile:
                print_profile(step_profile(llm, batch, args.context), weights_ms)
        del llm, other, streamer


if __name__ == "__main__":
    main()
