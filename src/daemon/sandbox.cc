#include "daemon/sandbox.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "common/spawn.h"

namespace nbos::daemon {
namespace {

namespace fs = std::filesystem;

bool NameMatches(std::string_view name, const std::vector<std::string>& patterns) {
  for (const std::string& p : patterns) {
    if (p.ends_with('*') ? name.starts_with(std::string_view(p).substr(0, p.size() - 1))
                         : name == p) {
      return true;
    }
  }
  return false;
}

Status WriteFile(const std::string& path, const std::string& value) {
  std::ofstream out(path);
  out << value;
  out.flush();
  if (!out) return Unavailable(fmt::format("cannot write {} to {}", value, path));
  return Status::Ok();
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The value after `key ` on its own line of a flat-keyed file (memory.events, memory.oom_control).
uint64_t KeyedValue(const std::string& text, std::string_view key) {
  std::istringstream lines(text);
  std::string k;
  uint64_t v = 0;
  while (lines >> k >> v) {
    if (k == key) return v;
  }
  return 0;
}

// The cgroup path of `controller` ("" for the v2 line) in /proc/self/cgroup's text.
std::optional<std::string> CgroupPathOf(std::string_view text, std::string_view controller) {
  std::istringstream lines{std::string(text)};
  std::string line;
  while (std::getline(lines, line)) {
    // hierarchy-ID:controller-list:path
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string list = line.substr(a + 1, b - a - 1);
    std::istringstream names(list);
    std::string name;
    bool match = controller.empty() && list.empty();
    while (!match && std::getline(names, name, ',')) match = name == controller;
    if (match) return line.substr(b + 1);
  }
  return std::nullopt;
}

// ROOT/CONTROLLER + PATH (a cgroup path from /proc/self/cgroup), without a doubled slash.
std::string CgroupDir(const std::string& root, const std::string& controller,
                      const std::string& path) {
  std::string dir = root + (controller.empty() ? "" : "/" + controller);
  return path == "/" ? dir : dir + path;
}

Status MakeGroup(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Unavailable("cannot create cgroup " + dir + ": " + ec.message());
  return Status::Ok();
}

// Before a mount at `path`: each parent directory, so that bubblewrap creates those missing in
// the sandbox (under its /tmp, inside a hidden tmpfs) traversable (0755) instead of 0700, which
// would keep the kernel's user from the replica's directory and the workspace. Parents on the
// host exist already and are left as they are.
void AddParents(const std::string& path, std::set<std::string>* made,
                std::vector<std::string>* cmd) {
  for (size_t slash = path.find('/', 1); slash != std::string::npos;
       slash = path.find('/', slash + 1)) {
    std::string parent = path.substr(0, slash);
    if (made->insert(parent).second) cmd->insert(cmd->end(), {"--perms", "0755", "--dir", parent});
  }
}

}  // namespace

std::vector<std::string> DefaultPassedEnvironment(std::string_view blob_store_url) {
  std::vector<std::string> names = {"PATH",
                                    "LANG",
                                    "LANGUAGE",
                                    "LC_*",
                                    "TZ",
                                    "LD_LIBRARY_PATH",
                                    "CUDA_*",
                                    "NVIDIA_*",
                                    "ASAN_OPTIONS",
                                    "TSAN_OPTIONS",
                                    "UBSAN_OPTIONS",
                                    "LSAN_OPTIONS"};
  if (blob_store_url.starts_with("s3://")) names.push_back("AWS_*");
  return names;
}

SanitizerPaths SanitizerPathsIn(const std::vector<std::string>& daemon_env) {
  SanitizerPaths paths;
  for (const std::string& kv : daemon_env) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || !kv.substr(0, eq).ends_with("SAN_OPTIONS")) continue;
    // The sanitizers split their options at spaces, colons and commas.
    std::string text = kv.substr(eq + 1);
    std::replace_if(
        text.begin(), text.end(), [](char c) { return c == ':' || c == ','; }, ' ');
    std::string option;
    std::istringstream options(text);
    while (options >> option) {
      for (const std::string_view prefix : {"log_path=/", "suppressions=/"}) {
        if (!option.starts_with(prefix)) continue;
        const std::string path = option.substr(prefix.size() - 1);
        if (prefix == "suppressions=/") {
          paths.readable.push_back(path);
        } else {
          paths.writable.push_back(fs::path(path).parent_path().string());
        }
      }
    }
  }
  return paths;
}

std::vector<std::string> SandboxCommand(const SandboxPolicy& policy,
                                        const std::vector<std::string>& argv) {
  std::vector<std::string> cmd = {policy.bwrap, "--die-with-parent", "--unshare-pid",
                                  "--unshare-ipc", "--unshare-uts", "--ro-bind", "/", "/", "--dev",
                                  "/dev", "--proc", "/proc",
                                  // Its own /tmp, writable by the kernel's user as on any
                                  // machine, gone with the replica.
                                  "--perms", "01777", "--tmpfs", "/tmp"};
  // Outer directories first: a tmpfs mounted later over a parent would cover what came before.
  std::vector<std::string> hidden = policy.hidden;
  std::sort(hidden.begin(), hidden.end(),
            [](const std::string& a, const std::string& b) { return a.size() < b.size(); });
  std::set<std::string> made;
  auto mount = [&](std::initializer_list<std::string> op, const std::string& path) {
    AddParents(path, &made, &cmd);
    cmd.insert(cmd.end(), op);
  };
  for (const std::string& path : hidden) mount({"--tmpfs", path}, path);
  for (const std::string& path : policy.hidden_files) mount({"--ro-bind", "/dev/null", path}, path);
  for (const std::string& path : policy.readable) mount({"--ro-bind", path, path}, path);
  for (const std::string& path : policy.writable) mount({"--bind", path, path}, path);
  for (const std::string& path : policy.devices) mount({"--dev-bind", path, path}, path);
  cmd.push_back("--");
  cmd.insert(cmd.end(), argv.begin(), argv.end());
  return cmd;
}

std::vector<std::string> SandboxEnvironment(const SandboxPolicy& policy,
                                            const std::vector<std::string>& daemon_env,
                                            const std::vector<std::string>& extra) {
  std::map<std::string, std::string> env;
  auto add = [&](const std::string& kv, bool filtered) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) return;
    std::string name = kv.substr(0, eq);
    if (filtered && !NameMatches(name, policy.env_passed)) return;
    env[std::move(name)] = kv.substr(eq + 1);
  };
  for (const std::string& kv : daemon_env) add(kv, true);
  for (const std::string& kv : extra) add(kv, false);
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

uint32_t SandboxUserId(std::string_view kernel_id, uint32_t base, uint32_t range) {
  uint32_t h = 2166136261u;
  for (unsigned char c : kernel_id) h = (h ^ c) * 16777619u;
  return base + (range == 0 ? 0 : h % range);
}

Status PrepareSharedBlobDirectory(const std::string& root) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec || chmod(root.c_str(), 0711) != 0) return Internal("cannot prepare blob store " + root);
  for (int i = 0; i < 256; ++i) {
    const std::string dir = fmt::format("{}/{:02x}", root, i);
    if ((mkdir(dir.c_str(), 01733) != 0 && errno != EEXIST) || chmod(dir.c_str(), 01733) != 0) {
      return Internal(fmt::format("cannot prepare {}: {}", dir, strerror(errno)));
    }
  }
  return Status::Ok();
}

std::string FindExecutable(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return name;
}

Status ProbeSandbox(const SandboxPolicy& policy, const std::vector<std::string>& probe) {
  std::vector<std::string> argv = SandboxCommand(policy, probe);
  std::vector<std::string> env = BuildEnvironment({});
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) {
    return Unavailable(std::string("cannot probe the sandbox: ") + strerror(errno));
  }
  Result<pid_t> pid = SpawnProcess(argv, env, -1, pipe_fds[1], "/");
  close(pipe_fds[1]);
  if (!pid.ok()) {
    close(pipe_fds[0]);
    return Unavailable(pid.status().message());
  }
  // Bounded: a probe that hangs is a failed one, and the daemon must still start.
  std::string said;
  bool ended = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  pollfd readable{pipe_fds[0], POLLIN, 0};
  char buf[512];
  while (!ended) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 || poll(&readable, 1, static_cast<int>(left.count())) <= 0) break;
    const ssize_t n = read(pipe_fds[0], buf, sizeof buf);
    if (n > 0) said.append(buf, static_cast<size_t>(n));
    ended = n <= 0;
  }
  close(pipe_fds[0]);
  if (!ended) kill(-*pid, SIGKILL);
  int status = 0;
  waitpid(*pid, &status, 0);
  if (ended && WIFEXITED(status) && WEXITSTATUS(status) == 0) return Status::Ok();
  while (!said.empty() && said.back() == '\n') said.pop_back();
  if (!ended) said = "the probe did not finish within 10 s";
  return Unavailable(fmt::format("{} cannot make a sandbox that runs {} here: {}", policy.bwrap,
                                 fmt::join(probe, " "), said.empty() ? "it failed" : said));
}

Result<ReplicaCgroups> ReplicaCgroups::Open(const std::string& root,
                                            std::string_view proc_self_cgroup,
                                            const std::string& group) {
  ReplicaCgroups c;
  std::optional<std::string> memory = CgroupPathOf(proc_self_cgroup, "memory");
  if (memory && fs::exists(CgroupDir(root, "memory", *memory))) {
    c.memory_dir_ = CgroupDir(root, "memory", *memory) + "/" + group;
    if (Status s = MakeGroup(c.memory_dir_); !s.ok()) return s;
    std::optional<std::string> cpu = CgroupPathOf(proc_self_cgroup, "cpu");
    if (cpu && fs::exists(CgroupDir(root, "cpu", *cpu))) {
      c.cpu_dir_ = CgroupDir(root, "cpu", *cpu) + "/" + group;
      if (!MakeGroup(c.cpu_dir_).ok()) c.cpu_dir_.clear();  // weights are optional
    }
    return c;
  }
  std::optional<std::string> unified = CgroupPathOf(proc_self_cgroup, "");
  if (!unified || !fs::exists(root + "/cgroup.controllers")) {
    return Unavailable("no memory cgroup controller under " + root);
  }
  c.unified_ = true;
  const std::string own = CgroupDir(root, "", *unified);
  std::string controllers = ReadFile(own + "/cgroup.controllers");
  if (controllers.find("memory") == std::string::npos) {
    while (!controllers.empty() && controllers.back() == '\n') controllers.pop_back();
    return Unavailable(fmt::format("the memory controller is not delegated to {} (it has: {})", own,
                                   controllers.empty() ? "none" : controllers));
  }
  c.memory_dir_ = own + "/" + group;
  if (Status s = MakeGroup(c.memory_dir_ + "/daemon"); !s.ok()) return s;
  // No processes may sit in a cgroup that delegates controllers: the daemon moves to a leaf.
  if (!WriteFile(own + "/cgroup.subtree_control", "+memory +cpu").ok()) {
    if (Status s = WriteFile(c.memory_dir_ + "/daemon/cgroup.procs", std::to_string(getpid()));
        !s.ok()) {
      return s;
    }
    if (!WriteFile(own + "/cgroup.subtree_control", "+memory +cpu").ok()) {
      return Unavailable(fmt::format(
          "cannot enable the memory controller under {}: other processes share that cgroup "
          "(give the daemon a cgroup of its own, e.g. systemd's Delegate=yes)",
          own));
    }
  }
  if (Status s = WriteFile(c.memory_dir_ + "/cgroup.subtree_control", "+memory +cpu"); !s.ok()) {
    return s;
  }
  return c;
}

Result<std::vector<std::string>> ReplicaCgroups::Create(const std::string& name, int64_t memory_mb,
                                                        int64_t millicpus) {
  const std::string mem = memory_dir_ + "/" + name;
  if (Status s = MakeGroup(mem); !s.ok()) return s;
  // No subscription, no limit: "max" (v2) and -1 (v1) also lift an earlier one.
  const std::string bytes = memory_mb > 0 ? std::to_string(memory_mb * 1024 * 1024) : "";
  std::vector<std::string> dirs = {mem};
  if (unified_) {
    if (Status s = WriteFile(mem + "/memory.max", bytes.empty() ? "max" : bytes); !s.ok()) {
      return s;
    }
    (void)WriteFile(mem + "/memory.swap.max", bytes.empty() ? "max" : "0");  // may be absent
    const int64_t weight = std::clamp<int64_t>(millicpus / 10, 1, 10000);    // 1 CPU: 100
    if (millicpus > 0) (void)WriteFile(mem + "/cpu.weight", std::to_string(weight));
    return dirs;
  }
  // memsw (memory + swap) must stay >= the memory limit: raised after it, lowered before it.
  const bool memsw = fs::exists(mem + "/memory.memsw.limit_in_bytes");
  if (memsw && !bytes.empty()) (void)WriteFile(mem + "/memory.memsw.limit_in_bytes", "-1");
  if (Status s = WriteFile(mem + "/memory.limit_in_bytes", bytes.empty() ? "-1" : bytes); !s.ok()) {
    return s;
  }
  if (memsw && !bytes.empty()) (void)WriteFile(mem + "/memory.memsw.limit_in_bytes", bytes);
  if (!cpu_dir_.empty() && millicpus > 0) {
    const std::string cpu = cpu_dir_ + "/" + name;
    if (MakeGroup(cpu).ok()) {
      const int64_t shares = std::max<int64_t>(2, millicpus * 1024 / 1000);  // 1 CPU: 1024
      if (WriteFile(cpu + "/cpu.shares", std::to_string(shares)).ok()) dirs.push_back(cpu);
    }
  }
  return dirs;
}

uint64_t ReplicaCgroups::OomKills(const std::string& name) const {
  const std::string dir = memory_dir_ + "/" + name;
  return KeyedValue(ReadFile(dir + (unified_ ? "/memory.events" : "/memory.oom_control")),
                    "oom_kill");
}

void ReplicaCgroups::RemoveGroups() {
  std::error_code ec;
  for (const std::string& dir : group_dirs()) fs::remove(dir, ec);  // rmdir: fails if in use
}

std::vector<std::string> ReplicaCgroups::group_dirs() const {
  std::vector<std::string> dirs = {memory_dir_};
  if (!cpu_dir_.empty()) dirs.push_back(cpu_dir_);
  return dirs;
}

void ReplicaCgroups::Remove(const std::string& name) {
  for (const std::string& group : group_dirs()) {
    // rmdir alone removes a cgroup (its files go with it). A process killed a moment ago may
    // still be leaving it: a few tries.
    const std::string dir = group + "/" + name;
    for (int attempt = 0; attempt < 20 && rmdir(dir.c_str()) != 0 && errno == EBUSY; ++attempt) {
      usleep(5000);
    }
  }
}

void ReplicaCgroups::RemoveStale() {
  for (const std::string& group : group_dirs()) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(group, ec)) {
      // Only empty cgroups can go: one in use fails with EBUSY and stays.
      if (entry.is_directory(ec) && entry.path().filename() != "daemon") {
        rmdir(entry.path().c_str());
      }
    }
  }
}

}  // namespace nbos::daemon
