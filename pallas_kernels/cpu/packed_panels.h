// The packed weight layout and the vector panels that stream it (matmul_packed.h runs them, or
// the AMX tiles of amx.h, over a call's rows).

#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include "common.h"

namespace {

// Packed matmuls (handler JaxpagePackedMatmul): out[M, N] float32 = x[M, K] . w, x and w of one
// element type (float32 or bfloat16), w packed once (pallas_kernels.cpu_ops.pack_weight)
// as [P][KG][kPanel][G]: P = N / kPanel panels of kPanel columns (32 with AVX-512, 16 with
// AVX2: two of the machine's vectors), each KG = ceil(K / G) groups of G rows long, a group's
// rows interleaved column by column (G = 2 for bfloat16: the pairs vdpbf16ps takes; G = 1 for
// float32: the panel is w's columns row after row). So a panel is one sequential stream of
// K * kPanel elements (a cache line a row, or a pair of rows, on AVX2), read once for up to
// kPackedRows x rows (8 with AVX-512, 6 with AVX2) whose accumulators (2 vectors a row) stay in
// registers along all of K: where the small matmuls' [K, N] walk reads kKChunk short row
// segments at a time (one row of w per page apart), this reads memory in order, as fast as a
// plain sequential read (docs/kernels.md). For bfloat16 each 32-bit lane of a panel row is
// the pair vdpbf16ps multiplies by a broadcast pair (x[m, k], x[m, k + 1]), and x's rows as they
// lie are exactly those pairs, so x needs no transposing (an odd K's x is copied once with a
// zero appended); without vdpbf16ps x is widened to float32 once a call and each pair's two
// rows are widened from the panel in turn; float32 broadcasts x[m, k]. More rows take more
// passes over each panel (from cache after the first), the rows split evenly among them. Products
// and sums as in the [K, N] tiles, bit for bit: float32 FMAs k by k (bfloat16 widened exactly),
// or vdpbf16ps (products exact, pair sums and accumulation in float32, subnormals flushed).

// How far ahead in a panel's stream a pass over it prefetches, by the rows it serves: one
// distance for all rows is too far for the fast 1-2 row streams or too near for the slower
// ones. 1-2 rows: 3 KB where the build targets a CPU with AMX, 2 KB elsewhere; more rows: 6 KB
// (each measured fastest on its CPU: docs/kernels.md). A call's `prefetch_bytes` attribute
// overrides it (0: this choice), for such measurements.
#ifdef __AMX_TILE__
constexpr int64_t kFewRowsPrefetchBytes = 3072;
#else
constexpr int64_t kFewRowsPrefetchBytes = 2048;
#endif
constexpr int64_t packed_prefetch_bytes(int64_t rows) {
  return rows <= 2 ? kFewRowsPrefetchBytes : 6144;
}
constexpr int64_t kMaxPrefetchBytes = int64_t{1} << 20;

// The packed panels' vectors are the machine's own width (kLanes floats: 16 with AVX-512, else
// 8), a panel two of them: 32 columns with AVX-512, 16 with AVX2. GCC lowers a vector wider
// than the machine's through the stack (a 16-float v16f on AVX2: every broadcast 16 scalar
// stores, every FMA's operands reloaded). Two vectors a row leave room for many rows a pass
// (below): wider AVX2 panels fitted 2 rows, too few to keep the FMA units busy (docs/kernels.md).
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vnf __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vnu __attribute__((vector_size(4 * kLanes)));
constexpr int kPanelVecs = 2;                    // a panel row's vectors
constexpr int64_t kPanel = kPanelVecs * kLanes;  // columns a panel
// cache lines a panel's stream advances a step (a float32 row or a bfloat16 pair of rows)
constexpr int kPanelLines = kPanel * 4 / 64;
// x rows one pass over a panel serves: their accumulators (kPanelVecs each), the panel row's
// vectors and a broadcast stay in registers: 8 x 2 + 3 of AVX-512's 32, 6 x 2 + 3 of AVX2's 16
constexpr int kPackedRows = kLanes == 16 ? 8 : 6;
constexpr auto kPackedRowSeq = std::make_integer_sequence<int, kPackedRows>();
// loads and stores of them anywhere (memcpy would make GCC keep the accumulators in memory)
typedef float vnf_u __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef uint32_t vnu_u __attribute__((vector_size(4 * kLanes), aligned(4)));
inline void store_panel_row(float* dst, const vnf* acc) {
  for (int v = 0; v < kPanelVecs; ++v) reinterpret_cast<vnf_u*>(dst)[v] = acc[v];
}

// acc + a * b lane by lane, rounded once: what the compiler makes of `acc += a * b` in the
// [K, N] tiles (contracted into an FMA), written out so that -fassociative-math cannot regroup
// two in a row (the two products summed first). Elsewhere than x86 std::fma, which matches the
// tiles where the compiler contracts (aarch64; an x86 without FMA would not, and round twice).
inline vnf fma_n(float a, vnf b, vnf acc) {
#if defined(__AVX512F__)
  return __builtin_bit_cast(vnf, _mm512_fmadd_ps(_mm512_set1_ps(a), __builtin_bit_cast(__m512, b),
                                                 __builtin_bit_cast(__m512, acc)));
#elif defined(__FMA__)
  return __builtin_bit_cast(vnf, _mm256_fmadd_ps(_mm256_set1_ps(a), __builtin_bit_cast(__m256, b),
                                                 __builtin_bit_cast(__m256, acc)));
#else
  vnf out;
  for (int i = 0; i < kLanes; ++i) out[i] = std::fma(a, b[i], acc[i]);
  return out;
#endif
}

// One panel of a bfloat16 w: rows m0..m0+MB of out (columns n0..n0+kPanel); w: the panel,
// KG * 2 * kPanel bf16. `Dot` (vdpbf16ps): x holds rows of KG pairs (uint32); else x holds rows
// of 2 * KG floats, widened once by the caller, and w is widened a vector at a time.
template <int MB, bool Dot>
void packed_panel_bf16(const void* x, int64_t KG, int64_t m0, const void* panel,
                       const char* w_end, int64_t ahead, float* out, int64_t N, int64_t n0) {
  vnf acc[MB][kPanelVecs] = {};
  const bf16* w = static_cast<const bf16*>(panel);
#ifdef __AVX512BF16__
  if constexpr (Dot) {
    const uint32_t* xm[MB];
    for (int m = 0; m < MB; ++m) xm[m] = static_cast<const uint32_t*>(x) + (m0 + m) * KG;
    for (int64_t kp = 0; kp < KG; ++kp, w += 2 * kPanel) {
      prefetch_ahead<kPanelLines>(w, ahead, w_end);
      const __m512bh w0 = as_bh(_mm512_loadu_si512(w)), w1 = as_bh(_mm512_loadu_si512(w + 32));
      for (int m = 0; m < MB; ++m) {
        const __m512bh xv = as_bh(_mm512_set1_epi32(static_cast<int32_t>(xm[m][kp])));
        acc[m][0] = __builtin_bit_cast(
            vnf, _mm512_dpbf16_ps(__builtin_bit_cast(__m512, acc[m][0]), xv, w0));
        acc[m][1] = __builtin_bit_cast(
            vnf, _mm512_dpbf16_ps(__builtin_bit_cast(__m512, acc[m][1]), xv, w1));
      }
    }
    for (int m = 0; m < MB; ++m) store_panel_row(out + (m0 + m) * N + n0, acc[m]);
    return;
  }
#endif
  const float* xm[MB];
  for (int m = 0; m < MB; ++m) xm[m] = static_cast<const float*>(x) + (m0 + m) * 2 * KG;
  for (int64_t kp = 0; kp < KG; ++kp, w += 2 * kPanel) {
    prefetch_ahead<kPanelLines>(w, ahead, w_end);
    // lane c of a panel row: the pair (w[k, c] low, w[k + 1, c] high), each widened by its
    // bits; every row's k, then every row's k + 1 (each sum in k's order, as the [K, N] walk's),
    // so that one widened half at a time is live
    vnf wv[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v)
      wv[v] = __builtin_bit_cast(vnf, reinterpret_cast<const vnu_u*>(w)[v] << 16);
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < kPanelVecs; ++v) acc[m][v] = fma_n(xm[m][2 * kp], wv[v], acc[m][v]);
    for (int v = 0; v < kPanelVecs; ++v)
      wv[v] = __builtin_bit_cast(vnf, reinterpret_cast<const vnu_u*>(w)[v] & 0xFFFF0000u);
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < kPanelVecs; ++v)
        acc[m][v] = fma_n(xm[m][2 * kp + 1], wv[v], acc[m][v]);
  }
  for (int m = 0; m < MB; ++m) store_panel_row(out + (m0 + m) * N + n0, acc[m]);
}

// One panel of a float32 w (KG = K rows of kPanel floats), rows m0..m0+MB of x [M][K].
template <int MB>
void packed_panel_f32(const void* x, int64_t K, int64_t m0, const void* panel, const char* w_end,
                      int64_t ahead, float* out, int64_t N, int64_t n0) {
  vnf acc[MB][kPanelVecs] = {};
  const float* xm[MB];
  for (int m = 0; m < MB; ++m) xm[m] = static_cast<const float*>(x) + (m0 + m) * K;
  const float* w = static_cast<const float*>(panel);
  for (int64_t k = 0; k < K; ++k, w += kPanel) {
    prefetch_ahead<kPanelLines>(w, ahead, w_end);
    vnf wv[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) wv[v] = reinterpret_cast<const vnf_u*>(w)[v];
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < kPanelVecs; ++v) acc[m][v] = fma_n(xm[m][k], wv[v], acc[m][v]);
  }
  for (int m = 0; m < MB; ++m) store_panel_row(out + (m0 + m) * N + n0, acc[m]);
}

using PackedPanelFn = void (*)(const void*, int64_t, int64_t, const void*, const char*, int64_t,
                               float*, int64_t, int64_t);

// The panel function for mb rows: float32 (F32), else bfloat16 on vdpbf16ps (Dot) or widened.
template <bool F32, bool Dot, int... MB>
PackedPanelFn packed_pick(int mb, std::integer_sequence<int, MB...>) {
  if constexpr (F32) {
    PackedPanelFn fns[] = {packed_panel_f32<MB + 1>...};
    return fns[mb - 1];
  } else {
    PackedPanelFn fns[] = {packed_panel_bf16<MB + 1, Dot>...};
    return fns[mb - 1];
  }
}

}  // namespace
