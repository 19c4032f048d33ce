#include "daemon/supervisor.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/ids.h"
#include "common/spawn.h"

namespace nbos::daemon {
namespace {

namespace fs = std::filesystem;

// After SIGKILL the process is gone as soon as the watch thread polls; this only bounds a wait
// that should never be reached (e.g. a process stuck in uninterruptible sleep).
constexpr auto kKillWait = std::chrono::seconds(10);

std::string ConnectionPath(const std::string& dir) { return dir + "/connection.json"; }

// Writes all of `data` to a socket; false if the peer is gone.
bool SendAll(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

int ExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  return -1;
}

std::string DescribeExit(int code) {
  if (code >= 0) return fmt::format("exited with status {}", code);
  return fmt::format("was killed by signal {} ({})", -code, strsignal(-code));
}

std::string CgroupName(const ReplicaKey& key) {
  return fmt::format("{}-{}", key.kernel_id, key.replica_id);
}

// Hands `dir` and everything in it to `uid`, the directory itself private to it.
Status GiveDirectory(const std::string& dir, uint32_t uid) {
  auto give = [uid](const fs::path& p) {
    return lchown(p.c_str(), uid, uid) == 0 || errno == ENOENT;
  };
  std::error_code ec;
  bool ok = give(dir);
  for (auto it = fs::recursive_directory_iterator(dir, ec); ok && !ec && it != end(it);
       it.increment(ec)) {
    ok = give(it->path());
  }
  if (!ok || ec)
    return Internal(fmt::format("cannot give {} to user {}: {}", dir, uid,
                                ec ? ec.message() : strerror(errno)));
  fs::permissions(dir, fs::perms::owner_all, fs::perm_options::replace, ec);
  return Status::Ok();
}

// The processes of process group `pgid` other than its leader.
std::vector<pid_t> GroupMembersButLeader(pid_t pgid) {
  std::vector<pid_t> out;
  for (const ProcessEntry& p : ListProcesses())
    if (p.pgrp == pgid && p.pid != pgid) out.push_back(p.pid);
  return out;
}

}  // namespace

std::string_view ReplicaStateName(ReplicaState state) {
  switch (state) {
    case ReplicaState::kPrepared:
      return "prepared";
    case ReplicaState::kRunning:
      return "running";
    case ReplicaState::kRestarting:
      return "restarting";
    case ReplicaState::kExited:
      return "exited";
    case ReplicaState::kStopped:
      return "stopped";
  }
  return "unknown";
}

Supervisor::Supervisor(SupervisorOptions options) : options_(std::move(options)) {
  watcher_ = std::thread([this] { Watch(); });
}

Supervisor::~Supervisor() {
  StopAll(/*keep_data=*/true);
  if (options_.cgroups) options_.cgroups->RemoveGroups();
  {
    MutexLock lock(&mu_);
    shutdown_ = true;
  }
  cv_.SignalAll();
  watcher_.join();
}

Status Supervisor::Prepare(const ReplicaKey& key, const std::string& dir,
                           const jupyter::ConnectionInfo& connection,
                           const std::string& raft_address, ReplicaLimits limits) {
  MutexLock lock(&mu_);
  if (children_.contains(key)) {
    return InvalidArgument("replica " + key.ToString() + " is already prepared");
  }
  std::error_code ec;
  const std::string raft_dir = RaftDirectory(dir);
  // A Raft directory outside DIR may be left by an earlier daemon; a new preparation is a new
  // Raft member, so its old log must not be replayed.
  if (!options_.raft_log_root.empty()) fs::remove_all(raft_dir, ec);
  for (const std::string& d : {dir, raft_dir}) {
    fs::create_directories(d, ec);
    if (ec) return Internal("cannot create " + d + ": " + ec.message());
  }
  {
    std::ofstream out(ConnectionPath(dir), std::ios::trunc);
    out << jupyter::ConnectionInfoToJson(connection);
    if (!out) return Internal("cannot write " + ConnectionPath(dir));
  }
  // The file holds the kernel's signing key.
  fs::permissions(ConnectionPath(dir), fs::perms::owner_read | fs::perms::owner_write,
                  fs::perm_options::replace, ec);
  Child child;
  child.info.key = key;
  child.info.dir = dir;
  child.info.raft_dir = raft_dir;
  child.info.raft_address = raft_address;
  child.info.connection = connection;
  child.limits = limits;
  children_.emplace(key, std::move(child));
  return Status::Ok();
}

Result<pid_t> Supervisor::Launch(const ReplicaKey& key,
                                 const std::vector<std::pair<uint32_t, std::string>>& peers,
                                 const std::string& blob_store_url,
                                 const std::map<std::string, std::string>& env,
                                 const std::optional<workspace::KernelWorkspace>& workspace) {
  MutexLock lock(&mu_);
  auto it = children_.find(key);
  if (it == children_.end()) return NotFound("replica " + key.ToString() + " is not prepared");
  Child& child = it->second;
  if (child.stopping) return Unavailable("replica " + key.ToString() + " is being stopped");
  if (child.info.state == ReplicaState::kRunning || child.info.state == ReplicaState::kRestarting) {
    return child.info.pid;  // a repeated launch (the gateway retried)
  }
  const std::string& dir = child.info.dir;
  std::vector<std::string> argv = {options_.nbos_binary,
                                   "replica",
                                   "-f",
                                   ConnectionPath(dir),
                                   "--id",
                                   std::to_string(key.replica_id),
                                   "--raft",
                                   child.info.raft_address,
                                   "--data-dir",
                                   child.info.raft_dir,
                                   "--blob-store",
                                   blob_store_url,
                                   "--log-level",
                                   options_.log_level};
  for (const auto& [id, address] : peers) argv.push_back(fmt::format("--peer={}={}", id, address));
  if (workspace) {
    argv.insert(argv.end(),
                {"--workspace-root=" + options_.workspace_root, "--workspace=" + workspace->visible,
                 "--working-dir=" + workspace->working_dir});
  }
  child.argv = std::move(argv);
  const std::map<std::string, std::string> identity = {
      {"NBOS_KERNEL_ID", key.kernel_id}, {"NBOS_REPLICA_ID", std::to_string(key.replica_id)}};
  if (options_.sandbox) {
    if (Status s = PrepareSandbox(child, blob_store_url); !s.ok()) return s;
    SandboxPolicy policy = options_.sandbox_policy;
    for (std::string& name : DefaultPassedEnvironment(blob_store_url))
      policy.env_passed.push_back(std::move(name));
    std::vector<std::string> extra = {"CUDA_DEVICE_ORDER=PCI_BUS_ID", "HOME=" + dir + "/home",
                                      "TMPDIR=/tmp", "USER=kernel", "LOGNAME=kernel"};
    for (const auto& layer : {env, identity})
      for (const auto& [k, v] : layer) extra.push_back(k + "=" + v);
    child.envp = SandboxEnvironment(policy, BuildEnvironment({}), extra);
  } else {
    child.envp = BuildEnvironment({{{"CUDA_DEVICE_ORDER", "PCI_BUS_ID"}}, env, identity});
  }
  child.restart_times.clear();
  if (Status s = Spawn(child); !s.ok()) return s;
  cv_.SignalAll();
  return child.info.pid;
}

Status Supervisor::PrepareSandbox(Child& child, const std::string& blob_store_url) {
  const ReplicaKey& key = child.info.key;
  // A home of its own (the daemon's is not writable there), beside its working directory rather
  // than it, so that paths in the working directory read as they do under ipykernel.
  std::error_code ec;
  fs::create_directories(child.info.dir + "/home", ec);
  if (options_.sandbox_users) {
    uint32_t uid =
        SandboxUserId(key.kernel_id, options_.sandbox_uid_base, options_.sandbox_uid_range);
    // Two kernels on one server never share an id: the next free one (rarely needed).
    auto taken = [&](uint32_t id) REQUIRES(mu_) {
      for (const auto& [k, c] : children_)
        if (k.kernel_id != key.kernel_id && c.info.uid == id) return true;
      return false;
    };
    while (taken(uid))
      uid = options_.sandbox_uid_base +
            (uid + 1 - options_.sandbox_uid_base) % options_.sandbox_uid_range;
    for (const std::string& d : {child.info.dir, child.info.raft_dir})
      if (Status s = GiveDirectory(d, uid); !s.ok()) return s;
    child.info.uid = uid;
    child.argv.push_back(fmt::format("--run-as={}:{}", uid, uid));
  }
  if (options_.cgroups) {
    auto dirs =
        options_.cgroups->Create(CgroupName(key), child.limits.memory_mb, child.limits.millicpus);
    if (!dirs.ok()) return dirs.status();
    for (const std::string& d : *dirs) child.argv.push_back("--cgroup=" + d);
  }
  // A directory store other than the daemon's (the launch named it) is bound in for this
  // replica alone, which then starts cold: warm processes were sandboxed without it.
  child.extra_writable.clear();
  if (blob_store_url.starts_with("dir://")) {
    const std::string root = blob_store_url.substr(6, blob_store_url.find('?') - 6);
    bool covered = false;
    for (const std::string& w : options_.sandbox_policy.writable)
      covered = covered || root == w || root.starts_with(w + "/");
    if (!covered) {
      fs::create_directories(root, ec);
      if (options_.sandbox_users) {
        if (Status s = PrepareSharedBlobDirectory(root); !s.ok()) return s;
      }
      child.extra_writable.push_back(root);
    }
  }
  return Status::Ok();
}

void Supervisor::NoteOutOfMemory(Child& child) {
  if (!options_.cgroups) return;
  const uint64_t kills = options_.cgroups->OomKills(CgroupName(child.info.key));
  if (kills <= child.oom_kills) return;
  child.oom_kills = kills;
  child.info.exit_reason = fmt::format(
      "out of memory: the kernel's cells used more than its {} MB (KERNEL_MEMORY), and the "
      "replica was stopped",
      child.limits.memory_mb);
  const std::string log_path = child.info.dir + "/replica.log";
  std::ofstream(log_path, std::ios::app)
      << "--- nbos daemon: " << child.info.exit_reason << " ---\n";
}

Status Supervisor::Spawn(Child& child) {
  const std::string log_path = child.info.dir + "/replica.log";
  int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) return Internal("cannot open " + log_path + ": " + strerror(errno));
  std::string banner = fmt::format("--- nbos daemon: starting replica {} at {} (restart {}) ---\n",
                                   child.info.key.ToString(), NowIsoUtc(), child.info.restarts);
  [[maybe_unused]] ssize_t w = write(log_fd, banner.data(), banner.size());
  if (options_.cgroups) child.oom_kills = options_.cgroups->OomKills(CgroupName(child.info.key));
  child.info.exit_reason.clear();
  if (child.extra_writable.empty() && Promote(child)) {
    close(log_fd);
    return Status::Ok();
  }
  SandboxPolicy policy = options_.sandbox_policy;
  policy.writable.insert(policy.writable.end(), child.extra_writable.begin(),
                         child.extra_writable.end());
  std::vector<std::string> argv =
      options_.sandbox ? SandboxCommand(policy, child.argv) : child.argv;
  Result<pid_t> pid = SpawnProcess(argv, child.envp, -1, log_fd, child.info.dir);
  close(log_fd);
  if (!pid.ok()) return pid.status();
  child.info.pid = *pid;
  child.info.state = ReplicaState::kRunning;
  ++warm_stats_.cold;
  spdlog::info("replica {} started, pid {}", child.info.key.ToString(), *pid);
  return Status::Ok();
}

bool Supervisor::Promote(Child& child) {
  while (!warm_.empty()) {
    // A ready one if there is one; else the oldest, which is furthest along its preload.
    auto pick =
        std::find_if(warm_.begin(), warm_.end(), [](const WarmProcess& w) { return w.ready; });
    if (pick == warm_.end()) pick = warm_.begin();
    WarmProcess warm = *pick;
    warm_.erase(pick);
    nlohmann::json promotion = {
        {"argv", std::vector<std::string>(child.argv.begin() + 2, child.argv.end())},
        {"env", child.envp},
        {"cwd", child.info.dir},
        {"log", child.info.dir + "/replica.log"}};
    const bool sent = SendAll(warm.stdin_fd, promotion.dump() + "\n");
    close(warm.stdin_fd);
    if (!sent) {
      // It died waiting; reap it here so the pool does not count it twice.
      kill(-warm.pid, SIGKILL);
      waitpid(warm.pid, nullptr, 0);
      ++warm_stats_.died;
      continue;
    }
    child.info.pid = warm.pid;
    child.info.state = ReplicaState::kRunning;
    ++warm_stats_.promoted;
    last_promotion_ = std::chrono::steady_clock::now();
    spdlog::info("replica {} started, pid {} (a warm process)", child.info.key.ToString(),
                 warm.pid);
    cv_.SignalAll();  // the watch thread tops the pool up
    return true;
  }
  return false;
}

Status Supervisor::SpawnWarm() {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return Internal(std::string("socketpair: ") + strerror(errno));
  }
  const std::string log_path = fmt::format("{}/warm-{}.log", options_.warm_dir, ++warm_spawned_);
  int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) {
    close(sv[0]);
    close(sv[1]);
    return Internal("cannot open " + log_path + ": " + strerror(errno));
  }
  std::vector<std::string> argv = {options_.nbos_binary, "replica", "--warm", "--log-level",
                                   options_.log_level};
  for (const std::string& m : options_.warm_preload) argv.push_back("--preload=" + m);
  std::vector<std::string> envp = BuildEnvironment({{{"CUDA_DEVICE_ORDER", "PCI_BUS_ID"}}});
  if (options_.sandbox) {
    // Until promoted, a warm process runs no one's code: the locale and paths are enough.
    argv = SandboxCommand(options_.sandbox_policy, argv);
    envp = SandboxEnvironment(options_.sandbox_policy, envp, {"CUDA_DEVICE_ORDER=PCI_BUS_ID"});
  }
  Result<pid_t> pid = SpawnProcess(argv, envp, sv[1], log_fd, options_.warm_dir);
  close(sv[1]);
  close(log_fd);
  if (!pid.ok()) {
    close(sv[0]);
    return pid.status();
  }
  warm_.push_back({*pid, sv[0]});
  return Status::Ok();
}

void Supervisor::TendWarmPool() {
  const auto now = std::chrono::steady_clock::now();
  for (auto it = warm_.begin(); it != warm_.end();) {
    char said[16];
    if (!it->ready && recv(it->stdin_fd, said, sizeof said, MSG_DONTWAIT) > 0) it->ready = true;
    int status = 0;
    if (waitpid(it->pid, &status, WNOHANG) != it->pid) {
      ++it;
      continue;
    }
    spdlog::warn("warm replica process {} {} before it was used; see {}/warm-*.log", it->pid,
                 DescribeExit(ExitCode(status)), options_.warm_dir);
    close(it->stdin_fd);
    it = warm_.erase(it);
    ++warm_stats_.died;
    warm_deaths_.push_back(now);
  }
  while (!warm_deaths_.empty() && now - warm_deaths_.front() > options_.restart_window) {
    warm_deaths_.pop_front();
  }
  if (!warm_stats_.disabled && static_cast<int>(warm_deaths_.size()) > options_.max_restarts) {
    spdlog::error("warm replica processes keep dying; the warm pool is off (cold starts only)");
    warm_stats_.disabled = true;
  }
  if (warm_closed_ || warm_stats_.disabled) return;
  // A replacement's exec and Python take a second or so of CPU, which the replicas just promoted
  // need for their own start.
  if (now - last_promotion_ < options_.warm_refill_delay) return;
  while (static_cast<int>(warm_.size()) < options_.warm_pool_size) {
    if (Status s = SpawnWarm(); !s.ok()) {
      spdlog::error("warm pool: {}", s.message());
      warm_stats_.disabled = true;
      return;
    }
  }
}

void Supervisor::StopWarmPool() {
  warm_closed_ = true;
  for (const WarmProcess& w : warm_) {
    close(w.stdin_fd);  // end of input: a waiting warm process exits
    kill(-w.pid, SIGTERM);
  }
  for (const WarmProcess& w : warm_) waitpid(w.pid, nullptr, 0);
  warm_.clear();
}

WarmPoolStats Supervisor::warm_pool() const {
  MutexLock lock(&mu_);
  WarmPoolStats stats = warm_stats_;
  for (const WarmProcess& w : warm_) ++(w.ready ? stats.ready : stats.starting);
  return stats;
}

Status Supervisor::Stop(const ReplicaKey& key, bool keep_data) {
  std::vector<std::string> dirs;
  {
    MutexLock lock(&mu_);
    if (!children_.contains(key)) return NotFound("replica " + key.ToString() + " is unknown");
    TerminateLocked({key});
    auto it = children_.find(key);
    if (it == children_.end()) return Status::Ok();  // a concurrent Stop finished first
    dirs = DirectoriesToRemove(it->second.info, keep_data);
    children_.erase(it);
    if (options_.cgroups) options_.cgroups->Remove(CgroupName(key));
  }
  spdlog::info("replica {} stopped{}", key.ToString(), keep_data ? ", data kept" : "");
  for (const std::string& dir : dirs) {
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (ec) return Internal("cannot remove " + dir + ": " + ec.message());
  }
  return Status::Ok();
}

void Supervisor::StopAll(bool keep_data) {
  std::vector<std::string> dirs;
  {
    MutexLock lock(&mu_);
    StopWarmPool();
    std::vector<ReplicaKey> keys;
    for (const auto& [key, child] : children_) keys.push_back(key);
    if (keys.empty()) return;
    TerminateLocked(keys);
    for (const ReplicaKey& key : keys) {
      auto it = children_.find(key);
      if (it == children_.end()) continue;
      for (std::string& dir : DirectoriesToRemove(it->second.info, keep_data))
        dirs.push_back(std::move(dir));
      children_.erase(it);
      if (options_.cgroups) options_.cgroups->Remove(CgroupName(key));
    }
  }
  for (const std::string& dir : dirs) {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
}

std::string Supervisor::RaftDirectory(const std::string& dir) const {
  if (options_.raft_log_root.empty()) return dir + "/data";
  return options_.raft_log_root + "/" + fs::path(dir).filename().string();
}

// A Raft log outside DIR goes even when DIR is kept: no later replica replays it (Prepare empties
// it), and it holds RAM.
std::vector<std::string> Supervisor::DirectoriesToRemove(const ReplicaProcess& info,
                                                         bool keep_data) const {
  std::vector<std::string> dirs;
  if (!keep_data) dirs.push_back(info.dir);
  if (!options_.raft_log_root.empty()) dirs.push_back(info.raft_dir);
  return dirs;
}

bool Supervisor::AllReaped(const std::vector<ReplicaKey>& keys) const {
  for (const ReplicaKey& key : keys) {
    auto it = children_.find(key);
    if (it != children_.end() && it->second.info.pid > 0) return false;
  }
  return true;
}

bool Supervisor::AwaitReaped(const std::vector<ReplicaKey>& keys,
                             std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!AllReaped(keys)) {
    if (!cv_.WaitUntil(&mu_, deadline)) return AllReaped(keys);
  }
  return true;
}

void Supervisor::TerminateLocked(const std::vector<ReplicaKey>& keys) {
  for (const ReplicaKey& key : keys) {
    auto it = children_.find(key);
    if (it == children_.end()) continue;
    it->second.stopping = true;
    it->second.info.state = ReplicaState::kStopped;
    const pid_t pid = it->second.info.pid;
    if (pid <= 0) continue;
    if (!options_.sandbox) {
      kill(-pid, SIGTERM);
      continue;
    }
    // bubblewrap dies of SIGTERM at once; the replica must be the one to hear it, and bubblewrap
    // then exits with it.
    for (pid_t member : GroupMembersButLeader(pid)) kill(member, SIGTERM);
  }
  if (AwaitReaped(keys, options_.stop_grace)) return;
  for (const ReplicaKey& key : keys) {
    auto it = children_.find(key);
    if (it == children_.end() || it->second.info.pid <= 0) continue;
    spdlog::warn("replica {} (pid {}) ignored SIGTERM for {} ms; killing it", key.ToString(),
                 it->second.info.pid, options_.stop_grace.count());
    kill(-it->second.info.pid, SIGKILL);
  }
  if (!AwaitReaped(keys, kKillWait)) {
    spdlog::error("replica processes survived SIGKILL for {} s", kKillWait.count());
  }
}

void Supervisor::Watch() {
  MutexLock lock(&mu_);
  while (!shutdown_) {
    std::vector<ExitEvent> exits;
    Poll(&exits);
    TendWarmPool();
    if (!exits.empty() && options_.on_exit) {
      // Without the lock: the callback takes the daemon's locks, and the daemon may call into
      // the Supervisor while holding them.
      lock.Unlock();
      for (const ExitEvent& e : exits) options_.on_exit(e.key, e.exit_code, e.restarting);
      lock.Lock();
    }
    cv_.WaitFor(&mu_, options_.poll_interval);
  }
}

void Supervisor::Poll(std::vector<ExitEvent>* exits) {
  const auto now = std::chrono::steady_clock::now();
  bool reaped = false;
  for (auto& [key, child] : children_) {
    pid_t pid = child.info.pid;
    if (pid <= 0) continue;
    siginfo_t info{};
    // WNOWAIT: the zombie keeps its pid, and so the process group id, reserved while we kill
    // whatever the replica left in its group; only then is it reaped.
    int rc = waitid(P_PID, pid, &info, WEXITED | WNOHANG | WNOWAIT);
    int code = 0;
    if (rc == 0 && info.si_pid == pid) {
      kill(-pid, SIGKILL);
      int status = 0;
      waitpid(pid, &status, 0);
      code = ExitCode(status);
    } else if (rc < 0 && errno == ECHILD) {
      code = -1;  // reaped elsewhere (SIGCHLD ignored by someone): the exit status is lost
    } else {
      continue;
    }
    reaped = true;
    child.info.pid = 0;
    child.info.exit_code = code;
    NoteOutOfMemory(child);
    if (child.stopping) continue;  // Stop() asked for it
    bool restart = false;
    if (code != 0) {
      while (!child.restart_times.empty() &&
             now - child.restart_times.front() > options_.restart_window) {
        child.restart_times.pop_front();
      }
      restart = static_cast<int>(child.restart_times.size()) < options_.max_restarts;
    }
    if (restart) {
      child.restart_times.push_back(now);
      child.info.restarts++;
      child.info.state = ReplicaState::kRestarting;
      child.restart_at = now + options_.restart_delay;
      spdlog::warn("replica {} (pid {}) {}{}; restarting ({} of {} within {} s)", key.ToString(),
                   pid, DescribeExit(code),
                   child.info.exit_reason.empty() ? "" : " (" + child.info.exit_reason + ")",
                   child.restart_times.size(), options_.max_restarts,
                   options_.restart_window.count() / 1000);
    } else {
      child.info.state = ReplicaState::kExited;
      if (code == 0) {
        spdlog::info("replica {} (pid {}) exited", key.ToString(), pid);
      } else {
        spdlog::error("replica {} (pid {}) {}; restart budget spent, giving up", key.ToString(),
                      pid, DescribeExit(code));
      }
    }
    exits->push_back({key, code, restart});
  }
  for (auto& [key, child] : children_) {
    if (child.info.state != ReplicaState::kRestarting || child.stopping || now < child.restart_at) {
      continue;
    }
    if (Status s = Spawn(child); !s.ok()) {
      spdlog::error("replica {}: {}", key.ToString(), s.message());
      child.info.state = ReplicaState::kExited;
      exits->push_back({key, child.info.exit_code, false});
    }
  }
  if (reaped) cv_.SignalAll();
}

std::optional<ReplicaProcess> Supervisor::Get(const ReplicaKey& key) const {
  MutexLock lock(&mu_);
  auto it = children_.find(key);
  if (it == children_.end()) return std::nullopt;
  return it->second.info;
}

std::vector<ReplicaProcess> Supervisor::List() const {
  MutexLock lock(&mu_);
  std::vector<ReplicaProcess> out;
  for (const auto& [key, child] : children_) out.push_back(child.info);
  return out;
}

}  // namespace nbos::daemon
