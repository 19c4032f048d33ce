// A slice of a workload, for replaying part of a trace against a live cluster (`nbos replay`) and
// simulating the very same part (`nbos sim --window --speedup --sessions`).
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>

#include "common/status.h"
#include "sim/trace.h"

namespace nbos::sim {

struct SliceOptions {
  int64_t start_ms = 0;      // window [start_ms, end_ms) of cell submissions, trace time
  int64_t end_ms = -1;       // < 0: to the end of the trace
  double speedup = 1.0;      // trace time runs this many times faster; > 0
  int32_t max_sessions = 0;  // > 0: keep this many of the window's sessions, evenly spaced
};

// The cells submitted inside the window, each whole (a cell may run past the window's end), and
// the sessions that have any. Times are shifted to the window's start and divided by the
// speedup, durations too (at least 1 ms). A session open before the window starts at 0; it stops
// when its last kept cell ends. With max_sessions, of the window's M sessions (by start, then id)
// those at indices ⌊i·M/N⌋ are kept, so the choice spreads over the window. Deterministic.
// InvalidArgument for a non-positive speedup or an empty window.
Result<Workload> SliceWorkload(const Workload& workload, const SliceOptions& options);

// "START-END", each a non-negative number with a unit s, m, h or d ("0" may go without one), e.g.
// "566h-568h" or "0-90m"; the result in ms. InvalidArgument names what is wrong.
Result<std::pair<int64_t, int64_t>> ParseWindow(std::string_view text);

}  // namespace nbos::sim
