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
- the matmul bound: the step's FLOPs at the cores' multiply-add peak (`fma_peak_gflops`: a C
  loop of independent FMAs on every core, measured here; twice that for bfloat16 where the
  kernels run AVX512-BF16's `vdpbf16ps`, two multiply-adds a lane; 16 times it where they
  run on AMX tiles: `matmul_peak_gflops`), what a big batch cannot beat. Not XLA's dot rate:
  the packed kernels beat XLA's bfloat16 dot where the CPU has no bfloat16 dot product (AVX2:
  XLA widens on the way, the kernels run float32 FMAs), and a bound they beat bounds nothing;
- `w+m`: the bytes' and the arithmetic's bounds added, what a step costs if reading and
  the arithmetic never overlap (at 8 rows on a 2-core AVX2 box the two are about equal, and
  a step lands between the larger and the sum);
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
arithmetic, each row adds its own cost. On CPU the engine's decode buckets start at one row (1,
2, 4, 8, 12, ...); `--vs-bucket 8` times each smaller batch against the same step padded to 8
rows, the smallest bucket before (XLA:CPU splits a step's elementwise ops over threads from 8
rows on, and the sampler reads every padded row). `--vs-xla-glue` times each step against the
same step with a layer's elementwise glue (residual adds and norms, SiLU, rope) as XLA's loop
fusions instead of the kernel library's calls. `--vs-prefetch 4096` times each step against
the same step with the packed matmuls prefetching 4 KB ahead in each panel (the one distance
before 2026-12-04) instead of the kernel's distance for the rows of a pass;
`--vs-uncut-attention` against the same step with the attention kernel never cutting a
sequence's keys among the threads (`paged_attention_cpu(key_splits=1)`; it cuts them where a
step has few sequences over long contexts). `--vs-unfused` against the same step with each
layer as its eleven kernel calls (`LlamaModel(fuse_layers=False)`) instead of one
(`cpu_ops.decoder_layer`, taken by steps of at most `llama.FUSED_LAYER_ROWS` tokens).
`--vs-4k-pool` times the step over blocks spread across the whole pool (as a pool long in
use hands them out) on the runner's pool, backed by huge pages (`huge_pages.advise_zeroed`),
against a pool of 4 KiB pages, where each block's K or V tile is a page and a TLB miss of its
own. `--vs-lookahead` times the whole engine's step while the batch decodes (scheduling, the
runner, the update, detokenizing: what a user waits for per token) with small decode steps
run ahead (`EngineConfig.decode_lookahead_rows`: the next step started before the draws of
the one before are read) and without, over the step's bound. `--vs-burst 4` times the
engine's step against the same forward chained on the device one step a call and four steps a
call (greedy draws fed to the next step; the host only dispatching): what the engine's host
work costs beyond a dispatch a step, and what one dispatch and launch a step costs.
`--by-placement 240` times the runner's and the engine's steps for 240 s a batch by where the
step's two threads ran, a round trip of a cache line between two threads alongside (`near`:
cores sharing a cache; `far`: not), each beside the bound at the read rate of its own rounds:
on the 2-core Zen 4 VM the fast reads come only with far placements, where every handoff
between the step's threads costs ~6x a near one's.

    python scripts/bench_decode_step.py                      # context 128, float32 and bf16
    python scripts/bench_decode_step.py --context 256 --batches 8,64 --dtypes float32
    python scripts/bench_decode_step.py --no-unpacked --profile   # and where each step goes
    python scripts/bench_decode_step.py --no-unpacked --batches 1,2,4,8 --vs-bucket 8
    python scripts/bench_decode_step.py --no-unpacked --batches 1,8,64 --vs-xla-glue
    python scripts/bench_decode_step.py --no-unpacked --batches 1,2,4,8 --vs-prefetch 4096
    python scripts/bench_decode_step.py --no-unpacked --batches 1,2 --context 1000 \
        --vs-uncut-attention
    python scripts/bench_decode_step.py --no-unpacked --batches 1,2,4,8 --vs-unfused
    python scripts/bench_decode_step.py --no-unpacked --batches 8,32 --vs-4k-pool
    python scripts/bench_decode_step.py --no-unpacked --batches 1,2,4,8 --vs-lookahead
    python scripts/bench_decode_step.py --no-unpacked --batches 1,8 --dtypes bfloat16 --vs-burst 4
    python scripts/bench_decode_step.py --no-unpacked --batches 1,8 --by-placement 240

With --profile each step's line is followed by where its time goes (`jax.profiler` over 5
steps): the forward's span, the sampler and the host's share (Python, dispatch), the matmuls
by shape (K -> N) beside the weight-read bound, attention, the pool writes and XLA's own ops.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_throughput import (  # noqa: E402
    decode_seqs,
    forward_flops,
    make_llm,
    matmul_gflops,
)


def unpacked(params):
    """The params with every packed weight back in its own layout, in new buffers: the
    projections and an untied head [K, N], a tied embedding table [V, H] (SmolLM2's K are all
    even: no padding row to drop)."""
    import jax

    from pallas_kernels import cpu_ops

    def unpack(w):
        return cpu_ops.unpack_weight(w) + 0 if w.ndim == 4 else w

    out = jax.tree.map(unpack, params)
    if params["embed"].ndim == 4:  # packed as the tied head, [H, V]
        out["embed"] = cpu_ops.unpack_weight(params["embed"]).T + 0
    return out


def _alternating(llm, batch: int, context: int, name: str, values, rounds: int,
                 spread: bool = False) -> tuple:
    """Median seconds of a decode step of `batch` sequences (`decode_seqs(spread=...)`) with
    the runner's attribute `name` set to each of `values` in turn, alternating step by step
    (the machine's drift falls on all of them; each compiles first). `values[0]` is the
    runner's own, which it keeps after. Each value is read back after its step: a step
    donates the KV pool and returns the next."""
    import numpy as np

    runner = llm.engine.runner
    values = list(values)
    seqs = decode_seqs(runner, batch, context, spread)
    times = [[] for _ in values]

    def step(i: int) -> float:
        setattr(runner, name, values[i])
        start = time.perf_counter()
        runner.execute(seqs)
        seconds = time.perf_counter() - start
        values[i] = getattr(runner, name)
        return seconds

    try:
        for i in range(len(values)):
            step(i)
        for _ in range(rounds):
            for i, out in enumerate(times):
                out.append(step(i))
    finally:
        setattr(runner, name, values[0])
    return tuple(float(np.median(t)) for t in times)


def paired_step_seconds(llm, batch: int, context: int, other_params, rounds: int = 7):
    """Median seconds of a decode step with the runner's params and with `other_params`."""
    return _alternating(llm, batch, context, "params",
                        (llm.engine.runner.params, other_params), rounds)


def padded_step_seconds(llm, batch: int, context: int, rows: int, rounds: int = 25):
    """Median seconds of a decode step of `batch` sequences in the runner's own bucket for it
    and padded to a bucket of `rows` (the smallest decode bucket before 2026-12-03 was 8)."""
    own = llm.engine.runner.decode_buckets
    return _alternating(llm, batch, context, "decode_buckets",
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
    return _alternating(llm, batch, context, "model", (model, other), rounds)


def glue_step_seconds(llm, batch: int, context: int, rounds: int = 30):
    """Median seconds of a decode step with the layer glue in the kernel library's calls
    (`jaxpage.models.llama.add_rms_norm`, `silu_mul`, `split_rotate` on CPU) and as XLA's
    fusions (the same model traced with the glue's jnp path), alternating."""
    from jaxpage.models import llama

    return _traced_apart_seconds(llm, batch, context, llama, "_cpu_glue",
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
    return _alternating(llm, batch, context, "model",
                        (model, dataclasses.replace(model, fuse_layers=False)), rounds)


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
    return _alternating(llm, batch, context, "kv_pool", (runner.kv_pool, small_pages), rounds,
                        spread=True)


def kv_bytes_per_token(llm) -> float:
    """Bytes of K/V (and scales) one token holds across the layers: the runner's block over
    its slots (`ModelRunner.block_bytes`)."""
    runner = llm.engine.runner
    return runner.block_bytes / runner.block_size


def decode_step_seconds(engine, tag: str, batch: int, context: int, tokens: int,
                        rng) -> list[float]:
    """Seconds of each engine step while `batch` requests (`start_decoding`'s) decode to
    their end."""
    start_decoding(engine, tag, batch, context, tokens, rng)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def start_decoding(engine, tag: str, batch: int, context: int, tokens: int, rng) -> None:
    """Add `batch` requests of `context` random prompt tokens, `tokens` greedy tokens each
    (ignore_eos), and step the engine through their prompts: what is left is decoding. A
    request admitted with part of its prompt (chunked prefill) is still prefilling: stepping
    until none waits is not enough; the steps go on until every request has its first token."""
    from jaxpage import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", rng.integers(100, 10_000, context).tolist(), params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        engine.step()


def cores() -> int:
    """The cores this process may run on: one thread each for the bandwidth and FMA probes."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


PROBES = r"""
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#ifdef __AVX512F__
typedef float vf __attribute__((vector_size(64)));
#else
typedef float vf __attribute__((vector_size(32)));
#endif
typedef float vf_u __attribute__((vector_size(sizeof(vf)), aligned(4))); /* loads anywhere */
enum { kAcc = 12 };  /* independent chains: more than FMA units x latency on any x86 core */
volatile float sink; /* keeps the loops */

typedef struct {
  long n;          /* FMA rounds, or vectors to read */
  const vf_u* data;  /* the slice to read; 0 for the FMA loop */
} job;

static void* fma_run(void* arg) {
  long n = ((job*)arg)->n;
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

/* one pass over the slice, front to back, a vector a load into 8 running sums: the way the
   packed kernels stream a panel (sequential 64-byte lines, no stores) */
static void* read_run(void* arg) {
  const vf_u* p = ((job*)arg)->data;
  long n = ((job*)arg)->n;
  vf s[8] = {};
  for (long i = 0; i + 8 <= n; i += 8)
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) s[j] += p[i + j];
  for (int j = 1; j < 8; ++j) s[0] += s[j];
  sink = s[0][0];
  return 0;
}

static double run_threads(void* (*fn)(void*), job* jobs, int threads) {
  pthread_t t[256];
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < threads; ++i) pthread_create(&t[i], 0, fn, &jobs[i]);
  for (int i = 0; i < threads; ++i) pthread_join(t[i], 0);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
}

/* FLOP/s of `threads` threads, each n rounds of kAcc vector FMAs */
double fma_flops(int threads, long n) {
  job jobs[256];
  if (threads > 256) threads = 256;
  for (int i = 0; i < threads; ++i) jobs[i] = (job){n, 0};
  double s = run_threads(fma_run, jobs, threads);
  return 2.0 * kAcc * (sizeof(vf) / sizeof(float)) * n * threads / s;
}

/* the mean round trip (ns) of a cache line between this thread and a second one, `n` times:
   each stores the next count the other waits for (a step's threads meet so at every stage) */
static _Atomic long ball __attribute__((aligned(64)));
static void* return_ball(void* arg) {
  long n = *(long*)arg;
  for (long i = 0; i < n; ++i) {
    while (atomic_load_explicit(&ball, memory_order_acquire) != 2 * i + 1) {
    }
    atomic_store_explicit(&ball, 2 * i + 2, memory_order_release);
  }
  return 0;
}
double round_trip_ns(long n) {
  pthread_t other;
  struct timespec t0, t1;
  atomic_store(&ball, 0);
  pthread_create(&other, 0, return_ball, &n);
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long i = 0; i < n; ++i) {
    atomic_store_explicit(&ball, 2 * i + 1, memory_order_release);
    while (atomic_load_explicit(&ball, memory_order_acquire) != 2 * i + 2) {
    }
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  pthread_join(other, 0);
  return ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / n;
}

/* bytes/s of `threads` threads reading `bytes` at `data` once between them, a contiguous
   slice each (NumPy's buffers are 16-byte aligned, not 64: the loads take any address) */
double read_bytes(int threads, const void* data, long bytes) {
  job jobs[256];
  if (threads > 256) threads = 256;
  long per = bytes / (long)sizeof(vf) / threads / 8 * 8;
  for (int i = 0; i < threads; ++i) jobs[i] = (job){per, (const vf_u*)data + (long)i * per};
  double s = run_threads(read_run, jobs, threads);
  return (double)per * sizeof(vf) * threads / s;
}
"""


def load_library(compiler: str, source_text: str, suffix: str, flags: list[str],
                 complain: bool = True):
    """`source_text` compiled by `compiler` with `flags` into a shared library and loaded
    (ctypes), or None where it does not build (the compiler's complaint on stderr if
    `complain`)."""
    import ctypes
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # loaded, the library outlives its file
        source, library = os.path.join(tmp, "lib" + suffix), os.path.join(tmp, "lib.so")
        with open(source, "w") as f:
            f.write(source_text)
        built = subprocess.run([compiler, *flags, "-shared", "-fPIC", "-pthread", "-o", library,
                                source], capture_output=True, text=True, timeout=300)
        if built.returncode:
            if complain:
                print(built.stderr[-2000:], file=sys.stderr)
            return None
        return ctypes.CDLL(library)


@functools.cache
def _probes():
    """The probes' C library (-O2 -march=native), or None where no C compiler builds it."""
    import ctypes
    import shutil

    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    lib = load_library(compiler, PROBES, ".c", ["-O2", "-march=native", "-ffp-contract=fast"],
                       complain=False)
    if lib is None:
        return None
    lib.fma_flops.argtypes = [ctypes.c_int, ctypes.c_long]
    lib.fma_flops.restype = ctypes.c_double
    lib.read_bytes.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long]
    lib.read_bytes.restype = ctypes.c_double
    lib.round_trip_ns.argtypes = [ctypes.c_long]
    lib.round_trip_ns.restype = ctypes.c_double
    return lib


def fma_peak_gflops() -> float:
    """The cores' float32 multiply-add peak in GFLOP/s: a C loop of 12 independent vector FMAs
    (the machine's widest vectors, -march=native) on one thread per core, the best of 9 runs
    of ~0.1 s (a ceiling: this box's neighbours slow some runs by up to 1.7x); what no matmul
    on float32 FMAs can beat on these cores. NaN where no C compiler builds it."""
    lib = _probes()
    if lib is None:
        return float("nan")
    threads = cores()
    lib.fma_flops(threads, 1_000_000)  # wake the cores
    return max(lib.fma_flops(threads, 20_000_000) for _ in range(9)) / 1e9


def matmul_peak_gflops(fma_peak: float, dtype: str) -> float:
    """The arithmetic ceiling of the kernels' matmuls in `dtype` from the FMA peak: for bfloat16
    16 times it where they run on AMX tiles (`packed_tiles()`: a `tdpbf16ps`, 16 x 16 x 32
    multiply-adds, issues once per 16 cycles, Intel's figure: 1024 flops a cycle a core against
    the two 16-lane FMA ports' 64), twice it where they run AVX512-BF16's `vdpbf16ps` (two
    multiply-adds a lane), else it."""
    from pallas_kernels import cpu_ops

    if dtype != "bfloat16":
        return fma_peak
    if cpu_ops.packed_tiles() and cpu_ops._default_tiles():
        return fma_peak * 16
    return fma_peak * (2 if cpu_ops.bf16_dot_compiled() else 1)


@functools.cache
def read_probe():
    """A function that reads 512 MiB once and returns the rate in GB/s: a C loop streaming it
    front to back, a vector a load into running sums (the way the packed kernels stream their
    panels), one thread per core, each a contiguous slice once. The buffer is NumPy's, which
    asks for huge pages for large arrays, as the runner does for its weights. Where no C
    compiler builds the probe, NumPy sums on the same threads (NumPy drops the GIL while it
    sums), which can read slower than the kernels stream (10-14 against 19.5 GB/s on the AMX
    box), and a bound from them would flatter the step, as would a single-threaded
    reduction."""
    import threading

    import numpy as np

    threads = cores()
    rows = np.ones((threads, (128 << 20) // threads), np.float32)
    lib = _probes()

    def read_all() -> float:
        if lib is not None:
            return lib.read_bytes(threads, rows.ctypes.data, rows.nbytes) / 1e9
        workers = [threading.Thread(target=row.sum) for row in rows]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return rows.nbytes / (time.perf_counter() - start) / 1e9

    read_all()  # fault in and warm the pages
    return read_all


def read_gbps() -> float:
    """Read bandwidth in GB/s (`read_probe`): the median of 9 reads."""
    rates = sorted(read_probe()() for _ in range(9))
    return rates[len(rates) // 2]


def stream_probe(llm):
    """A function timing the packed kernel (`cpu_ops.packed_matmul`) over one contiguous
    packed weight as large as the runner's weights, at a given count of rows, in seconds: what
    streaming the step's weight bytes through its own matmul kernel costs, the read and the
    dot products overlapped as well as the kernel overlaps them (one range of panels a thread,
    no other work between). A bound a step of few rows can reach only where nothing else costs;
    at 8 bfloat16 rows on the 2-core Zen 4 box the dot products can bind it, not the read. None
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


def step_and_read(llm, batch: int, context: int, stream=None,
                  rounds: int = 15) -> tuple[float, float, float | None]:
    """(median seconds of a decode step, median read rate in GB/s, median seconds of
    `stream` (a `stream_probe`) at the step's rows or None), the step, a read of `read_probe`
    and the stream alternating round by round: on a shared machine whose read bandwidth
    drifts (30-55 GB/s within an hour on the 2-core Zen 4 box, and 34 -> 59 -> 34 within
    minutes), a bound from a probe taken minutes before or after the steps says little about
    them. The medians mix the placements of the step's two threads, which set that rate and
    the cost of the threads' handoffs together: `placement_steps` splits them."""
    import numpy as np

    runner = llm.engine.runner
    seqs = decode_seqs(runner, batch, context)
    runner.execute(seqs)  # compile
    probe, steps, rates, streams = read_probe(), [], [], []
    if stream is not None:
        stream(batch)  # compiles
    for _ in range(rounds):
        rates.append(probe())
        start = time.perf_counter()
        runner.execute(seqs)
        steps.append(time.perf_counter() - start)
        if stream is not None:
            streams.append(stream(batch))
    return (float(np.median(steps)), float(np.median(rates)),
            float(np.median(streams)) if streams else None)


def bound_ms(nbytes: float, flops: float, peak_gflops: float, read_gbps: float) -> float:
    """A step's bound (ms): the larger of reading `nbytes` at `read_gbps` and its `flops` at
    `peak_gflops`."""
    return max(nbytes / (read_gbps * 1e9), flops / (peak_gflops * 1e9)) * 1e3


NEAR_NS = 150  # a round trip under it: the two cores share a cache (Zen 4: ~57 ns in one CCX)


def placement_steps(llm, batch: int, context: int, seconds: float,
                    tokens: int = 16) -> dict[str, tuple]:
    """Where the two threads run, and what it does to a step: rounds for `seconds`, each a
    round trip of a cache line between two threads (`round_trip_ns`, 5,000 times), a read of
    `read_probe`, a runner step, the engine's median step while `batch` requests decode
    `tokens` tokens (run ahead) and a round trip again; by placement, `near` (both round trips
    under NEAR_NS: cores sharing a cache) and `far` (both over; a round whose two disagree, the
    threads moved, is dropped), the medians (rounds, round trip ns, read GB/s, runner step s,
    engine step s). On the 2-core Zen 4 VM the hypervisor moves the two vCPUs between cores of
    one CCX (~57 ns round trips; one CCD's link, reads ~35 GB/s) and of two (~350 ns; two
    links, ~50-58 GB/s) within minutes: the fast reads come with slow handoffs between the
    threads, which a step makes at every stage of every layer."""
    import numpy as np

    lib = _probes()
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


def forward_args(runner, seqs) -> tuple:
    """The arguments the runner's step over `seqs` hands its jitted forward (model, params,
    pool, token ids, positions, attention metadata), caught as it runs the step once."""
    from jaxpage.engine import runner as runner_module

    forward, captured = runner_module._FORWARD, []

    def capture(*args):
        captured.append(args)
        return forward(*args)

    runner_module._FORWARD = capture
    try:
        runner.execute(seqs)
    finally:
        runner_module._FORWARD = forward
    return captured[0]


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
    model, params, _, token_ids, positions, attn_md = forward_args(
        runner, decode_seqs(runner, batch, context))

    def run(params, pool, token_ids, positions, attn_md, n):
        drawn = []
        for _ in range(n):
            logits, pool = model.forward(params, token_ids, positions, pool, attn_md)
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
    ap.add_argument("--vs-bucket", type=int, default=0, metavar="ROWS",
                    help="for batches below ROWS, also the step padded to a ROWS-row bucket "
                         "(alternating with the step in its own bucket, 25 each)")
    ap.add_argument("--vs-xla-glue", action="store_true",
                    help="also the step with the layer glue as XLA's fusions instead of the "
                         "kernel library's calls (alternating, 30 each)")
    ap.add_argument("--vs-prefetch", type=int, default=0, metavar="BYTES",
                    help="also the step with the packed matmuls prefetching BYTES ahead in a "
                         "panel instead of the kernel's distance for the rows (alternating, 40 "
                         "each)")
    ap.add_argument("--vs-uncut-attention", action="store_true",
                    help="also the step with the attention kernel never cutting a sequence's "
                         "keys among the threads (alternating, 40 each)")
    ap.add_argument("--vs-unfused", action="store_true",
                    help="also the step with each layer as its eleven kernel calls instead of "
                         "one (alternating, 40 each)")
    ap.add_argument("--vs-lookahead", action="store_true",
                    help="also the engine's step while the batch decodes, with the runner "
                         "starting each small decode step before reading the one before "
                         "(decode_lookahead_rows) and without (alternating, 6 x 47 steps each)")
    ap.add_argument("--vs-burst", type=int, default=0, metavar="STEPS",
                    help="also the engine's step against a chain of one-step jitted calls and "
                         "of STEPS-step calls (greedy draws fed on the device; alternating, 6 "
                         "rounds of 24 steps each)")
    ap.add_argument("--vs-4k-pool", action="store_true",
                    help="also the step over blocks spread across the pool, on the runner's "
                         "pool (huge pages) and on one of 4 KiB pages (alternating, 40 each)")
    ap.add_argument("--by-placement", type=float, default=0, metavar="SECONDS",
                    help="also, for SECONDS a batch, the runner's and the engine's steps by where "
                         "the two threads ran (a round trip between them alongside: cores "
                         "sharing a cache or not), each beside the bound at its read rate")
    ap.add_argument("--profile", action="store_true",
                    help="after each step's line, where its time goes by kind of op "
                         "(jax.profiler, 5 steps)")
    args = ap.parse_args()
    if args.vs_burst == 1 or args.vs_burst < 0:
        ap.error(f"--vs-burst takes 2 steps a call or more, got {args.vs_burst}")
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
        llm = make_llm(max(batches + [args.vs_bucket]), dtype=dtype)
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.params))
        params = llm.engine.runner.params
        packed = any(w.ndim == 4 for w in jax.tree.leaves(params))
        print(f"{dtype}: params {weight_bytes / 2**20:.0f} MiB "
              f"({'packed' if packed else 'not packed'}), XLA's 2048^3 dot {rate:.1f} GFLOP/s, "
              f"decode buckets {llm.engine.runner.decode_buckets}")
        compare = packed and not args.no_unpacked
        streamer = stream_probe(llm)
        other = unpacked(params) if compare else None
        for batch in batches:
            seconds, read, stream = step_and_read(llm, batch, args.context, streamer)
            kv_bytes = batch * (args.context + 1) * kv_bytes_per_token(llm)
            flops = forward_flops(llm.engine.model.config, batch, args.context, True)
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
            if args.profile:
                print_profile(step_profile(llm, batch, args.context), weights_ms)
        del llm, other, streamer


if __name__ == "__main__":
    main()
