// The client-side commands of `nbos` that use kernels on a gateway: `relay` (a local kernelspec
// shim) and `run` (execute a notebook), plus `kernelspec install --gateway`.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

#include "jupyter/kernelspec.h"

namespace nbos::app {

// Adds the subcommands to `app`; the returned function runs whichever was chosen and returns
// the process exit code, or -1 when none of them was.
std::function<int()> AddRelayCommands(CLI::App& app);

// Adds --gateway and --token to `nbos kernelspec install`. The returned function, called after
// parsing with the spec about to be installed, turns it into a relay kernelspec when --gateway
// was given: argv [self_path, relay, -f, {connection_file}, --gateway, URL(, --token, T)], name
// "nbos-remote" and display name "Python 3 (nbos remote)" unless --name/--display-name were given.
std::function<void(jupyter::KernelspecOptions*)> AddRelayKernelspecOptions(CLI::App& install,
                                                                           std::string self_path);

}  // namespace nbos::app
