// nbos: one binary, one subcommand per role (DESIGN.md §2).
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>

#include "cluster_commands.h"
#include "jupyter/connection_file.h"
#include "jupyter/kernelspec.h"
#include "relay_commands.h"
#include "replica/kernel_server.h"
#include "replica/replica_gate.h"

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

  auto* kernel = app.add_subcommand("kernel", "Run a standalone Jupyter kernel over ZeroMQ");
  std::string connection_file;
  std::string log_level = "warn";
  kernel->add_option("-f,--connection-file", connection_file, "Jupyter connection file")
      ->required();
  kernel->add_option("--log-level", log_level, "trace, debug, info, warn, error, off")
      ->capture_default_str();

  auto* replica = app.add_subcommand(
      "replica", "Run one replica of a distributed kernel (started by a daemon or a test driver)");
  nbos::replica::ReplicaOptions replica_options;
  std::vector<std::string> peer_specs;
  replica
      ->add_option("-f,--connection-file", connection_file,
                   "Jupyter connection file this replica binds")
      ->required();
  replica->add_option("--id", replica_options.replica_id, "Replica id (positive)")->required();
  replica
      ->add_option("--raft", replica_options.raft_address,
                   "IPv4:port of this replica's Raft endpoint (port + 1 serves proposals)")
      ->required();
  replica->add_option("--peer", peer_specs,
                      "ID=IPv4:port of each initial member, this one included; none to join an "
                      "existing group");
  replica->add_option("--data-dir", replica_options.data_dir, "Raft log directory")->required();
  replica
      ->add_option("--blob-store", replica_options.blob_store_url,
                   "dir:///path or redis://host:port/db")
      ->required();
  replica
      ->add_option("--checkpoint-every", replica_options.checkpoint_every,
                   "Journal records (deltas, side effects) between namespace checkpoints")
      ->capture_default_str();
  replica
      ->add_option("--snapshot-threshold", replica_options.snapshot_threshold,
                   "Raft entries between log snapshots")
      ->capture_default_str();
  replica->add_option("--log-level", log_level, "trace, debug, info, warn, error, off")
      ->capture_default_str();

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

  CLI11_PARSE(app, argc, argv);
  if (int rc = run_cluster_command(); rc >= 0) return rc;
  if (int rc = run_relay_command(); rc >= 0) return rc;

  // The kernel server's options from the connection file; nullopt (reported) if unreadable.
  auto kernel_options = [&](const char* command) -> std::optional<nbos::replica::KernelOptions> {
    auto info = nbos::jupyter::ReadConnectionFile(connection_file);
    if (!info.ok()) {
      std::cerr << "nbos " << command << ": " << info.status().message() << "\n";
      return std::nullopt;
    }
    nbos::replica::KernelOptions options;
    options.connection = *info;
    options.connection_file = std::filesystem::absolute(connection_file).string();
    options.version = kVersion;
    options.log_level = log_level;
    return options;
  };

  if (*kernel) {
    auto options = kernel_options("kernel");
    if (!options) return 2;
    nbos::replica::RunKernel(*options);
  }
  if (*replica) {
    auto options = kernel_options("replica");
    if (!options) return 2;
    for (const std::string& peer : peer_specs) {
      size_t eq = peer.find('=');
      uint64_t id = 0;
      if (eq != std::string::npos) id = std::strtoull(peer.substr(0, eq).c_str(), nullptr, 10);
      if (id == 0 || eq + 1 >= peer.size()) {
        std::cerr << "nbos replica: --peer wants ID=IPv4:port, got '" << peer << "'\n";
        return 2;
      }
      replica_options.peers.push_back({id, peer.substr(eq + 1)});
    }
    // The gate's threads must not take SIGINT (it interrupts the cell on the main thread).
    sigset_t sigint;
    sigemptyset(&sigint);
    sigaddset(&sigint, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigint, nullptr);
    auto gate = nbos::replica::ReplicaGate::Start(replica_options);
    if (!gate.ok()) {
      std::cerr << "nbos replica: " << gate.status().ToString() << "\n";
      return 1;
    }
    options->gate = gate->get();
    nbos::replica::RunKernel(*options);
  }
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
