// The cluster roles of `nbos`: gateway, daemon, and `up` (gateway plus daemons on this machine).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace nbos::app {

// Adds the subcommands to `app`; the returned function runs whichever was chosen and returns
// the process exit code, or -1 when none of them was.
std::function<int()> AddClusterCommands(CLI::App& app, std::string self_path);

}  // namespace nbos::app
