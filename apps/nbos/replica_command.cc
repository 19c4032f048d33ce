#include "replica_command.h"

#include <fcntl.h>
#include <grp.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "jupyter/connection_file.h"
#include "replica/kernel_server.h"
#include "replica/python_engine.h"
#include "replica/replica_gate.h"
#include "workspace/workspace_mount.h"

namespace nbos::app {
namespace {

struct ReplicaArgs {
  std::string connection_file;
  std::string log_level = "warn";
  replica::ReplicaOptions options;
  std::vector<std::string> peer_specs;
  std::string run_as;                   // UID:GID the replica takes before it runs any cell
  std::vector<std::string> cgroups;     // cgroup directories it joins first
  workspace::WorkspaceMount workspace;  // root and visible part; uid and gid from run_as
  std::string working_dir;              // where cells start
};

// The replica's options, on `cmd` (the subcommand, or the parser of a warm promotion).
void AddReplicaOptions(CLI::App& cmd, ReplicaArgs& a) {
  cmd.add_option("-f,--connection-file", a.connection_file,
                 "Jupyter connection file this replica binds");
  cmd.add_option("--id", a.options.replica_id, "Replica id (positive)");
  cmd.add_option("--raft", a.options.raft_address,
                 "IPv4:port of this replica's Raft endpoint (port + 1 serves proposals)");
  cmd.add_option("--peer", a.peer_specs,
                 "ID=IPv4:port of each initial member, this one included; none to join an "
                 "existing group");
  cmd.add_option("--data-dir", a.options.data_dir, "Raft log directory");
  cmd.add_option("--blob-store", a.options.blob_store_url,
                 "dir:///path, redis://host:port/db or s3://bucket/prefix?endpoint=URL");
  cmd.add_option("--checkpoint-every", a.options.checkpoint_every,
                 "Journal records (deltas, side effects) between namespace checkpoints")
      ->capture_default_str();
  cmd.add_option("--snapshot-threshold", a.options.snapshot_threshold,
                 "Raft entries between log snapshots")
      ->capture_default_str();
  cmd.add_option("--blob-hints", a.options.blob_hints,
                 "on or off: as the executor, announce each large blob a cell stores as soon as "
                 "it is stored, so that standbys fetch it during the cell's other writes")
      ->transform(
          CLI::CheckedTransformer(std::map<std::string, bool>{{"on", true}, {"off", false}}))
      ->default_str("off")
      ->envname("NBOS_BLOB_HINTS");
  cmd.add_option("--run-ahead", a.options.run_ahead,
                 "on or off: as the target executor of a cell after one it ran, run the cell "
                 "before its LEAD commits and commit the LEAD with its effects (decision 0012; "
                 "a cell then also starts without a reachable majority)")
      ->transform(
          CLI::CheckedTransformer(std::map<std::string, bool>{{"on", true}, {"off", false}}))
      ->default_str("off")
      ->envname("KERNEL_RUN_AHEAD");
  cmd.add_option("--restore-from", a.options.restore_from,
                 "Blob key of a checkpoint (nbos_checkpoint_request) a new group starts from")
      ->envname("NBOS_RESTORE_FROM");
  cmd.add_option("--log-level", a.log_level, "trace, debug, info, warn, error, off")
      ->capture_default_str();
  cmd.add_option("--run-as", a.run_as,
                 "UID:GID to switch to before running any cell (the daemon's sandbox)");
  cmd.add_option("--cgroup", a.cgroups, "cgroup directory to join first (repeatable)");
  cmd.add_option("--workspace-root", a.workspace.root, "The workspace root the daemon exports");
  cmd.add_option("--workspace", a.workspace.visible,
                 "The part of it this kernel sees (mounted in the sandbox before --run-as)");
  cmd.add_option("--working-dir", a.working_dir, "Where cells start (the notebook's directory)");
}

// The daemon's sandbox, from the inside: join the replica's cgroups (which needs the privileges
// the process still has), then give them up for the kernel's own user id, for good.
bool EnterSandbox(const ReplicaArgs& a) {
  for (const std::string& dir : a.cgroups) {
    const std::string procs = dir + "/cgroup.procs";
    int fd = open(procs.c_str(), O_WRONLY | O_CLOEXEC);
    bool joined = fd >= 0 && write(fd, "0", 1) == 1;
    if (fd >= 0) close(fd);
    if (!joined) {
      std::cerr << "nbos replica: cannot join cgroup " << dir << ": " << std::strerror(errno)
                << "\n";
      return false;
    }
  }
  if (a.run_as.empty()) return true;
  unsigned uid = 0, gid = 0;
  char extra = 0;
  if (std::sscanf(a.run_as.c_str(), "%u:%u%c", &uid, &gid, &extra) != 2 || uid == 0) {
    std::cerr << "nbos replica: --run-as wants UID:GID (not root), got '" << a.run_as << "'\n";
    return false;
  }
  if (!a.workspace.visible.empty()) {
    workspace::WorkspaceMount mount = a.workspace;
    mount.uid = uid;
    mount.gid = gid;
    auto note = workspace::MountWorkspace(mount);
    if (!note.ok()) {
      std::cerr << "nbos replica: " << note.status().message() << "\n";
      return false;
    }
    if (!note->empty())
      std::cerr << "nbos replica: workspace " << mount.visible << ": " << *note << "\n";
  }
  // Groups first (it needs the privilege the user id change takes away); setres* change every
  // thread (glibc), which a warm process with Python's threads needs.
  if (setgroups(0, nullptr) != 0 || setresgid(gid, gid, gid) != 0 ||
      setresuid(uid, uid, uid) != 0 || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
    std::cerr << "nbos replica: cannot switch to user " << uid << ": " << std::strerror(errno)
              << "\n";
    return false;
  }
  return true;
}

// The kernel server's options from the connection file; nullopt (reported) if unreadable.
std::optional<replica::KernelOptions> KernelOptionsFrom(const std::string& connection_file,
                                                        const std::string& version,
                                                        const std::string& log_level,
                                                        const char* command) {
  auto info = jupyter::ReadConnectionFile(connection_file);
  if (!info.ok()) {
    std::cerr << "nbos " << command << ": " << info.status().message() << "\n";
    return std::nullopt;
  }
  replica::KernelOptions options;
  options.connection = *info;
  options.connection_file = std::filesystem::absolute(connection_file).string();
  options.version = version;
  options.log_level = log_level;
  return options;
}

int RunReplica(ReplicaArgs& a, const std::string& version) {
  if (!EnterSandbox(a)) return 1;
  // As the kernel's user: its permissions, not the daemon's, decide.
  if (!a.working_dir.empty() && chdir(a.working_dir.c_str()) != 0) {
    std::cerr << "nbos replica: cannot enter the working directory " << a.working_dir << ": "
              << std::strerror(errno) << "\n";
    return 1;
  }
  std::string missing;
  if (a.connection_file.empty()) missing += " --connection-file";
  if (a.options.replica_id == 0) missing += " --id";
  if (a.options.raft_address.empty()) missing += " --raft";
  if (a.options.data_dir.empty()) missing += " --data-dir";
  if (a.options.blob_store_url.empty()) missing += " --blob-store";
  if (!missing.empty()) {
    std::cerr << "nbos replica: missing" << missing << "\n";
    return 2;
  }
  auto options = KernelOptionsFrom(a.connection_file, version, a.log_level, "replica");
  if (!options) return 2;
  for (const std::string& peer : a.peer_specs) {
    size_t eq = peer.find('=');
    uint64_t id = 0;
    if (eq != std::string::npos) id = std::strtoull(peer.substr(0, eq).c_str(), nullptr, 10);
    if (id == 0 || eq + 1 >= peer.size()) {
      std::cerr << "nbos replica: --peer wants ID=IPv4:port, got '" << peer << "'\n";
      return 2;
    }
    a.options.peers.push_back({id, peer.substr(eq + 1)});
  }
  a.options.connection_key = options->connection.key;
  options->start_gate = [gate_options = a.options] {
    return replica::ReplicaGate::StartInBackground(gate_options);
  };
  replica::RunKernel(*options);  // does not return
  return 0;
}

// A warm replica: Python first, then the promotion from stdin, then RunReplica.
int RunWarm(const std::vector<std::string>& preload, const std::string& version) {
  if (Status s = replica::PythonEngine::Preload(preload); !s.ok()) {
    std::cerr << "nbos replica --warm: " << s.message() << "\n";
    return 1;
  }
  // Stdin is a socket from the daemon: tell it the preload is done.
  [[maybe_unused]] ssize_t said = write(STDIN_FILENO, "ready\n", 6);
  std::string line;
  if (!std::getline(std::cin, line)) return 0;  // the pool was shut down
  nlohmann::json promotion = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!promotion.is_object() || !promotion.value("argv", nlohmann::json()).is_array() ||
      !promotion.value("env", nlohmann::json()).is_array() ||
      !promotion.value("cwd", nlohmann::json()).is_string() ||
      !promotion.value("log", nlohmann::json()).is_string()) {
    std::cerr << "nbos replica --warm: a promotion is {argv, env, cwd, log}, got: " << line << "\n";
    return 2;
  }
  const std::string log = promotion["log"];
  int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    std::cerr << "nbos replica --warm: cannot open " << log << ": " << std::strerror(errno) << "\n";
    return 1;
  }
  std::fflush(nullptr);
  dup2(fd, STDOUT_FILENO);
  dup2(fd, STDERR_FILENO);
  close(fd);
  const std::string cwd = promotion["cwd"];
  if (chdir(cwd.c_str()) != 0) {
    std::cerr << "nbos replica --warm: cannot enter " << cwd << ": " << std::strerror(errno)
              << "\n";
    return 1;
  }
  std::vector<std::string> env;
  for (const auto& e : promotion["env"])
    if (e.is_string()) env.push_back(e.get<std::string>());
  if (Status s = replica::PythonEngine::ReplaceEnvironment(env); !s.ok()) {
    std::cerr << "nbos replica --warm: " << s.message() << "\n";
    return 1;
  }
  ReplicaArgs a;
  CLI::App parser{"nbos replica (promoted)"};
  AddReplicaOptions(parser, a);
  std::vector<std::string> argv;
  for (const auto& e : promotion["argv"])
    if (e.is_string()) argv.push_back(e.get<std::string>());
  std::reverse(argv.begin(), argv.end());  // CLI11 takes a vector last argument first
  try {
    parser.parse(argv);
  } catch (const CLI::ParseError& e) {
    std::cerr << "nbos replica --warm: bad promotion arguments: " << e.what() << "\n";
    return 2;
  }
  return RunReplica(a, version);
}

}  // namespace

std::function<int()> AddReplicaCommands(CLI::App& app, std::string version) {
  auto kernel_args = std::make_shared<ReplicaArgs>();
  auto* kernel = app.add_subcommand("kernel", "Run a standalone Jupyter kernel over ZeroMQ");
  kernel
      ->add_option("-f,--connection-file", kernel_args->connection_file, "Jupyter connection file")
      ->required();
  kernel->add_option("--log-level", kernel_args->log_level, "trace, debug, info, warn, error, off")
      ->capture_default_str();

  auto replica_args = std::make_shared<ReplicaArgs>();
  auto warm = std::make_shared<bool>(false);
  auto preload = std::make_shared<std::vector<std::string>>();
  auto* replica = app.add_subcommand(
      "replica", "Run one replica of a distributed kernel (started by a daemon or a test driver)");
  AddReplicaOptions(*replica, *replica_args);
  replica->add_flag("--warm", *warm,
                    "Pre-start: load Python, then take the options from one JSON line on stdin");
  replica->add_option("--preload", *preload, "With --warm: Python modules to import ahead");

  return [=]() -> int {
    if (*kernel) {
      auto options = KernelOptionsFrom(kernel_args->connection_file, version,
                                       kernel_args->log_level, "kernel");
      if (!options) return 2;
      replica::RunKernel(*options);  // does not return
    }
    if (*replica) {
      if (*warm) {
        std::vector<std::string> modules = {"IPython.core.interactiveshell", "cloudpickle"};
        modules.insert(modules.end(), preload->begin(), preload->end());
        return RunWarm(modules, version);
      }
      return RunReplica(*replica_args, version);
    }
    return -1;
  };
}

}  // namespace nbos::app
