// How the kernels share their work among XLA's intra-op threads: run_shared (a call's units
// claimed by the caller and the helpers it schedules) and, for the decoder layer, a Team whose
// helpers are scheduled once and serve the call's stages in turn, with the stage clock that
// times those stages.

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "common.h"

namespace {

// Every thread runs a work's units through this one function, compiled once for each kind of
// work: inlined at each call site, run() was compiled twice, and -fassociative-math let each
// copy order its sums its own way, so a result depended on which thread computed it (a greedy
// draw's log-probability by one float32 ulp; docs/kernels.md).
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

// The threads a call can use: the pool's, the caller included.
int64_t thread_count(ffi::ThreadPool& pool) { return std::max<int64_t>(pool.num_threads(), 1); }

// The decoder layer's stage clock, compiled in only where JAXPAGE_STAGE_CLOCK is defined
// (scripts/lab/profile_layer_stages.py builds such a library): the calling thread's wall time in
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
// outweighs the many that start at once (the quantiles tell them apart; docs/kernels.md).
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

}  // namespace
