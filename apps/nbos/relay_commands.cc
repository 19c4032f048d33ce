#include "relay_commands.h"

#include <iostream>
#include <map>
#include <memory>
#include <vector>

#include "common/log.h"
#include "jupyter/connection_file.h"
#include "relay/gateway_link.h"
#include "relay/notebook_runner.h"
#include "relay/relay.h"

extern char** environ;

namespace nbos::app {
namespace {

struct GatewayArgs {
  std::string url;
  std::string token;
  std::string kernel_name = "nbos";
  std::vector<std::string> env;  // KEY=VALUE
  std::string log_level = "warn";
};

void AddGatewayOptions(CLI::App* cmd, GatewayArgs* args) {
  cmd->add_option("--gateway", args->url, "Gateway URL, http://HOST:PORT ($NBOS_GATEWAY)")
      ->envname("NBOS_GATEWAY")
      ->required();
  cmd->add_option("--token", args->token, "Gateway token ($NBOS_TOKEN)")->envname("NBOS_TOKEN");
  cmd->add_option("--kernel-name", args->kernel_name, "Kernelspec name on the gateway")
      ->capture_default_str();
  cmd->add_option("--env", args->env,
                  "KEY=VALUE for the gateway kernel (repeatable); KERNEL_* variables of this "
                  "process are always sent");
  cmd->add_option("--log-level", args->log_level, "trace, debug, info, warn, error, off")
      ->capture_default_str();
}

// The gateway options, or a message for the user.
Result<relay::GatewayOptions> ToOptions(const GatewayArgs& args) {
  relay::GatewayOptions o;
  o.url = args.url;
  o.token = args.token;
  o.kernel_name = args.kernel_name;
  o.env = relay::KernelEnvFrom(environ);
  for (const std::string& kv : args.env) {
    size_t eq = kv.find('=');
    if (eq == 0 || eq == std::string::npos) {
      return InvalidArgument("--env wants KEY=VALUE, got '" + kv + "'");
    }
    o.env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return o;
}

}  // namespace

std::function<int()> AddRelayCommands(CLI::App& app) {
  auto relay_args = std::make_shared<GatewayArgs>();
  auto connection_file = std::make_shared<std::string>();
  auto* relay_cmd = app.add_subcommand(
      "relay",
      "Run a local Jupyter kernel that relays to a kernel on an nbos gateway (what the kernelspec "
      "of `nbos kernelspec install --gateway` starts)");
  relay_cmd->add_option("-f,--connection-file", *connection_file, "Jupyter connection file")
      ->required();
  AddGatewayOptions(relay_cmd, relay_args.get());

  auto run_args = std::make_shared<GatewayArgs>();
  auto run_options = std::make_shared<relay::RunOptions>();
  auto cell_timeout = std::make_shared<int>(0);
  auto startup_timeout = std::make_shared<int>(120);
  auto* run_cmd = app.add_subcommand(
      "run", "Execute a notebook on a gateway kernel and write the executed notebook");
  run_cmd->add_option("notebook", run_options->notebook, "Notebook to run (.ipynb)")->required();
  run_cmd->add_option("-o,--output", run_options->output,
                      "Where to write the executed notebook (default: NB.nbos.ipynb beside it)");
  run_cmd->add_option("--timeout", *cell_timeout, "Seconds each cell may run (0: no limit)")
      ->capture_default_str();
  run_cmd
      ->add_option("--startup-timeout", *startup_timeout,
                   "Seconds to wait for the kernel to answer kernel_info")
      ->capture_default_str();
  run_cmd->add_flag("--allow-errors", run_options->allow_errors,
                    "Run every cell even if one fails (exit 0)");
  AddGatewayOptions(run_cmd, run_args.get());

  return [=]() -> int {
    if (*relay_cmd) {
      auto info = jupyter::ReadConnectionFile(*connection_file);
      if (!info.ok()) {
        std::cerr << "nbos relay: " << info.status().message() << "\n";
        return 2;
      }
      auto gateway = ToOptions(*relay_args);
      if (!gateway.ok()) {
        std::cerr << "nbos relay: " << gateway.status().message() << "\n";
        return 2;
      }
      relay::RelayOptions options;
      options.connection = *info;
      options.gateway = *gateway;
      options.log_level = relay_args->log_level;
      return relay::RunRelay(options);
    }
    if (*run_cmd) {
      InitLogging(2, run_args->log_level, "nbos-run");
      auto gateway = ToOptions(*run_args);
      if (!gateway.ok()) {
        std::cerr << "nbos run: " << gateway.status().message() << "\n";
        return 2;
      }
      relay::RunOptions options = *run_options;
      options.gateway = *gateway;
      options.cell_timeout = std::chrono::seconds(*cell_timeout);
      options.startup_timeout = std::chrono::seconds(*startup_timeout);
      return relay::RunNotebook(options);
    }
    return -1;
  };
}

std::function<void(jupyter::KernelspecOptions*)> AddRelayKernelspecOptions(CLI::App& install,
                                                                           std::string self_path) {
  auto url = std::make_shared<std::string>();
  auto token = std::make_shared<std::string>();
  install.add_option("--gateway", *url,
                     "Install a relay kernelspec for kernels on this gateway (http://HOST:PORT)");
  install.add_option("--token", *token,
                     "Gateway token written into the kernelspec; without it the relay reads "
                     "$NBOS_TOKEN when it starts");
  CLI::Option* name = install.get_option("--name");
  CLI::Option* display_name = install.get_option("--display-name");
  return [=](jupyter::KernelspecOptions* spec) {
    if (url->empty()) return;
    spec->argv = {self_path, "relay", "-f", "{connection_file}", "--gateway", *url};
    if (!token->empty()) {
      spec->argv.push_back("--token");
      spec->argv.push_back(*token);
    }
    if (name->count() == 0) spec->name = "nbos-remote";
    if (display_name->count() == 0) spec->display_name = "Python 3 (nbos remote)";
  };
}

}  // namespace nbos::app
