// What every op family of jaxpage's CPU kernel library shares: float helpers (a vectorizable
// exp, bfloat16 and float8 conversions), the 16-float vector type and its loads, an L2 prefetch
// of a weight stream, and the error text helpers. Included (with the other headers) only by
// ffi.cc, the library's one translation unit; everything here is in an anonymous namespace.

#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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
// same cost (no second clamp: one more select slowed the softmax step, docs/kernels.md);
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

// Whether the build targets AVX512-BF16 (`vdpbf16ps`: bfloat16 pairs multiplied exactly, summed
// in float32), which the bfloat16 dot paths of attention and the matmuls need.
#ifdef __AVX512BF16__
constexpr bool kHaveBf16Dot = true;

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }
#else
constexpr bool kHaveBf16Dot = false;
#endif

// 16 floats in GCC/Clang vector extensions: AVX-512 registers where the build targets them,
// split into narrower ones elsewhere (the small matmuls' walks and the greedy draw).
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

constexpr int kL2 = 2;                      // __builtin_prefetch locality: into L2

// Prefetches `Lines` cache lines `bytes` past `at` (a point in a stream of w) into L2, unless
// that lies past w's end `w_end`: the small matmuls' [N, K] walk one line 8 KB ahead in each
// row's stream per 64 bytes read, the packed panels two lines 2-6 KB ahead per 128 bytes.
template <int Lines = 1>
inline void prefetch_ahead(const void* at, int64_t bytes, const char* w_end) {
  const char* ahead = static_cast<const char*>(at) + bytes;
  for (int line = 0; line < Lines; ++line)
    if (ahead + 64 * line < w_end) __builtin_prefetch(ahead + 64 * line, 0, kL2);
}

// Error text: a shape as "[a, b, c]", an element type by its NumPy name.
std::string shape_string(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

// One layer of a buffer stacked per layer kind, [L, ...]: a view of layer `layer` as a buffer
// of the trailing dims (its data in place, nothing copied; its dims the stack's own, past the
// first: nothing allocated on the step's path), so a handler reads a layer of the model's
// stacked weights as it reads a weight of its own (`layer` < 0: the buffer itself, not
// stacked). `ok()` is false where `layer` is outside [0, L) or the buffer has no leading axis;
// the handler reports it. Valid while the handler runs (the dims are the call's).
class LayerView {
 public:
  template <typename Buf>
  LayerView(const Buf& stacked, int64_t layer) {
    const auto dims = stacked.dimensions();
    const bool whole = layer < 0;
    ok_ = whole || (dims.size() > 0 && layer < dims[0]);
    const size_t skip = whole || !ok_ ? 0 : 1;
    char* data = static_cast<char*>(stacked.untyped_data());
    if (skip) data += layer * static_cast<int64_t>(stacked.size_bytes() / dims[0]);
    // the C struct's dims are not const, but nothing writes through them
    buf_ = XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr,
                          static_cast<XLA_FFI_DataType>(stacked.element_type()), data,
                          static_cast<int64_t>(dims.size() - skip),
                          const_cast<int64_t*>(dims.begin() + skip)};
  }

  bool ok() const { return ok_; }
  ffi::AnyBuffer any() const { return ffi::AnyBuffer(&buf_); }
  template <ffi::DataType kType>
  ffi::Buffer<kType> typed() const { return ffi::Buffer<kType>(&buf_); }

 private:
  bool ok_ = false;
  XLA_FFI_Buffer buf_{};
};

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

}  // namespace
