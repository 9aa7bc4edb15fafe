"""Cost of one decode step against its batch size and dtype, beside the bounds that set it.

The default model (SmolLM2-135M) runs one decode step (every sequence at the same context,
greedy sampling included) at each batch size and dtype, in one process, after measuring this
machine's read bandwidth (sums over 512 MiB, a thread a core) and its matmul rate per dtype
(XLA's 2048^3 dot; a bfloat16 matmul accumulates in float32, as the model's projections do).
Beside each step:
- the weight-read bound: every weight is read once per step (bytes of the params / read
  bandwidth), what a small batch cannot beat;
- the matmul bound: the step's FLOPs at the cores' multiply-add peak (`fma_peak_gflops`: a C
  loop of independent FMAs on every core, measured here; twice that for bfloat16 where the
  kernels run AVX512-BF16's `vdpbf16ps`, two multiply-adds a lane; 16 times it where they
  run on AMX tiles: `matmul_peak_gflops`), what a big batch cannot beat. Not XLA's dot rate:
  the packed kernels beat XLA's bfloat16 dot where the CPU has no bfloat16 dot product (AVX2:
  XLA widens on the way, the kernels run float32 FMAs), and a bound they beat bounds nothing;
- `w+m`: the two added, what a step costs if reading the weights and the arithmetic never
  overlap (at 8 rows on a 2-core AVX2 box the two are about equal, and a step lands between
  the larger and the sum);
and the step's time over the larger of the two bounds. Then the same step, same process, with
the weights as a runner kept them before it packed them (`--no-unpacked` skips it): unpacked
(`cpu_attention.unpack_weight`) into new buffers that nobody advised to use huge pages, the
two alternating, and the packed step's speedup over it. The engine pads decode batches below
8 rows to 8, so batch 1 runs 8 rows: as long as a step is bound by reading the weights, rows are
nearly free (the regime of the vLLM paper's GPUs); once bound by arithmetic, each row adds
its own cost.

    python scripts/bench_decode_step.py                      # context 128, float32 and bf16
    python scripts/bench_decode_step.py --context 256 --batches 8,64 --dtypes float32
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_throughput import (  # noqa: E402
    decode_seqs,
    decode_step_rate,
    make_llm,
    matmul_gflops,
)


def unpacked(params):
    """The params with every packed weight back in its own layout, in new buffers: the
    projections and an untied head [K, N], a tied embedding table [V, H] (SmolLM2's K are all
    even: no padding row to drop)."""
    import jax

    from pallas_kernels import cpu_attention

    def unpack(w):
        return cpu_attention.unpack_weight(w) + 0 if w.ndim == 4 else w

    out = jax.tree.map(unpack, params)
    if params["embed"].ndim == 4:  # packed as the tied head, [H, V]
        out["embed"] = cpu_attention.unpack_weight(params["embed"]).T + 0
    return out


def paired_step_seconds(llm, batch: int, context: int, other_params, rounds: int = 7):
    """Median seconds of a decode step with the runner's params and with `other_params`, the
    two alternating step by step (the machine's drift falls on both)."""
    import numpy as np

    runner = llm.engine.runner
    mine = runner.params
    seqs = decode_seqs(runner, batch, context)
    times = ([], [])
    try:
        for params in (mine, other_params):  # compile both
            runner.params = params
            runner.execute(seqs)
        for _ in range(rounds):
            for params, out in zip((mine, other_params), times, strict=True):
                runner.params = params
                start = time.perf_counter()
                runner.execute(seqs)
                out.append(time.perf_counter() - start)
    finally:
        runner.params = mine
    return float(np.median(times[0])), float(np.median(times[1]))


def cores() -> int:
    """The cores this process may run on: one thread each for the bandwidth and FMA probes."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


FMA_LOOP = r"""
#include <pthread.h>
#include <time.h>
#ifdef __AVX512F__
typedef float vf __attribute__((vector_size(64)));
#else
typedef float vf __attribute__((vector_size(32)));
#endif
enum { kAcc = 12 };  /* independent chains: more than FMA units x latency on any x86 core */
volatile float sink; /* keeps the loop */

static void* run(void* arg) {
  long n = *(long*)arg;
  vf a[kAcc], b, c;
  for (int i = 0; i < kAcc; ++i) a[i] = (vf){} + 1e-3f * i;
  b = (vf){} + 0.999f;
  c = (vf){} + 1e-4f;
  for (long it = 0; it < n; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) a[i] = a[i] * b + c;  /* contracted into one FMA */
  float s = 0.0f;
  for (int i = 0; i < kAcc; ++i) s += a[i][0];
  sink = s;
  return 0;
}

/* FLOP/s of `threads` threads, each n rounds of kAcc vector FMAs */
double fma_flops(int threads, long n) {
  pthread_t t[256];
  long args[256];
  struct timespec t0, t1;
  if (threads > 256) threads = 256;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < threads; ++i) {
    args[i] = n;
    pthread_create(&t[i], 0, run, &args[i]);
  }
  for (int i = 0; i < threads; ++i) pthread_join(t[i], 0);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
  return 2.0 * kAcc * (sizeof(vf) / sizeof(float)) * n * threads / s;
}
"""


def fma_peak_gflops() -> float:
    """The cores' float32 multiply-add peak in GFLOP/s: a C loop of 12 independent vector FMAs
    (the machine's widest vectors, -march=native) on one thread per core, the best of 9 runs
    of ~0.1 s (a ceiling: this box's neighbours slow some runs by up to 1.7x); what no matmul
    on float32 FMAs can beat on these cores. NaN where no C compiler builds it."""
    import ctypes
    import shutil
    import subprocess
    import tempfile

    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return float("nan")
    threads = cores()
    with tempfile.TemporaryDirectory() as tmp:
        source, library = os.path.join(tmp, "fma.c"), os.path.join(tmp, "fma.so")
        with open(source, "w") as f:
            f.write(FMA_LOOP)
        built = subprocess.run([compiler, "-O2", "-march=native", "-ffp-contract=fast",
                                "-shared", "-fPIC", "-pthread", "-o", library, source],
                               capture_output=True, timeout=120)
        if built.returncode:
            return float("nan")
        fma = ctypes.CDLL(library)
        fma.fma_flops.argtypes = [ctypes.c_int, ctypes.c_long]
        fma.fma_flops.restype = ctypes.c_double
        fma.fma_flops(threads, 1_000_000)  # wake the cores
        return max(fma.fma_flops(threads, 20_000_000) for _ in range(9)) / 1e9


def matmul_peak_gflops(fma_peak: float, dtype: str) -> float:
    """The arithmetic ceiling of the kernels' matmuls in `dtype` from the FMA peak: for bfloat16
    16 times it where they run on AMX tiles (`packed_tiles()`: a `tdpbf16ps`, 16 x 16 x 32
    multiply-adds, issues once per 16 cycles, Intel's figure: 1024 flops a cycle a core against
    the two 16-lane FMA ports' 64), twice it where they run AVX512-BF16's `vdpbf16ps` (two
    multiply-adds a lane), else it."""
    from pallas_kernels import cpu_attention

    if dtype != "bfloat16":
        return fma_peak
    if cpu_attention.packed_tiles() and cpu_attention._default_tiles():
        return fma_peak * 16
    return fma_peak * (2 if cpu_attention.bf16_dot_compiled() else 1)


def read_gbps() -> float:
    """Read bandwidth: NumPy sums over 512 MiB of float32, one thread per core (NumPy drops
    the GIL while it sums), each a slice once; the median of 9 (runs here read 33-36 GB/s,
    with a rare outlier far above, which the best of a few would take). A single-threaded
    reduction (XLA's jnp.sum here) reads at ~60% of what the cores together can, and a bound
    from it would flatter the step."""
    import threading

    import numpy as np

    threads = cores()
    rows = np.ones((threads, (128 << 20) // threads), np.float32)

    def read_all() -> None:
        workers = [threading.Thread(target=row.sum) for row in rows]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    times = []
    for _ in range(9):
        start = time.perf_counter()
        read_all()
        times.append(time.perf_counter() - start)
    return rows.nbytes / sorted(times)[len(times) // 2] / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--no-unpacked", action="store_true",
                    help="skip the same step on the unpacked [K, N] weights")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = [d for d in args.dtypes.split(",") if d]

    import jax

    bandwidth = read_gbps()
    print(f"read bandwidth {bandwidth:.1f} GB/s; context {args.context}")
    peak = fma_peak_gflops()
    f32_rate = matmul_gflops("float32")
    print(f"FMA peak {peak:.1f} GFLOP/s (every core); XLA's float32 2048^3 dot {f32_rate:.1f}")
    print(f"{'dtype':>9}{'batch':>6}{'ms/step':>9}{'ms/seq':>8}{'weights':>9}{'matmul':>8}"
          f"{'w+m':>7}{'bound':>7}{'x bound':>9}" + ("" if args.no_unpacked else
                                            f"{'unpacked':>10}{'speedup':>9}")
          + "   (bounds and unpacked in ms)")
    for dtype in dtypes:
        rate = f32_rate if dtype == "float32" else matmul_gflops(dtype)
        dtype_peak = matmul_peak_gflops(peak, dtype)
        llm = make_llm(max(batches), dtype=dtype)
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.params))
        weights_ms = weight_bytes / (bandwidth * 1e9) * 1e3
        params = llm.engine.runner.params
        packed = any(w.ndim == 4 for w in jax.tree.leaves(params))
        print(f"{dtype}: params {weight_bytes / 2**20:.0f} MiB "
              f"({'packed' if packed else 'not packed'}), XLA's 2048^3 dot {rate:.1f} GFLOP/s, "
              f"decode buckets {llm.engine.runner.decode_buckets}")
        compare = packed and not args.no_unpacked
        other = unpacked(params) if compare else None
        for batch in batches:
            seconds, flops = decode_step_rate(llm, batch, args.context)
            matmul_ms = flops / (dtype_peak * 1e9) * 1e3
            bound = max(weights_ms, matmul_ms)
            line = (f"{dtype:>9}{batch:>6}{seconds * 1e3:>9.1f}{seconds * 1e3 / batch:>8.2f}"
                    f"{weights_ms:>9.1f}{matmul_ms:>8.1f}{weights_ms + matmul_ms:>7.1f}"
                    f"{bound:>7.1f}"
                    f"{seconds * 1e3 / bound:>9.2f}")
            if compare:
                ours, theirs = paired_step_seconds(llm, batch, args.context, other)
                line += f"{theirs * 1e3:>10.1f}{theirs / ours:>8.2f}x"
            print(line, flush=True)
        del llm, other


if __name__ == "__main__":
    main()
