// A decode-only step's layers (DecodeStack) run as one team of torch's threads: one OpenMP
// region for the whole stack instead of one per operator (~300 a step), and inside it every
// loop is cut into chunks that the team's threads claim. The calling thread takes whatever
// nobody claimed and waits only for chunks in progress, so a thread that lost its core (to
// the gateway's event loop, a client, a neighbour) costs the step its share of the work, not a
// wait at each of the ~300 ends: with fixed shares both threads had to run at once for a step
// to progress (docs/benchmarks.md, "Amplification"). Which thread computes a chunk never
// changes its bits: each output row is written by one chunk, as the serial code writes it.
//
// Outside a team, parallel_for is at::parallel_for, as before.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <functional>

namespace wsq {

using RangeFn = void (*)(const void* ctx, int64_t begin, int64_t end);

// Is the calling thread running a team's body (run_as_team)?
bool in_team();
// Run fn over [begin, end) in chunks of at least `grain` on the calling thread's team.
void team_run(int64_t begin, int64_t end, int64_t grain, RangeFn fn, const void* ctx);
// Run `body` on this thread with the other threads of torch's count as its team (inline when
// there is one thread, or already a parallel region). An exception of `body` or of any chunk
// is rethrown here, after the team has stopped.
void run_as_team(const std::function<void()>& body);
// A/B (bench): `on` false runs each body as before, every loop its own at::parallel_for;
// `hold_helpers` (tests) keeps the team's other threads from taking chunks.
void set_teams(bool on, bool hold_helpers);
// How many threads took chunks of a team's long loop (tests: torch's count; 1 when held).
int64_t team_threads();

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (in_team())
    team_run(
        begin, end, grain, [](const void* c, int64_t b, int64_t e) { (*static_cast<const F*>(c))(b, e); }, &f);
  else
    at::parallel_for(begin, end, grain, f);
}

}  // namespace wsq
