// The CPU kernel library's one translation unit: the op families' headers (each in an anonymous
// namespace, included only here), their XLA FFI handler symbols, and the C queries the Python
// side reads (pallas_kernels/cpu_library.py, which builds this file with -I this directory:
// g++ -O3 -march=native, on first use).

#include <cstdint>
#include <cstring>

#include "common.h"
#include "thread_team.h"
#include "attention.h"
#include "cache.h"
#include "matmul_small.h"
#include "packed_panels.h"
#include "amx.h"
#include "matmul_int8.h"
#include "matmul_packed.h"
#include "lora.h"
#include "layer_glue.h"
#include "decoder_layer.h"
#include "sampling.h"

// ---------------------------------------------------------------------------------------------
// Handlers, by op family

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
                                  //                                 or [L, ...] (`layer`)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // live rows: the rest zeros
                                  .Attr<int64_t>("bf16_dot")      // 1: vdpbf16ps, 2: AMX tiles
                                  .Attr<int64_t>("prefetch_bytes")  // 0: by the rows
                                  .Attr<int64_t>("layer")         // of a stacked w; -1: none
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagePackedMatmulInt8, PackedMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x [M, K]
                                  .Arg<ffi::AnyBuffer>()          // w int8 [N / 32, K, 32, 1]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // live rows: the rest zeros
                                  .Attr<int64_t>("prefetch_bytes")  // 0: by the rows
                                  .Attr<int64_t>("layer")         // of a stacked w; -1: none
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageLoraMatmul, LoraMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // y [T, N]: the base output
                                  .Arg<ffi::AnyBuffer>()          // x [T, K]
                                  .Arg<ffi::AnyBuffer>()          // a [S, K, R]
                                  .Arg<ffi::AnyBuffer>()          // b [S, R, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // live rows []
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y + delta (aliases y)

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
                                  .Arg<ffi::Buffer<ffi::F32>>()   // W_qkv's scales: [N] int8
                                  .Arg<ffi::Buffer<ffi::F32>>()   // W_o's       (a float
                                  .Arg<ffi::Buffer<ffi::F32>>()   // W_gate_up's weight's: [0])
                                  .Arg<ffi::Buffer<ffi::F32>>()   // W_down's
                                  .Attr<int64_t>("num_heads")
                                  .Attr<float>("eps")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("query_tile")
                                  .Attr<int64_t>("key_splits")
                                  .Attr<int64_t>("bf16_dot")      // packed_matmul's
                                  .Attr<int64_t>("layer")         // of stacked weights, scales
                                  //                                 and mlp_norm; -1: none
                                  .Attr<int64_t>("next_layer")    // next_norm's; -1: none
                                  .Ret<ffi::AnyBuffer>()          // x2 [T, H]
                                  .Ret<ffi::AnyBuffer>()          // h2 [T, H]: next_norm's
                                  .Ret<ffi::AnyBuffer>()          // k_pool, written
                                  .Ret<ffi::AnyBuffer>());        // v_pool, written

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageGreedyDraw, GreedyDraw,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [R, V]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // tokens [R]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // log-probabilities [R]

// ---------------------------------------------------------------------------------------------
// Queries of the build, for pallas_kernels/cpu_library.py and the tests

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
