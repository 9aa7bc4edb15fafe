// Sampling's greedy draw in one kernel call (see below).

#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>

#include "common.h"
#include "thread_team.h"

namespace {

// Greedy draws (handler JaxpageGreedyDraw): for each row of logits [R, V] float32, the first
// index of its maximum (of its first NaN where it has one), as jnp.argmax, and that token's
// log-probability, logit - (log(sum(exp(logits - max))) + max), jax.nn.logsumexp's formula; NaN
// where the maximum is not finite (as that formula gives). XLA:CPU spends three passes at ~1 ns
// an element on this (a max, a select-and-min over indices, the log-sum-exp). Here one vector pass over a row finds its maximum and where it
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
