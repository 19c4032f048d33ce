// nbos: one binary, one subcommand per role (DESIGN.md §2).
#include <CLI/CLI.hpp>
#include <filesystem>
#include <iostream>

#include "cluster_commands.h"
#include "jupyter/kernelspec.h"
#include "relay_commands.h"
#include "replay_command.h"
#include "replica_command.h"
#include "sim_commands.h"

namespace {

constexpr char kVersion[] = NBOS_VERSION;

std::string SelfPath() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "nbos" : p.string();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"nbos: replicated Jupyter kernels with GPUs bound per cell"};
  app.require_subcommand(1);
  app.set_version_flag("--version", kVersion);

  auto run_replica_command = nbos::app::AddReplicaCommands(app, kVersion);

  auto* kernelspec = app.add_subcommand("kernelspec", "Manage the nbos Jupyter kernelspec");
  kernelspec->require_subcommand(1);
  auto* install = kernelspec->add_subcommand("install", "Install the 'nbos' kernelspec");
  bool user = false;
  std::string prefix;
  nbos::jupyter::KernelspecOptions spec;
  install->add_flag("--user", user, "Install for the current user");
  install->add_option("--prefix", prefix, "Install under PREFIX/share/jupyter/kernels");
  install->add_option("--name", spec.name, "Kernelspec name")->capture_default_str();
  install->add_option("--display-name", spec.display_name, "Name shown in Jupyter")
      ->capture_default_str();

  auto relay_kernelspec = nbos::app::AddRelayKernelspecOptions(*install, SelfPath());

  auto run_cluster_command = nbos::app::AddClusterCommands(app, SelfPath());
  auto run_relay_command = nbos::app::AddRelayCommands(app);
  auto run_sim_command = nbos::app::AddSimCommands(app);
  auto run_replay_command = nbos::app::AddReplayCommand(app);

  CLI11_PARSE(app, argc, argv);
  if (int rc = run_replica_command(); rc >= 0) return rc;
  if (int rc = run_cluster_command(); rc >= 0) return rc;
  if (int rc = run_relay_command(); rc >= 0) return rc;
  if (int rc = run_sim_command(); rc >= 0) return rc;
  if (int rc = run_replay_command(); rc >= 0) return rc;

  if (*install) {
    spec.argv = {SelfPath(), "kernel", "-f", "{connection_file}"};
    relay_kernelspec(&spec);  // --gateway: a relay kernelspec instead
    auto dir = nbos::jupyter::InstallKernelspec(nbos::jupyter::KernelsDir(user, prefix), spec);
    if (!dir.ok()) {
      std::cerr << "nbos kernelspec install: " << dir.status().message() << "\n";
      return 1;
    }
    std::cout << "Installed kernelspec " << spec.name << " in " << *dir << "\n";
    return 0;
  }
  return 0;
}
