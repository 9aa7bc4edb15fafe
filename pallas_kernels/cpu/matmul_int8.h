// The vector panels of packed int8 weights (weight-only quantization), which matmul_packed.h's
// PackedWork runs over a call's rows as it runs the float panels.

#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"
#include "packed_panels.h"

namespace {

// Packed int8 matmuls (handler JaxpagePackedMatmulInt8): out[M, N] float32 = (x[M, K] . w) *
// scale[N], x float32 or bfloat16, w int8 with a float32 scale per column (a weight quantized
// per output channel), packed once (pallas_kernels.cpu_ops.pack_weight_int8) as float32 is,
// [P][K][kPanel][1]: P panels of kPanel columns, each K rows of kPanel bytes, one sequential
// stream of a quarter of float32's bytes and half of bfloat16's. A decode step is a read of its
// weights, so this is what makes it faster: each panel row is widened in registers (int8 ->
// int32 -> float32, exact) and multiplied as the float32 panel's (a float32 FMA a k, k by k,
// into accumulators that stay in registers along K), and each column's sum is multiplied by
// its scale once, at the end. bfloat16 x is widened to float32 once a call (exact), so every
// product is float32's (no vdpbf16ps: its pairs would need each widened int8 narrowed again).
//
// Widening costs vector instructions that the float panels do not have (two conversions a
// vector), and a row's FMAs depend on each other in k's order: with one or two rows a pass the
// latency of that chain, not memory, bounds a panel (AVX2's 16-byte int8 rows: ~4 B a cycle
// against the ~8 a core needs to keep up with memory). So passes of 1-3 rows sum k in `chains`
// interleaved chains (k mod C), added together at the end: more FMAs in flight, and sums in
// another order than a single chain's (within the same float32 bound). From 4 rows on one chain:
// enough FMAs are in flight, and the sums are the float32 panel's on the widened weight, bit
// for bit (the multi-pass path below relies on it only in that its passes are all of 4+ rows).
//
// Rows past one pass (prefill) would widen each panel once a pass; instead each panel is
// widened once into a float32 scratch panel of the thread's (K x kPanel floats, in L2), and the
// passes read that as the float32 panels read a float32 weight from cache, with the same sums.

constexpr int64_t kInt8RowsPerLine = 64 / kPanel;  // panel rows a cache line: 2 (AVX-512) or 4

// the interleaved k chains of a pass of MB rows: enough accumulators (MB x kPanelVecs a chain)
// in flight for two FMA units of 4 cycles' latency, within the registers (AVX2's 16 hold 3 x 2
// x 2 accumulators, a panel row and a broadcast)
constexpr int int8_chains(int MB) { return MB == 1 ? 4 : MB <= 3 ? 2 : 1; }

// a panel row of int8 widened to floats, kLanes bytes a vector: vpmovsxbd and vcvtdq2ps
// (GCC's __builtin_convertvector of int8 to float converts one lane at a time)
inline void load_panel_row(const int8_t* w, vnf* wv) {
  for (int v = 0; v < kPanelVecs; ++v) {
#if defined(__AVX512F__)
    wv[v] = __builtin_bit_cast(vnf, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w)))));
#elif defined(__AVX2__)
    wv[v] = __builtin_bit_cast(vnf, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)))));
#else
    for (int i = 0; i < kLanes; ++i) wv[v][i] = static_cast<float>(w[i]);
#endif
    w += kLanes;
  }
}
inline void load_panel_row(const float* w, vnf* wv) {
  for (int v = 0; v < kPanelVecs; ++v) wv[v] = reinterpret_cast<const vnf_u*>(w)[v];
}

// One panel of an int8 w (W = int8_t: read from the packed weight, prefetched `ahead` bytes in
// its stream) or of its widened scratch copy (W = float: in cache, not prefetched); rows
// m0..m0+MB of x, float32 [M][K]; out columns n0..n0+kPanel, each times its scale.
template <int MB, typename W>
void packed_panel_int8(const float* x, int64_t K, int64_t m0, const void* panel,
                       const char* w_end, int64_t ahead, const float* scale, float* out,
                       int64_t N, int64_t n0) {
  constexpr int C = int8_chains(MB);
  // panel rows a step: whole cache lines of int8 (one prefetch a step), and a multiple of C
  constexpr int64_t S = std::max<int64_t>(C, kInt8RowsPerLine);
  constexpr bool stream = std::is_same_v<W, int8_t>;
  vnf acc[C][MB][kPanelVecs] = {};
  const float* xm[MB];
  for (int m = 0; m < MB; ++m) xm[m] = x + (m0 + m) * K;
  const W* w = static_cast<const W*>(panel);
  int64_t k = 0;
  for (; k + S <= K; k += S, w += S * kPanel) {
    if constexpr (stream) prefetch_ahead<S * kPanel / 64>(w, ahead, w_end);
#pragma GCC unroll 4
    for (int r = 0; r < S; ++r) {
      vnf wv[kPanelVecs];
      load_panel_row(w + r * kPanel, wv);
      for (int m = 0; m < MB; ++m)
        for (int v = 0; v < kPanelVecs; ++v)
          acc[r % C][m][v] = fma_n(xm[m][k + r], wv[v], acc[r % C][m][v]);
    }
  }
  for (; k < K; ++k, w += kPanel) {  // K's last rows short of a step: chain 0 in k's order
    vnf wv[kPanelVecs];
    load_panel_row(w, wv);
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < kPanelVecs; ++v) acc[0][m][v] = fma_n(xm[m][k], wv[v], acc[0][m][v]);
  }
  vnf s[kPanelVecs];
  load_panel_row(scale + n0, s);
  for (int m = 0; m < MB; ++m) {
    vnf sum[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) {
      sum[v] = acc[0][m][v];
      for (int c = 1; c < C; ++c) sum[v] += acc[c][m][v];
      sum[v] *= s[v];
    }
    store_panel_row(out + (m0 + m) * N + n0, sum);
  }
}

// A panel of K int8 rows widened to float32 into `wide` (K x kPanel floats), read as a stream.
inline void widen_panel_int8(const int8_t* w, int64_t K, const char* w_end, int64_t ahead,
                             float* wide) {
  int64_t k = 0;
  for (; k + kInt8RowsPerLine <= K; k += kInt8RowsPerLine) {
    prefetch_ahead(w + k * kPanel, ahead, w_end);
    for (int64_t r = k; r < k + kInt8RowsPerLine; ++r) {
      vnf wv[kPanelVecs];
      load_panel_row(w + r * kPanel, wv);
      store_panel_row(wide + r * kPanel, wv);
    }
  }
  for (; k < K; ++k) {
    vnf wv[kPanelVecs];
    load_panel_row(w + k * kPanel, wv);
    store_panel_row(wide + k * kPanel, wv);
  }
}

using Int8PanelFn = void (*)(const float*, int64_t, int64_t, const void*, const char*, int64_t,
                             const float*, float*, int64_t, int64_t);

// The int8 panel function for mb rows, reading int8 (Wide = false) or a widened scratch panel.
template <bool Wide, int... MB>
Int8PanelFn int8_pick(int mb, std::integer_sequence<int, MB...>) {
  using W = std::conditional_t<Wide, float, int8_t>;
  Int8PanelFn fns[] = {packed_panel_int8<MB + 1, W>...};
  return fns[mb - 1];
}

// The calling thread's scratch panel for K rows (grown as needed, kept for the thread's life:
// XLA's pool threads serve every call).
inline float* int8_scratch(int64_t K) {
  thread_local std::vector<float> wide;
  if (static_cast<int64_t>(wide.size()) < K * kPanel) wide.resize(static_cast<size_t>(K * kPanel));
  return wide.data();
}

}  // namespace
