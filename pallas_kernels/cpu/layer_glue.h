// A layer's elementwise glue between its matmuls (see below), and the row sharing it uses.

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "common.h"
#include "thread_team.h"

namespace {

// A layer's elementwise glue between its matmuls (handlers JaxpageAddRmsNorm, JaxpageSiluMul,
// JaxpageQkvRope), for models in float32 or bfloat16 (T, the residual stream's type). XLA:CPU
// runs each of these as its own loop fusion, and from 8 rows on its parallel task assigner
// splits most of them over the intra-op threads: microseconds each for a few KB of data, ten
// of them a layer (a sixth of an 8-row step: docs/kernels.md). Here each is one call that
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

constexpr int64_t kShareElements = 1 << 16;  // below: one thread (measured on 64 x 3072 SiLU)

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

}  // namespace
