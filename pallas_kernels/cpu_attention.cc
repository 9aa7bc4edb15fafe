// Paged attention on CPU as an XLA FFI custom call: K/V are read where they lie in the pool.
//
// Same contract as pallas_kernels/reference.py (`paged_attention_reference`): a ragged,
// token-flat batch of T queries from S sequences, each sequence's queries being its last
// tokens, attending causally to everything the sequence has in the pool. XLA:CPU cannot fuse
// a gather into a contraction, so the jnp path copies every block it reads into a buffer
// first; here each (sequence, KV head, query tile) work item walks its block table and
// contracts each [block_size, head_dim] tile of K and V in place, with an online softmax.
// Work items are shared among XLA's intra-op threads.
//
// Attributes `sliding_window` (a query at p sees keys (p - window, p]; 0: off) and `soft_cap`
// (scores -> cap * tanh(scores / cap), Gemma 2; 0: off): an item's block loop starts at the
// block of the first key its earliest query sees, so a sliding layer reads only its window and
// never the blocks before it, whose table entries may name anything (the engine frees them).
//
// Pools are float32, bfloat16 (for both, the output is in q's dtype, which the wrapper makes
// the pools') or quantized (below). bfloat16 tiles are read where they lie too, two ways,
// chosen per call by the `bf16_dot` attribute:
// - dot (bf16_dot = 1, built only where the compiler targets AVX512-BF16, i.e. -march=native
//   on a CPU that has it: `__AVX512BF16__`): q.K and P.V on `vdpbf16ps` (bf16 pairs
//   multiplied exactly, summed in float32). q and K enter as they are (the scale multiplies
//   the float32 score); the probabilities P are rounded to bfloat16 (nearest even) before
//   P.V, as flash attention does on accelerators; the softmax (max, exp, denominator,
//   correction) and the accumulator stay float32. (vdpbf16ps also flushes subnormal inputs
//   and results to zero: below 1.2e-38, nothing attention sees.) Only the compiled
//   (head_dim, block_size) pairs take it; other sizes take the portable path.
// - portable (bf16_dot = 0, or no AVX512-BF16): each K/V tile is widened to float32 (bf16 is
//   the top half of a float32: a 16-bit shift, exact) and the float32 code runs on it, so
//   nothing is rounded but the output.
// Either way the output is rounded to bfloat16 (nearest even) once, at the end.
//
// Quantized pools (pallas_kernels/quantized.py, handler JaxpagePagedAttentionQuantized): K and
// V values [K, NB, B, D] of one storage type, int8, float8_e4m3fn or float8_e5m2, each with
// float32 scales [K, NB, B]; q and the output float32. Position p of head h reads
// float32(values[h, p]) * scales[h, p] (quantized.dequantize), nothing else: as on the portable
// bfloat16 path, each K/V tile is converted into float32 scratch, all B slots (int8 by a cast,
// float8 through a 256-entry table of the format's values built once, exact, with NaN and inf
// where the format has them: e4m3fn NaN at 0x7f and 0xff and no inf, e5m2 IEEE-like), each
// slot's row multiplied by its scale (one float32 multiply), and the float32 code runs on it.
// So the output is, bit for bit, the float32 kernel's on the dequantized pool. Unowned slots
// may have NaN scales (NaN rows); they are masked by position like any pool's.
//
// Built on first use by pallas_kernels/cpu_attention.py (g++ -O3 -march=native).

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kMaxTile = 256;  // largest head_dim and block_size served

// exp(x) for x <= 0, written so that loops over it vectorize (no libm call): Cephes' expf
// polynomial on [-ln2/2, ln2/2] times 2^n. Inputs below -87 give ~1e-38 instead of smaller.
//
// Free of undefined behaviour for every float, since the softmax also feeds it the garbage
// scores of masked key slots (NaN, +-inf, anything; their results are selected away after):
// - the clamp is a select whose comparison is false for NaN, so NaN (and -inf) become -87
//   (std::max(x, -87.0f) would pass NaN through: it returns its first argument when the
//   comparison fails);
// - 2^n is built without converting a float to an int (undefined when the value is out of
//   int32's range: NaN, +inf, a huge x): n, an integer-valued float, is added to 1.5 * 2^23,
//   whose low mantissa bits then hold n in two's complement (exact for |n| < 2^22), and the
//   exponent field is shifted out of those bits as an unsigned value, so it only wraps.
// For x in [-87, 0] the result is bit for bit what a static_cast<int32_t>(n) gives, at the
// same cost (no second clamp: measured, one more select slowed the softmax step by 15-20%);
// x up to ~88 still gives exp(x); above, x is out of contract (masked slots only) and the
// result is a defined but meaningless float.
inline float exp_nonpositive(float x) {
  x = x > -87.0f ? x : -87.0f;  // NaN -> -87
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const uint32_t n_bits = __builtin_bit_cast(uint32_t, n + 12582912.0f);  // 0x4B400000 + n
  const uint32_t bits = (n_bits + 127u) << 23;  // (n + 127) << 23: 0x4B400000 << 23 wraps to 0
  return y * __builtin_bit_cast(float, bits);
}

using bf16 = uint16_t;  // a bfloat16's bits: the top half of a float32's

inline float widen(bf16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

// float32 -> bfloat16, rounding to nearest even; NaN stays a (quiet) NaN.
inline bf16 narrow(float x) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((bits >> 16) | 0x40u);
  return static_cast<bf16>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return widen(x); }
template <typename T>
inline T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) return x; else return narrow(x);
}

// Quantized pools' element types (one byte each): int8_t, and the two float8 formats' bits.
struct E4M3 { uint8_t bits; };  // float8_e4m3fn: bias 7, no inf, NaN at 0x7f and 0xff
struct E5M2 { uint8_t bits; };  // float8_e5m2: bias 15, IEEE-like (inf and NaN at exponent 31)
static_assert(sizeof(E4M3) == 1 && sizeof(E5M2) == 1, "float8 elements are one byte");
template <typename T>
constexpr bool kQuantized =
    std::is_same_v<T, int8_t> || std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>;

// q and the output: bfloat16 for bfloat16 pools, else float32 (quantized pools included).
template <typename T>
using io_t = std::conditional_t<std::is_same_v<T, bf16>, bf16, float>;

// The float32 value of each of a float8 format's 256 bit patterns (exact: every float8 value
// is a float32), NaN and inf where the format has them.
struct Float8Table {
  float value[256];
  Float8Table(int exp_bits, int man_bits, bool ieee_specials) {
    const int bias = (1 << (exp_bits - 1)) - 1, exp_max = (1 << exp_bits) - 1;
    const int man_max = (1 << man_bits) - 1;
    for (int bits = 0; bits < 256; ++bits) {
      const int e = (bits >> man_bits) & exp_max, m = bits & man_max;
      float magnitude;
      if (ieee_specials && e == exp_max)  // e5m2: inf (m = 0) and NaN
        magnitude = m ? std::numeric_limits<float>::quiet_NaN()
                      : std::numeric_limits<float>::infinity();
      else if (!ieee_specials && e == exp_max && m == man_max)  // e4m3fn: S.1111.111 is NaN
        magnitude = std::numeric_limits<float>::quiet_NaN();
      else if (e == 0)  // subnormal: m * 2^(1 - bias - man_bits)
        magnitude = std::ldexp(static_cast<float>(m), 1 - bias - man_bits);
      else  // (2^man_bits + m) * 2^(e - bias - man_bits)
        magnitude = std::ldexp(static_cast<float>((1 << man_bits) + m), e - bias - man_bits);
      value[bits] = bits & 0x80 ? -magnitude : magnitude;
    }
  }
};

template <typename T>
const float* float8_table() {
  static_assert(std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>);
  // built on first use (thread-safe: a function-local static), once per process
  if constexpr (std::is_same_v<T, E4M3>) {
    static const Float8Table table(4, 3, false);
    return table.value;
  } else {
    static const Float8Table table(5, 2, true);
    return table.value;
  }
}

// A K or V tile of B slots by D read into float32 scratch for the float32 code: bfloat16
// widened (exact); quantized values converted exactly (int8: a cast; float8: the table) and
// each slot's row times its scale, one float32 multiply: quantized.dequantize's arithmetic,
// so the tile equals the dequantized pool's bit for bit. All B slots are converted: those
// past a tile's valid keys may hold anything (a NaN scale makes their row NaN) and are masked
// by position as in a float32 pool.
template <typename T>
inline void widen_tile(const T* __restrict src, const float* __restrict scales, int64_t B,
                       int64_t D, float* __restrict dst) {
  if constexpr (std::is_same_v<T, bf16>) {
#pragma omp simd
    for (int64_t i = 0; i < B * D; ++i) dst[i] = widen(src[i]);
  } else if constexpr (std::is_same_v<T, int8_t>) {
    for (int64_t t = 0; t < B; ++t) {
      const float s = scales[t];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[t * D + d] = static_cast<float>(src[t * D + d]) * s;
    }
  } else {
    const float* __restrict table = float8_table<T>();
    for (int64_t t = 0; t < B; ++t) {
      const float s = scales[t];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[t * D + d] = table[src[t * D + d].bits] * s;
    }
  }
}

// q and out point at float (float32 and quantized pools) or bf16 elements (bfloat16 pools);
// k and v at the pools' elements (float, bf16, int8_t, E4M3 or E5M2).
struct Problem {
  const void* q;         // [T, H, D]
  const void* k;         // [K, NB, B, D]
  const void* v;         // [K, NB, B, D]
  const float* k_scales; // [K, NB, B]: quantized pools' scales (else null)
  const float* v_scales; // [K, NB, B]
  const int32_t* tables; // [S, MB]
  const int32_t* lens;   // [S]
  const int32_t* qsl;    // [S + 1]
  void* out;             // [T, H, D]
  int64_t num_heads, head_dim, num_kv_heads, num_blocks, block_size, max_blocks, group;
  float scale;
  int64_t window;  // sliding window: a query at p sees keys (p - window, p]; 0: all keys
  float soft_cap;  // scores -> soft_cap * tanh(scores / soft_cap) (Gemma 2); 0: off
  float* partials = nullptr;  // key splits' sums (`Item::part`; see split_keys)
};

// The first key a query at `pos` sees. Blocks wholly before it are never read: a sliding
// layer's pool frees them, and their table entries may name any block.
inline int64_t first_key(const Problem& P, int64_t pos) {
  return P.window ? std::max<int64_t>(0, pos - P.window + 1) : 0;
}

// The key slots [begin, end) of the block whose first key is key0 (slots [0, valid) hold
// keys) that a query at `pos` sees; none when end <= begin.
struct Span {
  int64_t begin, end;
  bool empty() const { return end <= begin; }
};
inline Span visible(const Problem& P, int64_t pos, int64_t key0, int64_t valid) {
  return {std::max<int64_t>(0, first_key(P, pos) - key0), std::min<int64_t>(valid, pos + 1 - key0)};
}

// One work item: KV head `head` of sequence `seq`, its queries [tok_begin, tok_end) counted
// from the sequence's first query; a key split (part >= 0) only the blocks [block_begin,
// block_end) of those its queries see, its sums left in the partials for combine_splits.
struct Item {
  int32_t seq, head, tok_begin, tok_end;
  int64_t cost;
  int32_t part = -1;
  int32_t block_begin = 0, block_end = 0;
};

struct Scratch {
  const Item* next = nullptr;          // the item this thread runs next (claimed), if any
  std::vector<float> q, acc, row_max, denom, kt, scores, probs;
  std::vector<int32_t> pos;
  std::vector<float> kf, vf;           // bf16 portable / quantized: the K/V tile in float32
  std::vector<bf16> q16;               // dot path: the rows' queries
  std::vector<uint32_t> kpairs, vpairs; // dot path: K and V tiles as bf16 pairs
};

// Tiles of the next blocks are prefetched into L2 (locality 1): the hardware prefetcher does
// not follow a block table. Measured on 30 layers of a b64 decode step over scattered blocks:
// 60 -> 47 ms; into L1 no better than none; 4 or 8 blocks ahead no better than 2. (Decode
// items now spread theirs out: TilePump, below; prefill tiles issue them at once.)
constexpr int64_t kPrefetchBlocks = 2;

template <typename T>
inline void prefetch_tile(const T* tile, int64_t elements) {
  const char* p = reinterpret_cast<const char*>(tile);
  for (int64_t i = 0; i < elements * int64_t{sizeof(T)}; i += 64) __builtin_prefetch(p + i, 0, 1);
}

// Prefetch pool block `block`'s K and V tiles (none for an entry outside the pool).
template <typename T>
inline void prefetch_block(const Problem& P, int32_t block, const T* k_head, const T* v_head,
                           int64_t tile) {
  if (block >= 0 && block < P.num_blocks) {
    prefetch_tile(k_head + block * tile, tile);
    prefetch_tile(v_head + block * tile, tile);
  }
}

// Prefetch the tiles of the next blocks of a sequence's table (after block j of the item's
// blocks [first, n)), where k_head and v_head are the pools of the item's KV head and a tile
// holds `tile` elements.
template <typename T>
inline void prefetch_blocks(const Problem& P, const int32_t* table, int64_t j, int64_t first,
                            int64_t n, const T* k_head, const T* v_head, int64_t tile) {
  for (int64_t ahead = j == first ? 1 : kPrefetchBlocks; ahead <= kPrefetchBlocks; ++ahead) {
    if (j + ahead >= n) break;
    prefetch_block(P, table[j + ahead], k_head, v_head, tile);
  }
}

// The blocks an item reads: [first, n) of its sequence's row of the block tables (the first
// its first row sees: rows are in position order; up to the last key its last row sees).
struct ItemBlocks {
  const int32_t* table;
  int64_t first, n;
};
inline ItemBlocks item_blocks(const Problem& P, const Item& it) {
  const int32_t q_len = P.qsl[it.seq + 1] - P.qsl[it.seq];
  const int64_t first_pos = P.lens[it.seq] - q_len;  // position of the sequence's first query
  const int64_t reach = first_pos + it.tok_end;      // keys [0, reach) are visible to some row
  ItemBlocks b{P.tables + static_cast<int64_t>(it.seq) * P.max_blocks,
               first_key(P, first_pos + it.tok_begin) / P.block_size,
               (reach + P.block_size - 1) / P.block_size};
  if (it.part >= 0) {
    b.first = std::max<int64_t>(b.first, it.block_begin);
    b.n = std::min<int64_t>(b.n, it.block_end);
  }
  return b;
}

// Decode items (few rows, little arithmetic a block) prefetch differently: issued all at once,
// a block's 64 or more prefetches fill the core's queue of misses and stall it until most have
// arrived, so the block after next is prefetched a share at a time between the rows' dot
// products (`step`), and the next block at once only at an item's first block. Measured on 30
// layers of 32 decode sequences (bfloat16, 9 scattered blocks each): 13.3 -> 8.8 ms. Past an
// item's last blocks the pump goes on into the first blocks of the item its thread runs next,
// whose first block was otherwise read on demand (decode b8-b64, bfloat16 and float32 on a
// Zen 3: 24 of 32 alternating runs faster, by ~4-10% at the median).
struct TilePump {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t lines = 0, issued = 0;  // of each tile; issued counts K's lines, then V's

  // at block j of an item's blocks [first, n) of the tables' row `table`, k_head and v_head
  // the pools of its KV head (tiles of `tile` elements); `next`: the thread's next item or null
  template <typename T>
  void aim(const Problem& P, const int32_t* table, int64_t j, int64_t first, int64_t n,
           const T* k_head, const T* v_head, int64_t tile, const Item* next) {
    if (j == first && j + 1 < n) prefetch_block(P, table[j + 1], k_head, v_head, tile);
    int32_t far = j + 2 < n ? table[j + 2] : -1;
    if (j + 2 >= n && next != nullptr) {  // block j + 2 - n of the next item's
      const ItemBlocks b = item_blocks(P, *next);
      if (b.first + j + 2 - n < b.n) {
        far = b.table[b.first + j + 2 - n];
        k_head = static_cast<const T*>(P.k) + next->head * P.num_blocks * tile;
        v_head = static_cast<const T*>(P.v) + next->head * P.num_blocks * tile;
      }
    }
    issued = lines = 0;
    if (far >= 0 && far < P.num_blocks) {
      lines = tile * int64_t{sizeof(T)} / 64;
      k = reinterpret_cast<const char*>(k_head + far * tile);
      v = reinterpret_cast<const char*>(v_head + far * tile);
    }
  }

  // the share before each of `rows` rows' two steps (dot products, then P.V)
  static int64_t share(int64_t tile_bytes, int64_t rows) {
    return (2 * tile_bytes / 64 + 2 * rows - 1) / (2 * rows);
  }

  // `count` more lines: K's, then V's, in two plain loops (one loop choosing between them per
  // line was a quarter of a 3-row decode item's time with its tiles in cache)
  void step(int64_t count) {
    const int64_t end = std::min(issued + count, 2 * lines), k_end = std::min(end, lines);
    for (; issued < k_end; ++issued) __builtin_prefetch(k + issued * 64, 0, 1);
    for (; issued < end; ++issued) __builtin_prefetch(v + (issued - lines) * 64, 0, 1);
  }
  void finish() { step(2 * lines); }
};

// Block j's prefetching: a decode item's (fewer than 8 rows) by the pump, a prefill tile's at
// once.
template <typename T>
inline void prefetch_ahead(const Problem& P, const int32_t* table, int64_t j, int64_t first,
                           int64_t n, const T* k_head, const T* v_head, int64_t tile,
                           int64_t rows, TilePump& pump, const Item* next) {
  if (rows < 8)
    pump.aim(P, table, j, first, n, k_head, v_head, tile, next);
  else
    prefetch_blocks(P, table, j, first, n, k_head, v_head, tile);
}

// Write an item's rows (accumulator over denominator; rows that saw no key are 0) to their
// tokens' places in the output, rounded to T; a key split's accumulators, running maxima and
// denominators, as they are, to its place in the partials.
template <typename T>
inline void store_rows(const Problem& P, const Item& it, const Scratch& s, int64_t rows,
                       int32_t q_start, int64_t D) {
  if (it.part >= 0) {
    float* dst = P.partials + it.part * rows * (D + 2);
    std::memcpy(dst, s.acc.data(), rows * D * sizeof(float));
    std::memcpy(dst + rows * D, s.row_max.data(), rows * sizeof(float));
    std::memcpy(dst + rows * (D + 1), s.denom.data(), rows * sizeof(float));
    return;
  }
  const int64_t G = P.group;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_start + it.tok_begin + r / G;
    T* dst = static_cast<T*>(P.out) + (tok * P.num_heads + it.head * G + r % G) * D;
    const float inv = s.denom[r] > 0.0f ? 1.0f / s.denom[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) dst[d] = from_float<T>(s.acc[r * D + d] * inv);
  }
}

// The online softmax's factor on a row's sums when its running max goes from old_max to new_max
// (>= old_max): exp(old_max - new_max), 0 for a row that saw no key yet, and 1 without the exp
// where the max did not move (most blocks after the first few; exp_nonpositive(0) is 1 exactly,
// so finite maxima give what the exp gave; a max stuck at +inf, scores overflowed, now gives 1).
inline float max_correction(float old_max, float new_max) {
  if (old_max == kNegInf) return 0.0f;
  return old_max == new_max ? 1.0f : exp_nonpositive(old_max - new_max);
}

// Fold row r's scores for one key tile (keys [m, n) visible, 0 <= m < n) into its running max,
// denominator and accumulator (the online softmax), leaving the probabilities in `probs`. The
// scores are soft-capped first (in place) when `soft_cap` is set.
template <int kB>
inline float softmax_step(float* scores, int64_t m, int64_t n, int64_t block_size,
                          float soft_cap, float* probs, float* row_max, float* denom) {
  const int64_t B = kB ? kB : block_size;
  if (soft_cap > 0.0f) {
    const float inv_cap = 1.0f / soft_cap;
    // slots outside [m, n) may be garbage: tanh maps NaN to NaN, and they are selected away
    for (int64_t t = 0; t < B; ++t) scores[t] = soft_cap * std::tanh(scores[t] * inv_cap);
  }
  float block_max = kNegInf;
  for (int64_t t = 0; t < B; ++t)
    block_max = std::max(block_max, t >= m && t < n ? scores[t] : kNegInf);
  const float old_max = *row_max;
  const float new_max = std::max(old_max, block_max);
  const float correction = max_correction(old_max, new_max);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < B; ++t) {
    const float e = exp_nonpositive(scores[t] - new_max);  // slots outside [m, n): garbage
    probs[t] = t >= m && t < n ? e : 0.0f;
    sum += probs[t];
  }
  *row_max = new_max;
  *denom = *denom * correction + sum;
  return correction;
}

// Attention of one item's G * tokens query rows over the keys they can see. kD and kB are
// head_dim and block_size when known at compile time (the common pairs), or 0 for any size up
// to kMaxTile (read from the problem at run time). Few rows (a decode item: one token's GQA
// group) take dot products straight off the K tile; many rows (a prefill tile) transpose the
// K tile once and contract it eight rows at a time.
// T is the pools' element type: float, or bf16 (the portable path) or a quantized type (int8_t,
// E4M3, E5M2), whose K/V tiles are read into float32 scratch first (`widen_tile`: bf16 widened,
// quantized values dequantized) and contracted by the same code. q and the output are io_t<T>.
// Returns false if the block table names a block outside the pool.
template <int kD, int kB, typename T = float>
bool attend(const Problem& P, const Item& it, Scratch& s) {
  constexpr int64_t kDMax = kD ? kD : kMaxTile, kBMax = kB ? kB : kMaxTile;
  const int64_t D = kD ? kD : P.head_dim, B = kB ? kB : P.block_size;
  const int64_t G = P.group;
  const int32_t q_start = P.qsl[it.seq];
  const int32_t q_len = P.qsl[it.seq + 1] - q_start;
  const int32_t first_pos = P.lens[it.seq] - q_len;  // position of the sequence's first query
  const int64_t rows = static_cast<int64_t>(it.tok_end - it.tok_begin) * G;
  const int64_t reach = first_pos + it.tok_end;       // keys [0, reach) are visible to some row

  s.q.resize(rows * D);
  s.acc.assign(rows * D, 0.0f);
  s.row_max.assign(rows, kNegInf);
  s.denom.assign(rows, 0.0f);
  s.pos.resize(rows);
  s.kt.resize(D * B);
  s.scores.resize(8 * B);
  s.probs.resize(8 * B);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_start + it.tok_begin + r / G;
    const io_t<T>* src =
        static_cast<const io_t<T>*>(P.q) + (tok * P.num_heads + it.head * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) s.q[r * D + d] = to_float(src[d]) * P.scale;
    s.pos[r] = first_pos + it.tok_begin + static_cast<int32_t>(r / G);
  }

  const ItemBlocks blocks = item_blocks(P, it);
  const int32_t* table = blocks.table;
  const int64_t num_key_blocks = blocks.n, first_block = blocks.first;
  const int64_t head_offset = it.head * P.num_blocks;
  float* __restrict scores = s.scores.data();
  float* __restrict probs = s.probs.data();
  float* __restrict kt = s.kt.data();
  const T* const k_pool = static_cast<const T*>(P.k);
  const T* const v_pool = static_cast<const T*>(P.v);
  if constexpr (!std::is_same_v<T, float>) {
    s.kf.resize(B * D);
    s.vf.resize(B * D);
  }
  TilePump pump;
  const int64_t share = TilePump::share(B * D * int64_t{sizeof(T)}, rows);
  for (int64_t j = first_block; j < num_key_blocks; ++j) {
    const int32_t block = table[j];
    if (block < 0 || block >= P.num_blocks) return false;
    prefetch_ahead(P, table, j, first_block, num_key_blocks, k_pool + head_offset * B * D,
                   v_pool + head_offset * B * D, B * D, rows, pump, s.next);
    const float* __restrict kb;
    const float* __restrict vb;
    if constexpr (std::is_same_v<T, float>) {
      kb = k_pool + (head_offset + block) * B * D;
      vb = v_pool + (head_offset + block) * B * D;
    } else {  // the tile in float32 (all B slots: those past `valid` are masked as in float32)
      const int64_t slot0 = (head_offset + block) * B;
      const float* k_scales = nullptr;
      const float* v_scales = nullptr;
      if constexpr (kQuantized<T>) {
        k_scales = P.k_scales + slot0;
        v_scales = P.v_scales + slot0;
      }
      widen_tile(k_pool + slot0 * D, k_scales, B, D, s.kf.data());
      widen_tile(v_pool + slot0 * D, v_scales, B, D, s.vf.data());
      kb = s.kf.data();
      vb = s.vf.data();
    }
    const int64_t key0 = j * B;
    const int64_t valid = std::min<int64_t>(B, reach - key0);

    if (rows < 8) {
      for (int64_t r = 0; r < rows; ++r) {
        pump.step(share);
        const Span keys = visible(P, s.pos[r], key0, valid);  // the slots row r sees
        if (keys.empty()) continue;
        const float* __restrict qr = s.q.data() + r * D;
        for (int64_t t = 0; t < B; ++t) {  // all B: a fixed trip count unrolls; t >= n masked
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * kb[t * D + d];
          scores[t] = dot;
        }
        const float correction =
            softmax_step<kB>(scores, keys.begin, keys.end, B, P.soft_cap, probs, &s.row_max[r],
                             &s.denom[r]);
        pump.step(share);
        float* __restrict acc = s.acc.data() + r * D;
        alignas(64) float out[kDMax];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) out[d] = acc[d] * correction;
        for (int64_t t = keys.begin; t < keys.end; ++t) {
          const float p = probs[t];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) out[d] += p * vb[t * D + d];
        }
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] = out[d];
      }
      pump.finish();
      continue;
    }

    // many rows: K tile transposed to [D, B] (slots past `valid` zeroed: they may hold NaN)
    for (int64_t t = 0; t < B; ++t)
      for (int64_t d = 0; d < D; ++d) kt[d * B + t] = t < valid ? kb[t * D + d] : 0.0f;
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      const int64_t nr = std::min<int64_t>(8, rows - r0);
      // rows are in position order: the last row's causal reach, the first's window
      if (s.pos[r0 + nr - 1] + 1 - key0 <= 0 || first_key(P, s.pos[r0]) >= key0 + B) continue;
      alignas(64) float sc[8][kBMax] = {};
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t i = 0; i < 8; ++i) {
          const float qd = i < nr ? s.q[(r0 + i) * D + d] : 0.0f;
#pragma omp simd
          for (int64_t t = 0; t < B; ++t) sc[i][t] += qd * kt[d * B + t];
        }
      }
      int64_t n_max = 0;
      float correction[8];
      for (int64_t i = 0; i < nr; ++i) {
        const Span keys = visible(P, s.pos[r0 + i], key0, valid);
        if (!keys.empty()) n_max = std::max(n_max, keys.end);
        correction[i] = keys.empty() ? 1.0f
                                     : softmax_step<kB>(sc[i], keys.begin, keys.end, B, P.soft_cap,
                                                        probs + i * B, &s.row_max[r0 + i],
                                                        &s.denom[r0 + i]);
        if (keys.empty())
          for (int64_t t = 0; t < B; ++t) probs[i * B + t] = 0.0f;
      }
      for (int64_t i0 = 0; i0 < nr; i0 += 4) {
        const int64_t ni = std::min<int64_t>(4, nr - i0);
        alignas(64) float out[4][kDMax];
        for (int64_t i = 0; i < 4; ++i) {
          const float c = i < ni ? correction[i0 + i] : 0.0f;
          const float* acc = s.acc.data() + (r0 + i0 + std::min<int64_t>(i, ni - 1)) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) out[i][d] = acc[d] * c;
        }
        for (int64_t t = 0; t < n_max; ++t) {
          for (int64_t i = 0; i < 4; ++i) {
            const float p = i < ni ? probs[(i0 + i) * B + t] : 0.0f;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) out[i][d] += p * vb[t * D + d];
          }
        }
        for (int64_t i = 0; i < ni; ++i) {
          float* acc = s.acc.data() + (r0 + i0 + i) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] = out[i][d];
        }
      }
    }
  }

  store_rows<io_t<T>>(P, it, s, rows, q_start, D);
  return true;
}

#ifdef __AVX512BF16__
constexpr bool kHaveBf16Dot = true;

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// Two bfloat16s in one 32-bit lane (a low, b high): the pair vdpbf16ps multiplies by the pair
// in the same lane of its other operand, summing both products into the lane's float32.
inline uint32_t pair(bf16 a, bf16 b) {
  return static_cast<uint32_t>(a) | static_cast<uint32_t>(b) << 16;
}

// The sums of 16 vectors at once (a transposing tree: 15 adds instead of 16 reductions):
// lane j of the result is the sum of v[(j % 4) * 4 + j / 4].
inline __m512 sum16(const __m512* v) {
  __m512 c[8], e[4], g[2];
  for (int k = 0; k < 8; ++k)  // 256-bit halves: lanes 0-7 v[2k]'s partial sums, 8-15 v[2k+1]'s
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // 128-bit quarters
    e[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k) {  // 64-bit pairs within each quarter
    const __m512d lo = _mm512_castps_pd(e[2 * k]), hi = _mm512_castps_pd(e[2 * k + 1]);
    g[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));
}

// exp_nonpositive on 16 lanes, step for step (NaN -> -87 as there: vmaxps returns its second
// operand when either is NaN).
inline __m512 exp16_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i n_bits = _mm512_castps_si512(_mm512_add_ps(n, _mm512_set1_ps(12582912.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(n_bits, _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// The lanes i of a 16-slot group (slots t0 + i) with m <= t0 + i < n.
inline __mmask16 slot_mask(int64_t m, int64_t n, int64_t t0) {
  const int64_t lo = std::clamp<int64_t>(m - t0, 0, 16), hi = std::clamp<int64_t>(n - t0, 0, 16);
  const uint32_t below_hi = (1u << hi) - 1u, below_lo = (1u << lo) - 1u;
  return static_cast<__mmask16>(below_hi & ~below_lo);
}

// softmax_step without a soft cap, on 16 lanes at a time, for kB a multiple of 16; also leaves
// the probabilities rounded to bfloat16 in consecutive pairs (pairs[tp] = (p[2 tp], p[2 tp + 1]),
// as `pair(narrow(.), narrow(.))`: vcvtneps2bf16 rounds to nearest even, and the probabilities
// are 0 or normal numbers, which it does not flush).
template <int kB>
inline float softmax_step16(const float* scores, int64_t m, int64_t n, uint32_t* pairs,
                            float* row_max, float* denom) {
  constexpr int kV = kB / 16;
  __m512 sc[kV];
  __mmask16 mask[kV];
  __m512 block_max = _mm512_set1_ps(kNegInf);
  for (int v = 0; v < kV; ++v) {
    sc[v] = _mm512_loadu_ps(scores + 16 * v);
    mask[v] = slot_mask(m, n, 16 * v);
    // max(scores, running): a NaN score leaves the running max (as std::max does)
    block_max = _mm512_mask_max_ps(block_max, mask[v], sc[v], block_max);
  }
  const float old_max = *row_max;
  const float new_max = std::max(old_max, _mm512_reduce_max_ps(block_max));
  const float correction = max_correction(old_max, new_max);
  __m512 sum = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(new_max);
  for (int v = 0; v < kV; ++v) {
    const __m512 p = _mm512_maskz_mov_ps(mask[v], exp16_nonpositive(_mm512_sub_ps(sc[v], shift)));
    sum = _mm512_add_ps(sum, p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + 8 * v),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
  }
  *row_max = new_max;
  *denom = *denom * correction + _mm512_reduce_add_ps(sum);
  return correction;
}

// V tile rows 2 tp and 2 tp + 1 (kD bf16 each, zeroed where `keep_a` / `keep_b` is false) as
// kD pairs (v[2 tp][d], v[2 tp + 1][d]) in d order: one two-source word shuffle per 16 pairs.
template <int kD>
inline void v_pairs(const bf16* va, const bf16* vb, bool keep_a, bool keep_b, uint32_t* out) {
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37,
                                                  6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43,
                                                  12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(kLo);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int c = 0; c < kD / 32; ++c) {
    const __m512i a = keep_a ? _mm512_loadu_si512(va + 32 * c) : _mm512_setzero_si512();
    const __m512i b = keep_b ? _mm512_loadu_si512(vb + 32 * c) : _mm512_setzero_si512();
    _mm512_storeu_si512(out + 32 * c, _mm512_permutex2var_epi16(a, lo, b));
    _mm512_storeu_si512(out + 32 * c + 16, _mm512_permutex2var_epi16(a, hi, b));
  }
}

// P.V for R rows of one key tile: acc[i] = acc[i] * correction[i] + the sum over pairs tp in
// [tp_begin, tp_end) of p2[i][tp] . vpairs[tp] (vdpbf16ps, in tp order). A row's
// probabilities are 0 outside the keys it sees.
template <int kD, int kB, int R>
inline void pv_rows(float* acc, const float* correction, const uint32_t (*p2)[kB / 2],
                    int64_t tp_begin, int64_t tp_end, const uint32_t* __restrict vpairs) {
  constexpr int64_t D = kD, DV = kD / 16;
  __m512 out[R][DV];
  for (int64_t i = 0; i < R; ++i) {
    const __m512 c = _mm512_set1_ps(correction[i]);
    for (int64_t v = 0; v < DV; ++v)
      out[i][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + 16 * v), c);
  }
  for (int64_t tp = tp_begin; tp < tp_end; ++tp) {
    __m512i vv[DV];
    for (int64_t v = 0; v < DV; ++v) vv[v] = _mm512_loadu_si512(vpairs + tp * D + 16 * v);
    for (int64_t i = 0; i < R; ++i) {
      const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int32_t>(p2[i][tp])));
      for (int64_t v = 0; v < DV; ++v) out[i][v] = _mm512_dpbf16_ps(out[i][v], p, as_bh(vv[v]));
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t v = 0; v < DV; ++v) _mm512_storeu_ps(acc + i * D + 16 * v, out[i][v]);
}

// pv_rows for `nr` (at most 8) rows, kRows at a time (kRows * kD / 16 = 16 accumulators): each
// V pair is read once for them, and their dot chains interleave.
template <int kD, int kB>
inline void accumulate_pv(float* acc, int64_t nr, const float* correction,
                          const uint32_t (*p2)[kB / 2], int64_t tp_begin, int64_t tp_end,
                          const uint32_t* __restrict vpairs) {
  constexpr int64_t kRows = 256 / kD;
  static_assert(kRows <= 4, "pv_rows is instantiated for up to 4 rows");
  for (int64_t i0 = 0; i0 < nr; i0 += kRows) {
    float* a = acc + i0 * kD;
    switch (std::min<int64_t>(kRows, nr - i0)) {
      case 1: pv_rows<kD, kB, 1>(a, correction + i0, p2 + i0, tp_begin, tp_end, vpairs); break;
      case 2: pv_rows<kD, kB, 2>(a, correction + i0, p2 + i0, tp_begin, tp_end, vpairs); break;
      case 3: pv_rows<kD, kB, 3>(a, correction + i0, p2 + i0, tp_begin, tp_end, vpairs); break;
      default: pv_rows<kD, kB, 4>(a, correction + i0, p2 + i0, tp_begin, tp_end, vpairs);
    }
  }
}

// `attend` for bfloat16 pools on AVX512-BF16 (the compiled sizes: head_dim a multiple of 32,
// block_size of 16). Scores: q (as given) . K on vdpbf16ps, times the scale in float32. The
// online softmax is `softmax_step`'s, in float32. P.V: the probabilities rounded to bfloat16
// pairwise against V stored as pairs of consecutive key slots, on vdpbf16ps, into the float32
// accumulator. Decode rows take dot products straight off the K tile (pairs along head_dim,
// 16 key slots' sums at once); prefill tiles transpose K once into pairs of dims per key slot
// and contract eight rows at a time, as the float32 code does.
template <int kD, int kB>
bool attend_dot(const Problem& P, const Item& it, Scratch& s) {
  static_assert(kD % 32 == 0 && kB % 16 == 0, "vdpbf16ps takes 32 bf16 / 16 float32 lanes");
  constexpr int64_t D = kD, B = kB, DV = kD / 16, BV = kB / 16;
  constexpr int64_t kRows = 256 / kD;  // P.V rows at a time: kRows * DV = 16 accumulators
  const int64_t G = P.group;
  const int32_t q_start = P.qsl[it.seq];
  const int32_t q_len = P.qsl[it.seq + 1] - q_start;
  const int32_t first_pos = P.lens[it.seq] - q_len;
  const int64_t rows = static_cast<int64_t>(it.tok_end - it.tok_begin) * G;
  const int64_t reach = first_pos + it.tok_end;
  const float scale = P.scale;

  s.q16.resize(rows * D);
  s.acc.assign(rows * D, 0.0f);
  s.row_max.assign(rows, kNegInf);
  s.denom.assign(rows, 0.0f);
  s.pos.resize(rows);
  s.scores.resize(8 * B);
  s.probs.resize(8 * B);
  s.kpairs.resize(D / 2 * B);
  s.vpairs.resize(B / 2 * D);
  const bf16* const q_in = static_cast<const bf16*>(P.q);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_start + it.tok_begin + r / G;
    std::memcpy(s.q16.data() + r * D, q_in + (tok * P.num_heads + it.head * G + r % G) * D,
                D * sizeof(bf16));
    s.pos[r] = first_pos + it.tok_begin + static_cast<int32_t>(r / G);
  }

  const ItemBlocks blocks = item_blocks(P, it);
  const int32_t* table = blocks.table;
  const int64_t num_key_blocks = blocks.n, first_block = blocks.first;
  const int64_t head_offset = it.head * P.num_blocks;
  const bf16* const k_pool = static_cast<const bf16*>(P.k);
  const bf16* const v_pool = static_cast<const bf16*>(P.v);
  float* __restrict scores = s.scores.data();
  float* __restrict probs = s.probs.data();
  uint32_t* __restrict kpairs = s.kpairs.data();
  uint32_t* __restrict vpairs = s.vpairs.data();
  TilePump pump;
  const int64_t share = TilePump::share(B * D * int64_t{sizeof(bf16)}, rows);
  for (int64_t j = first_block; j < num_key_blocks; ++j) {
    const int32_t block = table[j];
    if (block < 0 || block >= P.num_blocks) return false;
    prefetch_ahead(P, table, j, first_block, num_key_blocks, k_pool + head_offset * B * D,
                   v_pool + head_offset * B * D, B * D, rows, pump, s.next);
    const bf16* __restrict kb = k_pool + (head_offset + block) * B * D;
    const bf16* __restrict vb = v_pool + (head_offset + block) * B * D;
    const int64_t key0 = j * B;
    const int64_t valid = std::min<int64_t>(B, reach - key0);

    // V as pairs of consecutive key slots: vpairs[tp * D + d] = (v[2 tp][d], v[2 tp + 1][d]);
    // slots past `valid` zeroed (they may hold NaN or inf, and 0 * NaN is NaN)
    for (int64_t tp = 0; tp < (valid + 1) / 2; ++tp)
      v_pairs<kD>(vb + 2 * tp * D, vb + (2 * tp + 1) * D, 2 * tp < valid, 2 * tp + 1 < valid,
                  vpairs + tp * D);

    if (rows < 8) {
      // each row's scores and probabilities, then P.V for the rows together (kRows at a time:
      // a V pair read once for them, their accumulators' dot chains interleaved)
      alignas(64) uint32_t p2[8][kB / 2];  // the probabilities rounded to bf16, in pairs
      float correction[8];
      int64_t tp_begin = B / 2, tp_end = 0;  // the pairs some row sees
      for (int64_t r = 0; r < rows; ++r) {
        pump.step(share);
        const Span keys = visible(P, s.pos[r], key0, valid);  // the slots row r sees
        // a row that sees none of the tile: P.V adds zero products (its sums unchanged, V being
        // finite in the slots other rows see; slots past `valid` are zeroed), as in the
        // many-row path below
        if (keys.empty()) {
          correction[r] = 1.0f;
          std::fill_n(p2[r], kB / 2, 0u);
          continue;
        }
        tp_begin = std::min<int64_t>(tp_begin, keys.begin / 2);
        tp_end = std::max<int64_t>(tp_end, (keys.end + 1) / 2);
        __m512i qv[D / 32];
        for (int64_t c = 0; c < D / 32; ++c)
          qv[c] = _mm512_loadu_si512(s.q16.data() + r * D + 32 * c);
        const __m512 sv = _mm512_set1_ps(scale);
        for (int64_t t0 = 0; t0 < B; t0 += 16) {  // all B: slots t >= n are masked later
          __m512 dots[16];
          for (int64_t t = 0; t < 16; ++t) {
            __m512 dot = _mm512_setzero_ps();
            for (int64_t c = 0; c < D / 32; ++c)
              dot = _mm512_dpbf16_ps(dot, as_bh(qv[c]),
                                     as_bh(_mm512_loadu_si512(kb + (t0 + t) * D + 32 * c)));
            dots[(t % 4) * 4 + t / 4] = dot;  // where sum16 puts slot t's sum in lane t
          }
          _mm512_storeu_ps(scores + t0, _mm512_mul_ps(sum16(dots), sv));
        }
        if (P.soft_cap > 0.0f) {
          correction[r] = softmax_step<kB>(scores, keys.begin, keys.end, B, P.soft_cap, probs,
                                           &s.row_max[r], &s.denom[r]);
          for (int64_t tp = 0; tp < B / 2; ++tp)
            p2[r][tp] = pair(narrow(probs[2 * tp]), narrow(probs[2 * tp + 1]));
        } else {
          correction[r] = softmax_step16<kB>(scores, keys.begin, keys.end, p2[r],
                                             &s.row_max[r], &s.denom[r]);
        }
        pump.step(share);
      }
      accumulate_pv<kD, kB>(s.acc.data(), rows, correction, p2, tp_begin, tp_end, vpairs);
      pump.finish();
      continue;
    }

    // many rows: K as pairs of consecutive dims, transposed: kpairs[dp * B + t] =
    // (k[t][2 dp], k[t][2 dp + 1]), slots past `valid` zeroed
    for (int64_t t = 0; t < B; ++t) {
      const bf16 keep = t < valid ? 0xffff : 0;
      for (int64_t dp = 0; dp < D / 2; ++dp)
        kpairs[dp * B + t] = pair(kb[t * D + 2 * dp] & keep, kb[t * D + 2 * dp + 1] & keep);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      const int64_t nr = std::min<int64_t>(8, rows - r0);
      // rows are in position order: the last row's causal reach, the first's window
      if (s.pos[r0 + nr - 1] + 1 - key0 <= 0 || first_key(P, s.pos[r0]) >= key0 + B) continue;
      __m512 acc_sc[8][BV];
      for (int64_t i = 0; i < 8; ++i)
        for (int64_t b = 0; b < BV; ++b) acc_sc[i][b] = _mm512_setzero_ps();
      const uint32_t* q32[8];
      for (int64_t i = 0; i < 8; ++i)
        q32[i] = reinterpret_cast<const uint32_t*>(s.q16.data() + (r0 + std::min(i, nr - 1)) * D);
      for (int64_t dp = 0; dp < D / 2; ++dp) {
        __m512i kv[BV];
        for (int64_t b = 0; b < BV; ++b) kv[b] = _mm512_loadu_si512(kpairs + dp * B + 16 * b);
        for (int64_t i = 0; i < 8; ++i) {
          uint32_t qp;
          std::memcpy(&qp, q32[i] + dp, sizeof qp);
          const __m512bh qb = as_bh(_mm512_set1_epi32(static_cast<int32_t>(qp)));
          for (int64_t b = 0; b < BV; ++b)
            acc_sc[i][b] = _mm512_dpbf16_ps(acc_sc[i][b], qb, as_bh(kv[b]));
        }
      }
      alignas(64) float sc[8][kB];
      const __m512 sv = _mm512_set1_ps(scale);
      for (int64_t i = 0; i < 8; ++i)
        for (int64_t b = 0; b < BV; ++b)
          _mm512_store_ps(sc[i] + 16 * b, _mm512_mul_ps(acc_sc[i][b], sv));
      int64_t n_max = 0;
      float correction[8];
      for (int64_t i = 0; i < nr; ++i) {
        const Span keys = visible(P, s.pos[r0 + i], key0, valid);
        if (!keys.empty()) n_max = std::max(n_max, keys.end);
        correction[i] = keys.empty() ? 1.0f
                                     : softmax_step<kB>(sc[i], keys.begin, keys.end, B, P.soft_cap,
                                                        probs + i * B, &s.row_max[r0 + i],
                                                        &s.denom[r0 + i]);
        if (keys.empty())
          for (int64_t t = 0; t < B; ++t) probs[i * B + t] = 0.0f;
      }
      alignas(64) uint32_t p2[8][kB / 2];  // the probabilities rounded to bf16, in pairs
      for (int64_t i = 0; i < nr; ++i)
        for (int64_t tp = 0; tp < B / 2; ++tp)
          p2[i][tp] = pair(narrow(probs[i * B + 2 * tp]), narrow(probs[i * B + 2 * tp + 1]));
      accumulate_pv<kD, kB>(s.acc.data() + r0 * D, nr, correction, p2, 0, (n_max + 1) / 2,
                            vpairs);
    }
  }

  store_rows<bf16>(P, it, s, rows, q_start, D);
  return true;
}
#else
constexpr bool kHaveBf16Dot = false;
#endif

// How a call's pools are read: float32, bfloat16 widened to float32, bfloat16 on vdpbf16ps,
// or quantized (int8, float8_e4m3fn, float8_e5m2) dequantized to float32.
enum class Mode { kF32, kBf16Portable, kBf16Dot, kS8, kF8E4M3FN, kF8E5M2 };

using AttendFn = bool (*)(const Problem&, const Item&, Scratch&);

// The (head_dim, block_size) pairs compiled for their sizes, else the run-time sized code.
template <typename T>
AttendFn pick_typed(int64_t head_dim, int64_t block_size) {
  if (block_size == 16) {
    if (head_dim == 64) return attend<64, 16, T>;
    if (head_dim == 128) return attend<128, 16, T>;
  }
  if (block_size == 32) {
    if (head_dim == 64) return attend<64, 32, T>;
    if (head_dim == 128) return attend<128, 32, T>;
  }
  if (head_dim <= kMaxTile && block_size >= 1 && block_size <= kMaxTile) return attend<0, 0, T>;
  return nullptr;
}

// The bf16 dot path serves the compiled pairs; any other size (or no AVX512-BF16) is portable.
AttendFn pick(int64_t head_dim, int64_t block_size, Mode mode) {
  switch (mode) {
    case Mode::kF32: return pick_typed<float>(head_dim, block_size);
    case Mode::kS8: return pick_typed<int8_t>(head_dim, block_size);
    case Mode::kF8E4M3FN: return pick_typed<E4M3>(head_dim, block_size);
    case Mode::kF8E5M2: return pick_typed<E5M2>(head_dim, block_size);
    case Mode::kBf16Portable: case Mode::kBf16Dot: break;
  }
#ifdef __AVX512BF16__
  if (mode == Mode::kBf16Dot) {
    if (block_size == 16) {
      if (head_dim == 64) return attend_dot<64, 16>;
      if (head_dim == 128) return attend_dot<128, 16>;
    }
    if (block_size == 32) {
      if (head_dim == 64) return attend_dot<64, 32>;
      if (head_dim == 128) return attend_dot<128, 32>;
    }
  }
#endif
  return pick_typed<bf16>(head_dim, block_size);
}

// Every thread runs a work's units through this one function, compiled once for each kind of
// work: inlined at each call site (the caller's, the helpers' lambda), run() was compiled twice,
// and -fassociative-math let each copy order its sums its own way. A greedy draw's
// log-probability then depended on which thread drew the row (one float32 ulp, in 107 of 300
// calls of 64 identical rows), and so did an engine's output from run to run.
#if defined(__clang__)
#define JAXPAGE_ONE_COPY __attribute__((noinline))
#else
#define JAXPAGE_ONE_COPY __attribute__((noipa))  // nor cloned for a call site's constants
#endif
template <typename W>
JAXPAGE_ONE_COPY void run_units(W& work) {
  work.run();
}

// Runs `work` (its run(): claim units until none is left, counting each in `done`) on this
// thread and on as many of XLA's intra-op threads as there are units for, and returns once all
// `total` units are done (the helpers hold `work` until they return).
template <typename W>
void run_shared(ffi::ThreadPool& pool, const std::shared_ptr<W>& work, int64_t total) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { run_units(*work); });
  run_units(*work);
  while (work->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

// Items shared by the caller and the helpers it schedules: each thread claims the next
// unclaimed item until none is left; the caller then waits only for items being worked on.
struct Work {
  Problem problem;
  std::vector<Item> items;
  std::vector<float> partials;  // key splits' sums: G rows x (D + 2) floats a part
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> bad_block{false};
  AttendFn attend_fn = nullptr;

  void run() {
    Scratch scratch;
    const int64_t n = static_cast<int64_t>(items.size());
    // an item's successor is claimed before it runs, so that it can prefetch the successor's
    // first blocks (a thread holds at most one item it has not started, one of the last and
    // lightest: items run heaviest first)
    for (int64_t i = next.fetch_add(1); i < n;) {
      const int64_t after = next.fetch_add(1);
      scratch.next = after < n ? &items[after] : nullptr;
      if (!attend_fn(problem, items[i], scratch)) bad_block.store(true);
      done.fetch_add(1, std::memory_order_release);
      i = after;
    }
  }
};

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("paged attention: " + what);
}

// Key splits (flash decoding's split-K): a decode step of few sequences has few work items for
// the threads (a sequence's KV heads: 3 for one SmolLM2 sequence, on 2 threads), and an item
// reads its blocks one after another, each a scattered tile whose latency the pump hides only
// in part: one sequence at 1000 tokens spent 1.8 ms a step in 30 layers' attention, against
// 0.8 ms to read its 23 MB of K/V. So single-token items over many blocks are cut into parts
// of consecutive blocks, each a work item whose sums (the online softmax's accumulators,
// running maxima and denominators) go to the partials, and combine_splits merges an item's
// parts as the online softmax merges blocks: out = sum_p acc_p w_p / sum_p l_p w_p, w_p =
// e^(m_p - m), m = max_p m_p, in float32, rounded to the output's type once (a part that saw no
// key has m_p = -inf and weight 0).
struct Split {
  Item item;  // as it was before the split
  int64_t first_part, parts;
};

constexpr int64_t kSplitMinBlocks = 16;  // blocks a part reads at least, where the kernel chooses

// The parts an item of `blocks` blocks is cut into, one of `items` items for `threads`
// threads: `key_splits` (1: none; k > 1: up to k, a block each at least, for tests and
// benchmarks) or, at 0, enough parts for about four items a thread, of kSplitMinBlocks blocks
// at least, where the items are fewer than two a thread.
int64_t parts_for(int64_t blocks, int64_t items, int64_t threads, int64_t key_splits) {
  if (key_splits >= 1) return std::max<int64_t>(1, std::min(key_splits, blocks));
  if (items >= 2 * threads) return 1;
  const int64_t want = (4 * threads + items - 1) / items;
  return std::max<int64_t>(1, std::min(want, blocks / kSplitMinBlocks));
}

// Cut the work's single-token items as parts_for says, recording each cut in `splits`.
void split_keys(Work& work, int64_t threads, int64_t key_splits, std::vector<Split>& splits) {
  Problem& P = work.problem;
  const int64_t count = static_cast<int64_t>(work.items.size());
  // most steps cut nothing (enough items for the threads): leave their items as they are
  if (parts_for(std::numeric_limits<int64_t>::max(), count, threads, key_splits) <= 1) return;
  std::vector<Item> items;
  int64_t parts_total = 0;
  for (const Item& it : work.items) {
    const ItemBlocks b = item_blocks(P, it);
    const int64_t blocks = b.n - b.first;
    const int64_t parts =
        it.tok_end - it.tok_begin == 1 ? parts_for(blocks, count, threads, key_splits) : 1;
    if (parts <= 1) {
      items.push_back(it);
      continue;
    }
    splits.push_back({it, parts_total, parts});
    for (int64_t p = 0; p < parts; ++p) {
      Item piece = it;
      piece.part = static_cast<int32_t>(parts_total + p);
      piece.block_begin = static_cast<int32_t>(b.first + p * blocks / parts);
      piece.block_end = static_cast<int32_t>(b.first + (p + 1) * blocks / parts);
      piece.cost = it.cost * (piece.block_end - piece.block_begin) / blocks;
      items.push_back(piece);
    }
    parts_total += parts;
  }
  work.items = std::move(items);
  if (parts_total) {
    work.partials.assign(static_cast<size_t>(parts_total * P.group * (P.head_dim + 2)), 0.0f);
    P.partials = work.partials.data();
  }
}

// Each split item's rows from its parts' sums (see Split), rounded to T, in the output.
template <typename T>
void combine_splits(const Problem& P, const std::vector<Split>& splits) {
  const int64_t G = P.group, D = P.head_dim, stride = G * (D + 2);
  std::vector<float> acc(static_cast<size_t>(D));
  for (const Split& sp : splits) {
    const int64_t tok = P.qsl[sp.item.seq] + sp.item.tok_begin;
    for (int64_t r = 0; r < G; ++r) {
      float m = kNegInf;
      for (int64_t p = 0; p < sp.parts; ++p)
        m = std::max(m, P.partials[(sp.first_part + p) * stride + G * D + r]);
      float denom = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t p = 0; p < sp.parts; ++p) {
        const float* part = P.partials + (sp.first_part + p) * stride;
        const float part_max = part[G * D + r];
        if (part_max == kNegInf) continue;  // the part saw no key
        const float w = exp_nonpositive(part_max - m);
        denom += part[G * (D + 1) + r] * w;
        for (int64_t d = 0; d < D; ++d) acc[d] += part[r * D + d] * w;
      }
      T* dst = static_cast<T*>(P.out) + (tok * P.num_heads + sp.item.head * G + r) * D;
      const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
      for (int64_t d = 0; d < D; ++d) dst[d] = from_float<T>(acc[d] * inv);
    }
  }
}

std::string shape_string(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

// Everything the work items trust is checked here, before any of them runs: shapes (the output
// is q's; quantized pools' scales are their values' shape less head_dim), query ranges
// (query_start_loc non-decreasing within [0, T], so that the sequences'
// query rows neither overlap nor leave the batch), each sequence's query count <= its seq_len
// and, for sequences with queries, seq_len <= what its block table holds. Block ids are
// checked by the items as they read them (only the blocks a sequence reaches are read).
// The handlers below pass their buffers' data and dimensions; `out_bytes` is the size of an
// output element (q's: float32 or bfloat16).
struct Operand {
  const void* data;
  ffi::Span<const int64_t> dims;
};

// One call's attention, checked and cut into work items (PrepareAttention), run by the threads,
// then checked for bad blocks and its split items combined (FinishAttention): RunAttention's
// three parts, which the decoder layer (JaxpageDecoderLayer) runs among its other stages.
struct Attention {
  std::shared_ptr<Work> work = std::make_shared<Work>();
  std::vector<Split> splits;
  size_t out_bytes = 0;
};

ffi::Error PrepareAttention(Attention& A, int64_t threads, Operand q, Operand k_pool,
                            Operand v_pool, const float* k_scales, const float* v_scales,
                            ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                            ffi::Buffer<ffi::S32> query_start_loc, float scale,
                            int64_t query_tile, int64_t sliding_window, float soft_cap,
                            int64_t key_splits, Mode mode, void* out_data,
                            ffi::Span<const int64_t> od, size_t out_bytes) {
  const auto qd = q.dims;
  const auto kd = k_pool.dims;
  const auto td = block_tables.dimensions();
  const auto vd = v_pool.dims;
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || vd.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) ||
      static_cast<int64_t>(seq_lens.element_count()) != td[0] ||
      static_cast<int64_t>(query_start_loc.element_count()) != td[0] + 1 ||
      kd[3] != qd[2] || kd[0] == 0 || qd[1] % kd[0] != 0 || query_tile < 1) {
    return Invalid("inconsistent shapes");
  }
  if (od.size() != qd.size() || !std::equal(qd.begin(), qd.end(), od.begin())) {
    return Invalid("output shape " + shape_string(od) + " is not q's shape " + shape_string(qd));
  }
  if (sliding_window < 0) {
    return Invalid("sliding_window " + std::to_string(sliding_window) + " is negative (0: off)");
  }
  if (!(soft_cap >= 0.0f) || std::isinf(soft_cap)) {
    return Invalid("soft_cap " + std::to_string(soft_cap) + " must be finite and >= 0 (0: off)");
  }
  if (key_splits < 0) {
    return Invalid("key_splits " + std::to_string(key_splits) +
                   " is negative (0: the kernel chooses, 1: none)");
  }
  A.out_bytes = out_bytes;
  Work* work = A.work.get();
  Problem& P = work->problem;
  P = Problem{q.data, k_pool.data, v_pool.data, k_scales, v_scales,
              block_tables.typed_data(), seq_lens.typed_data(), query_start_loc.typed_data(),
              out_data, qd[1], qd[2], kd[0], kd[1], kd[2], td[1], qd[1] / kd[0], scale,
              sliding_window, soft_cap};

  work->attend_fn = pick(P.head_dim, P.block_size, mode);
  if (work->attend_fn == nullptr) {
    return Invalid("head_dim " + std::to_string(P.head_dim) + " with block_size " +
                   std::to_string(P.block_size) +
                   " is not served (head_dim at most 256, block_size 1 to 256)");
  }
  const int64_t num_tokens = qd[0], num_seqs = td[0];
  const int32_t* qsl = P.qsl;
  if (qsl[0] < 0) {
    return Invalid("query_start_loc[0] = " + std::to_string(qsl[0]) + " is negative");
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (qsl[s + 1] < qsl[s]) {
      return Invalid("query_start_loc decreases at sequence " + std::to_string(s) +
                     ": query_start_loc[" + std::to_string(s) + "] = " + std::to_string(qsl[s]) +
                     " > query_start_loc[" + std::to_string(s + 1) + "] = " +
                     std::to_string(qsl[s + 1]) + " (query ranges must not overlap)");
    }
  }
  if (qsl[num_seqs] > num_tokens) {
    return Invalid("query_start_loc[" + std::to_string(num_seqs) + "] = " +
                   std::to_string(qsl[num_seqs]) + " exceeds the " + std::to_string(num_tokens) +
                   " query tokens");
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = static_cast<int64_t>(qsl[s + 1]) - qsl[s];  // >= 0: checked above
    if (len > P.lens[s]) {
      return Invalid("sequence " + std::to_string(s) + " has " + std::to_string(len) +
                     " queries but seq_len " + std::to_string(P.lens[s]));
    }
    if (len > 0 && P.lens[s] > P.max_blocks * P.block_size) {
      return Invalid("sequence " + std::to_string(s) + " has seq_len " +
                     std::to_string(P.lens[s]) + " but its block table holds " +
                     std::to_string(P.max_blocks * P.block_size) + " tokens");
    }
  }

  // padding tokens stay 0
  std::memset(P.out, 0, out_bytes * qd[0] * qd[1] * qd[2]);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = static_cast<int64_t>(qsl[s + 1]) - qsl[s];
    // tiles [a, b) of at most query_tile tokens (no a + query_tile: query_tile may be huge)
    for (int64_t a = 0, b = 0; a < len; a = b) {
      b = len - a <= query_tile ? len : a + query_tile;
      const int64_t reach = P.lens[s] - len + b;
      const int64_t keys = reach - first_key(P, P.lens[s] - len + a);  // at most, per row
      for (int32_t h = 0; h < P.num_kv_heads; ++h)
        work->items.push_back(Item{static_cast<int32_t>(s), h, static_cast<int32_t>(a),
                                   static_cast<int32_t>(b), keys * (b - a)});
    }
  }
  split_keys(*work, threads, key_splits, A.splits);
  // heaviest first, so that the last items to finish are short ones
  std::stable_sort(work->items.begin(), work->items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return ffi::Error::Success();
}

ffi::Error FinishAttention(const Attention& A) {
  if (A.work->bad_block.load()) return Invalid("block table entry outside the pool");
  if (A.out_bytes == sizeof(bf16))
    combine_splits<bf16>(A.work->problem, A.splits);
  else
    combine_splits<float>(A.work->problem, A.splits);
  return ffi::Error::Success();
}

int64_t thread_count(ffi::ThreadPool& pool) { return std::max<int64_t>(pool.num_threads(), 1); }

ffi::Error RunAttention(ffi::ThreadPool pool, Operand q, Operand k_pool, Operand v_pool,
                        const float* k_scales, const float* v_scales,
                        ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                        ffi::Buffer<ffi::S32> query_start_loc, float scale, int64_t query_tile,
                        int64_t sliding_window, float soft_cap, int64_t key_splits, Mode mode,
                        void* out_data, ffi::Span<const int64_t> od, size_t out_bytes) {
  Attention A;
  if (ffi::Error e = PrepareAttention(A, thread_count(pool), q, k_pool, v_pool, k_scales,
                                      v_scales, block_tables, seq_lens, query_start_loc, scale,
                                      query_tile, sliding_window, soft_cap, key_splits, mode,
                                      out_data, od, out_bytes);
      e.failure())
    return e;
  run_shared(pool, A.work, static_cast<int64_t>(A.work->items.size()));
  return FinishAttention(A);
}

// bfloat16 pools' mode: vdpbf16ps where asked (bf16_dot != 0) and built, else portable.
Mode bf16_mode(int64_t bf16_dot) {
  return bf16_dot && kHaveBf16Dot ? Mode::kBf16Dot : Mode::kBf16Portable;
}

// kType: F32 (mode kF32) or BF16 (kBf16Portable or kBf16Dot) for q, the pools and out.
template <ffi::DataType kType>
ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<kType> q,
                          ffi::Buffer<kType> k_pool, ffi::Buffer<kType> v_pool,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                          ffi::Buffer<ffi::S32> query_start_loc, float scale,
                          int64_t query_tile, int64_t sliding_window, float soft_cap,
                          int64_t key_splits, Mode mode, ffi::ResultBuffer<kType> out) {
  return RunAttention(pool, {q.untyped_data(), q.dimensions()},
                      {k_pool.untyped_data(), k_pool.dimensions()},
                      {v_pool.untyped_data(), v_pool.dimensions()}, nullptr, nullptr,
                      block_tables, seq_lens, query_start_loc, scale, query_tile,
                      sliding_window, soft_cap, key_splits, mode, out->untyped_data(),
                      out->dimensions(), sizeof(ffi::NativeType<kType>));
}

ffi::Error PagedAttentionF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                             ffi::Buffer<ffi::F32> k_pool, ffi::Buffer<ffi::F32> v_pool,
                             ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                             ffi::Buffer<ffi::S32> query_start_loc, float scale,
                             int64_t query_tile, int64_t sliding_window, float soft_cap,
                             int64_t key_splits, ffi::ResultBuffer<ffi::F32> out) {
  return PagedAttention<ffi::F32>(pool, q, k_pool, v_pool, block_tables, seq_lens,
                                  query_start_loc, scale, query_tile, sliding_window, soft_cap,
                                  key_splits, Mode::kF32, out);
}

// bf16_dot: 1 takes vdpbf16ps where this build has it (see JaxpagePagedAttentionBf16Dot), 0
// the portable path (widen to float32).
ffi::Error PagedAttentionBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> q,
                              ffi::Buffer<ffi::BF16> k_pool, ffi::Buffer<ffi::BF16> v_pool,
                              ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                              ffi::Buffer<ffi::S32> query_start_loc, float scale,
                              int64_t query_tile, int64_t sliding_window, float soft_cap,
                              int64_t key_splits, int64_t bf16_dot,
                              ffi::ResultBuffer<ffi::BF16> out) {
  const Mode mode = bf16_mode(bf16_dot);
  return PagedAttention<ffi::BF16>(pool, q, k_pool, v_pool, block_tables, seq_lens,
                                   query_start_loc, scale, query_tile, sliding_window, soft_cap,
                                   key_splits, mode, out);
}

std::string type_name(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::F8E4M3FNUZ: return "float8_e4m3fnuz";
    case ffi::DataType::F8E5M2FNUZ: return "float8_e5m2fnuz";
    default: return "element type " + std::to_string(static_cast<int>(type));
  }
}

// Quantized pools (pallas_kernels/quantized.py): K and V values [K, NB, B, D] of one storage
// type (int8, float8_e4m3fn or float8_e5m2) with float32 scales [K, NB, B]; q and out float32.
// Position p of head h reads float32(values[h, p]) * scales[h, p], as the float32 kernel reads
// quantized.dequantize_pool(pool): the output is that kernel's, bit for bit.
ffi::Error PagedAttentionQuantized(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                   ffi::AnyBuffer k_values, ffi::Buffer<ffi::F32> k_scales,
                                   ffi::AnyBuffer v_values, ffi::Buffer<ffi::F32> v_scales,
                                   ffi::Buffer<ffi::S32> block_tables,
                                   ffi::Buffer<ffi::S32> seq_lens,
                                   ffi::Buffer<ffi::S32> query_start_loc, float scale,
                                   int64_t query_tile, int64_t sliding_window, float soft_cap,
                                   int64_t key_splits, ffi::ResultBuffer<ffi::F32> out) {
  const ffi::DataType type = k_values.element_type();
  if (v_values.element_type() != type) {
    return Invalid("K values are " + type_name(type) + " but V values " +
                   type_name(v_values.element_type()) + " (quantized pools of one type)");
  }
  Mode mode;
  switch (type) {
    case ffi::DataType::S8: mode = Mode::kS8; break;
    case ffi::DataType::F8E4M3FN: mode = Mode::kF8E4M3FN; break;
    case ffi::DataType::F8E5M2: mode = Mode::kF8E5M2; break;
    default:
      return Invalid("quantized pools are int8, float8_e4m3fn or float8_e5m2, not " +
                     type_name(type));
  }
  for (const auto& [values, scales] : {std::pair{k_values.dimensions(), k_scales.dimensions()},
                                       std::pair{v_values.dimensions(), v_scales.dimensions()}}) {
    if (values.size() != 4 || scales.size() != 3 ||
        !std::equal(scales.begin(), scales.end(), values.begin())) {
      return Invalid("scales " + shape_string(scales) + " are not the values' " +
                     shape_string(values) + " less head_dim");
    }
  }
  return RunAttention(pool, {q.untyped_data(), q.dimensions()},
                      {k_values.untyped_data(), k_values.dimensions()},
                      {v_values.untyped_data(), v_values.dimensions()}, k_scales.typed_data(),
                      v_scales.typed_data(), block_tables, seq_lens, query_start_loc, scale,
                      query_tile, sliding_window, soft_cap, key_splits, mode,
                      out->untyped_data(), out->dimensions(), sizeof(float));
}

// The first of `count` indices outside [0, rows), or -1.
int64_t first_bad_index(const int32_t* index, int64_t count, int64_t rows) {
  for (int64_t t = 0; t < count; ++t)
    if (index[t] < 0 || index[t] >= rows) return t;
  return -1;
}

// dst[k, index[t]] = values[t, k] (token-major) or values[k, t], rows of `row_bytes`, in t order
// (a later duplicate wins), for a pool of `heads` x `rows` rows; dst starts as a copy of `src`
// where it is not src itself (XLA did not alias the result with the pool). The caller checks
// the indices (first_bad_index).
void write_rows(char* dst, const void* src, int64_t heads, int64_t rows, int64_t row_bytes,
                const int32_t* index, int64_t count, const char* values, bool token_major) {
  if (dst != src) std::memcpy(dst, src, static_cast<size_t>(heads * rows * row_bytes));
  for (int64_t k = 0; k < heads; ++k)
    for (int64_t t = 0; t < count; ++t)
      std::memcpy(dst + (k * rows + index[t]) * row_bytes,
                  values + (token_major ? t * heads + k : k * count + t) * row_bytes,
                  static_cast<size_t>(row_bytes));
}

// pool[:, index[t]] = values[:, t] in place (the result aliases the pool): the KV write and
// block copies for pools XLA:CPU cannot scatter itself without converting the whole pool to
// float32 and back (bfloat16, float8; see pallas_kernels/bits.py). values [K, T, R...] of
// the pool's element type, index [T] int32; the pool [K, ...] is read as [K, N, prod(R)]
// whatever its shape (a [K, blocks, block_size, D] pool takes slot indices directly: a
// reshape of the operand would make XLA copy the pool before the call). Rows are written in
// t order (a later duplicate wins; callers never rely on it).
ffi::Error SetRows(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> index, ffi::AnyBuffer values,
                   int64_t token_major, ffi::Result<ffi::AnyBuffer> out) {
  const auto pd = pool.dimensions();
  const auto vd = values.dimensions();
  // values [K, T, *row], or [T, K, *row] with token_major (a step's new K/V as the projection
  // leaves them: no transposing copy before the write)
  const int64_t head_axis = token_major ? 1 : 0, token_axis = 1 - head_axis;
  if (pool.element_type() != values.element_type() || pd.size() < 1 || vd.size() < 2 ||
      index.dimensions().size() != 1 || vd[head_axis] != pd[0] ||
      vd[token_axis] != index.dimensions()[0])
    return Invalid("set_rows: inconsistent shapes or element types");
  int64_t row_elems = 1;
  for (size_t i = 2; i < vd.size(); ++i) row_elems *= vd[i];
  const int64_t per_head = pd[0] ? static_cast<int64_t>(pool.element_count()) / pd[0] : 0;
  if (row_elems == 0 || per_head % row_elems)
    return Invalid("set_rows: rows do not tile the pool");
  const int64_t rows = per_head / row_elems;
  const int64_t row_bytes = row_elems * static_cast<int64_t>(ffi::ByteWidth(pool.element_type()));
  const int64_t heads = pd[0], count = vd[token_axis];
  if (first_bad_index(index.typed_data(), count, rows) >= 0)
    return Invalid("set_rows: index outside the pool");
  write_rows(static_cast<char*>(out->untyped_data()), pool.untyped_data(), heads, rows, row_bytes,
             index.typed_data(), count, static_cast<const char*>(values.untyped_data()),
             token_major);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
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
// (measured on a 2-core Zen 4 reading 34 GB/s: the [N, K] walk 8.9 -> 14-16 GB/s on one
// core, 11 -> 26 on both).
// GCC/Clang vector extensions: AVX-512 registers where the build targets them, split into
// narrower ones elsewhere.

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v16f load16(const bf16* p) {
  v16h h;
  std::memcpy(&h, p, sizeof h);
  const v16u u = __builtin_convertvector(h, v16u) << 16;
  return __builtin_bit_cast(v16f, u);
}
inline float hsum(v16f v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

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
// JaxpageVectorLanes; the packed panels below use the machine's own width.)
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
constexpr int kL2 = 2;                      // __builtin_prefetch locality: into L2

// Prefetches rows [r0, r1) of w (row_bytes apart from `w` on), `bytes` of each from byte
// `offset` on, into L2, row by row: so memory serves each row's segment as one run.
inline void prefetch_rows(const char* w, int64_t row_bytes, int64_t r0, int64_t r1,
                          int64_t offset, int64_t bytes) {
  for (int64_t r = r0; r < r1; ++r) {
    const char* row = w + r * row_bytes + offset;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, kL2);
  }
}

// Prefetches `Lines` cache lines `bytes` past `at` (a point in a stream of w) into L2, unless
// that lies past w's end `w_end`: the [N, K] walk one line 8 KB ahead in each row's stream per
// 64 bytes read, the packed walk two lines 2-6 KB ahead in its panel per 128 bytes.
template <int Lines = 1>
inline void prefetch_ahead(const void* at, int64_t bytes, const char* w_end) {
  const char* ahead = static_cast<const char*>(at) + bytes;
  for (int line = 0; line < Lines; ++line)
    if (ahead + 64 * line < w_end) __builtin_prefetch(ahead + 64 * line, 0, kL2);
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

// ---------------------------------------------------------------------------------------------
// Packed matmuls (handler JaxpagePackedMatmul): out[M, N] float32 = x[M, K] . w, x and w of one
// element type (float32 or bfloat16), w packed once (pallas_kernels.cpu_attention.pack_weight)
// as [P][KG][kPanel][G]: P = N / kPanel panels of kPanel columns (32 with AVX-512, 16 with
// AVX2: two of the machine's vectors), each KG = ceil(K / G) groups of G rows long, a group's
// rows interleaved column by column (G = 2 for bfloat16: the pairs vdpbf16ps takes; G = 1 for
// float32: the panel is w's columns row after row). So a panel is one sequential stream of
// K * kPanel elements (a cache line a row, or a pair of rows, on AVX2), read once for up to
// kPackedRows x rows (8 with AVX-512, 6 with AVX2) whose accumulators (2 vectors a row) stay in
// registers along all of K: where the [K, N] walk above reads kKChunk short row segments at a
// time (one row of w per page apart), this reads memory in order, as fast as a plain sequential
// read (measured on the 2-core Zen box, bfloat16: the 120 projections of a SmolLM2 step at 1
// row 19-25 -> 33 GB/s, 8 rows 18-23 -> 29). For bfloat16 each 32-bit lane of a panel row is
// the pair vdpbf16ps multiplies by a broadcast pair (x[m, k], x[m, k + 1]), and x's rows as they
// lie are exactly those pairs, so x needs no transposing (an odd K's x is copied once with a
// zero appended); without vdpbf16ps x is widened to float32 once a call and each pair's two
// rows are widened from the panel in turn; float32 broadcasts x[m, k]. More rows take more
// passes over each panel (from cache after the first), the rows split evenly among them. Products
// and sums as in the [K, N] tiles, bit for bit: float32 FMAs k by k (bfloat16 widened exactly),
// or vdpbf16ps (products exact, pair sums and accumulation in float32, subnormals flushed).

// How far ahead in a panel's stream a pass over it prefetches, by the rows it serves: 2 KB for 1
// or 2 rows (3 KB where the build targets a CPU with AMX, below), 6 KB for more. Measured on the
// 2-core Zen 4 box (a decode step's 121 projections, weights from memory, each distance
// alternating with the others in one process, 60-100 rounds): one distance for all rows (4 KB
// before) is either too far for the fastest streams or too near for the slower ones: at 1 / 2 /
// 4 / 8 rows, bfloat16, 2 KB is 1.07x / 1.08x / 0.87x / 0.78x the 4 KB walk and 6 KB 0.99x /
// 1.01x / 1.07x / 1.10x (float32 alike: 1.03x / 1.08x / 0.95x / 0.76x and 0.93x / 1.03x / 1.08x
// / 1.10x); a whole decode step 1.03-1.11x (`bench_small_matmul.py --vs-prefetch 4096`,
// `bench_decode_step.py --vs-prefetch 4096`). On the 2-core AMX Xeon VM (Intel, the cores with
// AMX-BF16 this was measured on) 1-2 rows want more: the engine's decode step with each distance
// against 2 KB, alternating in one process (`scripts/ab_env_switch.py --engine`, 16 rounds each,
// paired medians), bfloat16 2 rows 2.5 KB -0.61 ms, 3 KB -0.59 / -0.71, 3.5 KB -0.67, 4 KB -0.27 /
// -0.54, 6 KB -0.48, 8 KB -0.29 (of ~12.5); 1 row 2.5 KB -0.17, 3 KB -0.27, 3.5 KB -0.40, 4 KB
// -0.06 / 0.00; float32 3 KB 2 rows -0.30, 1 row +0.01. A call's `prefetch_bytes` attribute
// overrides it (0: this choice), for those measurements.
#ifdef __AMX_TILE__
constexpr int64_t kFewRowsPrefetchBytes = 3072;
#else
constexpr int64_t kFewRowsPrefetchBytes = 2048;
#endif
constexpr int64_t packed_prefetch_bytes(int64_t rows) {
  return rows <= 2 ? kFewRowsPrefetchBytes : 6144;
}
constexpr int64_t kMaxPrefetchBytes = int64_t{1} << 20;
// Panels are shared among the threads in units (each claimed by the next free thread) of about
// this many a thread where M's rows take several passes over each panel (prefill; the arithmetic
// dominates, and small units even out threads that run at different speeds), and in one unit a
// thread where they take one (few rows, e.g. a decode step; a stream of the weights): each
// thread then reads one contiguous range, where four units a thread made it jump between
// ranges, restarting its prefetch stream at each. Measured on the 2-core Zen 4 box, bfloat16
// SmolLM2, against four units a thread in one process (scripts/ab_env_switch.py: a scratch
// build switched at run time; the median of paired differences): the engine's 8-row decode
// step 0.12-0.43 ms faster in 4 runs of 16-24 rounds (of ~12.5-13 ms; the four-unit build
// faster in 38-50% of the rounds), the runner's alone 0.23 and 0.34 ms faster in two runs of
// 40 and 0.24 ms slower in a third: a small gain, near the machine's noise; one row within
// noise (-0.09 ms). A thread that falls behind (descheduled, or late to start) leaves its range
// to the other only where that one has not started it.
constexpr int64_t kPackedUnitsPerThread = 4;

// The packed panels' vectors are the machine's own width (kLanes floats: 16 with AVX-512, else
// 8), a panel two of them: 32 columns with AVX-512, 16 with AVX2. GCC lowers a vector wider
// than the machine's through the stack (a 16-float v16f on AVX2: every broadcast 16 scalar
// stores, every FMA's operands reloaded), which made the 8-row float32 panel 7x slower than
// XLA's dot on a Zen 3 box. Two vectors a row leave room for many rows a pass (below); AVX2's
// earlier 32-column panels (4 vectors a row) fitted 2 rows, whose 8 accumulators with two
// dependent FMAs each per bfloat16 pair left the FMA units waiting (~41 GFLOP/s a thread of
// ~114 on a Zen 3 core), and splitting such a panel into halves for more rows made it two
// passes over alternate cache lines (slower in a decode step, where w comes from memory).
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

// bfloat16 on AMX tiles (Intel's Advanced Matrix Extensions, where the build targets a CPU with
// AMX-BF16 and Linux lets the process use the tile registers): one `tdpbf16ps` multiplies a
// 16-row x 32 tile of x by a 32 x 16 tile of w and adds it to a 16 x 16 float32 tile, 16 times
// the multiply-adds of a `vdpbf16ps`. The packed panels are already the layout it reads for w: a
// panel row of pairs is 32 columns x 2 bf16 (128 bytes), the left 16 columns' pairs its first 64
// bytes, so 16 consecutive pair rows at a stride of 128 bytes are one w tile (its 16 rows: pairs
// of k, its 64 bytes: 16 columns' pairs), and the panel's two halves two tiles. x is read as
// rows of a multiple of 16 pairs (zeros after K), 16-row blocks (zero rows after M), so every
// tile is whole: one tile configuration for every call (a panel's last, partial k-step reads w
// through a zeroed copy of its pair rows); x is copied once a call into that shape unless it
// has it already (a call of at most 16 rows loads only its rows). A pass over a panel serves two
// row blocks (32 rows): four output tiles, two of x, two of w, the machine's eight. Products
// exact, sums in float32 (subnormals flushed, as vdpbf16ps), in an order of the hardware's:
// within the float64 oracle's bound, not bit for bit the vdpbf16ps panels'.
constexpr int64_t kTileRows = 16, kTilePairs = 16;  // an x tile: 16 rows of 16 pairs
// Calls of fewer live rows take the vdpbf16ps panels instead: at 1-2 rows they stream the
// weights faster. bfloat16 SmolLM2 on a 2-core AMX Xeon VM, the engine's decode step alternating
// with tiles at every row count (scripts/ab_env_switch.py, 16 rounds each): 1 row 13.00 -> 11.27
// ms, 2 rows 13.74 -> 13.04, 4 rows within noise (+0.02), 8 rows 16.59 -> 19.62 (there the
// tiles' arithmetic pays); once the tiles took only the live rows (configure_tiles), tiles
// against the vector panels: 1 row +1.11 ms, 2 rows +0.57, 3 rows -0.20.
constexpr int64_t kTileMinRows = 3;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define JAXPAGE_TILES 1  // this build has the AMX tile path (PackedWork::run takes it too)
constexpr bool kHaveTiles = true;

// Linux hands out the tile registers' state only to a process that asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, once for all its threads).
bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// every tile 64 bytes wide (tdpbf16ps takes them as 16 float32 or 16 pairs a row), 16 rows but
// the first block's x and output tiles (0, 1, 4), `rows` (1-16): a call of fewer rows loads and
// multiplies only those
inline void configure_tiles(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  for (int t : {0, 1, 4}) config.rows[t] = static_cast<uint8_t>(rows);
  // GCC 12's _tile_loadconfig tells the compiler that ldtilecfg reads 8 bytes of the struct
  // (its asm operand is `*(const void**)config`), so the stores to the other 56 may be dropped
  // as dead: a copy of this function outlined in a scratch build lost them and ldtilecfg faulted
  // on the stack's old bytes (scripts/bench_ceilings.py, 2026-12-05). This barrier keeps them.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

constexpr int64_t kTileStepBytes = kTilePairs * kPanel * 2 * 2;  // a k-step of a panel: 2 KB
constexpr int64_t kTilePrefetchBytes = 2 * kTileStepBytes;  // how far ahead a panel's walk reads
static_assert(kPanel == 32, "a panel is two 16-column tiles wide");

// Output tiles 0 and 1 (`lower`: 2 and 3; the intrinsics take a tile's number as a literal) to
// a panel's 32 columns at dst, rows `stride` bytes apart.
inline void store_tile_pair(bool lower, float* dst, int64_t stride) {
  if (lower) {
    _tile_stored(2, dst, stride);
    _tile_stored(3, dst + 16, stride);
  } else {
    _tile_stored(0, dst, stride);
    _tile_stored(1, dst + 16, stride);
  }
}

// A block's last rows that fill part of a 16-row tile (see store_tiles), through a buffer here.
__attribute__((noinline)) void store_tile_rows(bool lower, float* out, int64_t N, int64_t rows) {
  alignas(64) float buf[kTileRows][kPanel];
  store_tile_pair(lower, &buf[0][0], kPanel * 4);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * N, buf[r], kPanel * 4);
}

// out[r0 .. r0 + rows, n0 .. n0 + 32] from output tiles 0 and 1 (`lower`: 2 and 3), which hold
// `tile_rows` rows (configure_tiles).
// Straight into out where those are all the rows wanted: vector loads of what a tile store has
// just written are slow (by the timings, they wait for the store to complete: no forwarding
// from tile stores), and bouncing each panel's 8 rows through a buffer here cost an 8-row step
// 0.43 ms (runner) / 0.51 (engine) on the 2-core AMX box (scripts/ab_env_switch.py; the walk
// alone, bench_ceilings.py's, 11% slower with the bounce, 4% with the stores straight to out).
// Only a block's last rows that fill part of a 16-row tile go through a buffer, out of line
// (tile_panel below says why).
inline void store_tiles(bool lower, float* out, int64_t N, int64_t r0, int64_t rows,
                        int64_t tile_rows, int64_t n0) {
  float* dst = out + r0 * N + n0;
  if (rows != tile_rows) return store_tile_rows(lower, dst, N, rows);
  store_tile_pair(lower, dst, N * 4);
}

// A panel's last k-step where KG is not a multiple of 16 (`bytes` of pairs at `wt`): loads w
// tiles 6 and 7 from its pairs then zeros (x is zeros there too).
__attribute__((noinline)) void load_tail_tiles(const char* wt, int64_t bytes) {
  alignas(64) char tail[kTileStepBytes];
  std::memcpy(tail, wt, bytes);
  std::memset(tail + bytes, 0, kTileStepBytes - bytes);
  // GCC's _tile_loadd does not tell the compiler that it reads memory: without this barrier
  // the writes above are dead stores to a local, and were dropped
  asm volatile("" : : "r"(tail) : "memory");
  _tile_loadd(6, tail, kPanel * 4);
  _tile_loadd(7, tail + 64, kPanel * 4);
}

// One panel (KG pairs) for row blocks b and, where `Two`, b + 1 of x_tiles (rows of KGT pairs,
// KGT a multiple of 16); `rows`: the live rows of x, `ahead`: how far ahead of a k-step its
// weights are prefetched. The rare paths, a last k-step of fewer than 16 pairs and a block's
// partial last rows, run out of line (load_tail_tiles, store_tile_rows) with their buffers:
// written in here, the same loop of tile loads and prefetches streamed an 8-row bfloat16 step
// 0.22-0.31 ms slower (engine; 4 rows 0.18; scripts/ab_env_switch.py, 20 rounds, faster in
// 75-90%) on the 2-core AMX Xeon, and a C++ harness of 80 gate_up walks 4-10% slower. The
// loop's instructions are the same either way (objdump): the cause is not established.
// `Stream` (a call of more than 16 rows: every one with `Two`) loads w's tiles with the
// non-temporal hint (tileloaddt1): past 16 rows x's tiles of a pass (32 rows of K pairs: 36 KB for
// K = 576) no longer stay in L1 beside the weight stream, and loading one from L2 costs the walk
// most of what its rows add (a harness walking 80 gate_up weights at 64 rows: 300 us a weight, 230
// with x's loads from one L1-resident tile); with w kept out of L1 a 24-32 row bfloat16 SmolLM2
// step ran 0.5-1.1 ms faster (runner, scripts/ab_env_switch.py, faster in 63-75% of 20-40 rounds),
// 64 rows 0.1-0.8, 48 rows within noise (2-core AMX Xeon).
template <bool Two, bool Stream = Two>
void tile_panel(const uint32_t* xt, int64_t KGT, int64_t KG, int64_t b, int64_t rows,
                const char* panel, const char* w_end, int64_t ahead, float* out, int64_t N,
                int64_t n0) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (Two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint32_t* a0 = xt + b * kTileRows * KGT;
  const uint32_t* a1 = a0 + kTileRows * KGT;
  const int64_t a_stride = KGT * 4, steps = KGT / kTilePairs, whole = KG / kTilePairs;
  for (int64_t s = 0; s < steps; ++s) {
    const char* wt = panel + s * kTileStepBytes;
    if (s == whole) {
      load_tail_tiles(wt, (KG - whole * kTilePairs) * kPanel * 2 * 2);
    } else {
      for (int64_t line = 0; line < kTileStepBytes; line += 64)
        if (wt + ahead + line < w_end) __builtin_prefetch(wt + ahead + line, 0, 2);
      if constexpr (Stream) {
        _tile_stream_loadd(6, wt, kPanel * 4);
        _tile_stream_loadd(7, wt + 64, kPanel * 4);
      } else {
        _tile_loadd(6, wt, kPanel * 4);
        _tile_loadd(7, wt + 64, kPanel * 4);
      }
    }
    _tile_loadd(4, a0 + s * kTilePairs, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (Two) {
      _tile_loadd(5, a1 + s * kTilePairs, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t r0 = b * kTileRows;
  store_tiles(false, out, N, r0, std::min(kTileRows, rows - r0), std::min(rows, kTileRows), n0);
  if constexpr (Two)
    store_tiles(true, out, N, r0 + kTileRows, std::min(kTileRows, rows - r0 - kTileRows),
                kTileRows, n0);
}
#else
constexpr bool kHaveTiles = false;
bool tiles_permitted() { return false; }
#endif

struct PackedWork {
  // what the panel functions read as x: float32 rows [M][K], or bfloat16 rows as KG pairs
  // (vdpbf16ps), or bfloat16 rows widened to 2 KG floats
  const void* x = nullptr;
  std::vector<uint32_t> x_pairs;  // an odd K's bfloat16 x, a zero appended to each row
  std::vector<float> x_wide;      // bfloat16 x widened (an odd K's with a zero appended)
  const char* w = nullptr;
  const char* w_end = nullptr;
  float* out = nullptr;
  int64_t M = 0, KG = 0, N = 0, panel_bytes = 0, panels = 0, units = 0;
  int64_t prefetch = 0;  // bytes ahead in a panel's stream; 0: packed_prefetch_bytes(rows)
  PackedPanelFn fns[kPackedRows] = {};  // by rows in the pass, less one
  // AMX tiles (`tiles`): x as rows of KGT pairs (a multiple of 16), 16-row blocks, at `xt`: x
  // itself where its rows are that already (prepare_packed), else `x_tiles`, a padded copy
  bool tiles = false;
  std::vector<uint32_t> x_tiles;
  const uint32_t* xt = nullptr;
  int64_t KGT = 0;
  // Epilogues, for the decoder layer (vector panels and tiles alike): the units share groups
  // of `span` panels, [0, panels / span); each panel p of a group is run with panel p + pair
  // where `pair` > 0, and `after_group(g)` (where set) follows group g on the same thread,
  // reading its columns from this thread's cache: gate_up (span 1, pair I / kPanel: a gate
  // panel, its up panel, SiLU of their columns) and qkv (span D / kPanel: a head, its rotary
  // embedding).
  int64_t span = 1, pair = 0;
  std::function<void(int64_t)> after_group;

  void run() {
#ifdef JAXPAGE_TILES
    if (tiles) {
      // this thread's tile registers, released (zeroed) when done
      configure_tiles(std::min(M, kTileRows));
      const int64_t blocks = (M + kTileRows - 1) / kTileRows;
      const int64_t ahead = prefetch ? prefetch : kTilePrefetchBytes;
      const bool stream = M > kTileRows;
      run_groups([&](int64_t p) {
        for (int64_t b = 0; b < blocks; b += 2)  // the panel from cache after the first
          (b + 1 < blocks ? tile_panel<true>
                          : stream ? tile_panel<false, true> : tile_panel<false>)(
              xt, KGT, KG, b, M, w + p * panel_bytes, w_end, ahead, out, N,
              p * kPanel);
      });
      _tile_release();
      return;
    }
#endif
    // M's rows in as few passes over a panel as kPackedRows allows, as even as can be (8 rows
    // on AVX2: 4 + 4, not 6 + 2, whose 2-row pass waits on its FMAs' latency; bfloat16 on one
    // cached [576, 3072] weight, Zen 3: 182-190 us against 202-218)
    const int64_t passes = (M + kPackedRows - 1) / kPackedRows;
    run_groups([&](int64_t p) {
      for (int64_t b = 0; b < passes; ++b) {  // the panel from cache after the first
        const int64_t m0 = b * M / passes, m1 = (b + 1) * M / passes;
        const int64_t ahead = prefetch ? prefetch : packed_prefetch_bytes(m1 - m0);
        fns[m1 - m0 - 1](x, KG, m0, w + p * panel_bytes, w_end, ahead, out, N, p * kPanel);
      }
    });
  }

  // claims units until none is left, running each one's groups of panels (`panel(p)`) and their
  // epilogues, and counts each unit in `done`
  template <typename Panel>
  void run_groups(const Panel& panel) {
    const int64_t groups = panels / span;
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) {
      // unit u: groups [u G / units, (u + 1) G / units), as even as can be
      for (int64_t g = u * groups / units, last = (u + 1) * groups / units; g < last; ++g) {
        for (int64_t p = g * span; p < (g + 1) * span; ++p) {
          panel(p);
          if (pair) panel(p + pair);
        }
        if (after_group) after_group(g);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }

  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

ffi::Error InvalidPacked(const std::string& what) {
  return ffi::Error::InvalidArgument("packed matmul: " + what);
}

// Sets `work` up for out [M, N] = x [M, K] . w (packed, P panels; N = P kPanel), x float32 or
// bfloat16 (`f32`) as w, of which only the first `live` rows are multiplied: the others (a
// bucket's padding) are zeros, not computed: on a CPU bound by its multiply-adds (AVX2: 8 rows
// cost ~2x one) padding a decode step is not free. Returns the units to run (0: nothing).
int64_t prepare_packed(PackedWork& work, const void* x, bool f32, int64_t M, int64_t live,
                       int64_t K, const void* w, int64_t P, float* out, int64_t bf16_dot,
                       int64_t prefetch_bytes, int64_t threads) {
  const int64_t G = f32 ? 1 : 2, KG = (K + G - 1) / G, N = P * kPanel;
  if (M == 0 || N == 0) return 0;
  const int64_t rows = std::clamp<int64_t>(live, 0, M);
  std::fill(out + (K == 0 ? 0 : rows) * N, out + M * N, 0.0f);
  if (K == 0 || rows == 0) return 0;
  work.x = x;  // read by the helpers, all done before the call returns
  const bf16* xb = static_cast<const bf16*>(x);
  const bool dot = !f32 && bf16_dot != 0 && kHaveBf16Dot;
  work.tiles = dot && bf16_dot == 2 && rows >= kTileMinRows && kHaveTiles && tiles_permitted();
  if (work.tiles) {  // x's rows as whole tiles: pairs to a multiple of 16, rows of 16
    work.KGT = (KG + kTilePairs - 1) / kTilePairs * kTilePairs;
    if (K % (2 * kTilePairs) == 0 && rows <= kTileRows) {
      // x's rows are whole tile rows already, and a call of at most 16 rows loads only those
      // (configure_tiles): the tiles read x where it lies. The copy (a zeroed 16-row block, then
      // the rows) ran on the calling thread while the helpers waited for the stage: without it
      // a bfloat16 SmolLM2 step of 8 rows was 0.30 ms faster (runner; the engine 0.18), of 4
      // rows 0.29 (2-core AMX Xeon, scripts/ab_env_switch.py, 20-30 rounds, 70-80% faster).
      work.xt = reinterpret_cast<const uint32_t*>(xb);
    } else {
      const int64_t padded_rows = (rows + kTileRows - 1) / kTileRows * kTileRows;
      work.x_tiles.assign(static_cast<size_t>(padded_rows * work.KGT), 0u);
      for (int64_t m = 0; m < rows; ++m)
        std::memcpy(work.x_tiles.data() + m * work.KGT, xb + m * K, K * sizeof(bf16));
      work.xt = work.x_tiles.data();
    }
  } else if (!f32 && !dot) {  // each x element widened once here, not once per panel
    work.x_wide.assign(static_cast<size_t>(rows * 2 * KG), 0.0f);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < K; ++k) work.x_wide[m * 2 * KG + k] = widen(xb[m * K + k]);
    work.x = work.x_wide.data();
  } else if (dot && K % 2) {
    work.x_pairs.assign(static_cast<size_t>(rows * KG), 0u);
    for (int64_t m = 0; m < rows; ++m)
      std::memcpy(work.x_pairs.data() + m * KG, xb + m * K, K * sizeof(bf16));
    work.x = work.x_pairs.data();
  }
  for (int mb = 1; mb <= kPackedRows; ++mb)
    work.fns[mb - 1] = f32   ? packed_pick<true, false>(mb, kPackedRowSeq)
                       : dot ? packed_pick<false, true>(mb, kPackedRowSeq)
                             : packed_pick<false, false>(mb, kPackedRowSeq);
  work.w = static_cast<const char*>(w);
  work.panel_bytes = KG * kPanel * G * (f32 ? 4 : 2);
  work.w_end = work.w + P * work.panel_bytes;
  work.out = out;
  work.M = rows, work.KG = KG, work.N = N, work.panels = P;
  work.prefetch = prefetch_bytes;
  // a multiple of the threads' count of units (where there are enough panels), so that each
  // thread has as many: units of floor(P / (4 x threads)) panels cut SmolLM2's 36-panel o and
  // down projections (AVX2's 16-column panels) into 9 units of 4 for 2 threads, 5 for one
  work.units = std::min(P, threads * (rows <= kPackedRows ? 1 : kPackedUnitsPerThread));
  return work.units;
}

ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::Buffer<ffi::S32> live, int64_t bf16_dot, int64_t prefetch_bytes,
                        ffi::ResultBuffer<ffi::F32> out) {
  const ffi::DataType type = x.element_type();
  if (const std::string problem = matmul_types_problem(type, w.element_type()); !problem.empty())
    return InvalidPacked(problem);
  const bool f32 = type == ffi::DataType::F32;
  const int64_t G = f32 ? 1 : 2;
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[2] != kPanel || wd[3] != G)
    return InvalidPacked("x " + shape_string(xd) + " must be a matrix and w " +
                         shape_string(wd) + " [panels, K / " + std::to_string(G) + ", " +
                         std::to_string(kPanel) + ", " + std::to_string(G) + "]");
  const int64_t M = xd[0], K = xd[1], P = wd[0], KG = wd[1], N = P * kPanel;
  if ((K + G - 1) / G != KG)
    return InvalidPacked("x " + shape_string(xd) + " does not contract with w " +
                         shape_string(wd) + " (K groups)");
  if (od.size() != 2 || od[0] != M || od[1] != N)
    return InvalidPacked("output " + shape_string(od) + " is not [" +
                         std::to_string(M) + ", " + std::to_string(N) + "]");
  if (bf16_dot < 0 || bf16_dot > 2)
    return InvalidPacked("bf16_dot must be 0, 1 or 2, got " + std::to_string(bf16_dot));
  if (prefetch_bytes < 0 || prefetch_bytes > kMaxPrefetchBytes)
    return InvalidPacked("prefetch_bytes must be in [0, " + std::to_string(kMaxPrefetchBytes) +
                         "], got " + std::to_string(prefetch_bytes));
  if (live.element_count() != 1)
    return InvalidPacked("live rows must be one int32, got " + shape_string(live.dimensions()));
  auto work = std::make_shared<PackedWork>();
  const int64_t total = prepare_packed(*work, x.untyped_data(), f32, M, live.typed_data()[0], K,
                                       w.untyped_data(), P, out->typed_data(), bf16_dot,
                                       prefetch_bytes, thread_count(pool));
  if (total) run_shared(pool, work, total);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// A layer's elementwise glue between its matmuls (handlers JaxpageAddRmsNorm, JaxpageSiluMul,
// JaxpageQkvRope), for models in float32 or bfloat16 (T, the residual stream's type). XLA:CPU
// runs each of these as its own loop fusion, and from 8 rows on its parallel task assigner
// splits most of them over the intra-op threads: ~5-20 us each for a few KB of data, ten of
// them a layer (bfloat16, 8 rows: 3.4 ms of a 20 ms SmolLM2 step). Here each is one call that
// reads the matmul's float32 output where it lies and rounds it to T first, as the model's
// `.astype(T)` does; small calls stay on the calling thread, large ones (prefill) share their
// rows among the threads.
// - add + RMSNorm: sum = T(x + T(delta)) (the residual add: float32 sum of the two, rounded
//   once, as XLA adds T values), then normed = T(weight * T(sum * 1 / sqrt(mean(sum^2) + eps)))
//   in float32 (HF's and rms_norm's formula and roundings; the mean sums in this kernel's
//   order, so not bit for bit XLA's). Without delta (0 elements) sum is x.
// - SiLU and multiply: out = T(T(silu(g)) * u), g and u the two halves of gate_up rounded to T,
//   silu(g) = g * sigmoid(g) in float32 (sigmoid from exp_nonpositive(-|g|), never overflowing),
//   rounded once as HF's bfloat16 silu is (XLA rounds each of its ops to bfloat16 in turn).
// - qkv split and rotary embedding (rotate_half): q, k, v from qkv [T, (H + 2 KH) D] rounded to
//   T; q and k rotated as rotate() does, T(T(x cos) + T(r sin)) with r = rotate_half(x): each
//   product and the sum rounded to T as XLA rounds them, so bit for bit the jnp path's.

// x rounded to bfloat16 (nearest even; NaN a quiet NaN), as a float32: narrow() then widen()
// on 32-bit lanes, with a select for NaN, so that loops over it vectorize without packing
// and unpacking 16-bit lanes
inline float to_io(float x, float) { return x; }
inline float to_io(float x, bf16) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  const uint32_t even = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const uint32_t nan = (bits | 0x400000u) & 0xffff0000u;
  return __builtin_bit_cast(float, (bits & 0x7fffffffu) > 0x7f800000u ? nan : even);
}
template <typename T> inline float rounded(float x) { return to_io(x, T{}); }

// Rows [0, rows) in chunks shared by the caller and the pool's threads when there are enough
// elements to pay for waking them (a decode step's rows stay on the caller).
template <typename F>
struct RowWork {
  F fn;
  int64_t rows = 0, chunk = 1, units = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  explicit RowWork(F f) : fn(std::move(f)) {}
  void run() {
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) {
      fn(u * chunk, std::min(rows, (u + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// fn over rows [0, rows) on this thread alone, as one unit, through the code the helpers run
// (run_units): a row's glue is the same computed alone or shared
template <typename F>
void rows_here(F fn, int64_t rows) {
  RowWork<F> alone(std::move(fn));
  alone.rows = alone.chunk = rows;
  alone.units = rows > 0;
  run_units(alone);
}

constexpr int64_t kShareElements = 1 << 16;  // below: one thread (measured: 64 x 3072 SiLU)

template <typename F>
void for_rows(ffi::ThreadPool& pool, int64_t rows, int64_t row_elements, F fn) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (threads == 1 || rows < 2 || rows * row_elements < kShareElements) {
    rows_here(std::move(fn), rows);
    return;
  }
  auto work = std::make_shared<RowWork<F>>(std::move(fn));
  work->rows = rows;
  work->chunk = (rows + threads * 4 - 1) / (threads * 4);
  work->units = (rows + work->chunk - 1) / work->chunk;
  run_shared(pool, work, work->units);
}

template <typename T> T* data_as(ffi::AnyBuffer b) { return static_cast<T*>(b.untyped_data()); }
template <typename T> T* data_as(ffi::Result<ffi::AnyBuffer>& b) {
  return static_cast<T*>(b->untyped_data());
}

// One row of add + RMSNorm: x, delta (D: float, or T), weight, sum and out of H elements.
template <typename T, typename D>
void add_rms_norm_row(const T* x, const D* delta, const T* weight, float eps, int64_t H, T* sum,
                      T* out) {
  float squares[16] = {};
  const int64_t vec_end = H / 16 * 16;
  for (int64_t j0 = 0; j0 < vec_end; j0 += 16) {
#pragma omp simd
    for (int l = 0; l < 16; ++l) {
      const int64_t j = j0 + l;
      float s = to_float(x[j]);
      if (delta) s = rounded<T>(s + rounded<T>(to_float(delta[j])));
      sum[j] = from_float<T>(s);
      squares[l] += s * s;
    }
  }
  float tail = 0.0f;
  for (int64_t j = vec_end; j < H; ++j) {
    float s = to_float(x[j]);
    if (delta) s = rounded<T>(s + rounded<T>(to_float(delta[j])));
    sum[j] = from_float<T>(s);
    tail += s * s;
  }
  float total = tail;
  for (int l = 0; l < 16; ++l) total += squares[l];
  const float scale = 1.0f / std::sqrt(total / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t j = 0; j < H; ++j)
    out[j] = from_float<T>(to_float(weight[j]) * rounded<T>(to_float(sum[j]) * scale));
}

// Rows r0..r1 of add + RMSNorm (add_rms_norm_row), x, delta (or null), sum and out [T, H].
template <typename T, typename D>
void add_rms_norm_rows(const T* x, const D* delta, const T* weight, float eps, int64_t H,
                       int64_t r0, int64_t r1, T* sum, T* out) {
  for (int64_t r = r0; r < r1; ++r)
    add_rms_norm_row<T, D>(x + r * H, delta ? delta + r * H : nullptr, weight, eps, H,
                           sum + r * H, out + r * H);
}

template <typename T>
ffi::Error AddRmsNormTyped(ffi::ThreadPool& pool, ffi::AnyBuffer x, ffi::AnyBuffer delta,
                           ffi::AnyBuffer weight, float eps, ffi::Result<ffi::AnyBuffer>& sum,
                           ffi::Result<ffi::AnyBuffer>& out) {
  const auto xd = x.dimensions();
  const int64_t H = xd[1], rows = xd[0];
  const T* xs = data_as<const T>(x);
  const T* w = data_as<const T>(weight);
  T* sums = data_as<T>(sum);
  T* outs = data_as<T>(out);
  const bool has_delta = delta.element_count() != 0;
  const bool delta_f32 = delta.element_type() == ffi::DataType::F32;
  for_rows(pool, rows, H, [=](int64_t r0, int64_t r1) {
    if (has_delta && delta_f32)
      add_rms_norm_rows<T, float>(xs, data_as<const float>(delta), w, eps, H, r0, r1, sums, outs);
    else
      add_rms_norm_rows<T, T>(xs, has_delta ? data_as<const T>(delta) : nullptr, w, eps, H, r0,
                              r1, sums, outs);
  });
  return ffi::Error::Success();
}

bool is_model_type(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

bool same_dims(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

ffi::Error AddRmsNorm(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer delta,
                      ffi::AnyBuffer weight, float eps, ffi::Result<ffi::AnyBuffer> sum,
                      ffi::Result<ffi::AnyBuffer> out) {
  const ffi::DataType type = x.element_type();
  const auto xd = x.dimensions();
  const bool has_delta = delta.element_count() != 0;
  if (!is_model_type(type) || weight.element_type() != type || sum->element_type() != type ||
      out->element_type() != type ||
      (has_delta && delta.element_type() != type && delta.element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument(
        "add_rms_norm: x, weight and the outputs must be float32 or bfloat16 alike, delta of "
        "x's type or float32");
  if (xd.size() != 2 || weight.dimensions().size() != 1 || weight.dimensions()[0] != xd[1] ||
      (has_delta && (delta.dimensions().size() != 2 || delta.dimensions()[0] != xd[0] ||
                     delta.dimensions()[1] != xd[1])) ||
      !same_dims(sum->dimensions(), xd) || !same_dims(out->dimensions(), xd))
    return ffi::Error::InvalidArgument(
        "add_rms_norm: x [T, H] " + shape_string(xd) + ", delta [T, H] or empty " +
        shape_string(delta.dimensions()) + ", weight [H] " +
        shape_string(weight.dimensions()) + " and outputs of x's shape");
  if (!(eps >= 0.0f)) return ffi::Error::InvalidArgument("add_rms_norm: eps must be >= 0");
  return type == ffi::DataType::F32 ? AddRmsNormTyped<float>(pool, x, delta, weight, eps, sum, out)
                                    : AddRmsNormTyped<bf16>(pool, x, delta, weight, eps, sum, out);
}

// silu(g) in float32: g * sigmoid(g), the sigmoid 1 / (1 + e) or e / (1 + e) with
// e = exp(-|g|) <= 1 (NaN stays NaN: g * anything).
inline float silu(float g) {
  const float e = exp_nonpositive(-std::fabs(g));
  const float inv = 1.0f / (1.0f + e);
  return g * (g >= 0.0f ? inv : e * inv);
}

// out[r, c0 .. c1) = T(T(silu(g)) * u) for rows [r0, r1) of gate_up [T, 2I] (g its first I
// columns, u the rest) and out [T, I]: every element alike, whatever columns a call takes
template <typename T, typename S>
void silu_mul_block(const S* gate_up, int64_t I, int64_t r0, int64_t r1, int64_t c0,
                    int64_t c1, T* out) {
  for (int64_t r = r0; r < r1; ++r) {
    const S* gate = gate_up + r * 2 * I;
    const S* up = gate + I;
    T* o = out + r * I;
#pragma omp simd
    for (int64_t j = c0; j < c1; ++j) {
      const float g = rounded<T>(to_float(gate[j])), u = rounded<T>(to_float(up[j]));
      o[j] = from_float<T>(rounded<T>(silu(g)) * u);
    }
  }
}

template <typename T, typename S>
void silu_mul_rows(const S* gate_up, int64_t I, int64_t r0, int64_t r1, T* out) {
  silu_mul_block<T, S>(gate_up, I, r0, r1, 0, I, out);
}

ffi::Error SiluMul(ffi::ThreadPool pool, ffi::AnyBuffer gate_up, ffi::Result<ffi::AnyBuffer> out) {
  const ffi::DataType type = out->element_type(), in = gate_up.element_type();
  const auto gd = gate_up.dimensions(), od = out->dimensions();
  if (!is_model_type(type) || (in != type && in != ffi::DataType::F32))
    return ffi::Error::InvalidArgument(
        "silu_mul: the output must be float32 or bfloat16, gate_up of its type or float32");
  if (gd.size() != 2 || gd[1] % 2 || od.size() != 2 || od[0] != gd[0] || od[1] * 2 != gd[1])
    return ffi::Error::InvalidArgument("silu_mul: gate_up [T, 2I] " + shape_string(gd) +
                                       " and output [T, I] " + shape_string(od));
  const int64_t I = od[1];
  const void* src = gate_up.untyped_data();
  void* dst = out->untyped_data();
  const bool f32_in = in == ffi::DataType::F32;
  for_rows(pool, gd[0], 2 * I, [=](int64_t r0, int64_t r1) {
    if (type == ffi::DataType::F32)
      silu_mul_rows<float, float>(static_cast<const float*>(src), I, r0, r1,
                                  static_cast<float*>(dst));
    else if (f32_in)
      silu_mul_rows<bf16, float>(static_cast<const float*>(src), I, r0, r1,
                                 static_cast<bf16*>(dst));
    else
      silu_mul_rows<bf16, bf16>(static_cast<const bf16*>(src), I, r0, r1,
                                static_cast<bf16*>(dst));
  });
  return ffi::Error::Success();
}

// `heads` heads of one token rotated: x (S elements, D apart) -> out (T), cos and sin [D]. The
// two products are rounded before their sum, as XLA's float32 ops are: not contracted into an
// FMA (which the compiler would do here otherwise, and give another float32 result).
template <typename T, typename S>
__attribute__((optimize("fp-contract=off"))) void rope_heads(const S* x, const T* cos, const T* sin, int64_t heads, int64_t D, T* out) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const S* xh = x + h * D;
    T* oh = out + h * D;
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) {
      const float v = rounded<T>(to_float(xh[j]));
      const float r = j < half ? -rounded<T>(to_float(xh[j + half]))
                               : rounded<T>(to_float(xh[j - half]));
      const float a = rounded<T>(v * to_float(cos[j]));
      const float b = rounded<T>(r * to_float(sin[j]));
      oh[j] = from_float<T>(a + b);
    }
  }
}

// out[0 .. n) = x rounded to T (v's part of qkv)
template <typename T, typename S>
void round_to(const S* x, int64_t n, T* out) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = from_float<T>(rounded<T>(to_float(x[j])));
}

template <typename T, typename S>
void qkv_rope_rows(const S* qkv, const T* cos, const T* sin, int64_t H, int64_t KH, int64_t D,
                   int64_t r0, int64_t r1, T* q, T* k, T* v) {
  const int64_t width = (H + 2 * KH) * D;
  for (int64_t t = r0; t < r1; ++t) {
    const S* row = qkv + t * width;
    rope_heads<T, S>(row, cos + t * D, sin + t * D, H, D, q + t * H * D);
    rope_heads<T, S>(row + H * D, cos + t * D, sin + t * D, KH, D, k + t * KH * D);
    round_to<T, S>(row + (H + KH) * D, KH * D, v + t * KH * D);
  }
}

ffi::Error QkvRope(ffi::ThreadPool pool, ffi::AnyBuffer qkv, ffi::AnyBuffer cos,
                   ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> q,
                   ffi::Result<ffi::AnyBuffer> k, ffi::Result<ffi::AnyBuffer> v) {
  const ffi::DataType type = q->element_type(), in = qkv.element_type();
  if (!is_model_type(type) || (in != type && in != ffi::DataType::F32) ||
      cos.element_type() != type || sin.element_type() != type || k->element_type() != type ||
      v->element_type() != type)
    return ffi::Error::InvalidArgument(
        "qkv_rope: q, k, v, cos and sin must be float32 or bfloat16 alike, qkv of their type "
        "or float32");
  const auto xd = qkv.dimensions(), qd = q->dimensions(), kd = k->dimensions(),
             vd = v->dimensions(), cd = cos.dimensions();
  const bool shapes = xd.size() == 2 && qd.size() == 3 && kd.size() == 3 && same_dims(vd, kd) &&
                      qd[0] == xd[0] && kd[0] == xd[0] && qd[2] == kd[2] && qd[2] % 2 == 0 &&
                      (qd[1] + 2 * kd[1]) * qd[2] == xd[1] && cd.size() == 2 &&
                      cd[0] == xd[0] && cd[1] == qd[2] && same_dims(sin.dimensions(), cd);
  if (!shapes)
    return ffi::Error::InvalidArgument(
        "qkv_rope: qkv [T, (H + 2 KH) D] " + shape_string(xd) + ", q [T, H, D] " +
        shape_string(qd) + ", k and v [T, KH, D] " + shape_string(kd) + " " +
        shape_string(vd) + ", cos and sin [T, D] " + shape_string(cd) + " " +
        shape_string(sin.dimensions()) + " (D even)");
  const int64_t H = qd[1], KH = kd[1], D = qd[2];
  const void* src = qkv.untyped_data();
  const void *c = cos.untyped_data(), *s = sin.untyped_data();
  void *qo = q->untyped_data(), *ko = k->untyped_data(), *vo = v->untyped_data();
  const bool f32_in = in == ffi::DataType::F32;
  for_rows(pool, xd[0], xd[1], [=](int64_t r0, int64_t r1) {
    if (type == ffi::DataType::F32)
      qkv_rope_rows<float, float>(static_cast<const float*>(src), static_cast<const float*>(c),
                                  static_cast<const float*>(s), H, KH, D, r0, r1,
                                  static_cast<float*>(qo), static_cast<float*>(ko),
                                  static_cast<float*>(vo));
    else if (f32_in)
      qkv_rope_rows<bf16, float>(static_cast<const float*>(src), static_cast<const bf16*>(c),
                                 static_cast<const bf16*>(s), H, KH, D, r0, r1,
                                 static_cast<bf16*>(qo), static_cast<bf16*>(ko),
                                 static_cast<bf16*>(vo));
    else
      qkv_rope_rows<bf16, bf16>(static_cast<const bf16*>(src), static_cast<const bf16*>(c),
                                static_cast<const bf16*>(s), H, KH, D, r0, r1,
                                static_cast<bf16*>(qo), static_cast<bf16*>(ko),
                                static_cast<bf16*>(vo));
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// A decoder layer in one call (handler JaxpageDecoderLayer): a Llama-family layer without biases
// or q/k norms (SmolLM2, Llama, TinyLlama), float32 or bfloat16 (T), its weights packed, for a
// step of few tokens (decode). The model's unfused path makes eleven calls of such a layer (three
// packed matmuls and the o projection, the rotary split, two pool writes, attention, SiLU, two
// add + norms), and each parallel one schedules its helpers anew and starts its weight stream
// cold: a 1-row bfloat16 step of SmolLM2 spends ~1.4 ms more on its 121 matmuls than one stream
// of the same weights takes (9.97 against 8.54 ms, measured in turn in XLA and in C++), where
// two threads that stay together and wait for each other between the matmuls lose 0.07 ms
// (scratch C++, 30 layers' weights and the head: 8.88 ms as one stream, 8.95 ms with a barrier
// after each matmul). Here the helpers are scheduled once and serve the layer's parallel stages
// in turn (Team); the glue between runs on the calling thread. Each stage is the function the
// unfused call runs, on the same operands, so outputs and pools are the unfused path's bit for
// bit:
//   qkv = h . W_qkv; q, k, v = rotary split of qkv (QkvRope); pools[:, slot[t]] = k[t], v[t];
//   a = attention(q, pools) (as JaxpagePagedAttention[Bf16]); o = a . W_o;
//   (x1, h1) = add_rms_norm(x, o, mlp_norm); s = silu_mul(h1 . W_gate_up);
//   (x2, h2) = add_rms_norm(x1, s . W_down, next_norm)
// and returns x2, h2 and the pools (written in place: the results alias them).

// The decoder layer's stage clock, compiled in only where JAXPAGE_STAGE_CLOCK is defined
// (scripts/profile_layer_stages.py builds such a library): the calling thread's wall time in
// each stage of the call (LayerStage, in order), summed over the calls, and how late each
// helper started after it was scheduled (a helper that starts late leaves the call's first
// stages to the caller alone).
#ifdef JAXPAGE_STAGE_CLOCK
constexpr bool kStageClock = true;
#else
constexpr bool kStageClock = false;
#endif
enum LayerStage {
  kStart, kQkv, kRope, kWrite, kAttnPrep, kAttn, kAttnFinish, kO, kNorm1, kGateUp, kSilu, kDown,
  kNorm2, kLayerStages
};
constexpr int64_t kLateJoinNanos = 50'000;
// joins by lateness: bucket b counts those of [2^b - 1, 2^(b+1) - 1) ns (the last, all later).
// Their mean says little: a helper the OS keeps off its core for milliseconds now and then
// outweighs the many that start at once (8 bfloat16 rows on the 2-core box: median 3.5 us, 90%
// within 28 us, 99% within 2.3 ms, a mean of ~100 us).
constexpr int kJoinBuckets = 32;
struct StageClock {  // zero-initialized (static storage)
  std::atomic<int64_t> nanos[kLayerStages];
  std::atomic<int64_t> calls, joins, join_nanos, late_joins;
  std::atomic<int64_t> join_buckets[kJoinBuckets];
};
StageClock g_stage_clock;

int64_t nanos_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              t).count();
}

// Laps of one call on the calling thread: lap(s) ends stage s (a no-op without the clock).
struct StageLaps {
  std::chrono::steady_clock::time_point t =
      kStageClock ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  void operator()(LayerStage stage) {
    if constexpr (kStageClock) {
      g_stage_clock.nanos[stage].fetch_add(nanos_since(t), std::memory_order_relaxed);
      t = std::chrono::steady_clock::now();
      if (stage == kLayerStages - 1) g_stage_clock.calls.fetch_add(1, std::memory_order_relaxed);
    }
  }
};

void note_join(std::chrono::steady_clock::time_point scheduled) {
  if constexpr (kStageClock) {
    const int64_t late = nanos_since(scheduled);
    g_stage_clock.joins.fetch_add(1, std::memory_order_relaxed);
    g_stage_clock.join_nanos.fetch_add(late, std::memory_order_relaxed);
    if (late > kLateJoinNanos) g_stage_clock.late_joins.fetch_add(1, std::memory_order_relaxed);
    const uint64_t ns = static_cast<uint64_t>(std::max<int64_t>(late, 0)) + 1;
    const int bucket = std::min(kJoinBuckets - 1, 63 - __builtin_clzll(ns));
    g_stage_clock.join_buckets[bucket].fetch_add(1, std::memory_order_relaxed);
  }
}

// The caller's helpers for one call: scheduled once, each runs every stage the caller publishes,
// claiming its units as the caller does, until the caller has finished. A helper that starts
// late finds the earlier stages' units claimed and goes on to the next.
struct Team {
  static constexpr int kMaxStages = 12;
  std::function<void()> stages[kMaxStages];
  std::atomic<int> published{0};
  std::atomic<bool> finished{false};
  const std::thread::id caller = std::this_thread::get_id();  // made by the caller

  void serve() {
    // a pool that runs a task inline when its queues are full (Eigen's does) would run this on
    // the caller, before it publishes: serving there would never return
    if (std::this_thread::get_id() == caller) return;
    for (int seen = 0;;) {
      const int n = published.load(std::memory_order_acquire);
      while (seen < n) stages[seen++]();
      if (finished.load(std::memory_order_acquire)) return;
      std::this_thread::yield();
    }
  }

  // runs `work` (run(): claim units until none is left, counting each in `done`; `total` units)
  // on this thread and the helpers, and returns once every unit is done
  template <typename W>
  void stage(const std::shared_ptr<W>& work, int64_t total) {
    const int n = published.load(std::memory_order_relaxed);
    if (n == kMaxStages) {  // no room to publish it: this thread runs it alone
      run_units(*work);
      return;
    }
    stages[n] = [work] { run_units(*work); };
    published.store(n + 1, std::memory_order_release);
    run_units(*work);
    while (work->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
  }
};

ffi::Error InvalidLayer(const std::string& what) {
  return ffi::Error::InvalidArgument("decoder layer: " + what);
}

// A packed weight's panels if it is [P, ceil(K / G), kPanel, G] for `type`, else -1.
int64_t packed_panels(ffi::AnyBuffer w, ffi::DataType type, int64_t K) {
  const int64_t G = type == ffi::DataType::F32 ? 1 : 2;
  const auto d = w.dimensions();
  if (w.element_type() != type || d.size() != 4 || d[1] != (K + G - 1) / G || d[2] != kPanel ||
      d[3] != G)
    return -1;
  return d[0];
}

template <typename T>
ffi::Error DecoderLayerTyped(ffi::ThreadPool& pool, ffi::AnyBuffer x, ffi::AnyBuffer h,
                             ffi::AnyBuffer w_qkv, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                             ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                             ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> block_tables,
                             ffi::Buffer<ffi::S32> seq_lens,
                             ffi::Buffer<ffi::S32> query_start_loc, ffi::AnyBuffer w_o,
                             ffi::AnyBuffer mlp_norm, ffi::AnyBuffer w_gate_up,
                             ffi::AnyBuffer w_down, ffi::AnyBuffer next_norm, int64_t live_rows,
                             int64_t num_heads, float eps, float scale, int64_t query_tile,
                             int64_t key_splits, int64_t bf16_dot, T* x_out, T* h_out,
                             void* k_out, void* v_out) {
  StageLaps lap;
  constexpr bool f32 = std::is_same_v<T, float>;
  const ffi::DataType type = f32 ? ffi::DataType::F32 : ffi::DataType::BF16;
  const auto xd = x.dimensions(), pd = k_pool.dimensions();
  const int64_t M = xd[0], H = xd[1], KH = pd[0], D = pd[3], Q = num_heads * D;
  const int64_t P_qkv = packed_panels(w_qkv, type, H), P_o = packed_panels(w_o, type, Q),
                P_gu = packed_panels(w_gate_up, type, H);
  const int64_t I = P_gu * kPanel / 2, P_down = packed_panels(w_down, type, I);
  if (P_qkv * kPanel != Q + 2 * KH * D || P_o * kPanel != H || P_gu < 1 || (P_gu * kPanel) % 2 ||
      P_down * kPanel != H)
    return InvalidLayer("packed weights qkv " + shape_string(w_qkv.dimensions()) + ", o " +
                        shape_string(w_o.dimensions()) + ", gate_up " +
                        shape_string(w_gate_up.dimensions()) + ", down " +
                        shape_string(w_down.dimensions()) + " do not fit hidden size " +
                        std::to_string(H) + ", " + std::to_string(num_heads) + " heads and " +
                        std::to_string(KH) + " KV heads of " + std::to_string(D));
  const int64_t slots_total = pd[1] * pd[2];
  const int32_t* slot = slots.typed_data();
  if (const int64_t t = first_bad_index(slot, M, slots_total); t >= 0)
    return InvalidLayer("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slot[t]) +
                        " is outside the pool's " + std::to_string(slots_total) + " slots");
  const int64_t threads = thread_count(pool);
  const int64_t live = std::clamp<int64_t>(live_rows, 0, M);
  // the helpers first: a parked pool thread takes microseconds to wake, spent here on the
  // scratch and the prefetches below
  auto team = std::make_shared<Team>();
  struct Finish {  // on every return: the helpers stop serving
    Team& team;
    ~Finish() { team.finished.store(true, std::memory_order_release); }
  } finish{*team};
  for (int64_t i = 1; i < threads; ++i) {
    const auto scheduled = lap.t;
    pool.Schedule([team, scheduled] {
      note_join(scheduled);
      team->serve();
    });
  }
  // the pool rows this step writes, prefetched for writing: read into cache while the qkv
  // matmul runs, not one miss after another in the writes (with the qkv stage's epilogue on
  // both threads, 0.03 ms faster an 8-row step in one CCX, 0.05 slower across two CCDs)
  for (const void* pool_out : {k_out, v_out})
    for (int64_t kh = 0; kh < KH; ++kh)
      for (int64_t t = 0; t < M; ++t)
        for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
          __builtin_prefetch(static_cast<const char*>(pool_out) +
                                 ((kh * slots_total + slot[t]) * D) * sizeof(T) + b, 1, 1);
  // scratch, every element written before it is read (not zeroed: at 8 rows that was ~5 us a
  // layer)
  const auto floats = [](int64_t n) { return std::unique_ptr<float[]>(new float[n]); };
  const auto ts = [](int64_t n) { return std::unique_ptr<T[]>(new T[n]); };
  const auto qkv = floats(M * (Q + 2 * KH * D)), o = floats(M * H), gate_up = floats(M * 2 * I),
             down = floats(M * H);
  const auto q = ts(M * Q), k = ts(M * KH * D), v = ts(M * KH * D), a = ts(M * Q),
             x1 = ts(M * H), h1 = ts(M * H), act = ts(M * I);

  // a matmul's work over this call's rows, and its units (0: nothing to run)
  auto packed_work = [&](const void* in, int64_t K, ffi::AnyBuffer w, float* out) {
    auto work = std::make_shared<PackedWork>();
    const int64_t total = prepare_packed(*work, in, f32, M, live, K, w.untyped_data(),
                                         w.dimensions()[0], out, bf16_dot, 0, threads);
    return std::make_pair(work, total);
  };
  auto matmul = [&](const void* in, int64_t K, ffi::AnyBuffer w, float* out) {
    const auto [work, total] = packed_work(in, K, w, out);
    if (total) team->stage(work, total);
  };

  // the glue between the matmuls, its rows shared among the threads (at 8 rows it was ~1 ms of
  // a bfloat16 step on the calling thread alone)
  auto rows_stage = [&](auto fn) {
    if (M < 2) return rows_here(fn, M);
    auto work = std::make_shared<RowWork<decltype(fn)>>(fn);
    work->rows = work->units = M;
    team->stage(work, M);
  };

  lap(kStart);
  const T *cos_t = static_cast<const T*>(cos.untyped_data()),
          *sin_t = static_cast<const T*>(sin.untyped_data());
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  // qkv and the rotary embedding as one stage where a head is whole panels (D a multiple of kPanel;
  // vector panels or AMX tiles): the thread that makes a head's columns rotates them and writes k
  // and v straight to their pool rows, in t order as SetRows does (padding rows share a slot),
  // where a stage of its own read qkv from the other core's cache and this thread then wrote the
  // pools alone (8 bfloat16 rows, alternating with those stages: 0.10 ms a runner step across two
  // CCDs, 0.03 in one CCX, 0.12 an engine step; on a 2-core AMX Xeon, tiles, with the gate_up
  // epilogue below: 0.10 ms a runner step, 55% of 40 rounds). The stage clock then counts the
  // rotation and the writes in qkv.
  const auto [qkv_work, qkv_units] = packed_work(h.untyped_data(), H, w_qkv, qkv.get());
  if (qkv_units && D % kPanel == 0) {
    T *k_rows = static_cast<T*>(k_out), *v_rows = static_cast<T*>(v_out);
    for (const auto& [out, in] : {std::pair{k_rows, k_pool.untyped_data()},
                                  std::pair{v_rows, v_pool.untyped_data()}})
      if (out != in) std::memcpy(out, in, static_cast<size_t>(KH * slots_total * row_bytes));
    const int64_t width = Q + 2 * KH * D;
    qkv_work->span = D / kPanel;
    qkv_work->units = std::min(qkv_units, qkv_work->panels / qkv_work->span);
    qkv_work->after_group = [&](int64_t g) {
      for (int64_t t = 0; t < M; ++t) {
        const float* head = qkv.get() + t * width + g * D;
        const T *c = cos_t + t * D, *s = sin_t + t * D;
        const int64_t kh = g - num_heads;  // k's head, then (kh - KH) v's
        if (kh < 0)
          rope_heads<T, float>(head, c, s, 1, D, q.get() + (t * num_heads + g) * D);
        else if (kh < KH)
          rope_heads<T, float>(head, c, s, 1, D, k_rows + (kh * slots_total + slot[t]) * D);
        else
          round_to<T, float>(head, D, v_rows + ((kh - KH) * slots_total + slot[t]) * D);
      }
    };
    team->stage(qkv_work, qkv_work->units);
    lap(kQkv);
    lap(kRope);
  } else {
    if (qkv_units) team->stage(qkv_work, qkv_units);
    lap(kQkv);
    rows_stage([&](int64_t r0, int64_t r1) {
      qkv_rope_rows<T, float>(qkv.get(), cos_t, sin_t, num_heads, KH, D, r0, r1, q.get(),
                              k.get(), v.get());
    });
    lap(kRope);
    // as SetRows writes them, on this thread alone (padding rows share a slot)
    write_rows(static_cast<char*>(k_out), k_pool.untyped_data(), KH, slots_total, row_bytes,
               slot, M, reinterpret_cast<const char*>(k.get()), true);
    write_rows(static_cast<char*>(v_out), v_pool.untyped_data(), KH, slots_total, row_bytes,
               slot, M, reinterpret_cast<const char*>(v.get()), true);
  }
  lap(kWrite);
  const int64_t q_dims[3] = {M, num_heads, D};
  const ffi::Span<const int64_t> qd(q_dims, 3);
  const Mode mode = f32 ? Mode::kF32 : bf16_mode(bf16_dot);
  Attention A;
  if (ffi::Error e = PrepareAttention(A, threads, {q.get(), qd}, {k_out, pd}, {v_out, pd},
                                      nullptr, nullptr, block_tables, seq_lens, query_start_loc,
                                      scale, query_tile, 0, 0.0f, key_splits, mode, a.get(), qd,
                                      sizeof(T));
      e.failure())
    return e;
  lap(kAttnPrep);
  team->stage(A.work, static_cast<int64_t>(A.work->items.size()));
  lap(kAttn);
  if (ffi::Error e = FinishAttention(A); e.failure()) return e;
  lap(kAttnFinish);

  matmul(a.get(), Q, w_o, o.get());
  lap(kO);
  const T* x_in = static_cast<const T*>(x.untyped_data());
  const T* mlp_w = static_cast<const T*>(mlp_norm.untyped_data());
  rows_stage([&](int64_t r0, int64_t r1) {
    add_rms_norm_rows<T, float>(x_in, o.get(), mlp_w, eps, H, r0, r1, x1.get(), h1.get());
  });
  lap(kNorm1);
  // gate_up and SiLU as one stage where each gate panel's up panel lies I columns on (I a multiple
  // of kPanel; vector panels or AMX tiles): the thread that runs a gate panel runs its up panel and
  // their SiLU, from its own cache, where a stage of its own read half of gate_up from the other
  // thread's (8 bfloat16 rows: 0.2 ms a step with the two vCPUs in one CCX, 0.5 ms across two
  // CCDs). The stage clock then counts SiLU in gate_up.
  const auto [gate_up_work, gate_up_units] = packed_work(h1.get(), H, w_gate_up, gate_up.get());
  if (gate_up_units && I % kPanel == 0) {
    gate_up_work->pair = gate_up_work->panels = P_gu / 2;
    gate_up_work->units = std::min(gate_up_units, P_gu / 2);
    gate_up_work->after_group = [&](int64_t p) {
      silu_mul_block<T, float>(gate_up.get(), I, 0, M, p * kPanel, (p + 1) * kPanel, act.get());
    };
    team->stage(gate_up_work, gate_up_work->units);
    lap(kGateUp);
  } else {
    if (gate_up_units) team->stage(gate_up_work, gate_up_units);
    lap(kGateUp);
    rows_stage([&](int64_t r0, int64_t r1) {
      silu_mul_rows<T, float>(gate_up.get(), I, r0, r1, act.get());
    });
  }
  lap(kSilu);
  matmul(act.get(), I, w_down, down.get());
  lap(kDown);
  const T* next_w = static_cast<const T*>(next_norm.untyped_data());
  rows_stage([&](int64_t r0, int64_t r1) {
    add_rms_norm_rows<T, float>(x1.get(), down.get(), next_w, eps, H, r0, r1, x_out, h_out);
  });
  lap(kNorm2);
  return ffi::Error::Success();
}

bool is_vector_of(ffi::AnyBuffer b, int64_t n) {
  return b.dimensions().size() == 1 && b.dimensions()[0] == n;
}

ffi::Error DecoderLayer(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer h,
                        ffi::AnyBuffer w_qkv, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                        ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                        ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> block_tables,
                        ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                        ffi::AnyBuffer w_o, ffi::AnyBuffer mlp_norm, ffi::AnyBuffer w_gate_up,
                        ffi::AnyBuffer w_down, ffi::AnyBuffer next_norm,
                        ffi::Buffer<ffi::S32> live, int64_t num_heads, float eps, float scale,
                        int64_t query_tile, int64_t key_splits, int64_t bf16_dot,
                        ffi::Result<ffi::AnyBuffer> x_out, ffi::Result<ffi::AnyBuffer> h_out,
                        ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const ffi::DataType type = x.element_type();
  const auto xd = x.dimensions(), pd = k_pool.dimensions(), cd = cos.dimensions();
  bool types = is_model_type(type);
  for (ffi::DataType t : {h.element_type(), cos.element_type(), sin.element_type(),
                          k_pool.element_type(), v_pool.element_type(),
                          mlp_norm.element_type(), next_norm.element_type(),
                          x_out->element_type(), h_out->element_type(),
                          k_out->element_type(), v_out->element_type()})
    types = types && t == type;
  if (!types)
    return InvalidLayer("x, h, cos, sin, the pools, the norms and the outputs must be float32 "
                        "or bfloat16 alike");
  if (xd.size() != 2 || pd.size() != 4 || !same_dims(h.dimensions(), xd) ||
      !same_dims(x_out->dimensions(), xd) || !same_dims(h_out->dimensions(), xd) ||
      !same_dims(v_pool.dimensions(), pd) || !same_dims(k_out->dimensions(), pd) ||
      !same_dims(v_out->dimensions(), pd) || cd.size() != 2 || cd[0] != xd[0] ||
      cd[1] != pd[3] || pd[3] % 2 || !same_dims(sin.dimensions(), cd) ||
      !is_vector_of(mlp_norm, xd[1]) || !is_vector_of(next_norm, xd[1]) ||
      static_cast<int64_t>(slots.element_count()) != xd[0] ||
      live.element_count() != 1)
    return InvalidLayer("x and h [T, H] " + shape_string(xd) + " " +
                        shape_string(h.dimensions()) + ", cos and sin [T, D] " +
                        shape_string(cd) + ", pools [KH, blocks, block_size, D] " +
                        shape_string(pd) + " " + shape_string(v_pool.dimensions()) +
                        ", norms [H], slot_mapping [T], live rows [] (D even)");
  if (num_heads < 1 || pd[0] < 1 || num_heads % pd[0])
    return InvalidLayer(std::to_string(num_heads) + " heads do not share " +
                        std::to_string(pd[0]) + " KV heads evenly");
  if (!(eps >= 0.0f)) return InvalidLayer("eps must be >= 0");
  if (bf16_dot < 0 || bf16_dot > 2)
    return InvalidLayer("bf16_dot must be 0, 1 or 2, got " + std::to_string(bf16_dot));
  auto run = [&](auto* type_tag) {  // T of the tag's pointee
    using T = std::remove_pointer_t<decltype(type_tag)>;
    return DecoderLayerTyped<T>(pool, x, h, w_qkv, cos, sin, k_pool, v_pool, slots, block_tables,
                                seq_lens, query_start_loc, w_o, mlp_norm, w_gate_up, w_down,
                                next_norm, live.typed_data()[0], num_heads, eps, scale,
                                query_tile, key_splits, bf16_dot,
                                static_cast<T*>(x_out->untyped_data()),
                                static_cast<T*>(h_out->untyped_data()), k_out->untyped_data(),
                                v_out->untyped_data());
  };
  return type == ffi::DataType::F32 ? run(static_cast<float*>(nullptr))
                                    : run(static_cast<bf16*>(nullptr));
}

// ---------------------------------------------------------------------------------------------
// Greedy draws (handler JaxpageGreedyDraw): for each row of logits [R, V] float32, the first
// index of its maximum (of its first NaN where it has one), as jnp.argmax, and that token's
// log-probability, logit - (log(sum(exp(logits - max))) + max), jax.nn.logsumexp's formula; NaN
// where the maximum is not finite (as that formula gives). XLA:CPU spends three passes at ~1 ns
// an element on this (a max, a select-and-min over indices, the log-sum-exp: 6.9 ms for 64 rows
// of SmolLM2's 49,152 logits). Here one vector pass over a row finds its maximum and where it
// first is (16 lanes, each keeping the first index of its own maximum: a strictly greater value
// replaces it), and a second, reading the row back from L2, sums exp(x - max) through
// `exp_nonpositive`. Rows are shared among the threads.

typedef int32_t v16i __attribute__((vector_size(64)));

struct GreedyWork {
  const float* logits;
  int64_t rows, vocab;
  int32_t* tokens;
  float* logprobs;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void draw(int64_t r) const {
    const float* x = logits + r * vocab;
    const int64_t vec_end = vocab / 16 * 16;
    v16f best = {};
    v16i where = {}, index = {}, nan = {};
    for (int i = 0; i < 16; ++i) best[i] = kNegInf, index[i] = i;
    for (int64_t i = 0; i < vec_end; i += 16, index += 16) {
      const v16f v = load16(x + i);
      nan |= v != v;
      const v16i greater = v > best;
      best = greater ? v : best;
      where = greater ? index : where;
    }
    float top = kNegInf;
    int64_t token = 0;
    bool has_nan = false;
    for (int i = 0; i < 16; ++i) {
      has_nan |= nan[i] != 0;
      if (best[i] > top || (best[i] == top && where[i] < token)) top = best[i], token = where[i];
    }
    for (int64_t i = vec_end; i < vocab; ++i) {  // after every vector index: only > replaces
      has_nan |= x[i] != x[i];
      if (x[i] > top) top = x[i], token = i;
    }
    const float quiet_nan = std::numeric_limits<float>::quiet_NaN();
    if (has_nan) {
      for (token = 0; x[token] == x[token]; ++token) {
      }
      tokens[r] = static_cast<int32_t>(token);
      logprobs[r] = quiet_nan;
      return;
    }
    tokens[r] = static_cast<int32_t>(token);
    if (!std::isfinite(top)) {
      logprobs[r] = quiet_nan;
      return;
    }
    float sums[16] = {};
    for (int64_t i = 0; i < vec_end; i += 16)
      for (int l = 0; l < 16; ++l) sums[l] += exp_nonpositive(x[i + l] - top);
    float sum = 0.0f;
    for (int64_t i = vec_end; i < vocab; ++i) sum += exp_nonpositive(x[i] - top);
    for (int l = 0; l < 16; ++l) sum += sums[l];
    logprobs[r] = top - (std::log(sum) + top);
  }

  void run() {
    for (int64_t r = next.fetch_add(1); r < rows; r = next.fetch_add(1)) {
      draw(r);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error GreedyDraw(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                      ffi::Result<ffi::Buffer<ffi::S32>> tokens,
                      ffi::Result<ffi::Buffer<ffi::F32>> logprobs) {
  const auto d = logits.dimensions();
  if (d.size() != 2 || d[1] < 1 || tokens->dimensions().size() != 1 ||
      tokens->dimensions()[0] != d[0] || logprobs->dimensions().size() != 1 ||
      logprobs->dimensions()[0] != d[0])
    return ffi::Error::InvalidArgument("greedy draw: logits must be [R, V >= 1], outputs [R], got " +
                                       shape_string(d));
  if (d[1] > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("greedy draw: a vocabulary past int32's range");
  auto work = std::make_shared<GreedyWork>();
  work->logits = logits.typed_data();
  work->rows = d[0];
  work->vocab = d[1];
  work->tokens = tokens->typed_data();
  work->logprobs = logprobs->typed_data();
  if (d[0]) run_shared(pool, work, d[0]);
  return ffi::Error::Success();
}

}  // namespace

// The arguments and attributes both handlers take, for pools (q, out) of element type kType.
template <ffi::DataType kType>
auto bind_attention() {
  // `.template`: after the first kType argument the binding's type depends on kType
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .template Arg<ffi::Buffer<kType>>()      // q
      .template Arg<ffi::Buffer<kType>>()      // k_pool
      .template Arg<ffi::Buffer<kType>>()      // v_pool
      .template Arg<ffi::Buffer<ffi::S32>>()   // block_tables
      .template Arg<ffi::Buffer<ffi::S32>>()   // seq_lens
      .template Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc
      .template Attr<float>("scale")
      .template Attr<int64_t>("query_tile")
      .template Attr<int64_t>("sliding_window")  // 0: every earlier key
      .template Attr<float>("soft_cap")          // 0: no soft-capping
      .template Attr<int64_t>("key_splits");     // 0: the kernel chooses, 1: none
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagePagedAttention, PagedAttentionF32,
                              bind_attention<ffi::F32>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagePagedAttentionBf16, PagedAttentionBf16,
                              bind_attention<ffi::BF16>()
                                  .Attr<int64_t>("bf16_dot")
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagePagedAttentionQuantized, PagedAttentionQuantized,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // K values
                                  .Arg<ffi::Buffer<ffi::F32>>()   // K scales
                                  .Arg<ffi::AnyBuffer>()          // V values
                                  .Arg<ffi::Buffer<ffi::F32>>()   // V scales
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("query_tile")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("key_splits")
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The float32 value of each of the 256 bit patterns of a float8 format as the kernel reads
// them (format 0: float8_e4m3fn, 1: float8_e5m2), written to out[256]: for tests.
extern "C" void JaxpageFloat8Table(int format, float* out) {
  const float* table = format == 0 ? float8_table<E4M3>() : float8_table<E5M2>();
  std::memcpy(out, table, 256 * sizeof(float));
}

// Whether this build has the bfloat16 dot path (compiled for a CPU with AVX512-BF16).
extern "C" int JaxpagePagedAttentionBf16Dot() { return kHaveBf16Dot ? 1 : 0; }

// The packed panels' vector width in floats: 16 where the build targets AVX-512, else 8 (the
// other kernels' 16-float vectors are the machine's own only in the first case).
extern "C" int JaxpageVectorLanes() { return kLanes; }

// Columns in a packed weight's panel: two vectors, 32 where the build targets AVX-512, else 16.
extern "C" int JaxpagePanelColumns() { return kPanel; }

// Whether the packed bfloat16 matmul can run on AMX tiles: built for a CPU with AMX-BF16, and
// Linux lets this process use them.
extern "C" int JaxpagePackedTiles() { return kHaveTiles && tiles_permitted() ? 1 : 0; }

// The decoder layer's stage clock (see StageClock): writes the seconds of each LayerStage
// summed over the calls, then the helpers' joins, their lateness summed (seconds), the joins
// later than 50 us and the joins in each of kJoinBuckets buckets of lateness, kLayerStages + 3 +
// kJoinBuckets values; returns the calls clocked, or -1 where the library was built without
// it. `reset` zeroes it after reading.
extern "C" int64_t JaxpageStageClock(double* out, int reset) {
  if (!kStageClock) return -1;
  auto& c = g_stage_clock;
  for (int i = 0; i < kLayerStages; ++i) out[i] = c.nanos[i].load() * 1e-9;
  out[kLayerStages] = static_cast<double>(c.joins.load());
  out[kLayerStages + 1] = c.join_nanos.load() * 1e-9;
  out[kLayerStages + 2] = static_cast<double>(c.late_joins.load());
  for (int b = 0; b < kJoinBuckets; ++b)
    out[kLayerStages + 3 + b] = static_cast<double>(c.join_buckets[b].load());
  const int64_t calls = c.calls.load();
  if (reset) {
    for (auto& n : c.nanos) n.store(0);
    for (auto& n : c.join_buckets) n.store(0);
    for (auto* n : {&c.calls, &c.joins, &c.join_nanos, &c.late_joins}) n->store(0);
  }
  return calls;
}

// kJoinBuckets, for the caller's buffer (JaxpageStageClock)
extern "C" int JaxpageStageClockJoinBuckets() { return kJoinBuckets; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageGreedyDraw, GreedyDraw,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [R, V]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // tokens [R]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // log-probabilities [R]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageAddRmsNorm, AddRmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x [T, H]
                                  .Arg<ffi::AnyBuffer>()          // delta [T, H] or empty
                                  .Arg<ffi::AnyBuffer>()          // weight [H]
                                  .Attr<float>("eps")
                                  .Ret<ffi::AnyBuffer>()          // x + delta [T, H]
                                  .Ret<ffi::AnyBuffer>());        // its RMSNorm [T, H]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageSiluMul, SiluMul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // gate_up [T, 2I]
                                  .Ret<ffi::AnyBuffer>());        // silu(gate) * up [T, I]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageQkvRope, QkvRope,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // qkv [T, (H + 2 KH) D]
                                  .Arg<ffi::AnyBuffer>()          // cos [T, D]
                                  .Arg<ffi::AnyBuffer>()          // sin [T, D]
                                  .Ret<ffi::AnyBuffer>()          // q [T, H, D], rotated
                                  .Ret<ffi::AnyBuffer>()          // k [T, KH, D], rotated
                                  .Ret<ffi::AnyBuffer>());        // v [T, KH, D]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageSetRows, SetRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // index
                                  .Arg<ffi::AnyBuffer>()          // values
                                  .Attr<int64_t>("token_major")   // values [T, K, ...]
                                  .Ret<ffi::AnyBuffer>());        // the pool, written

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x [M, K]
                                  .Arg<ffi::AnyBuffer>()          // w [K, N] or [N, K]
                                  .Attr<int64_t>("transpose_w")   // 1: w is [N, K]
                                  .Attr<int64_t>("bf16_dot")      // 1: vdpbf16ps if built
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagePackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x [M, K]
                                  .Arg<ffi::AnyBuffer>()          // w [N / 32, ceil(K / G), 32, G]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // live rows: the rest zeros
                                  .Attr<int64_t>("bf16_dot")      // 1: vdpbf16ps, 2: AMX tiles
                                  .Attr<int64_t>("prefetch_bytes")  // 0: by the rows
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageDecoderLayer, DecoderLayer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x [T, H]: the residual
                                  .Arg<ffi::AnyBuffer>()          // h [T, H]: its attn norm
                                  .Arg<ffi::AnyBuffer>()          // W_qkv, packed
                                  .Arg<ffi::AnyBuffer>()          // cos [T, D]
                                  .Arg<ffi::AnyBuffer>()          // sin [T, D]
                                  .Arg<ffi::AnyBuffer>()          // k_pool [KH, NB, B, D]
                                  .Arg<ffi::AnyBuffer>()          // v_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slot_mapping [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc
                                  .Arg<ffi::AnyBuffer>()          // W_o, packed
                                  .Arg<ffi::AnyBuffer>()          // mlp_norm [H]
                                  .Arg<ffi::AnyBuffer>()          // W_gate_up, packed
                                  .Arg<ffi::AnyBuffer>()          // W_down, packed
                                  .Arg<ffi::AnyBuffer>()          // next_norm [H]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // live rows []
                                  .Attr<int64_t>("num_heads")
                                  .Attr<float>("eps")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("query_tile")
                                  .Attr<int64_t>("key_splits")
                                  .Attr<int64_t>("bf16_dot")      // packed_matmul's
                                  .Ret<ffi::AnyBuffer>()          // x2 [T, H]
                                  .Ret<ffi::AnyBuffer>()          // h2 [T, H]: next_norm's
                                  .Ret<ffi::AnyBuffer>()          // k_pool, written
                                  .Ret<ffi::AnyBuffer>());        // v_pool, written
