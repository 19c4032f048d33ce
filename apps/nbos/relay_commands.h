// The client-side commands of `nbos` that use kernels on a gateway: `relay` (a local kernelspec
// shim) and `run` (execute a notebook), plus `kernelspec install --gateway`.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "jupyter/kernelspec.h"
#include "relay/gateway_link.h"

namespace nbos::app {

// What every command that talks to a gateway kernel takes.
struct GatewayArgs {
  std::string url;
  std::string token;
  std::string kernel_name = "nbos";
  std::vector<std::string> env;  // KEY=VALUE
  std::string log_level = "warn";
  // Ask the gateway to run the kernel in the notebook's directory (KERNEL_WORKING_DIR), which
  // must then lie in its workspace: for a gateway whose servers share this machine's files.
  bool send_working_dir = false;
};
// --gateway (required, $NBOS_GATEWAY), --token ($NBOS_TOKEN), --kernel-name, --env,
// --send-working-dir, --log-level.
void AddGatewayOptions(CLI::App* cmd, GatewayArgs* args);
// The gateway options (KERNEL_* of this process and --env in the kernel's env; with
// --send-working-dir, `working_dir` as KERNEL_WORKING_DIR unless one is set), or a message for
// the user.
Result<relay::GatewayOptions> ToOptions(const GatewayArgs& args, const std::string& working_dir);

// Adds the subcommands to `app`; the returned function runs whichever was chosen and returns
// the process exit code, or -1 when none of them was.
std::function<int()> AddRelayCommands(CLI::App& app);

// Adds --gateway and --token to `nbos kernelspec install`. The returned function, called after
// parsing with the spec about to be installed, turns it into a relay kernelspec when --gateway
// was given: argv [self_path, relay, -f, {connection_file}, --gateway, URL(, --token, T)
// (, --send-working-dir)], name
// "nbos-remote" and display name "Python 3 (nbos remote)" unless --name/--display-name were given.
std::function<void(jupyter::KernelspecOptions*)> AddRelayKernelspecOptions(CLI::App& install,
                                                                           std::string self_path);

}  // namespace nbos::app
