// Writes into the KV pools (and block copies) in place: the in-place row write `set_rows`
// (handler JaxpageSetRows), whose row copy the decoder layer reuses for its pool writes.

#pragma once

#include <cstdint>
#include <cstring>

#include "attention.h"
#include "common.h"

namespace {

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

}  // namespace
