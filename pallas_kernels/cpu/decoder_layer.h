// A decoder layer of a decode step in one kernel call (see below).

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "attention.h"
#include "cache.h"
#include "common.h"
#include "layer_glue.h"
#include "matmul_packed.h"
#include "packed_panels.h"
#include "thread_team.h"

namespace {

// A decoder layer in one call (handler JaxpageDecoderLayer): a Llama-family layer without biases
// or q/k norms (SmolLM2, Llama, TinyLlama), float32 or bfloat16 (T), its weights packed, for a
// step of few tokens (decode). The model's unfused path makes eleven calls of such a layer (three
// packed matmuls and the o projection, the rotary split, two pool writes, attention, SiLU, two
// add + norms), and each parallel one schedules its helpers anew and starts its weight stream
// cold, where two threads that stay together and wait for each other between the matmuls lose
// next to nothing (docs/kernels.md). Here the helpers are scheduled once and serve the layer's
// parallel stages
// in turn (Team), the glue's rows included. Each stage is the function the
// unfused call runs, on the same operands, so outputs and pools are the unfused path's bit for
// bit:
//   qkv = h . W_qkv; q, k, v = rotary split of qkv (QkvRope); pools[:, slot[t]] = k[t], v[t];
//   a = attention(q, pools) (as JaxpagePagedAttention[Bf16]); o = a . W_o;
//   (x1, h1) = add_rms_norm(x, o, mlp_norm); s = silu_mul(h1 . W_gate_up);
//   (x2, h2) = add_rms_norm(x1, s . W_down, next_norm)
// and returns x2, h2 and the pools (written in place: the results alias them). Each projection's
// weight is packed float (T's type) or packed int8 with its columns' float32 scales (a scale
// buffer of N elements; 0 elements for a float weight), run as JaxpagePackedMatmulInt8 runs it.

ffi::Error InvalidLayer(const std::string& what) {
  return ffi::Error::InvalidArgument("decoder layer: " + what);
}

// A packed weight's panels if it is [P, ceil(K / G), kPanel, G] for `type`, or int8 [P,
// ceil(K / 2), kPanel, 2] with a scale of P kPanel elements (a float weight's scale has none),
// else -1.
int64_t packed_panels(ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale, ffi::DataType type,
                      int64_t K) {
  const int64_t n_scale = static_cast<int64_t>(scale.element_count());
  if (w.element_type() == ffi::DataType::S8) {
    const int64_t P = int8_panels(w, K);
    return P >= 0 && scale.dimensions().size() == 1 && n_scale == P * kPanel ? P : -1;
  }
  const int64_t G = type == ffi::DataType::F32 ? 1 : 2;
  const auto d = w.dimensions();
  if (w.element_type() != type || d.size() != 4 || d[1] != (K + G - 1) / G || d[2] != kPanel ||
      d[3] != G || n_scale != 0)
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
                             ffi::Buffer<ffi::F32> s_qkv, ffi::Buffer<ffi::F32> s_o,
                             ffi::Buffer<ffi::F32> s_gate_up, ffi::Buffer<ffi::F32> s_down,
                             int64_t num_heads, float eps, float scale, int64_t query_tile,
                             int64_t key_splits, int64_t bf16_dot, T* x_out, T* h_out,
                             void* k_out, void* v_out) {
  StageLaps lap;
  constexpr bool f32 = std::is_same_v<T, float>;
  const ffi::DataType type = f32 ? ffi::DataType::F32 : ffi::DataType::BF16;
  const auto xd = x.dimensions(), pd = k_pool.dimensions();
  const int64_t M = xd[0], H = xd[1], KH = pd[0], D = pd[3], Q = num_heads * D;
  const int64_t P_qkv = packed_panels(w_qkv, s_qkv, type, H),
                P_o = packed_panels(w_o, s_o, type, Q),
                P_gu = packed_panels(w_gate_up, s_gate_up, type, H);
  const int64_t I = P_gu * kPanel / 2, P_down = packed_panels(w_down, s_down, type, I);
  if (P_qkv * kPanel != Q + 2 * KH * D || P_o * kPanel != H || P_gu < 1 || (P_gu * kPanel) % 2 ||
      P_down * kPanel != H)
    return InvalidLayer("packed weights qkv " + shape_string(w_qkv.dimensions()) + ", o " +
                        shape_string(w_o.dimensions()) + ", gate_up " +
                        shape_string(w_gate_up.dimensions()) + ", down " +
                        shape_string(w_down.dimensions()) + " (scales " +
                        shape_string(s_qkv.dimensions()) + " " + shape_string(s_o.dimensions()) +
                        " " + shape_string(s_gate_up.dimensions()) + " " +
                        shape_string(s_down.dimensions()) + ") do not fit hidden size " +
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
  // matmul runs, not one miss after another in the writes (docs/kernels.md)
  for (const void* pool_out : {k_out, v_out})
    for (int64_t kh = 0; kh < KH; ++kh)
      for (int64_t t = 0; t < M; ++t)
        for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
          __builtin_prefetch(static_cast<const char*>(pool_out) +
                                 ((kh * slots_total + slot[t]) * D) * sizeof(T) + b, 1, 1);
  // scratch, every element written before it is read (not zeroed: that cost ~5 us a layer)
  const auto floats = [](int64_t n) { return std::unique_ptr<float[]>(new float[n]); };
  const auto ts = [](int64_t n) { return std::unique_ptr<T[]>(new T[n]); };
  const auto qkv = floats(M * (Q + 2 * KH * D)), o = floats(M * H), gate_up = floats(M * 2 * I),
             down = floats(M * H);
  const auto q = ts(M * Q), k = ts(M * KH * D), v = ts(M * KH * D), a = ts(M * Q),
             x1 = ts(M * H), h1 = ts(M * H), act = ts(M * I);

  // a matmul's work over this call's rows, and its units (0: nothing to run)
  auto packed_work = [&](const void* in, int64_t K, ffi::AnyBuffer w,
                         ffi::Buffer<ffi::F32> scale, float* out) {
    auto work = std::make_shared<PackedWork>();
    const int64_t total =
        w.element_type() == ffi::DataType::S8
            ? prepare_packed_int8(*work, in, f32, M, live, K, w.untyped_data(),
                                  scale.typed_data(), w.dimensions()[0], out, 0, threads)
            : prepare_packed(*work, in, f32, M, live, K, w.untyped_data(), w.dimensions()[0],
                             out, bf16_dot, 0, threads);
    return std::make_pair(work, total);
  };
  auto matmul = [&](const void* in, int64_t K, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                    float* out) {
    const auto [work, total] = packed_work(in, K, w, scale, out);
    if (total) team->stage(work, total);
  };

  // the glue between the matmuls, its rows shared among the threads (on the calling thread
  // alone it was ~1 ms of an 8-row bfloat16 step)
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
  // pools alone (docs/kernels.md). The stage clock then counts the rotation and the writes in qkv.
  const auto [qkv_work, qkv_units] = packed_work(h.untyped_data(), H, w_qkv, s_qkv, qkv.get());
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

  matmul(a.get(), Q, w_o, s_o, o.get());
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
  // thread's (docs/kernels.md). The stage clock then counts SiLU in gate_up.
  const auto [gate_up_work, gate_up_units] = packed_work(h1.get(), H, w_gate_up, s_gate_up, gate_up.get());
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
  matmul(act.get(), I, w_down, s_down, down.get());
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

// The weights, their int8 scales ([L, N]; a float weight's [0] is not stacked) and mlp_norm
// may be stacked per layer kind [L, ...] and read at `layer`, next_norm at `next_layer`
// (LayerView; -1: not stacked): a model's layers then hand the call their one array per kind.
ffi::Error DecoderLayer(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer h,
                        ffi::AnyBuffer stacked_qkv, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                        ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                        ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> block_tables,
                        ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                        ffi::AnyBuffer stacked_o, ffi::AnyBuffer stacked_mlp_norm,
                        ffi::AnyBuffer stacked_gate_up, ffi::AnyBuffer stacked_down,
                        ffi::AnyBuffer stacked_next_norm, ffi::Buffer<ffi::S32> live,
                        ffi::Buffer<ffi::F32> stacked_s_qkv, ffi::Buffer<ffi::F32> stacked_s_o,
                        ffi::Buffer<ffi::F32> stacked_s_gate_up,
                        ffi::Buffer<ffi::F32> stacked_s_down, int64_t num_heads, float eps,
                        float scale, int64_t query_tile, int64_t key_splits, int64_t bf16_dot,
                        int64_t layer, int64_t next_layer, ffi::Result<ffi::AnyBuffer> x_out,
                        ffi::Result<ffi::AnyBuffer> h_out, ffi::Result<ffi::AnyBuffer> k_out,
                        ffi::Result<ffi::AnyBuffer> v_out) {
  auto scale_layer = [layer](const ffi::Buffer<ffi::F32>& s) {
    return s.dimensions().size() == 2 ? layer : -1;
  };
  const LayerView qkv_view(stacked_qkv, layer), o_view(stacked_o, layer),
      gate_up_view(stacked_gate_up, layer), down_view(stacked_down, layer),
      mlp_norm_view(stacked_mlp_norm, layer), next_norm_view(stacked_next_norm, next_layer),
      s_qkv_view(stacked_s_qkv, scale_layer(stacked_s_qkv)),
      s_o_view(stacked_s_o, scale_layer(stacked_s_o)),
      s_gate_up_view(stacked_s_gate_up, scale_layer(stacked_s_gate_up)),
      s_down_view(stacked_s_down, scale_layer(stacked_s_down));
  for (const LayerView* view : {&qkv_view, &o_view, &gate_up_view, &down_view, &mlp_norm_view,
                                &next_norm_view, &s_qkv_view, &s_o_view, &s_gate_up_view,
                                &s_down_view})
    if (!view->ok())
      return InvalidLayer("layer " + std::to_string(layer) + " (next " +
                          std::to_string(next_layer) + ") is outside the stacked weights " +
                          shape_string(stacked_qkv.dimensions()) + " or norms " +
                          shape_string(stacked_mlp_norm.dimensions()) + " " +
                          shape_string(stacked_next_norm.dimensions()));
  const ffi::AnyBuffer w_qkv = qkv_view.any(), w_o = o_view.any(),
                       w_gate_up = gate_up_view.any(), w_down = down_view.any(),
                       mlp_norm = mlp_norm_view.any(), next_norm = next_norm_view.any();
  const ffi::Buffer<ffi::F32> s_qkv = s_qkv_view.typed<ffi::F32>(),
                              s_o = s_o_view.typed<ffi::F32>(),
                              s_gate_up = s_gate_up_view.typed<ffi::F32>(),
                              s_down = s_down_view.typed<ffi::F32>();
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
                                next_norm, live.typed_data()[0], s_qkv, s_o, s_gate_up, s_down,
                                num_heads, eps, scale,
                                query_tile, key_splits, bf16_dot,
                                static_cast<T*>(x_out->untyped_data()),
                                static_cast<T*>(h_out->untyped_data()), k_out->untyped_data(),
                                v_out->untyped_data());
  };
  return type == ffi::DataType::F32 ? run(static_cast<float*>(nullptr))
                                    : run(static_cast<bf16*>(nullptr));
}

}  // namespace
