#include "gateway/local_host_provider.h"

#include <fcntl.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/spawn.h"

namespace nbos::gateway {
namespace {

namespace fs = std::filesystem;

std::string HostId(int i) { return "host-" + std::to_string(i); }

// Whether `pid` runs `nbos daemon --server-id <id>`: a pid file can outlive its process and the
// pid be reused.
bool RunsDaemon(pid_t pid, const std::string& id) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  std::string cmdline((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return cmdline.find(std::string("daemon") + '\0') != std::string::npos &&
         cmdline.find(std::string("--server-id") + '\0' + id + '\0') != std::string::npos;
}

// Waits for `pid` to exit, up to `timeout`; a child is reaped. True when it is gone.
bool WaitGone(pid_t pid, bool child, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (child ? waitpid(pid, nullptr, WNOHANG) == pid : kill(pid, 0) != 0) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

LocalHostProvider::LocalHostProvider(LocalHostOptions options) : options_(std::move(options)) {
  std::error_code ec;
  fs::create_directories(options_.state_dir + "/hosts", ec);
  fs::create_directories(options_.state_dir + "/logs", ec);
  Adopt();
}

LocalHostProvider::~LocalHostProvider() = default;

std::string LocalHostProvider::PidFile(const std::string& id) const {
  return options_.state_dir + "/hosts/" + id + ".pid";
}

// Servers a previous gateway started keep running through its restart; they are this
// provider's again (their daemons re-register on their own).
void LocalHostProvider::Adopt() {
  for (int i = 1; i <= options_.max_hosts; ++i) {
    const std::string id = HostId(i);
    std::ifstream f(PidFile(id));
    pid_t pid = -1;
    if (!(f >> pid) || pid <= 0) continue;
    if (!RunsDaemon(pid, id)) {
      std::error_code ec;
      fs::remove(PidFile(id), ec);
      continue;
    }
    servers_[id] = Server{pid, false};
    spdlog::info("local hosts: adopted {} (pid {})", id, pid);
  }
}

std::vector<std::string> LocalDaemonArgv(const LocalHostOptions& options, int index) {
  const std::string id = "host-" + std::to_string(index);
  const int per_host = options.ports.size() / options.max_hosts;
  const int first = options.ports.first + (index - 1) * per_host;
  std::vector<std::string> argv = {
      options.nbos_binary,
      "daemon",
      "--server-id",
      id,
      "--gateway",
      options.control_address,
      "--gpus",
      std::to_string(options.gpus_per_host),
      "--virtual-gpus",
      "--state-dir",
      options.state_dir + "/" + id,
      "--blob-store",
      options.blob_store_url,
      "--replica-ports",
      std::to_string(first) + "-" + std::to_string(first + per_host - 1),
      "--warm-pool",
      std::to_string(options.warm_pool),
      "--log-level",
      options.log_level,
      "--sandbox",
      options.sandbox,
      "--sandbox-hide",
      options.state_dir,
      "--raft-log-dir",
      options.raft_log_dir};
  for (const std::string& dir : options.sandbox_share) {
    argv.push_back("--sandbox-share");
    argv.push_back(dir);
  }
  if (!options.workspace_root.empty()) {
    argv.push_back("--workspace-root");
    argv.push_back(options.workspace_root);
  }
  if (!options.credential_file.empty()) {
    argv.push_back("--credential");
    argv.push_back(options.credential_file);
  }
  return argv;
}

Status LocalHostProvider::Start(const std::string& id) {
  std::vector<std::string> argv = LocalDaemonArgv(options_, std::stoi(id.substr(5)));
  std::vector<std::string> envp = BuildEnvironment({});
  const std::string log_path = options_.state_dir + "/logs/" + id + ".log";
  const int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) return Unavailable("cannot open " + log_path);
  Result<pid_t> pid = SpawnProcess(argv, envp, -1, log_fd, options_.state_dir);
  close(log_fd);
  if (!pid.ok()) return pid.status();
  std::ofstream(PidFile(id)) << *pid << "\n";
  servers_[id] = Server{*pid, true};
  spdlog::info("local hosts: started {} (pid {})", id, *pid);
  return Status::Ok();
}

Result<std::vector<std::string>> LocalHostProvider::AddServers(int count) {
  std::vector<std::string> started;
  for (int i = 1; i <= options_.max_hosts && static_cast<int>(started.size()) < count; ++i) {
    const std::string id = HostId(i);
    if (servers_.count(id)) continue;
    if (Status s = Start(id); !s.ok()) {
      if (started.empty()) return s;
      break;
    }
    pending_.insert(id);
    started.push_back(id);
  }
  if (started.empty()) {
    return Unavailable("all " + std::to_string(options_.max_hosts) + " local servers run");
  }
  return started;
}

void LocalHostProvider::Stop(const std::string& id, Server& server) {
  kill(server.pid, SIGTERM);
  if (!WaitGone(server.pid, server.child, std::chrono::seconds(20))) {
    spdlog::warn("local hosts: {} did not stop on SIGTERM; killing it", id);
    kill(server.pid, SIGKILL);
    (void)WaitGone(server.pid, server.child, std::chrono::seconds(5));
  }
  std::error_code ec;
  fs::remove(PidFile(id), ec);
}

Status LocalHostProvider::RemoveServer(const std::string& id) {
  auto it = servers_.find(id);
  if (it == servers_.end()) return NotFound("no local server " + id);
  Stop(id, it->second);
  servers_.erase(it);
  pending_.erase(id);
  // Its replica directories must not come back with a later server of the same id.
  std::error_code ec;
  fs::remove_all(options_.state_dir + "/" + id, ec);
  spdlog::info("local hosts: removed {}", id);
  return Status::Ok();
}

std::vector<std::string> LocalHostProvider::Pending() const {
  return {pending_.begin(), pending_.end()};
}

bool LocalHostProvider::Owns(const std::string& id) const { return servers_.count(id) > 0; }

void LocalHostProvider::OnRegistered(const std::string& id) { pending_.erase(id); }

void LocalHostProvider::Poll() {
  for (auto& [id, server] : servers_) {
    const bool gone = server.child ? waitpid(server.pid, nullptr, WNOHANG) == server.pid
                                   : kill(server.pid, 0) != 0;
    if (!gone) continue;
    spdlog::warn("local hosts: {} (pid {}) exited; starting it again", id, server.pid);
    if (Status s = Start(id); !s.ok()) spdlog::error("local hosts: {}: {}", id, s.ToString());
  }
}

void LocalHostProvider::Shutdown() {
  // All at once: each daemon takes a moment to stop its replicas.
  for (auto& [id, server] : servers_) kill(server.pid, SIGTERM);
  for (auto& [id, server] : servers_) Stop(id, server);
  servers_.clear();
  pending_.clear();
}

}  // namespace nbos::gateway
