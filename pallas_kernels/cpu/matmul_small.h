// Few-row matmuls of weights as they lie (handler JaxpageSmallMatmul), and the matmuls' shared
// type check. A one-device CPU runner packs its weights (matmul_packed.h); this kernel serves
// the unpacked ones (a tensor-parallel runner's shards, packing turned off) on AVX-512 builds.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"
#include "thread_team.h"

namespace {

// Small matmuls (handler JaxpageSmallMatmul): out[M, N] float32 = x[M, K] . w, x and w of one
// element type (float32 or bfloat16), w [K, N] (projections, transpose_w = 0) or [N, K] (a tied
// LM head, transpose_w = 1); products and sums in float32. Made for decode steps (M <= 16
// rows), where a matmul is a stream of the weights: each weight is read from memory once and
// used for all M rows while it is in registers.
// - [K, N]: N is cut into column tiles of 16 * V floats, and the tiles into units of up to
//   kMaxUnitTiles adjacent tiles, shared among the threads. A unit walks K in chunks of
//   kKChunk rows, and each chunk across its tiles: a tile's accumulators for (up to 8) rows
//   (MB x V vectors of 16 floats) live in registers for one chunk, in an L1 scratch between
//   chunks. So w is read as kKChunk streams of contiguous row segments, not one 64-byte piece
//   of each of K rows 2N bytes apart (which the memory system serves at a third of its
//   bandwidth); more than 8 rows take a second pass over each chunk's tile, then in L1. x is
//   transposed into float32 scratch [K, M] so each step broadcasts its M values.
// - [N, K]: each output is a dot product of x[m] (float32 scratch [M, K], in L1) with a
//   contiguous w row; a thread takes a range of w's rows and walks R of them at a time along K,
//   keeping MB x R vector accumulators, then sums each across its lanes.
// bfloat16 weights are widened to float32 as they are loaded (a 16-bit shift: exact), so the
// only roundings are float32's; the columns and K entries past the last full vector take a
// scalar loop. w is prefetched into L2 far ahead of its loads (a chunk ahead, row by row, in
// the [K, N] walk, kPrefetchBytesNK in the [N, K] one): memory latency is then hidden behind the
// multiply-adds, where loads that miss every cache would fill the load queue and stall them
// (the [N, K] walk's rate nearly doubled: docs/kernels.md). The 16-float vectors (v16f) are
// AVX-512 registers where the build targets them, split into narrower ones elsewhere.

// sums[i] = the sum of v[i]'s 16 lanes for i < 16 (v: v16f or __m512): a transposing
// reduction, ~45 shuffles and adds for all 16 where each alone takes ~8 (the [N, K] path ends
// every 8 x 2 or 4 x 4 block of dot products with 16 of them).
template <typename Vec>
inline void hsum16(const Vec* v, float* sums) {
#ifdef __AVX512F__
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: v[2i]'s halves summed, 8-15: v[2i + 1]'s
    const __m512 a = __builtin_bit_cast(__m512, v[2 * i]);
    const __m512 b = __builtin_bit_cast(__m512, v[2 * i + 1]);
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: v[4i + L]'s quarters summed
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  const __m512 p = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const __m512 q = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
  // lane 4L + e: the sum of v[4e + L]
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(p, q, 0x44), _mm512_shuffle_ps(p, q, 0xEE));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, r);
  for (int L = 0; L < 4; ++L)
    for (int e = 0; e < 4; ++e) sums[4 * e + L] = lanes[4 * L + e];
#else
  for (int i = 0; i < 16; ++i) sums[i] = hsum(__builtin_bit_cast(v16f, v[i]));
#endif
}

constexpr int64_t kKChunk = 32;             // [K, N]: w rows per chunk (even: bf16 pairs)
constexpr int64_t kMaxUnitTiles = 16;       // [K, N]: column tiles per work unit
constexpr int64_t kPrefetchBytesNK = 8192;  // [N, K]: bytes ahead in each row's stream
// x rows per register tile, and the rows up to which a tile is 64 columns ([K, N]) or spans 4 of
// w's rows ([N, K]): a tile's accumulators (MB x V vectors of 16 floats) stay in registers only
// where there are enough of them. AVX-512 has 32 of 16 floats: 8 rows x 2 (or 4 x 4) fit.
// AVX2 has 16 of 8 floats, a v16f taking two: 8 x 2 would be 32 registers, more than there
// are, so 2 rows x 2, 1 x 4. (That alone did not make the 16-float walks fast on AVX2, where GCC
// lowers v16f through the stack: models route few-row matmuls around them there,
// JaxpageVectorLanes; the packed panels, packed_panels.h, use the machine's own width.)
#ifdef __AVX512F__
constexpr int kMaxRowBlock = 8;
constexpr int kWideRows = 4;
#else
constexpr int kMaxRowBlock = 2;
constexpr int kWideRows = 1;
#endif
// the row counts a pick function instantiates its tiles for (1..kMaxRowBlock, 1..kWideRows)
constexpr auto kRowSeq = std::make_integer_sequence<int, kMaxRowBlock>();
constexpr auto kWideSeq = std::make_integer_sequence<int, kWideRows>();
constexpr int kTileFloats = 16 * 16;        // one tile's accumulators: up to 16 vectors


// Prefetches rows [r0, r1) of w (row_bytes apart from `w` on), `bytes` of each from byte
// `offset` on, into L2, row by row: so memory serves each row's segment as one run.
inline void prefetch_rows(const char* w, int64_t row_bytes, int64_t r0, int64_t r1,
                          int64_t offset, int64_t bytes) {
  for (int64_t r = r0; r < r1; ++r) {
    const char* row = w + r * row_bytes + offset;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, kL2);
  }
}


struct MatmulProblem {
  const float* x;  // float32 scratch: [K, M] for w [K, N], [M, K] for w [N, K]
  const void* w;
  float* out;      // [M, N]
  int64_t M, K, N;
};

// [K, N]: rows m0..m0+MB of out, columns n0..n0+16V, w rows k0..k1: the accumulators start
// at zero (`first`) or from `acc` [MB][V][16], and are left there.
template <typename T, int MB, int V>
void kn_tile(const MatmulProblem& P, int64_t m0, int64_t n0, int64_t k0, int64_t k1,
             float* acc_store, bool first) {
  const T* w = static_cast<const T*>(P.w);
  v16f acc[MB][V] = {};
  if (!first) std::memcpy(acc, acc_store, sizeof acc);
  const T* wp = w + k0 * P.N + n0;
  for (int64_t k = k0; k < k1; ++k, wp += P.N) {
    v16f wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load16(wp + 16 * v);
    const float* xk = P.x + k * P.M + m0;
    for (int m = 0; m < MB; ++m) {
      const float xm = xk[m];
      for (int v = 0; v < V; ++v) acc[m][v] += xm * wv[v];
    }
  }
  std::memcpy(acc_store, acc, sizeof acc);
}

// [K, N]: kn_tile's accumulators (rows m0..m0+mb, V vectors) into out.
void kn_store(const MatmulProblem& P, int64_t m0, int64_t n0, int mb, int V,
              const float* acc) {
  for (int m = 0; m < mb; ++m)
    std::memcpy(P.out + (m0 + m) * P.N + n0, acc + m * V * 16, V * 16 * sizeof(float));
}

// [K, N]: the columns n0..N (fewer than a tile), all rows, scalar.
template <typename T>
void kn_tail(const MatmulProblem& P, int64_t n0) {
  const T* w = static_cast<const T*>(P.w);
  const int64_t width = P.N - n0;
  for (int64_t m = 0; m < P.M; ++m)
    for (int64_t n = 0; n < width; ++n) P.out[m * P.N + n0 + n] = 0.0f;
  for (int64_t k = 0; k < P.K; ++k) {
    const T* wk = w + k * P.N + n0;
    for (int64_t m = 0; m < P.M; ++m) {
      const float xm = P.x[k * P.M + m];
      float* o = P.out + m * P.N + n0;
      for (int64_t n = 0; n < width; ++n) o[n] += xm * to_float(wk[n]);
    }
  }
}

// [N, K]: out rows m0..m0+MB, columns (w rows) n0..n0+R.
template <typename T, int MB, int R>
void nk_block(const MatmulProblem& P, int64_t m0, int64_t n0, const char* w_end) {
  const T* w = static_cast<const T*>(P.w) + n0 * P.K;
  v16f acc[MB][R] = {};
  int64_t k = 0;
  for (; k + 16 <= P.K; k += 16) {
    v16f wv[R];
    for (int r = 0; r < R; ++r) {
      prefetch_ahead(w + r * P.K + k, kPrefetchBytesNK, w_end);
      wv[r] = load16(w + r * P.K + k);
    }
    for (int m = 0; m < MB; ++m) {
      const v16f xv = load16(P.x + (m0 + m) * P.K + k);
      for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
    }
  }
  float sums[MB * R];
  if constexpr (MB * R == 16) hsum16(&acc[0][0], sums);
  else
    for (int i = 0; i < MB * R; ++i) sums[i] = hsum(acc[i / R][i % R]);
  for (int m = 0; m < MB; ++m) {
    const float* xm = P.x + (m0 + m) * P.K;
    for (int r = 0; r < R; ++r) {
      float s = sums[m * R + r];
      const T* wr = w + r * P.K;
      for (int64_t j = k; j < P.K; ++j) s += xm[j] * to_float(wr[j]);
      P.out[(m0 + m) * P.N + n0 + r] = s;
    }
  }
}

using KnTileFn = void (*)(const MatmulProblem&, int64_t, int64_t, int64_t, int64_t, float*,
                          bool);
using NkBlockFn = void (*)(const MatmulProblem&, int64_t, int64_t, const char*);

// [K, N] tiles: V = 4 (64 columns) for up to 4 rows, else V = 2 (32 columns) for 8 rows a pass.
template <typename T, int V, int... MB>
KnTileFn kn_pick(int mb, std::integer_sequence<int, MB...>) {
  KnTileFn fns[] = {kn_tile<T, MB + 1, V>...};
  return fns[mb - 1];
}
// [N, K]: R = 4 w rows at a time for up to 4 x rows, else R = 2 for 8 x rows a pass.
template <typename T, int R, int... MB>
NkBlockFn nk_pick(int mb, std::integer_sequence<int, MB...>) {
  NkBlockFn fns[] = {nk_block<T, MB + 1, R>...};
  return fns[mb - 1];
}

#ifdef __AVX512BF16__
// bfloat16 on vdpbf16ps (AVX512-BF16): each instruction multiplies 32 bf16 pairs exactly and
// adds each pair's two products into a float32 lane (rounded, as float32 sums are), so half the
// multiply-adds of the widened path (which is bound by them for 8 or more rows on a CPU with
// one 512-bit FMA a cycle). Subnormal inputs and results are flushed to zero (below 1.2e-38).
// [N, K]: x and w rows are both contiguous along K: pairs (k, k + 1) as they lie.
template <int MB, int R>
void nk_block_dot(const MatmulProblem& P, const bf16* x, int64_t m0, int64_t n0,
                  const char* w_end) {
  const bf16* w = static_cast<const bf16*>(P.w) + n0 * P.K;
  __m512 acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= P.K; k += 32) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) {
      prefetch_ahead(w + r * P.K + k, kPrefetchBytesNK, w_end);
      wv[r] = as_bh(_mm512_loadu_si512(w + r * P.K + k));
    }
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = as_bh(_mm512_loadu_si512(x + (m0 + m) * P.K + k));
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  float sums[MB * R];
  if constexpr (MB * R == 16) hsum16(&acc[0][0], sums);
  else
    for (int i = 0; i < MB * R; ++i) sums[i] = hsum(__builtin_bit_cast(v16f, acc[i / R][i % R]));
  for (int m = 0; m < MB; ++m) {
    const bf16* xm = x + (m0 + m) * P.K;
    for (int r = 0; r < R; ++r) {
      float s = sums[m * R + r];
      const bf16* wr = w + r * P.K;
      for (int64_t j = k; j < P.K; ++j) s += widen(xm[j]) * widen(wr[j]);
      P.out[(m0 + m) * P.N + n0 + r] = s;
    }
  }
}

// [K, N]: rows k and k + 1 of a 32-column group are interleaved into bf16 pairs (unpack lo/hi:
// lane j of lo holds columns 8j..8j+3, of hi 8j+4..8j+7) against x's pairs, packed beforehand
// as 32-bit words [ceil(K / 2), M] (an odd K's last pair is (x, 0) against (w, 0)). G groups of
// 32 columns, MB rows: MB x 2G accumulators, kept in `acc` [MB][2G][16] between chunks (k0
// even); kn_store_dot puts them in column order.
template <int MB, int G>
void kn_tile_dot(const MatmulProblem& P, const uint32_t* xpairs, int64_t m0, int64_t n0,
                 int64_t k0, int64_t k1, float* acc_store, bool first) {
  const bf16* w = static_cast<const bf16*>(P.w) + n0;
  __m512 acc[MB][2 * G];
  for (int m = 0; m < MB; ++m)
    for (int g = 0; g < 2 * G; ++g)
      acc[m][g] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_store + (m * 2 * G + g) * 16);
  for (int64_t k = k0; k < k1; k += 2) {
    const bf16* w0 = w + k * P.N;
    const bool pair = k + 1 < P.K;
    __m512bh lo[G], hi[G];
    for (int g = 0; g < G; ++g) {
      const __m512i a = _mm512_loadu_si512(w0 + 32 * g);
      const __m512i b = pair ? _mm512_loadu_si512(w0 + P.N + 32 * g) : _mm512_setzero_si512();
      lo[g] = as_bh(_mm512_unpacklo_epi16(a, b));
      hi[g] = as_bh(_mm512_unpackhi_epi16(a, b));
    }
    const uint32_t* xk = xpairs + (k / 2) * P.M + m0;
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = as_bh(_mm512_set1_epi32(static_cast<int32_t>(xk[m])));
      for (int g = 0; g < G; ++g) {
        acc[m][2 * g] = _mm512_dpbf16_ps(acc[m][2 * g], xv, lo[g]);
        acc[m][2 * g + 1] = _mm512_dpbf16_ps(acc[m][2 * g + 1], xv, hi[g]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int g = 0; g < 2 * G; ++g) _mm512_storeu_ps(acc_store + (m * 2 * G + g) * 16, acc[m][g]);
}

void kn_store_dot(const MatmulProblem& P, int64_t m0, int64_t n0, int mb, int G,
                  const float* acc) {
  for (int m = 0; m < mb; ++m) {
    float* o = P.out + (m0 + m) * P.N + n0;
    for (int g = 0; g < G; ++g) {
      const float* l = acc + (m * 2 * G + 2 * g) * 16;
      const float* h = l + 16;
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 4; ++i) {
          o[32 * g + 8 * j + i] = l[4 * j + i];
          o[32 * g + 8 * j + 4 + i] = h[4 * j + i];
        }
    }
  }
}

template <int G, int... MB>
void (*kn_pick_dot(int mb, std::integer_sequence<int, MB...>))(const MatmulProblem&,
                                                                 const uint32_t*, int64_t,
                                                                 int64_t, int64_t, int64_t,
                                                                 float*, bool) {
  void (*fns[])(const MatmulProblem&, const uint32_t*, int64_t, int64_t, int64_t, int64_t,
                float*, bool) = {kn_tile_dot<MB + 1, G>...};
  return fns[mb - 1];
}
template <int R, int... MB>
void (*nk_pick_dot(int mb, std::integer_sequence<int, MB...>))(const MatmulProblem&,
                                                                 const bf16*, int64_t, int64_t,
                                                                 const char*) {
  void (*fns[])(const MatmulProblem&, const bf16*, int64_t, int64_t, const char*) = {
      nk_block_dot<MB + 1, R>...};
  return fns[mb - 1];
}
#endif  // __AVX512BF16__

struct MatmulWork {
  MatmulProblem problem;
  std::vector<float> x_scratch;
  bool transpose_w = false, is_bf16 = false, dot = false;  // dot: the vdpbf16ps path
  const bf16* x_bf16 = nullptr;     // [N, K] dot path: x as it lies
  std::vector<uint32_t> x_pairs;    // [K, N] dot path: x's bf16 pairs [ceil(K / 2), M]
  int64_t units = 0;
  int64_t unit_width = 0;                       // [N, K]: w rows per unit
  int64_t tile_width = 0, full_tiles = 0, unit_tiles = 0;  // [K, N] (and the tail's unit)
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // [K, N] unit u: column tiles u * unit_tiles.. (of tile_width columns), or the columns past
  // the last full tile (the last unit when N is not a multiple of tile_width), chunk by chunk.
  template <typename T>
  void unit_kn(int64_t u, float* scratch) {
    const MatmulProblem& P = problem;
    const int64_t first = u * unit_tiles;
    if (first >= full_tiles) return kn_tail<T>(P, full_tiles * tile_width);
    const int64_t count = std::min(unit_tiles, full_tiles - first);
    const int64_t blocks = (P.M + kMaxRowBlock - 1) / kMaxRowBlock;
    const bool wide = tile_width == 64;  // up to kWideRows rows
    const char* w = static_cast<const char*>(P.w);
    const int64_t row_bytes = P.N * sizeof(T), offset = first * tile_width * sizeof(T);
    const int64_t segment = count * tile_width * sizeof(T);  // the unit's bytes of a row
    const int64_t rows_a_tile = (kKChunk + count - 1) / count;
    for (int64_t k0 = 0; k0 < P.K; k0 += kKChunk) {
      const int64_t k1 = std::min(P.K, k0 + kKChunk);
      // the rows to prefetch during this chunk: the next chunk's, or in the last chunk the
      // first chunk of the unit a thread claims next (whichever thread does, it then reads
      // them from this core's L2 rather than from memory)
      int64_t ahead_row = k1, ahead_offset = offset, ahead_segment = segment;
      if (k1 == P.K) {
        const int64_t next_first = next.load(std::memory_order_relaxed) * unit_tiles;
        ahead_row = 0;
        ahead_offset = next_first * tile_width * sizeof(T);
        ahead_segment = std::min(unit_tiles, full_tiles - next_first) * tile_width * sizeof(T);
      }
      for (int64_t t = 0; t < count; ++t) {
        const int64_t n0 = (first + t) * tile_width;
        // a share of those rows before each tile, so that they arrive a chunk ahead
        const int64_t r0 = std::min(P.K, ahead_row + t * rows_a_tile);
        const int64_t r1 = std::min({P.K, r0 + rows_a_tile, ahead_row + kKChunk});
        if (ahead_segment > 0)
          prefetch_rows(w, row_bytes, r0, r1, ahead_offset, ahead_segment);
        for (int64_t b = 0; b < blocks; ++b) {  // the chunk's tile stays in L1 for the next
          const int64_t m0 = b * kMaxRowBlock;
          const int mb = static_cast<int>(std::min<int64_t>(kMaxRowBlock, P.M - m0));
          float* acc = scratch + (t * blocks + b) * kTileFloats;
#ifdef __AVX512BF16__
          if (std::is_same_v<T, bf16> && dot) {
            const auto fn = wide ? kn_pick_dot<2>(mb, kWideSeq)
                                 : kn_pick_dot<1>(mb, kRowSeq);
            fn(P, x_pairs.data(), m0, n0, k0, k1, acc, k0 == 0);
            continue;
          }
#endif
          const KnTileFn fn = wide ? kn_pick<T, 4>(mb, kWideSeq)
                                   : kn_pick<T, 2>(mb, kRowSeq);
          fn(P, m0, n0, k0, k1, acc, k0 == 0);
        }
      }
    }
    for (int64_t t = 0; t < count; ++t)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t m0 = b * kMaxRowBlock, n0 = (first + t) * tile_width;
        const int mb = static_cast<int>(std::min<int64_t>(kMaxRowBlock, P.M - m0));
        const float* acc = scratch + (t * blocks + b) * kTileFloats;
#ifdef __AVX512BF16__
        if (std::is_same_v<T, bf16> && dot) {
          kn_store_dot(P, m0, n0, mb, wide ? 2 : 1, acc);
          continue;
        }
#endif
        kn_store(P, m0, n0, mb, wide ? 4 : 2, acc);
      }
  }

  template <typename T>
  void unit_nk(int64_t u) {
    const MatmulProblem& P = problem;
    const int64_t first = u * unit_width, last = std::min(P.N, first + unit_width);
    const char* w_end = static_cast<const char*>(P.w) + P.N * P.K * sizeof(T);
    const int R = P.M <= kWideRows ? 4 : 2;
    int64_t n = first;
    for (; n + R <= last; n += R) {
      for (int64_t m0 = 0; m0 < P.M; m0 += kMaxRowBlock) {  // w's R rows stay in L1
        const int mb = static_cast<int>(std::min<int64_t>(kMaxRowBlock, P.M - m0));
#ifdef __AVX512BF16__
        if (std::is_same_v<T, bf16> && dot) {
          const auto fn = R == 4 ? nk_pick_dot<4>(mb, kWideSeq)
                                 : nk_pick_dot<2>(mb, kRowSeq);
          fn(P, x_bf16, m0, n, w_end);
          continue;
        }
#endif
        const NkBlockFn fn = R == 4 ? nk_pick<T, 4>(mb, kWideSeq)
                                    : nk_pick<T, 2>(mb, kRowSeq);
        fn(P, m0, n, w_end);
      }
    }
    for (; n < last; ++n)
      for (int64_t m0 = 0; m0 < P.M; m0 += kMaxRowBlock) {
        const int mb = static_cast<int>(std::min<int64_t>(kMaxRowBlock, P.M - m0));
        nk_pick<T, 1>(mb, kRowSeq)(P, m0, n, w_end);
      }
  }

  void run() {
    // [K, N]: a unit's accumulators between chunks (the first chunk writes them: no fill)
    std::unique_ptr<float[]> scratch;
    if (!transpose_w)
      scratch.reset(new float[unit_tiles * ((problem.M + kMaxRowBlock - 1) / kMaxRowBlock) *
                              kTileFloats]);
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) {
      if (transpose_w) {
        if (is_bf16) unit_nk<bf16>(u); else unit_nk<float>(u);
      } else {
        if (is_bf16) unit_kn<bf16>(u, scratch.get()); else unit_kn<float>(u, scratch.get());
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// What is wrong with a matmul's element types ("" if nothing): x and w of one type, float32
// or bfloat16.
std::string matmul_types_problem(ffi::DataType x, ffi::DataType w) {
  if (x != ffi::DataType::F32 && x != ffi::DataType::BF16)
    return "x is " + type_name(x) + ", not float32 or bfloat16";
  if (w != x) return "x is " + type_name(x) + " but w " + type_name(w) + " (one dtype for both)";
  return "";
}

ffi::Error InvalidMatmul(const std::string& what) {
  return ffi::Error::InvalidArgument("small matmul: " + what);
}

ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                       int64_t transpose_w, int64_t bf16_dot,
                       ffi::ResultBuffer<ffi::F32> out) {
  const ffi::DataType type = x.element_type();
  if (const std::string problem = matmul_types_problem(type, w.element_type()); !problem.empty())
    return InvalidMatmul(problem);
  if (transpose_w != 0 && transpose_w != 1)
    return InvalidMatmul("transpose_w must be 0 or 1, got " + std::to_string(transpose_w));
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2)
    return InvalidMatmul("x " + shape_string(xd) + " and w " + shape_string(wd) +
                         " must both be matrices");
  const int64_t M = xd[0], K = xd[1];
  const int64_t wk = transpose_w ? wd[1] : wd[0], N = transpose_w ? wd[0] : wd[1];
  if (wk != K)
    return InvalidMatmul("x " + shape_string(xd) + " does not contract with w " +
                         shape_string(wd) + (transpose_w ? " ([N, K])" : " ([K, N])"));
  if (od.size() != 2 || od[0] != M || od[1] != N)
    return InvalidMatmul("output " + shape_string(od) + " is not [" + std::to_string(M) + ", " +
                         std::to_string(N) + "]");
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {  // empty sums: no chunk runs
    std::fill_n(out->typed_data(), M * N, 0.0f);
    return ffi::Error::Success();
  }

  auto work = std::make_shared<MatmulWork>();
  work->transpose_w = transpose_w != 0;
  work->is_bf16 = type == ffi::DataType::BF16;
  // x in float32 (bfloat16 widened, exact): [K, M] for the [K, N] walk, [M, K] for [N, K]
  work->x_scratch.resize(static_cast<size_t>(std::max<int64_t>(M * K, 1)));
  float* xs = work->x_scratch.data();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const float value = work->is_bf16 ? widen(static_cast<const bf16*>(x.untyped_data())[m * K + k])
                                     : static_cast<const float*>(x.untyped_data())[m * K + k];
      xs[work->transpose_w ? m * K + k : k * M + m] = value;
    }
  work->problem = MatmulProblem{xs, w.untyped_data(), out->typed_data(), M, K, N};
  work->dot = work->is_bf16 && bf16_dot != 0 && kHaveBf16Dot;
  if (work->dot) {
    const bf16* xb = static_cast<const bf16*>(x.untyped_data());
    work->x_bf16 = xb;  // read by the [N, K] items, all done before this call returns
    if (!work->transpose_w) {  // (x[m, k], x[m, k + 1]) as one 32-bit word, low half first
      const int64_t pairs = (K + 1) / 2;
      work->x_pairs.resize(static_cast<size_t>(std::max<int64_t>(pairs * M, 1)));
      for (int64_t p = 0; p < pairs; ++p)
        for (int64_t m = 0; m < M; ++m) {
          const uint32_t lo = xb[m * K + 2 * p];
          const uint32_t hi = 2 * p + 1 < K ? xb[m * K + 2 * p + 1] : 0u;
          work->x_pairs[p * M + m] = lo | (hi << 16);
        }
    }
  }
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (work->transpose_w) {
    // ranges of 64 w rows (fewer for small N, so that every thread has some)
    work->unit_width = std::max<int64_t>(4, std::min<int64_t>(64, (N / threads + 3) / 4 * 4));
    work->units = (N + work->unit_width - 1) / work->unit_width;
  } else {
    // tiles shared evenly among a multiple of the threads' count of units (so that each
    // thread has as many), of at most kMaxUnitTiles tiles where there are enough
    work->tile_width = M <= kWideRows ? 64 : 32;
    work->full_tiles = N / work->tile_width;
    const int64_t wanted = (work->full_tiles + kMaxUnitTiles - 1) / kMaxUnitTiles;
    const int64_t spread = std::max<int64_t>(
        1, std::min(work->full_tiles, (wanted + threads - 1) / threads * threads));
    work->unit_tiles = std::max<int64_t>(1, (work->full_tiles + spread - 1) / spread);
    work->units = (work->full_tiles + work->unit_tiles - 1) / work->unit_tiles +
                  (N % work->tile_width != 0);  // the tail's unit
  }
  const int64_t total = work->units;
  run_shared(pool, work, total);
  return ffi::Error::Success();
}

}  // namespace
