#include "common/spawn.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>

#include "common/work_queue.h"

extern char** environ;

namespace nbos {

std::vector<std::string> BuildEnvironment(
    const std::vector<std::map<std::string, std::string>>& overrides) {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string kv(*e);
    size_t eq = kv.find('=');
    if (eq == std::string::npos) continue;
    env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& layer : overrides) {
    for (const auto& [k, v] : layer) env[k] = v;
  }
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

namespace {

std::vector<char*> CStrings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// The parent thread of every child: one worker, started on first use and never stopped. The kernel
// sends a child's parent-death signal when the *thread* that forked it exits, so children of a
// gRPC worker thread would die with that worker. Process-directed signals go to the threads that
// expect them: the worker starts with every signal blocked.
KeyedWorkQueue& Spawner() {
  static KeyedWorkQueue* spawner = [] {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    auto* queue = new KeyedWorkQueue(1, "spawner");  // leaked: outlives every caller
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    return queue;
  }();
  return *spawner;
}

Result<pid_t> SpawnNow(std::vector<std::string>& argv, std::vector<std::string>& envp, int stdin_fd,
                       int log_fd, const std::string& cwd) {
  // posix_spawn (vfork-like in glibc) rather than fork: the daemon is multi-threaded (gRPC).
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (stdin_fd < 0) {
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  } else {
    posix_spawn_file_actions_adddup2(&actions, stdin_fd, 0);
  }
  posix_spawn_file_actions_adddup2(&actions, log_fd, 1);
  posix_spawn_file_actions_adddup2(&actions, log_fd, 2);
  posix_spawn_file_actions_addclosefrom_np(&actions, 3);  // no inherited daemon sockets
  posix_spawn_file_actions_addchdir_np(&actions, cwd.c_str());

  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  // Its own process group, so Stop() reaches whatever the replica's cells started too.
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);
  sigset_t empty;
  sigemptyset(&empty);
  posix_spawnattr_setsigmask(&attr, &empty);
  // Ignored dispositions survive exec (gRPC ignores SIGPIPE); the replica expects defaults.
  sigset_t defaults;
  sigemptyset(&defaults);
  for (int sig : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD, SIGUSR1, SIGUSR2}) {
    sigaddset(&defaults, sig);
  }
  posix_spawnattr_setsigdefault(&attr, &defaults);

  std::vector<char*> args = CStrings(argv);
  std::vector<char*> env = CStrings(envp);
  pid_t pid = 0;
  int rc = posix_spawn(&pid, args[0], &actions, &attr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) return Internal(fmt::format("cannot start {}: {}", argv[0], strerror(rc)));
  return pid;
}

}  // namespace

Result<pid_t> SpawnProcess(std::vector<std::string>& argv, std::vector<std::string>& envp,
                           int stdin_fd, int log_fd, const std::string& cwd) {
  std::packaged_task<Result<pid_t>()> spawn(
      [&] { return SpawnNow(argv, envp, stdin_fd, log_fd, cwd); });
  std::future<Result<pid_t>> done = spawn.get_future();
  Spawner().Post("spawn", [&spawn] { spawn(); });
  return done.get();
}

std::vector<ProcessEntry> ListProcesses() {
  std::vector<ProcessEntry> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    // pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so from the last ')'.
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 1));
    ProcessEntry p;
    p.pid = static_cast<pid_t>(std::stol(name));
    if (rest >> p.state >> p.ppid >> p.pgrp) out.push_back(p);
  }
  return out;
}

}  // namespace nbos
