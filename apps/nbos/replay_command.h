// `nbos replay`: drives a trace slice against a live gateway and compares what it measured with
// `nbos sim` on the same slice and cluster (src/replay).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace nbos::app {

// Adds `replay` to `app`; the returned function runs it and returns the exit code, or -1 when it
// was not chosen.
std::function<int()> AddReplayCommand(CLI::App& app);

}  // namespace nbos::app
