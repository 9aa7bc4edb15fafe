// Packed matmuls (handler JaxpagePackedMatmul; the layout and the panels in packed_panels.h):
// a call's panels shared among the threads, each run on the vector panels or on AMX tiles.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "amx.h"
#include "common.h"
#include "matmul_int8.h"
#include "matmul_small.h"
#include "packed_panels.h"
#include "thread_team.h"

namespace {

// Panels are shared among the threads in units (each claimed by the next free thread) of about
// this many a thread where M's rows take several passes over each panel (prefill; the arithmetic
// dominates, and small units even out threads that run at different speeds), and in one unit a
// thread where they take one (few rows, e.g. a decode step; a stream of the weights): each
// thread then reads one contiguous range, where four units a thread made it jump between
// ranges, restarting its prefetch stream at each (a small gain: docs/kernels.md). A thread that
// falls behind (descheduled, or late to start) leaves its range to the other only where that
// one has not started it.
constexpr int64_t kPackedUnitsPerThread = 4;

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
  // int8 weights (prepare_packed_int8; matmul_int8.h): their columns' scales (null for float
  // weights), x's rows quantized to int16 (2 KG = K rounded up to even a row) and their
  // scales, the int8 panel functions by rows in the pass
  const float* scale = nullptr;
  std::vector<int16_t> x_q;
  std::vector<float> x_scale;
  Int8PanelFn int8_fns[kPackedRows] = {};

  void run() {
    if (scale) return run_int8();
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
    // on AVX2: 4 + 4, not 6 + 2, whose 2-row pass waits on its FMAs' latency; docs/kernels.md)
    const int64_t passes = (M + kPackedRows - 1) / kPackedRows;
    run_groups([&](int64_t p) {
      for (int64_t b = 0; b < passes; ++b) {  // the panel from cache after the first
        const int64_t m0 = b * M / passes, m1 = (b + 1) * M / passes;
        const int64_t ahead = prefetch ? prefetch : packed_prefetch_bytes(m1 - m0);
        fns[m1 - m0 - 1](x, KG, m0, w + p * panel_bytes, w_end, ahead, out, N, p * kPanel);
      }
    });
  }

  void run_int8() {
    // as the float panels: M's rows in as few passes as can be, the panel from cache after the
    // first (each pass widens it again)
    const int64_t passes = (M + kPackedRows - 1) / kPackedRows;
    run_groups([&](int64_t p) {
      for (int64_t b = 0; b < passes; ++b) {
        const int64_t m0 = b * M / passes, m1 = (b + 1) * M / passes;
        const int64_t ahead = prefetch ? prefetch : packed_prefetch_bytes(m1 - m0);
        int8_fns[m1 - m0 - 1](x_q.data(), KG, m0, w + p * panel_bytes, w_end, ahead, x_scale.data(),
                              scale, out, N, p * kPanel);
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
      // (configure_tiles): the tiles read x where it lies. A copy would run on the calling
      // thread while the helpers wait for the stage (docs/kernels.md).
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

// A stacked w [L, ...] is read at `layer` (LayerView; -1: w is one weight).
ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer stacked_w,
                        ffi::Buffer<ffi::S32> live, int64_t bf16_dot, int64_t prefetch_bytes,
                        int64_t layer, ffi::ResultBuffer<ffi::F32> out) {
  const LayerView w_view(stacked_w, layer);
  if (!w_view.ok())
    return InvalidPacked("layer " + std::to_string(layer) + " is outside w " +
                         shape_string(stacked_w.dimensions()));
  const ffi::AnyBuffer w = w_view.any();
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

// Sets `work` up for out [M, N] = (x [M, K] . w) * scale, w int8 packed (P panels of
// ceil(K / 2) pair rows; matmul_int8.h) with its columns' float32 scales, x float32 or bfloat16
// (`f32`), of which only the first `live` rows are multiplied (the others zeros, as
// prepare_packed's) and quantized to int16 here. Returns the units to run (0: nothing).
int64_t prepare_packed_int8(PackedWork& work, const void* x, bool f32, int64_t M, int64_t live,
                            int64_t K, const void* w, const float* scale, int64_t P, float* out,
                            int64_t prefetch_bytes, int64_t threads) {
  const int64_t N = P * kPanel, KG = (K + 1) / 2;
  if (M == 0 || N == 0) return 0;
  const int64_t rows = std::clamp<int64_t>(live, 0, M);
  std::fill(out + (K == 0 ? 0 : rows) * N, out + M * N, 0.0f);
  if (K == 0 || rows == 0) return 0;
  work.x_q.resize(static_cast<size_t>(rows * 2 * KG));
  work.x_scale.resize(static_cast<size_t>(rows));
  if (f32)
    quantize_rows(static_cast<const float*>(x), rows, K, work.x_q.data(), work.x_scale.data());
  else
    quantize_rows(static_cast<const bf16*>(x), rows, K, work.x_q.data(), work.x_scale.data());
  for (int mb = 1; mb <= kPackedRows; ++mb)
    work.int8_fns[mb - 1] = int8_pick(mb, kPackedRowSeq);
  work.scale = scale;
  work.w = static_cast<const char*>(w);
  work.panel_bytes = KG * 2 * kPanel;
  work.w_end = work.w + P * work.panel_bytes;
  work.out = out;
  work.M = rows, work.KG = KG, work.N = N, work.panels = P;
  work.prefetch = prefetch_bytes;
  work.units = std::min(P, threads * (rows <= kPackedRows ? 1 : kPackedUnitsPerThread));
  return work.units;
}

// A packed int8 weight's panels if it is [P, ceil(K / 2), kPanel, 2] int8, else -1.
int64_t int8_panels(ffi::AnyBuffer w, int64_t K) {
  const auto d = w.dimensions();
  if (w.element_type() != ffi::DataType::S8 || d.size() != 4 || d[1] != (K + 1) / 2 ||
      d[2] != kPanel || d[3] != 2)
    return -1;
  return d[0];
}

// A stacked w [L, ...] and scale [L, N] are read at `layer` (LayerView; -1: one weight).
ffi::Error PackedMatmulInt8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer stacked_w,
                            ffi::Buffer<ffi::F32> stacked_scale, ffi::Buffer<ffi::S32> live,
                            int64_t prefetch_bytes, int64_t layer,
                            ffi::ResultBuffer<ffi::F32> out) {
  const LayerView w_view(stacked_w, layer), scale_view(stacked_scale, layer);
  if (!w_view.ok() || !scale_view.ok())
    return InvalidPacked("layer " + std::to_string(layer) + " is outside w " +
                         shape_string(stacked_w.dimensions()) + " or its scale " +
                         shape_string(stacked_scale.dimensions()));
  const ffi::AnyBuffer w = w_view.any();
  const ffi::Buffer<ffi::F32> scale = scale_view.typed<ffi::F32>();
  const ffi::DataType type = x.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16)
    return InvalidPacked("x is " + type_name(type) + ", not float32 or bfloat16");
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2)
    return InvalidPacked("x " + shape_string(xd) + " must be a matrix");
  const int64_t M = xd[0], K = xd[1], P = int8_panels(w, K), N = P * kPanel;
  if (P < 0)
    return InvalidPacked("w " + type_name(w.element_type()) + " " + shape_string(wd) +
                         " is not an int8 weight packed for x " + shape_string(xd) + ": [panels, " +
                         std::to_string((K + 1) / 2) + ", " + std::to_string(kPanel) + ", 2]");
  if (scale.dimensions().size() != 1 || scale.dimensions()[0] != N)
    return InvalidPacked("scale " + shape_string(scale.dimensions()) + " is not [" +
                         std::to_string(N) + "]: one a column");
  if (od.size() != 2 || od[0] != M || od[1] != N)
    return InvalidPacked("output " + shape_string(od) + " is not [" +
                         std::to_string(M) + ", " + std::to_string(N) + "]");
  if (prefetch_bytes < 0 || prefetch_bytes > kMaxPrefetchBytes)
    return InvalidPacked("prefetch_bytes must be in [0, " + std::to_string(kMaxPrefetchBytes) +
                         "], got " + std::to_string(prefetch_bytes));
  if (live.element_count() != 1)
    return InvalidPacked("live rows must be one int32, got " + shape_string(live.dimensions()));
  auto work = std::make_shared<PackedWork>();
  const int64_t total = prepare_packed_int8(
      *work, x.untyped_data(), type == ffi::DataType::F32, M, live.typed_data()[0], K,
      w.untyped_data(), scale.typed_data(), P, out->typed_data(), prefetch_bytes,
      thread_count(pool));
  if (total) run_shared(pool, work, total);
  return ffi::Error::Success();
}

}  // namespace
