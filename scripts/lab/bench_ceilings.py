"""The read patterns of a small CPU decode step, each alone, beside the engine's own step.

Lab probe of the small decode step's floor (docs/cpu_decode_history.md): how fast this machine
lets the step's reads run, walked the way the CPU kernels walk them but with nothing else to
do, in one process. A decode step of few rows is a read: every weight once (bench_decode_step's
bound: the bytes over the read probe's rate), and each sequence's K/V. The step's kernels read
in patterns the probe's one long stream does not have, and this script measures what each
pattern alone allows (a C++ program of loads and nothing else, two threads as the kernels run):
- `stream`: every weight (the layers' and the head's) read once front to back, each thread a
  contiguous half (the read probe's pattern);
- `walk`: the layers' four matmuls in a step's order, panel by panel (32 columns of K pairs,
  as `cpu_ops.pack_weight` lays them out), each matmul's panels split between the threads
  and the threads meeting after each one, as the layer kernel's stages do (gate_up pairs each
  gate panel with its up panel). At 1-2 rows the loads are vector loads with the panels' prefetch
  2 KB ahead (the vector panels' distance, but on AMX CPUs, where theirs is 3 KB); from 3 rows on
  a CPU with AMX-BF16, the tile loads and `tdpbf16ps` of the kernel's tile walk for those rows
  (prefetch 4 KB ahead), x in tiles; elsewhere vector loads at every row count (the read alone,
  without the few-row panels' arithmetic);
- `scattered`: attention's K/V reads, each layer's blocks (one a sequence, KV head and 16-token
  block, K and V apart; the sequences' context halfway through the rounds) at random places of
  a 1 GiB pool, split between the threads, which meet after each layer.
Rounds alternate the patterns and four of the engine's steps while `rows` requests decode
(bfloat16, the default model, context 128; the host's work runs ahead as it does in a trace) so
that all share the machine's drifting bandwidth; each figure is a median. The step's floor
from them: the layers' weights at the walk's rate, the K/V at the scattered rate, the head at
the stream's.

    python scripts/lab/bench_ceilings.py                    # 1 and 8 rows
    python scripts/lab/bench_ceilings.py --rows 1,2,4,8 --rounds 15

Where the step sits over its floor, the kernels lose time to something other than the machine's
reads (their own walk, the threads' handoffs, the glue); where the floor sits over the bound,
the patterns themselves cost it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import cores, load_library, make_llm, start_decoding  # noqa: E402

STEPS = 4  # engine steps a round

SOURCE = r"""
#include <immintrin.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {
constexpr int64_t kStep = 2048;  // a k-step of a 32-column bfloat16 panel: 16 pairs x 32 x 4 B
int g_threads = 2;
char* g_weights = nullptr;  // the layers' matmuls in a step's order, then the head
int64_t g_layer_bytes = 0, g_total = 0, g_kn[4][2];
int g_layers = 0;
char* g_pool = nullptr;  // K blocks, then V blocks
int64_t g_pool_bytes = 0, g_block_bytes = 0;
float g_sink[64][16];  // each thread's results land in rows of its own: nothing is shared
std::vector<uint32_t> g_x;  // x as tiles: 16 rows of g_x_pairs pairs (zeros)
int64_t g_x_pairs = 0;

char* huge(int64_t bytes) {
  const int64_t huge_page = 2 << 20;
  const int64_t whole = (bytes + huge_page - 1) / huge_page * huge_page;
  char* p = static_cast<char*>(aligned_alloc(huge_page, whole));
  if (p == nullptr) return nullptr;
  madvise(p, bytes, MADV_HUGEPAGE);
  for (int64_t i = 0; i < bytes; i += 4) {
    const float f = 1e-3f * static_cast<float>(i % 1024);
    std::memcpy(p + i, &f, 4);
  }
  return p;
}

struct Barrier {
  std::atomic<int> count{0}, generation{0};
  void wait() {
    const int g = generation.load();
    if (count.fetch_add(1) + 1 == g_threads) {
      count.store(0);
      generation.fetch_add(1);
    } else {
      while (generation.load() == g) _mm_pause();
    }
  }
};

// runs fn(t) on g_threads threads (this one is thread 0), returns the seconds it took
template <typename F>
double on_threads(F fn) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> helpers;
  for (int t = 1; t < g_threads; ++t) helpers.emplace_back(fn, t);
  fn(0);
  for (auto& h : helpers) h.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

__m512 sum_lines(const char* p, int64_t bytes, __m512 acc) {
  for (int64_t b = 0; b < bytes; b += 64)
    acc = _mm512_add_ps(acc, _mm512_load_ps(reinterpret_cast<const float*>(p + b)));
  return acc;
}

void vector_panel(const char* panel, int64_t steps, const char* end, int t) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    const char* w = panel + s * kStep;
    for (int64_t line = 0; line < kStep; line += 64)
      if (w + kStep + line < end) __builtin_prefetch(w + kStep + line, 0, 2);
    acc = sum_lines(w, kStep, acc);
  }
  _mm512_storeu_ps(g_sink[32 + t], acc);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void tile_panel(const char* panel, int64_t steps, const char* end, int rows, int t) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t s = 0; s < steps; ++s) {
    const char* w = panel + s * kStep;
    for (int64_t line = 0; line < kStep; line += 64)
      if (w + 2 * kStep + line < end) __builtin_prefetch(w + 2 * kStep + line, 0, 2);
    _tile_loadd(6, w, 128);
    _tile_loadd(7, w + 64, 128);
    _tile_loadd(4, g_x.data() + s * 16, g_x_pairs * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
  }
  alignas(64) float out[16][32];
  _tile_stored(0, &out[0][0], 128);
  _tile_stored(1, &out[0][16], 128);
  g_sink[48 + t][0] += out[rows - 1][31];
}

void configure_tiles(int rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  for (int t : {0, 1, 4}) config.rows[t] = static_cast<uint8_t>(rows);
  // GCC need not see that ldtilecfg reads the struct: where it outlined this function it
  // dropped the stores above (and ldtilecfg faulted on the stack's garbage)
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
constexpr bool kTiles = true;
#else
void tile_panel(const char*, int64_t, const char*, int, int) {}
void configure_tiles(int) {}
constexpr bool kTiles = false;
#endif
}  // namespace

extern "C" {

// where the weights and the pool lie (their huge-page share is read from /proc/self/smaps), and
// the layers' bytes (panels padded to whole k-steps, as ceil_walk walks them)
const char* ceil_weights() { return g_weights; }
int64_t ceil_layer_bytes() { return g_layer_bytes * g_layers; }
const char* ceil_pool() { return g_pool; }

int ceil_has_tiles() {
  if (!kTiles) return 0;
  // Linux hands the tile state only to a process that asks (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

// shapes: layers, the four matmuls' (K, N) (qkv, o, gate_up, down), the head's bytes, the pool's
// bytes and a K (or V) block's; 0 once allocated, -1 where memory ran out
int ceil_init(int threads, int layers, const int64_t* kn, int64_t head_bytes, int64_t pool_bytes,
              int64_t block_bytes) {
  g_threads = std::clamp(threads, 1, 16);  // g_sink's rows: 16 a kind of walk
  g_layers = layers;
  g_layer_bytes = 0;
  for (int m = 0; m < 4; ++m) {
    g_kn[m][0] = kn[2 * m];
    g_kn[m][1] = kn[2 * m + 1];
    g_layer_bytes += (g_kn[m][0] + 31) / 32 * 32 * g_kn[m][1] * 2;
    g_x_pairs = std::max(g_x_pairs, (g_kn[m][0] + 31) / 32 * 16);
  }
  g_x.assign(static_cast<size_t>(16 * g_x_pairs), 0u);
  g_total = g_layer_bytes * layers + head_bytes;
  g_pool_bytes = pool_bytes;
  g_block_bytes = block_bytes;
  g_weights = huge(g_total);
  g_pool = huge(2 * pool_bytes);
  return g_weights && g_pool ? 0 : -1;
}

// every weight once, front to back, each thread a contiguous part
double ceil_stream() {
  return on_threads([](int t) {
    const int64_t lines = g_total / 64;
    const int64_t a = t * lines / g_threads * 64, b = (t + 1) * lines / g_threads * 64;
    _mm512_storeu_ps(g_sink[t], sum_lines(g_weights + a, b - a, _mm512_setzero_ps()));
  });
}

// the layers' matmuls panel by panel, the threads meeting after each matmul; tiles: 0 for vector
// loads, else the tile walk for `rows` rows
double ceil_walk(int tiles, int rows) {
  Barrier barrier;
  return on_threads([&](int t) {
    if (tiles) configure_tiles(rows);
    const char* w = g_weights;
    for (int layer = 0; layer < g_layers; ++layer) {
      for (int m = 0; m < 4; ++m) {
        const int64_t K = g_kn[m][0], N = g_kn[m][1], panels = N / 32, steps = (K + 31) / 32;
        const int64_t panel_bytes = steps * kStep, bytes = panels * panel_bytes;
        const char* end = w + bytes;
        auto run = [&](int64_t p) {
          if (tiles) tile_panel(w + p * panel_bytes, steps, end, rows, t);
          else vector_panel(w + p * panel_bytes, steps, end, t);
        };
        if (m == 2) {  // gate_up: a gate panel, then its up panel
          const int64_t half = panels / 2;
          for (int64_t p = t * half / g_threads; p < (t + 1) * half / g_threads; ++p) {
            run(p);
            run(p + half);
          }
        } else {
          for (int64_t p = t * panels / g_threads; p < (t + 1) * panels / g_threads; ++p) run(p);
        }
        barrier.wait();
        w = end;
      }
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tiles) _tile_release();
#endif
  });
}

// each layer's `blocks` K blocks and as many V blocks at random places in the pool, the threads
// splitting them and meeting after each layer; `chunk` bytes a block (a K block's, or a multiple
// for the sweep of --scatter-sweep) and, when `ahead` > 0, software prefetches into L2 of the
// block `ahead` places on (K and V) before each block's loads
double ceil_scattered(int64_t blocks, uint64_t seed, int64_t chunk, int64_t ahead) {
  const int64_t slots = g_pool_bytes / chunk;
  std::vector<int64_t> at(static_cast<size_t>(g_layers * blocks));
  std::mt19937_64 rng(seed);
  for (auto& b : at) b = static_cast<int64_t>(rng() % static_cast<uint64_t>(slots));
  Barrier barrier;
  return on_threads([&](int t) {
    __m512 acc = _mm512_setzero_ps();
    for (int layer = 0; layer < g_layers; ++layer) {
      const int64_t* mine = at.data() + layer * blocks;
      const int64_t i0 = t * blocks / g_threads, i1 = (t + 1) * blocks / g_threads;
      for (int64_t i = i0; i < i1; ++i) {
        if (ahead > 0 && i + ahead < i1) {
          const char* k = g_pool + mine[i + ahead] * chunk;
          for (int64_t b = 0; b < chunk; b += 64) {
            __builtin_prefetch(k + b, 0, 1);
            __builtin_prefetch(k + g_pool_bytes + b, 0, 1);
          }
        }
        acc = sum_lines(g_pool + mine[i] * chunk, chunk, acc);
        acc = sum_lines(g_pool + g_pool_bytes + mine[i] * chunk, chunk, acc);
      }
      barrier.wait();
    }
    _mm512_storeu_ps(g_sink[16 + t], acc);
  });
}
}
"""


def build() -> ctypes.CDLL | None:
    """The program as a library (g++ -O2 -march=native, with AMX where the CPU has it), or None
    where no C++ compiler builds it or the CPU has no AVX-512 (its loads are 64-byte vectors)."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    compiler = os.environ.get("CXX") or shutil.which("g++")
    if compiler is None or " avx512f" not in flags:
        return None
    extra = ["-mamx-tile", "-mamx-bf16"] if " amx_tile" in flags and " amx_bf16" in flags else []
    lib = load_library(compiler, SOURCE, ".cc", ["-O2", "-march=native", *extra, "-std=c++17"])
    if lib is None:
        return None
    lib.ceil_init.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
                              ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    for name in ("ceil_stream", "ceil_walk", "ceil_scattered"):
        getattr(lib, name).restype = ctypes.c_double
    lib.ceil_walk.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.ceil_scattered.argtypes = [ctypes.c_int64, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64]
    lib.ceil_weights.restype = lib.ceil_pool.restype = ctypes.c_void_p
    lib.ceil_layer_bytes.restype = ctypes.c_int64
    return lib


def huge_share(address: int, nbytes: int) -> float:
    """The share of [address, address + nbytes) Linux backs with huge pages: the AnonHugePages of
    the mappings holding it (`huge_pages.anon_huge_bytes`) over its bytes, which is the buffer's
    own share for the walks' buffers (each hundreds of MiB from ceil_init, a mapping of its own;
    a buffer sharing a mapping would count its neighbours' huge pages too). Where Linux found no
    free 2 MiB pages a walk pays a TLB miss per 4 KiB, which is the walk's pattern no more."""
    from jaxpage.engine import huge_pages

    try:
        return min(1.0, huge_pages.anon_huge_bytes(address, nbytes) / nbytes)
    except OSError:
        return float("nan")


def shapes(runner) -> tuple[list[tuple[int, int]], int, int, int]:
    """The runner's packed matmuls as (K, N) in a step's order, the head's bytes, the layers
    and a K block's bytes (one KV head's 16 tokens)."""
    layer = runner.params["layers"][0]
    kn = []
    for name in ("qkv", "o", "gate_up", "down"):
        panels, pairs, width, two = layer[name].shape  # [P, ceil(K / 2), 32, 2]
        kn.append((pairs * two, panels * width))
    head = runner.params["embed"]
    block_size, _, head_dim, dtype = runner._pool_dims
    return kn, head.size * head.dtype.itemsize, len(runner.params["layers"]), \
        block_size * head_dim * dtype.itemsize


AHEAD = (0, 1, 2, 4, 8)  # --scatter-sweep's software prefetch distances, in blocks


def round_tokens(args) -> int:
    """The tokens each sequence decodes through a table's rounds (STEPS + 1 steps a round)."""
    return args.rounds * (STEPS + 1) + 2


def kv_blocks(rows: int, args, kv_heads: int, block_size: int) -> int:
    """The K blocks a layer's attention reads while `rows` sequences decode through a table's
    rounds (each sequence's context halfway through them: it grows a token a step)."""
    return rows * kv_heads * -(-(args.context + round_tokens(args) // 2) // block_size)


def scatter_sweep(lib, rows, args, kv_heads, block_size, layers, block_bytes) -> None:
    """The scattered read of `rows` sequences' K/V (context halfway through a table's rounds)
    as the floor's probe reads it (one K block and one V block at a time, the hardware's
    prefetching alone), with software prefetches `ahead` blocks on, and with the same bytes in
    fewer, larger pieces (what a layout keeping a block's KV heads, or more tokens, together
    would read): the median GB/s of --rounds rounds, each on fresh random places."""
    import numpy as np

    blocks = kv_blocks(rows, args, kv_heads, block_size)
    print(f"scattered K/V reads, {rows} rows: {2 * layers * blocks * block_bytes / 2**20:.1f} "
          f"MiB a step in {block_bytes} B blocks (GB/s, median of {args.rounds})")
    print(f"{'bytes in one place':>18}  " + "  ".join(f"ahead {a:>2}" for a in AHEAD))
    for times in (1, 2, 4, 16):
        pieces = max(1, blocks // times)  # the same bytes (to a piece) in fewer, larger pieces
        kv = 2 * layers * pieces * block_bytes * times
        rates = []
        for ahead in AHEAD:
            got = [kv / lib.ceil_scattered(pieces, r + 1, block_bytes * times, ahead)
                   for r in range(args.rounds)]
            rates.append(float(np.median(got)) / 1e9)
        print(f"{block_bytes * times:>18}  " + "  ".join(f"{g:>8.1f}" for g in rates), flush=True)


def main() -> None:
    import jax
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--scatter-sweep", action="store_true",
                    help="instead of the table: the scattered K/V read's rate at the largest "
                         "--rows by the bytes read in one place and the software prefetch "
                         "distance (is the scattered rate the pattern's, or the probe's?)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lib = build()
    if lib is None:
        print("skipped: the walks need a C++ compiler and AVX-512 (64-byte vector loads)")
        return
    tiles = bool(lib.ceil_has_tiles())
    llm = make_llm(8, dtype="bfloat16")
    engine, runner = llm.engine, llm.engine.runner
    if runner.params["layers"][0]["qkv"].ndim != 4:
        print("skipped: the runner's weights are not packed (not the cpp backend's decode path)")
        return
    kn, head_bytes, layers, block_bytes = shapes(runner)
    _, kv_heads, _, _ = runner._pool_dims
    threads = min(cores(), 16)  # the walks run at most 16 threads
    flat = (ctypes.c_int64 * 8)(*[v for pair in kn for v in pair])
    if lib.ceil_init(threads, layers, flat, head_bytes, 1 << 29, block_bytes):
        print("skipped: no memory for the weights and a 1 GiB pool")
        return
    layer_bytes = lib.ceil_layer_bytes()
    weights = layer_bytes + head_bytes
    print(f"{threads} threads; weights {weights / 2**20:.0f} MiB ({layer_bytes / 2**20:.0f} in "
          f"the layers, {head_bytes / 2**20:.0f} the head), K/V blocks of {block_bytes} B; "
          f"AMX tiles: {'yes' if tiles else 'no'}; in huge pages: the walks' weights "
          f"{huge_share(lib.ceil_weights(), weights):.0%}, their pool "
          f"{huge_share(lib.ceil_pool(), 1 << 30):.0%}")
    if args.scatter_sweep:
        scatter_sweep(lib, max(int(r) for r in args.rows.split(",")), args, kv_heads,
                      runner.block_size, layers, block_bytes)
        return
    print(f"{'rows':>4}  {'stream':>11}  {'walk':>16}  {'scattered K/V':>18}  {'bound':>8}  "
          f"{'floor':>8}  {'step':>8}  step/floor  step/bound  floor/bound")
    for rows in [int(r) for r in args.rows.split(",")]:
        use_tiles = tiles and rows >= 3
        tokens = round_tokens(args)
        blocks = kv_blocks(rows, args, kv_heads, runner.block_size)
        kv = 2 * layers * blocks * block_bytes
        start_decoding(engine, f"warm{rows}", rows, args.context, STEPS, rng)
        while engine.has_unfinished_requests():  # compiles
            engine.step()
        start_decoding(engine, f"rows{rows}", rows, args.context, tokens, rng)
        lib.ceil_stream(), lib.ceil_walk(int(use_tiles), rows)  # fault in, warm
        stream, walk, scattered, step = [], [], [], []
        for r in range(args.rounds):
            stream.append(weights / lib.ceil_stream() / 1e9)
            walk.append(layer_bytes / lib.ceil_walk(int(use_tiles), rows) / 1e9)
            scattered.append(kv / lib.ceil_scattered(blocks, r + 1, block_bytes, 0) / 1e9)
            engine.step()  # its forward ran ahead before the walks: not timed
            for _ in range(STEPS):
                start = time.perf_counter()
                engine.step()
                step.append((time.perf_counter() - start) * 1e3)
            jax.block_until_ready(jax.live_arrays())  # the steps run ahead: done before the walks
        while engine.has_unfinished_requests():
            engine.step()
        s, w, k, ms = (float(np.median(v)) for v in (stream, walk, scattered, step))
        bound = (weights + kv) / s / 1e6
        floor = layer_bytes / w / 1e6 + kv / k / 1e6 + head_bytes / s / 1e6
        kind = "tiles" if use_tiles else "vector"
        print(f"{rows:>4}  {s:>6.1f} GB/s  {w:>6.1f} GB/s {kind:>6}  {k:>6.1f} GB/s "
              f"{kv / 2**20:>4.1f} MiB  {bound:>5.2f} ms  {floor:>5.2f} ms  {ms:>5.2f} ms  "
              f"{ms / floor:>9.2f}x  {ms / bound:>9.2f}x  {floor / bound:>10.2f}x", flush=True)


if __name__ == "__main__":
    main()
