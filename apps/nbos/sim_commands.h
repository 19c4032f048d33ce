// `nbos sim`: the trace-driven simulator (run, generate, report, replay).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>

#include "common/status.h"
#include "sim/trace.h"

namespace nbos::app {

// Which part of a trace to run (sim::SliceWorkload): `nbos sim` and `nbos replay` take the same.
struct SliceArgs {
  std::string window;    // "START-END" (sim::ParseWindow); empty: the whole trace
  double speedup = 1.0;  // > 0
  int32_t sessions = 0;  // > 0: at most this many of the window's sessions
};
// --window, --speedup, --sessions.
void AddSliceOptions(CLI::App* cmd, SliceArgs* args);
// The trace at `path`, sliced when any of the slice options was given.
Result<sim::Workload> LoadSlice(const std::string& path, const SliceArgs& args);

// Adds `sim` and its subcommands to `app`; the returned function runs whichever was chosen and
// returns the process exit code, or -1 when none of them was.
std::function<int()> AddSimCommands(CLI::App& app);

}  // namespace nbos::app
