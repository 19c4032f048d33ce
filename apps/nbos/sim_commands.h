// `nbos sim`: the trace-driven simulator (run, generate, report, replay).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace nbos::app {

// Adds `sim` and its subcommands to `app`; the returned function runs whichever was chosen and
// returns the process exit code, or -1 when none of them was.
std::function<int()> AddSimCommands(CLI::App& app);

}  // namespace nbos::app
