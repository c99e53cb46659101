// The team of team.h. One word holds the current loop's claims:
//   claim = epoch << 24 | next chunk << 12 | chunk count
// A thread claims by compare-and-swap on the whole word, so one still holding an old epoch can
// never take a chunk of a newer loop; a claimed chunk holds its loop open (the caller moves on
// only when every chunk is done), so the job it reads stays valid.
#include "team.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

namespace wsq {
namespace {

constexpr int kCountBits = 12;  // at most 4095 chunks a loop
constexpr uint64_t kCountMask = (uint64_t(1) << kCountBits) - 1;
constexpr int kEpochShift = 2 * kCountBits;
constexpr int64_t kChunksPerThread = 8;  // enough that the thread that runs takes a stalled one's share

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

struct Team {
  alignas(64) std::atomic<uint64_t> claim{0};
  alignas(64) std::atomic<uint64_t> done{0};
  std::atomic<bool> stop{false};
  RangeFn fn = nullptr;  // the current loop, written before its epoch is published
  const void* ctx = nullptr;
  int64_t begin = 0, end = 0, chunk = 1;
  uint64_t epoch = 0;
  int threads = 1;
  std::mutex error_m;
  std::exception_ptr error;

  void fail() {
    std::lock_guard<std::mutex> l(error_m);
    if (!error) error = std::current_exception();
  }
};

std::atomic<bool> g_enabled{true};
std::atomic<bool> g_hold{false};  // tests: the helpers take no chunk, as threads that never get a core
thread_local Team* tl_team = nullptr;  // the caller's team while its body runs

// Claim and run chunks of loop `epoch` until none is left.
void drain(Team& t, uint64_t epoch) {
  for (;;) {
    uint64_t v = t.claim.load(std::memory_order_acquire);
    const uint64_t next = (v >> kCountBits) & kCountMask, count = v & kCountMask;
    if ((v >> kEpochShift) != epoch || next >= count) return;
    if (!t.claim.compare_exchange_weak(v, v + (uint64_t(1) << kCountBits), std::memory_order_acq_rel)) continue;
    const int64_t b = t.begin + int64_t(next) * t.chunk, e = std::min(t.end, b + t.chunk);
    try {
      t.fn(t.ctx, b, e);
    } catch (...) {
      t.fail();
    }
    t.done.fetch_add(1, std::memory_order_acq_rel);
  }
}

// A team thread other than the caller: take chunks of each loop until the body has ended.
void help(Team& t) {
  const bool held = g_hold.load();
  uint64_t seen = 0;
  while (!t.stop.load(std::memory_order_acquire)) {
    const uint64_t epoch = t.claim.load(std::memory_order_acquire) >> kEpochShift;
    if (epoch != seen && !held) {
      drain(t, epoch);
      seen = epoch;
    } else {
      cpu_relax();
    }
  }
}

}  // namespace

bool in_team() { return tl_team != nullptr; }

void team_run(int64_t begin, int64_t end, int64_t grain, RangeFn fn, const void* ctx) {
  if (end <= begin) return;
  Team& t = *tl_team;
  grain = std::max<int64_t>(grain, 1);
  const int64_t range = end - begin;
  if (range <= grain) {
    fn(ctx, begin, end);
    return;
  }
  int64_t count = std::min<int64_t>({(range + grain - 1) / grain, t.threads * kChunksPerThread, int64_t(kCountMask)});
  const int64_t chunk = (range + count - 1) / count;
  count = (range + chunk - 1) / chunk;
  t.fn = fn;
  t.ctx = ctx;
  t.begin = begin;
  t.end = end;
  t.chunk = chunk;
  t.done.store(0, std::memory_order_relaxed);
  const uint64_t epoch = ++t.epoch & ((uint64_t(1) << (64 - kEpochShift)) - 1);
  t.claim.store(epoch << kEpochShift | uint64_t(count), std::memory_order_release);
  tl_team = nullptr;  // a loop inside a chunk runs inline
  drain(t, epoch);
  tl_team = &t;
  // What is left are chunks other threads hold; one that lost its core mid-chunk gets this
  // one's turn after a while.
  for (int i = 0; t.done.load(std::memory_order_acquire) != uint64_t(count); ++i) {
    if (i < 4096)
      cpu_relax();
    else
      std::this_thread::yield();
  }
  if (t.error) {
    std::exception_ptr e;
    std::swap(e, t.error);
    std::rethrow_exception(e);
  }
}

void run_as_team(const std::function<void()>& body) {
  const int threads = at::get_num_threads();
  if (threads <= 1 || !g_enabled.load(std::memory_order_relaxed) || tl_team != nullptr || at::in_parallel_region()) {
    body();
    return;
  }
  Team t;
  t.threads = threads;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      tl_team = &t;
      try {
        body();
      } catch (...) {
        error = std::current_exception();
      }
      tl_team = nullptr;
      t.stop.store(true, std::memory_order_release);
    } else {
      help(t);
    }
  }
  if (error) std::rethrow_exception(error);
  if (t.error) std::rethrow_exception(t.error);
}

void set_teams(bool on, bool hold_helpers) {
  g_enabled.store(on);
  g_hold.store(hold_helpers);
}

int64_t team_threads() {
  std::atomic<uint64_t> seen{0};
  run_as_team([&] {
    parallel_for(0, 4096, 1, [&](int64_t, int64_t) {
      volatile double spin = 0;  // long enough that every thread that can gets a share
      for (int i = 0; i < 200000; ++i) spin = spin + 1.0;
      seen.fetch_or(uint64_t(1) << (omp_get_thread_num() % 64));
    });
  });
  return __builtin_popcountll(seen.load());
}

}  // namespace wsq
