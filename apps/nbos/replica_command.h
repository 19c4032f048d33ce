// `nbos kernel` and `nbos replica`: the processes that run user code.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

namespace nbos::app {

// Adds `kernel` (a standalone Jupyter kernel) and `replica` (one replica of a distributed
// kernel) to `app`. `nbos replica --warm` is a pre-started replica: it loads Python and the
// modules named by --preload, then waits for one JSON line on stdin that makes it a replica:
//   {"argv": [replica options, as on the command line], "env": ["KEY=VALUE", ...],
//    "cwd": DIR, "log": FILE}
// (FILE takes its stdout and stderr; the environment replaces its own). End of input before that
// line exits 0. The returned function runs the chosen command (it does not return when one ran)
// and returns -1 when neither was chosen.
std::function<int()> AddReplicaCommands(CLI::App& app, std::string version);

}  // namespace nbos::app
