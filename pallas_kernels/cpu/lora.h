// Multi-LoRA deltas (handler JaxpageLoraMatmul): each row of a step adds its adapter's low-rank
// product to a projection's float32 output, the rows grouped by adapter so that each adapter's
// weights are read once a call (Punica's SGMV "shrink" and "expand", on the CPU's vectors).

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "packed_panels.h"
#include "thread_team.h"

namespace {

// out[t] = y[t] + delta[t], delta[t] = T(x[t] . a[s]) . b[s] for s = slots[t], x [rows, K] and
// the adapters a [S, K, R], b [S, R, N] of one element type T (float32 or bfloat16), y and out
// float32 [rows, N]. Rows with s <= 0 (no adapter) or s >= S (out of contract, never read past
// a or b), and rows from `live` on (a bucket's padding), keep y. Products and sums in float32
// (bfloat16 widened exactly), the intermediate [R] vector rounded once to T (nearest even, as
// PyTorch's bfloat16 lora_B(lora_A(x)) rounds it; float32: unchanged), delta summed from zero
// in r's order and then added to y (as the jnp reference, y + delta).
// - The live rows are counting-sorted by slot, and each slot's rows cut into tiles of up to
//   kLoraRows rows (evenly: 9 rows are 5 + 4, not 8 + 1).
// - Shrink, a tile at a time: tmp[rows, R] = x[rows] . a[s], walking K and keeping the tile's
//   accumulators (rows x up to kLoraVecs vectors of R) in registers, each step broadcasting
//   x[m, k] against the vectors of a[s][k] (read once for all the tile's rows); R past two
//   vectors takes more passes (x's rows are in L1 by then), a partial last vector loads masked.
//   bfloat16 x rows are widened into float32 scratch first.
// - Expand: y[rows, n..] += tmp . b[s][:, n..] for column blocks of up to kLoraVecs vectors,
//   the accumulators again in registers along R, y read and written once.
// Work units are (tile, column chunk): one chunk per tile where there are enough tiles for the
// threads, else N cut into chunks so that a few-row call still spreads (each chunk's unit
// repeats its tile's shrink, bit for bit the same: one function computes it, in one order; a
// chunk is at least K / 2 columns wide, so that the repeats cost at most twice its expand).
// Calls under kLoraSmallWork vector multiply-adds stay on the calling thread (a helper starts
// 3-50 us after it is scheduled, as its thread spins or sleeps). Every output element is one
// unit's, computed by the same sequence of float32 operations whatever the tile's rows, the
// column pass and the thread: the result is the same for any thread count, and each row's is
// what the row alone would give (the tests hold a row of a batch to the row alone, bit for bit).

#ifdef __AVX512F__
constexpr int kLoraRows = 8;  // a tile's rows: 8 x 2 accumulators + 2 weight vectors of 32
#else
constexpr int kLoraRows = 4;  // 4 x 2 + 2 of AVX2's 16
#endif
constexpr int kLoraVecs = 2;  // vectors of R (shrink) or of N (expand) a pass
constexpr int64_t kLoraBlock = kLoraVecs * kLanes;
constexpr auto kLoraRowSeq = std::make_integer_sequence<int, kLoraRows>();
// below this many vector multiply-adds (10-15 us on one core) a call runs on the caller alone
constexpr int64_t kLoraSmallWork = 32768;
constexpr int64_t kLoraMinColumns = 4 * kLoraBlock;  // the narrowest column chunk of a unit
constexpr int64_t kLoraAhead = 4;  // the expand prefetches b this many column blocks ahead

typedef uint16_t vnh_u __attribute__((vector_size(2 * kLanes), aligned(2)));

inline vnf lora_load(const float* p) { return *reinterpret_cast<const vnf_u*>(p); }
// bfloat16 widened by its bits (exact): one zero-extending load and a shift (GCC's lowering of
// the vector extension's conversion took six instructions)
inline vnf lora_load(const bf16* p) {
#if defined(__AVX512F__)
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i wide = _mm512_cvtepu16_epi32(half);
  return __builtin_bit_cast(vnf, _mm512_slli_epi32(wide, 16));
#elif defined(__AVX2__)
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i wide = _mm256_cvtepu16_epi32(half);
  return __builtin_bit_cast(vnf, _mm256_slli_epi32(wide, 16));
#else
  const vnu wide = __builtin_convertvector(*reinterpret_cast<const vnh_u*>(p), vnu) << 16;
  return __builtin_bit_cast(vnf, wide);
#endif
}
inline void lora_store(float* p, vnf v) { *reinterpret_cast<vnf_u*>(p) = v; }

// The first n (1..kLanes - 1) elements at p, the other lanes zero; nothing past them is read.
inline vnf lora_load_part(const float* p, int n) {
#ifdef __AVX512F__
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1u);
  return __builtin_bit_cast(vnf, _mm512_maskz_loadu_ps(mask, p));
#else
  float buf[kLanes] = {};
  std::memcpy(buf, p, n * sizeof(float));
  return lora_load(buf);
#endif
}
inline vnf lora_load_part(const bf16* p, int n) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m256i half = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p);
  return __builtin_bit_cast(vnf, _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
#else
  bf16 buf[kLanes] = {};
  std::memcpy(buf, p, n * sizeof(bf16));
  return lora_load(buf);
#endif
}
// Stores v's first n lanes at p (writes nothing past them).
inline void lora_store_part(float* p, vnf v, int n) {
#ifdef __AVX512F__
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), __builtin_bit_cast(__m512, v));
#else
  float buf[kLanes];
  std::memcpy(buf, &v, sizeof buf);
  std::memcpy(p, buf, n * sizeof(float));
#endif
}

// The shrink's pass over columns r0..r0 + (V - 1) kLanes + tail of R for a tile of MB rows:
// tmp[m][r] = sum_k xr[m][k] a[k][r] (xr: float32 rows of K; a [K][R] of T), float32 FMAs in
// k's order. `Tail`: the last vector holds `tail` (< kLanes) columns, loaded masked. tmp's rows
// are Rp floats apart (R rounded up to kLanes): every vector is stored whole, the lanes past R
// hold what no one reads.
template <typename T, int MB, int V, bool Tail>
void lora_shrink(const float* const* xr, const void* a_, int64_t K, int64_t R, int64_t r0,
                 int tail, float* tmp, int64_t Rp) {
  const T* a = static_cast<const T*>(a_) + r0;
  vnf acc[MB][V] = {};
  for (int64_t k = 0; k < K; ++k, a += R) {
    vnf av[V];
    for (int v = 0; v < V; ++v)
      av[v] = Tail && v == V - 1 ? lora_load_part(a + v * kLanes, tail)
                                 : lora_load(a + v * kLanes);
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < V; ++v) acc[m][v] = fma_n(xr[m][k], av[v], acc[m][v]);
  }
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < V; ++v) lora_store(tmp + m * Rp + r0 + v * kLanes, acc[m][v]);
}

// The expand's block of columns n0..n0 + (V - 1) kLanes + tail for a tile of MB rows:
// yr[m][n] += sum_r tmp[m][r] b[r][n] (b [R][N] of T), the sum from zero in r's order, then
// added to y.
template <typename T, int MB, int V, bool Tail>
void lora_expand(const float* tmp, int64_t Rp, const void* b_, int64_t R, int64_t N, int64_t n0,
                 int tail, float* const* yr) {
  const T* b = static_cast<const T*>(b_) + n0;
  vnf acc[MB][V] = {};
  for (int64_t r = 0; r < R; ++r, b += N) {
    // b's R rows are R streams N apart: each row's line kLoraAhead blocks on is prefetched
    // (5-15% faster at 64 and 512 rows of SmolLM2's qkv, R = 16 and 48, bfloat16)
    __builtin_prefetch(b + kLoraAhead * kLoraBlock, 0, 3);
    vnf bv[V];
    for (int v = 0; v < V; ++v)
      bv[v] = Tail && v == V - 1 ? lora_load_part(b + v * kLanes, tail)
                                 : lora_load(b + v * kLanes);
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < V; ++v) acc[m][v] = fma_n(tmp[m * Rp + r], bv[v], acc[m][v]);
  }
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < V; ++v) {
      float* y = yr[m] + n0 + v * kLanes;
      if (Tail && v == V - 1)
        lora_store_part(y, lora_load_part(y, tail) + acc[m][v], tail);
      else
        lora_store(y, lora_load(y) + acc[m][v]);
    }
}

using LoraShrinkFn = void (*)(const float* const*, const void*, int64_t, int64_t, int64_t, int,
                              float*, int64_t);
using LoraExpandFn = void (*)(const float*, int64_t, const void*, int64_t, int64_t, int64_t, int,
                              float* const*);

// The pass for mb rows (1..kLoraRows), v vectors (1..kLoraVecs), a partial last one or not.
template <typename T, int... MB>
LoraShrinkFn lora_shrink_pick(int mb, int v, bool tail, std::integer_sequence<int, MB...>) {
  static constexpr LoraShrinkFn fns[][kLoraVecs][2] = {
      {{lora_shrink<T, MB + 1, 1, false>, lora_shrink<T, MB + 1, 1, true>},
       {lora_shrink<T, MB + 1, 2, false>, lora_shrink<T, MB + 1, 2, true>}}...};
  return fns[mb - 1][v - 1][tail];
}
template <typename T, int... MB>
LoraExpandFn lora_expand_pick(int mb, int v, bool tail, std::integer_sequence<int, MB...>) {
  static constexpr LoraExpandFn fns[][kLoraVecs][2] = {
      {{lora_expand<T, MB + 1, 1, false>, lora_expand<T, MB + 1, 1, true>},
       {lora_expand<T, MB + 1, 2, false>, lora_expand<T, MB + 1, 2, true>}}...};
  return fns[mb - 1][v - 1][tail];
}

// A pass of up to kLoraBlock columns of `left` remaining: its vectors and the last one's lanes.
struct LoraPass {
  int vecs, tail;
  explicit LoraPass(int64_t left)
      : vecs(static_cast<int>(std::min<int64_t>(kLoraVecs, (left + kLanes - 1) / kLanes))),
        tail(static_cast<int>(std::min<int64_t>(kLanes, left - (vecs - 1) * kLanes))) {}
  bool partial() const { return tail < kLanes; }
};

struct LoraTile {
  int64_t first;  // its rows: order[first..first + rows)
  int32_t slot, rows;
};

struct LoraWork {
  const void* x = nullptr;
  const char* a = nullptr;
  const char* b = nullptr;
  float* out = nullptr;
  bool is_bf16 = false;
  int64_t K = 0, R = 0, N = 0, Rp = 0;
  std::vector<int32_t> order;  // the live rows with an adapter, by slot (then by row)
  std::vector<LoraTile> tiles;
  int64_t chunks = 1, chunk_width = 0;  // a tile's column chunks (units)
  int64_t units = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // unit u: tile u / chunks, columns of chunk u % chunks; `shrunk`: the tile whose shrink tmp
  // holds (a thread's consecutive units of one tile compute it once)
  template <typename T>
  void unit(int64_t u, float* tmp, float* xw, int64_t& shrunk) {
    const int64_t t = u / chunks;
    const LoraTile& tile = tiles[t];
    const int mb = tile.rows;
    float* yr[kLoraRows];
    for (int m = 0; m < mb; ++m) yr[m] = out + order[tile.first + m] * N;
    if (shrunk != t) {
      const float* xr[kLoraRows];
      for (int m = 0; m < mb; ++m) {
        const int64_t row = order[tile.first + m];
        if constexpr (std::is_same_v<T, bf16>) {
          const bf16* xs = static_cast<const bf16*>(x) + row * K;
          float* w = xw + m * K;
          for (int64_t k = 0; k < K; ++k) w[k] = widen(xs[k]);
          xr[m] = w;
        } else {
          xr[m] = static_cast<const float*>(x) + row * K;
        }
      }
      const char* a_s = a + tile.slot * K * R * static_cast<int64_t>(sizeof(T));
      for (int64_t r0 = 0; r0 < R; r0 += kLoraBlock) {
        const LoraPass pass(R - r0);
        lora_shrink_pick<T>(mb, pass.vecs, pass.partial(), kLoraRowSeq)(xr, a_s, K, R, r0,
                                                                          pass.tail, tmp, Rp);
      }
      if constexpr (std::is_same_v<T, bf16>)  // the intermediate in x's type, once
        for (int m = 0; m < mb; ++m)
          for (int64_t r = 0; r < R; ++r) tmp[m * Rp + r] = widen(narrow(tmp[m * Rp + r]));
      shrunk = t;
    }
    const char* b_s = b + tile.slot * R * N * static_cast<int64_t>(sizeof(T));
    const int64_t n1 = std::min(N, (u % chunks + 1) * chunk_width);
    for (int64_t n = (u % chunks) * chunk_width; n < n1; n += kLoraBlock) {
      const LoraPass pass(n1 - n);
      lora_expand_pick<T>(mb, pass.vecs, pass.partial(), kLoraRowSeq)(tmp, Rp, b_s, R, N, n,
                                                                        pass.tail, yr);
    }
  }

  void run() {
    std::vector<float> tmp(static_cast<size_t>(std::max<int64_t>(kLoraRows * Rp, 1)));
    std::vector<float> xw(static_cast<size_t>(is_bf16 ? std::max<int64_t>(kLoraRows * K, 1) : 0));
    int64_t shrunk = -1;
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) {
      if (is_bf16) unit<bf16>(u, tmp.data(), xw.data(), shrunk);
      else unit<float>(u, tmp.data(), xw.data(), shrunk);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error InvalidLora(const std::string& what) {
  return ffi::Error::InvalidArgument("lora matmul: " + what);
}

ffi::Error LoraMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> y, ffi::AnyBuffer x,
                      ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> slots,
                      ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> out) {
  const ffi::DataType type = x.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16)
    return InvalidLora("x is " + type_name(type) + ", not float32 or bfloat16");
  if (a.element_type() != type || b.element_type() != type)
    return InvalidLora("x, a and b must be of one dtype, got " + type_name(type) + ", " +
                       type_name(a.element_type()) + " and " + type_name(b.element_type()));
  const auto yd = y.dimensions(), xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  const auto sd = slots.dimensions(), od = out->dimensions();
  if (yd.size() != 2 || xd.size() != 2 || ad.size() != 3 || bd.size() != 3 || sd.size() != 1)
    return InvalidLora("takes y [T, N], x [T, K], a [S, K, R], b [S, R, N] and slots [T], got y " +
                       shape_string(yd) + ", x " + shape_string(xd) + ", a " + shape_string(ad) +
                       ", b " + shape_string(bd) + " and slots " + shape_string(sd));
  const int64_t T = yd[0], N = yd[1], K = xd[1], S = ad[0], R = ad[2];
  if (xd[0] != T || ad[1] != K || bd[0] != S || bd[1] != R || bd[2] != N || sd[0] != T)
    return InvalidLora("shapes do not agree: y " + shape_string(yd) + " (T, N), x " +
                       shape_string(xd) + " (T, K), a " + shape_string(ad) + " (S, K, R), b " +
                       shape_string(bd) + " (S, R, N), slots " + shape_string(sd) + " (T)");
  if (od.size() != 2 || od[0] != T || od[1] != N)
    return InvalidLora("output " + shape_string(od) + " is not y's " + shape_string(yd));
  if (live.element_count() != 1)
    return InvalidLora("live rows must be one int32, got " + shape_string(live.dimensions()));
  float* o = out->typed_data();
  if (o != y.typed_data() && T * N > 0)  // not aliased (XLA aliases it where it can)
    std::memcpy(o, y.typed_data(), T * N * sizeof(float));
  const int64_t rows = std::clamp<int64_t>(live.typed_data()[0], 0, T);
  if (rows == 0 || N == 0 || S <= 1) return ffi::Error::Success();

  auto work = std::make_shared<LoraWork>();
  // the live rows with an adapter, counting-sorted by slot
  const int32_t* s = slots.typed_data();
  std::vector<int64_t> start(static_cast<size_t>(S + 1), 0);
  for (int64_t t = 0; t < rows; ++t)
    if (s[t] > 0 && s[t] < S) ++start[s[t] + 1];
  for (int64_t i = 1; i <= S; ++i) start[i] += start[i - 1];
  const int64_t count = start[S];
  if (count == 0) return ffi::Error::Success();
  work->order.resize(static_cast<size_t>(count));
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < rows; ++t)
      if (s[t] > 0 && s[t] < S) work->order[fill[s[t]]++] = static_cast<int32_t>(t);
  }
  for (int64_t slot = 1; slot < S; ++slot) {  // each slot's rows in even tiles
    const int64_t n = start[slot + 1] - start[slot];
    if (n == 0) continue;
    const int64_t tiles = (n + kLoraRows - 1) / kLoraRows;
    for (int64_t i = 0, first = start[slot]; i < tiles; ++i) {
      const int32_t tile_rows = static_cast<int32_t>(n / tiles + (i < n % tiles));
      work->tiles.push_back(LoraTile{first, static_cast<int32_t>(slot), tile_rows});
      first += tile_rows;
    }
  }
  work->x = x.untyped_data();
  work->a = static_cast<const char*>(a.untyped_data());
  work->b = static_cast<const char*>(b.untyped_data());
  work->out = o;
  work->is_bf16 = type == ffi::DataType::BF16;
  work->K = K, work->R = R, work->N = N;
  work->Rp = (R + kLanes - 1) / kLanes * kLanes;

  const int64_t tiles = static_cast<int64_t>(work->tiles.size());
  const int64_t threads = thread_count(pool);
  const int64_t fmas = count * (K + N) * (work->Rp / kLanes);  // vector multiply-adds
  const bool alone = threads == 1 || fmas < kLoraSmallWork;
  // few tiles for the threads: each cut into column chunks, each chunk's unit repeating the
  // tile's shrink (K R per row), so at least K / 2 columns (an expand of half that) and
  // kLoraMinColumns
  int64_t chunks = 1;
  if (!alone && tiles < 2 * threads)
    chunks = std::max<int64_t>(1, std::min((2 * threads + tiles - 1) / tiles,
                                           N / std::max(kLoraMinColumns, K / 2)));
  work->chunk_width = (N + chunks - 1) / chunks;
  work->chunk_width = (work->chunk_width + kLoraBlock - 1) / kLoraBlock * kLoraBlock;
  work->chunks = (N + work->chunk_width - 1) / work->chunk_width;
  work->units = tiles * work->chunks;
  if (alone) run_units(*work);  // the one copy of run(), as the helpers' (thread_team.h)
  else run_shared(pool, work, work->units);
  return ffi::Error::Success();
}

}  // namespace
