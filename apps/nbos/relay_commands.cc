#include "relay_commands.h"

#include <signal.h>

#include <cmath>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "common/log.h"
#include "http/client.h"
#include "jupyter/connection_file.h"
#include "relay/cluster_status.h"
#include "relay/gateway_link.h"
#include "relay/notebook_runner.h"
#include "relay/relay.h"

extern char** environ;

namespace nbos::app {

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
  cmd->add_flag("--send-working-dir", args->send_working_dir,
                "Run the kernel in the notebook's directory (KERNEL_WORKING_DIR), which must lie "
                "in the gateway's workspace (a gateway on this machine, or one sharing its files)");
  cmd->add_option("--log-level", args->log_level, "trace, debug, info, warn, error, off")
      ->capture_default_str();
}

Result<relay::GatewayOptions> ToOptions(const GatewayArgs& args, const std::string& working_dir) {
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
  if (args.send_working_dir) o.env.emplace("KERNEL_WORKING_DIR", working_dir);
  return o;
}

namespace {

struct StatusArgs {
  std::string url;
  std::string token;
  double watch_seconds = 0;  // 0: once
  bool json = false;
};

// One look at the cluster: 0 when shown, 1 when the gateway could not be read, 2 when it
// refused the token. `clear`: redraw the terminal in place (--watch).
int ShowStatus(const StatusArgs& args, bool clear) {
  std::string base = args.url;
  while (!base.empty() && base.back() == '/') base.pop_back();
  http::Headers headers;
  if (!args.token.empty()) headers.push_back({"Authorization", "token " + args.token});
  auto r =
      http::HttpRequest("GET", base + "/api/nbos/cluster", headers, "", std::chrono::seconds(10));
  std::string problem;
  int code = 1;
  if (!r.ok()) {
    problem = "cannot read " + base + ": " + r.status().message();
  } else if (r->status == 401 || r->status == 403) {
    problem = base + " refused the token (HTTP " + std::to_string(r->status) +
              "); give it with "
              "--token or $NBOS_TOKEN";
    code = 2;
  } else if (r->status != 200) {
    problem = base + " answered HTTP " + std::to_string(r->status) + ": " + r->body;
  }
  auto cluster =
      problem.empty() ? nlohmann::json::parse(r->body, nullptr, false) : nlohmann::json();
  if (problem.empty() && cluster.is_discarded()) problem = base + " answered with no JSON";
  if (clear) std::cout << "\x1b[H\x1b[2J";
  if (!problem.empty()) {
    (clear ? std::cout : std::cerr) << "nbos status: " << problem << std::endl;
    return code;
  }
  std::cout << (args.json ? cluster.dump(2) + "\n" : relay::RenderClusterStatus(cluster, base))
            << std::flush;
  return 0;
}

// --watch: redraws every interval until SIGINT or SIGTERM (exit 0); a gateway that cannot be
// read meanwhile is said on screen and tried again.
int WatchStatus(const StatusArgs& args) {
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  sigprocmask(SIG_BLOCK, &stop, nullptr);
  for (;;) {
    if (ShowStatus(args, /*clear=*/true) == 2) return 2;
    const double whole = std::floor(args.watch_seconds);
    timespec wait{static_cast<time_t>(whole),
                  static_cast<long>((args.watch_seconds - whole) * 1e9)};
    if (sigtimedwait(&stop, nullptr, &wait) > 0) return 0;
  }
}

void AddStatusOptions(CLI::App* status_cmd, StatusArgs* args) {
  status_cmd->add_option("--gateway", args->url, "Gateway URL, http://HOST:PORT ($NBOS_GATEWAY)")
      ->envname("NBOS_GATEWAY")
      ->required();
  status_cmd->add_option("--token", args->token, "Gateway token ($NBOS_TOKEN)")
      ->envname("NBOS_TOKEN");
  status_cmd
      ->add_option("--watch", args->watch_seconds,
                   "Redraw every this many seconds (2 when none is given) until Ctrl-C")
      ->expected(0, 1)
      ->default_str("2")
      ->check(CLI::Range(0.0, 3600.0));
  status_cmd->add_flag("--json", args->json, "Print the gateway's JSON instead");
}

int Relay(const std::string& connection_file, const GatewayArgs& args) {
  auto info = jupyter::ReadConnectionFile(connection_file);
  if (!info.ok()) {
    std::cerr << "nbos relay: " << info.status().message() << "\n";
    return 2;
  }
  // The kernel manager that started this relay made the notebook's directory its own.
  auto gateway = ToOptions(args, std::filesystem::current_path().string());
  if (!gateway.ok()) {
    std::cerr << "nbos relay: " << gateway.status().message() << "\n";
    return 2;
  }
  relay::RelayOptions options;
  options.connection = *info;
  options.gateway = *gateway;
  options.log_level = args.log_level;
  return relay::RunRelay(options);
}

int RunNotebook(const GatewayArgs& args, relay::RunOptions options,
                std::chrono::seconds cell_timeout, std::chrono::seconds startup_timeout) {
  InitLogging(2, args.log_level, "nbos-run");
  auto gateway = ToOptions(
      args, std::filesystem::absolute(options.notebook).parent_path().lexically_normal().string());
  if (!gateway.ok()) {
    std::cerr << "nbos run: " << gateway.status().message() << "\n";
    return 2;
  }
  options.gateway = *gateway;
  options.cell_timeout = cell_timeout;
  options.startup_timeout = startup_timeout;
  return relay::RunNotebook(options);
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

  auto status_args = std::make_shared<StatusArgs>();
  auto* status_cmd = app.add_subcommand(
      "status", "The cluster in the terminal: servers, GPUs, kernels, replicas, recent events");
  AddStatusOptions(status_cmd, status_args.get());

  return [=]() -> int {
    if (*status_cmd) {
      return status_args->watch_seconds > 0 ? WatchStatus(*status_args)
                                            : ShowStatus(*status_args, /*clear=*/false);
    }
    if (*relay_cmd) return Relay(*connection_file, *relay_args);
    if (*run_cmd) {
      return RunNotebook(*run_args, *run_options, std::chrono::seconds(*cell_timeout),
                         std::chrono::seconds(*startup_timeout));
    }
    return -1;
  };
}

std::function<void(jupyter::KernelspecOptions*)> AddRelayKernelspecOptions(CLI::App& install,
                                                                           std::string self_path) {
  auto url = std::make_shared<std::string>();
  auto token = std::make_shared<std::string>();
  auto send_working_dir = std::make_shared<bool>(false);
  install.add_option("--gateway", *url,
                     "Install a relay kernelspec for kernels on this gateway (http://HOST:PORT)");
  install.add_option("--token", *token,
                     "Gateway token written into the kernelspec; without it the relay reads "
                     "$NBOS_TOKEN when it starts");
  install.add_flag("--send-working-dir", *send_working_dir,
                   "The relay asks the gateway to run each kernel in its notebook's directory "
                   "(nbos relay --send-working-dir)");
  CLI::Option* name = install.get_option("--name");
  CLI::Option* display_name = install.get_option("--display-name");
  return [=](jupyter::KernelspecOptions* spec) {
    if (url->empty()) return;
    spec->argv = {self_path, "relay", "-f", "{connection_file}", "--gateway", *url};
    if (!token->empty()) {
      spec->argv.push_back("--token");
      spec->argv.push_back(*token);
    }
    if (*send_working_dir) spec->argv.push_back("--send-working-dir");
    if (name->count() == 0) spec->name = "nbos-remote";
    if (display_name->count() == 0) spec->display_name = "Python 3 (nbos remote)";
  };
}

}  // namespace nbos::app
