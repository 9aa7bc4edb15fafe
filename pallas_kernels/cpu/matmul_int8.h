// The vector panels of packed int8 weights (weight-only quantization), which matmul_packed.h's
// PackedWork runs over a call's rows as it runs the float panels.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"
#include "packed_panels.h"

namespace {

// Packed int8 matmuls (handler JaxpagePackedMatmulInt8): out[M, N] float32 = (x[M, K] . w) *
// scale[N], x float32 or bfloat16, w int8 with a float32 scale per column (a weight quantized
// per output channel), packed once (pallas_kernels.cpu_ops.pack_weight_int8) as bfloat16 is,
// [P][KG][kPanel][2]: P panels of kPanel columns, each KG = ceil(K / 2) pairs of rows, a pair's
// two rows interleaved column by column (an odd K's last pair has a zero second row): one
// sequential stream of half of bfloat16's bytes. A decode step is a read of its weights, so this
// is what makes it faster, if the arithmetic keeps up with the halved bytes.
//
// Widening each int8 to float32 (vpmovsxbd + vcvtdq2ps) and multiplying by float32 FMAs did
// not: three vector instructions for 16 weights, ~24 G weights a second a core on an AMD EPYC
// (Zen 4) from L1, below its memory's rate on two cores and 2x slower than vdpbf16ps at 64
// rows. So the products are integers: each row of x is scaled to int16 (x_q = rint(x * 32767 /
// a), a = max|x|, and a scale s = a / 32767 a row: `quantize_rows`), and a panel pair row
// widened to int16 (vpmovsxbw, 32 weights a vector) is multiplied by x_q's broadcast pair and
// summed pairwise into int32 lanes (vpdpwssd with AVX512-VNNI or AVX-VNNI, else vpmaddwd +
// vpaddd): 32 multiply-adds an instruction, as vdpbf16ps does, exact. A lane's pair adds at
// most 2 * 32767 * 128 < 2^23, so the int32 sums run over chunks of kInt8ChunkPairs = 128
// pairs (< 2^30) and each chunk is converted and added to a float32 sum; each column's sum is
// times (s times its scale).
//
// The only error beyond float32's roundings is x's: |x - s x_q| <= ~s / 2 an element, so a
// column is off by at most s / 2 * sum_k |w[k, n]| times its scale: relative to max|x|, 2^-16,
// below the bfloat16 rounding of the activations that follow (and far below int8 weights' own
// error). A row with a NaN or an inf has no such scale: its outputs are NaN. Integer sums are
// exact, so the result does not depend on how the chains or the rows' passes split the work:
// bit for bit `quantize_rows`' integers summed in chunks, for any rows, threads and prefetch
// distance.
//
// Passes of 1-3 rows sum k in `int8_chains` interleaved chains (k mod C; integers, so in any
// order) to keep enough multiply-adds in flight; rows past one pass (prefill) make more passes
// over each panel, widening it again from cache (L2) each pass.

constexpr float kInt8XLevels = 32767.0f;     // x_q in [-32767, 32767]
constexpr int64_t kInt8ChunkPairs = 128;     // pairs an int32 lane sums before it goes to float

// the interleaved k chains of a pass of MB rows: enough accumulators (MB x kPanelVecs a chain)
// in flight for the multiply-adds' latency
constexpr int int8_chains(int MB) { return MB == 1 ? 4 : MB <= 3 ? 2 : 1; }

// A panel pair row's vector of kLanes columns as int16 pairs (`vni`), and the multiply-add of
// such a vector by a broadcast pair of x_q into int32 lanes.
#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef __m512i vni;
inline vni widen_pairs(const int8_t* w) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
inline vni pair_dot(vni acc, vni x, vni w) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, x, w);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w));
#endif
}
inline vni broadcast_pair(uint32_t x) { return _mm512_set1_epi32(static_cast<int32_t>(x)); }
inline vni add_lanes(vni a, vni b) { return _mm512_add_epi32(a, b); }
inline vnf lanes_to_float(vni a) { return __builtin_bit_cast(vnf, _mm512_cvtepi32_ps(a)); }
#elif defined(__AVX2__) && !defined(__AVX512F__)
typedef __m256i vni;
inline vni widen_pairs(const int8_t* w) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}
inline vni pair_dot(vni acc, vni x, vni w) {
#ifdef __AVXVNNI__
  return _mm256_dpwssd_avx_epi32(acc, x, w);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w));
#endif
}
inline vni broadcast_pair(uint32_t x) { return _mm256_set1_epi32(static_cast<int32_t>(x)); }
inline vni add_lanes(vni a, vni b) { return _mm256_add_epi32(a, b); }
inline vnf lanes_to_float(vni a) { return __builtin_bit_cast(vnf, _mm256_cvtepi32_ps(a)); }
#else
// anywhere else (or AVX-512 without its byte and word instructions): the same lanes in GCC's
// vectors; a lane's pair is int16 elements 2 c and 2 c + 1
typedef int16_t vns __attribute__((vector_size(4 * kLanes)));
typedef int32_t vni __attribute__((vector_size(4 * kLanes)));
inline vns widen_pairs(const int8_t* w) {
  vns out;
  for (int i = 0; i < 2 * kLanes; ++i) out[i] = w[i];
  return out;
}
inline vni pair_dot(vni acc, uint32_t x, vns w) {
  const int32_t lo = static_cast<int16_t>(x & 0xFFFF), hi = static_cast<int16_t>(x >> 16);
  for (int i = 0; i < kLanes; ++i) acc[i] += lo * w[2 * i] + hi * w[2 * i + 1];
  return acc;
}
inline uint32_t broadcast_pair(uint32_t x) { return x; }
inline vni add_lanes(vni a, vni b) { return a + b; }
inline vnf lanes_to_float(vni a) { return __builtin_convertvector(a, vnf); }
#endif

// Rows [0, rows) of x (float32, or bfloat16 widened) as int16, xq[m][0, 2 KG) = x_q[m] (an
// odd K's last element 0): x_q = rint(x * (32767 / a)) in float32 (the quotient rounded first),
// a = max|x[m]|, and the row's scale s[m] = a / 32767 (rounded). A row of zeros, or whose a is
// below 2^-100 (its products are below any activation's): s = 0, x_q = 0; a row with a NaN or
// an inf: s = NaN, x_q = 0. Loops GCC vectorizes (the float64 arithmetic of a first version
// cost ~1 ms a call at 256 rows of K = 1536, on the calling thread).
template <typename X>
void quantize_rows(const X* x, int64_t rows, int64_t K, int16_t* xq, float* s) {
  const int64_t KG = (K + 1) / 2;
  for (int64_t m = 0; m < rows; ++m) {
    const X* xm = x + m * K;
    int16_t* out = xq + m * 2 * KG;
    float amax = 0.0f;
    uint32_t bad = 0;  // an exponent of all ones (a NaN or an inf) seen: by the bits, which no
                       // flag (-fassociative-math) lets the compiler reason away
#pragma omp simd reduction(max : amax) reduction(| : bad)
    for (int64_t k = 0; k < K; ++k) {
      const float v = to_float(xm[k]);
      amax = std::max(amax, std::fabs(v));
      bad |= (__builtin_bit_cast(uint32_t, v) & 0x7F800000u) == 0x7F800000u;
    }
    if (bad || !(amax >= 0x1p-100f)) {
      std::fill(out, out + 2 * KG, int16_t{0});
      s[m] = bad ? NAN : 0.0f;
      continue;
    }
    const float inv = kInt8XLevels / amax;
    for (int64_t k = 0; k < K; ++k)
      out[k] = static_cast<int16_t>(std::nearbyint(to_float(xm[k]) * inv));
    if (K % 2) out[K] = 0;
    s[m] = amax / kInt8XLevels;
  }
}

// x_q's pair (x_q[2j], x_q[2j + 1]) at `at`, low half first
inline uint32_t x_pair(const int16_t* at) {
  uint32_t pair;
  std::memcpy(&pair, at, sizeof pair);
  return pair;
}

// One panel of an int8 w (KG pair rows of 2 kPanel bytes, prefetched `ahead` bytes in its
// stream): rows m0..m0+MB of xq [M][2 KG] (scales xs), out columns n0..n0+kPanel, each times
// its scale.
template <int MB>
void packed_panel_int8(const int16_t* xq, int64_t KG, int64_t m0, const void* panel,
                       const char* w_end, int64_t ahead, const float* xs, const float* scale,
                       float* out, int64_t N, int64_t n0) {
  constexpr int C = int8_chains(MB);
  constexpr int64_t kPairBytes = 2 * kPanel;                        // a pair row of the panel
  constexpr int64_t S = std::max<int64_t>(C, 64 / kPairBytes);     // pair rows a step
  static_assert(kInt8ChunkPairs % S == 0);
  const int16_t* xm[MB];
  for (int m = 0; m < MB; ++m) xm[m] = xq + (m0 + m) * 2 * KG;
  const int8_t* w = static_cast<const int8_t*>(panel);
  vnf sum[MB][kPanelVecs] = {};
  for (int64_t k0 = 0; k0 < KG; k0 += kInt8ChunkPairs) {
    const int64_t k1 = std::min(KG, k0 + kInt8ChunkPairs);
    vni acc[C][MB][kPanelVecs];
    for (int c = 0; c < C; ++c)
      for (int m = 0; m < MB; ++m)
        for (int v = 0; v < kPanelVecs; ++v) acc[c][m][v] = vni{};
    int64_t k = k0;
    for (; k + S <= k1; k += S) {
      prefetch_ahead<S * kPairBytes / 64>(w + k * kPairBytes, ahead, w_end);
#pragma GCC unroll 4
      for (int r = 0; r < S; ++r) {
        const int8_t* row = w + (k + r) * kPairBytes;
        decltype(widen_pairs(row)) wv[kPanelVecs];
        for (int v = 0; v < kPanelVecs; ++v) wv[v] = widen_pairs(row + v * 2 * kLanes);
        for (int m = 0; m < MB; ++m) {
          const auto xv = broadcast_pair(x_pair(xm[m] + 2 * (k + r)));
          for (int v = 0; v < kPanelVecs; ++v)
            acc[r % C][m][v] = pair_dot(acc[r % C][m][v], xv, wv[v]);
        }
      }
    }
    for (; k < k1; ++k) {  // the chunk's last pair rows short of a step
      const int8_t* row = w + k * kPairBytes;
      decltype(widen_pairs(row)) wv[kPanelVecs];
      for (int v = 0; v < kPanelVecs; ++v) wv[v] = widen_pairs(row + v * 2 * kLanes);
      for (int m = 0; m < MB; ++m) {
        const auto xv = broadcast_pair(x_pair(xm[m] + 2 * k));
        for (int v = 0; v < kPanelVecs; ++v) acc[0][m][v] = pair_dot(acc[0][m][v], xv, wv[v]);
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < kPanelVecs; ++v) {
        vni lanes = acc[0][m][v];
        for (int c = 1; c < C; ++c) lanes = add_lanes(lanes, acc[c][m][v]);
        sum[m][v] += lanes_to_float(lanes);
      }
  }
  // each sum times (its column's scale times its row's), that product rounded first: held in
  // memory the compiler cannot see through, so that -fassociative-math cannot regroup the two
  // multiplies (it did, differently for different MB)
  for (int m = 0; m < MB; ++m) {
    vnf both[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v)
      both[v] = reinterpret_cast<const vnf_u*>(scale + n0)[v] * xs[m0 + m];
    asm volatile("" : "+m"(both));
    for (int v = 0; v < kPanelVecs; ++v) sum[m][v] *= both[v];
    store_panel_row(out + (m0 + m) * N + n0, sum[m]);
  }
}

using Int8PanelFn = void (*)(const int16_t*, int64_t, int64_t, const void*, const char*, int64_t,
                             const float*, const float*, float*, int64_t, int64_t);

// The int8 panel function for mb rows.
template <int... MB>
Int8PanelFn int8_pick(int mb, std::integer_sequence<int, MB...>) {
  Int8PanelFn fns[] = {packed_panel_int8<MB + 1>...};
  return fns[mb - 1];
}

}  // namespace
