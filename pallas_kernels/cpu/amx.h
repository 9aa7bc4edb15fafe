// The packed bfloat16 matmul on AMX tiles (Sapphire Rapids and later): the tile configuration,
// Linux's permission to use the tile registers, and the walk of one panel (tile_panel).

#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "packed_panels.h"

namespace {

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
// weights faster, from 3 rows the tiles win (docs/kernels.md).
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
  // as dead (an outlined copy of this function lost them, and ldtilecfg faulted on the stack's
  // old bytes). This barrier keeps them.
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
// just written are slow (no forwarding from tile stores), so a bounce through a buffer cost
// measurably (docs/kernels.md). Only a block's last rows that fill part of a 16-row tile go
// through a buffer, out of line (tile_panel below says why).
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
// written in here, the same loop streamed measurably slower, though its instructions are the
// same (objdump; the cause is not established; docs/kernels.md).
// `Stream` (a call of more than 16 rows: every one with `Two`) loads w's tiles with the
// non-temporal hint (tileloaddt1): past 16 rows x's tiles of a pass (32 rows of K pairs: 36 KB for
// K = 576) no longer stay in L1 beside the weight stream, and reloading them from L2 costs the
// walk most of what its rows add; with w kept out of L1 they stay (docs/kernels.md).
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

}  // namespace
