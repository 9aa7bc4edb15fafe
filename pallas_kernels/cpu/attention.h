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
// The work: items (sequence, KV head, query tile) heaviest first, shared among the threads
// (run_shared, or the decoder layer's Team); few items over long contexts are cut into key
// splits, merged after (combine_splits). Handlers JaxpagePagedAttention[Bf16|Quantized].

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"
#include "thread_team.h"

namespace {

constexpr int64_t kMaxTile = 256;  // largest head_dim and block_size served

// q and the output: bfloat16 for bfloat16 pools, else float32 (quantized pools included).
template <typename T>
using io_t = std::conditional_t<std::is_same_v<T, bf16>, bf16, float>;

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
// not follow a block table. Two blocks ahead, into L2: measured fastest (docs/kernels.md).
// Prefill tiles issue them at once; decode items spread theirs out (TilePump, below).
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
// products (`step`), and the next block at once only at an item's first block. Past an item's
// last blocks the pump goes on into the first blocks of the item its thread runs next, whose
// first block was otherwise read on demand. (Both measured faster: docs/kernels.md.)
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
#endif  // __AVX512BF16__


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
// in part (a long lone sequence read its K/V at under half the machine's rate: docs/kernels.md).
// So single-token items over many blocks are cut into parts
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

}  // namespace
