// Runs one Python program in a replica's sandbox exactly as a daemon builds it (sandbox.h): the
// bubblewrap command, the environment, the per-replica cgroup with its memory limit; then reports
// the exit status and the cgroup's OOM kills. For checks on machines where nbos itself does not
// run (a GPU machine without nbos's libraries): built statically by tests/gpu/run-gpu-check.
//
//   sandbox_probe BWRAP PYTHON SCRIPT MEMORY_MB STATE_DIR [ARG...]
//
// The script gets NBOS_PROBE_CGROUPS (the cgroup directories to join, colon-separated) and
// NBOS_PROBE_UID (the user id to take), as `nbos replica --cgroup --run-as` would.
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "common/spawn.h"
#include "daemon/sandbox.h"

namespace fs = std::filesystem;
using nbos::daemon::ReplicaCgroups;
using nbos::daemon::SandboxPolicy;

int main(int argc, char** argv) {
  if (argc < 6) {
    std::cerr << "usage: sandbox_probe BWRAP PYTHON SCRIPT MEMORY_MB STATE_DIR [ARG...]\n";
    return 2;
  }
  const std::string state = argv[5];
  const std::string replica_dir = state + "/replicas/probe-1";
  fs::create_directories(replica_dir);
  std::ifstream self("/proc/self/cgroup");
  std::stringstream text;
  text << self.rdbuf();
  auto cgroups = ReplicaCgroups::Open("/sys/fs/cgroup", text.str(), "nbos-probe");
  SandboxPolicy policy;
  policy.bwrap = argv[1];
  policy.hidden = {state};
  policy.writable = {state + "/replicas"};
  for (const auto& e : fs::directory_iterator("/dev"))
    if (e.path().filename().string().starts_with("nvidia")) policy.devices.push_back(e.path());
  policy.env_passed = nbos::daemon::DefaultPassedEnvironment("");
  policy.env_passed.push_back("PYTHONPATH");
  std::string joins;
  if (cgroups.ok()) {
    for (const std::string& d : cgroups->group_dirs()) policy.writable.push_back(d);
    auto dirs = cgroups->Create("probe-1", std::stoll(argv[4]), 2000);
    if (!dirs.ok()) std::cerr << "cgroup: " << dirs.status().ToString() << "\n";
    for (const std::string& d : dirs.ok() ? *dirs : std::vector<std::string>{})
      joins += (joins.empty() ? "" : ":") + d;
    std::cout << "cgroups: " << (cgroups->unified() ? "v2" : "v1") << ", joining " << joins << "\n";
  } else {
    std::cout << "cgroups: none (" << cgroups.status().message() << ")\n";
  }
  std::cout << "sandbox probe: " << nbos::daemon::ProbeSandbox(policy).ToString() << std::endl;
  std::vector<std::string> cmd = {argv[2], argv[3]};
  for (int i = 6; i < argc; ++i) cmd.push_back(argv[i]);
  cmd = nbos::daemon::SandboxCommand(policy, cmd);
  const uint32_t uid = nbos::daemon::SandboxUserId("probe", 1u << 30, 1u << 24);
  fs::permissions(state + "/replicas", fs::perms::owner_all | fs::perms::others_exec);
  if (chown(replica_dir.c_str(), uid, uid) != 0) perror("chown");
  setenv("DAEMON_SECRET", "must-not-reach-the-cell", 1);
  std::vector<std::string> env = nbos::daemon::SandboxEnvironment(
      policy, nbos::BuildEnvironment({}),
      {"NBOS_PROBE_CGROUPS=" + joins, "NBOS_PROBE_UID=" + std::to_string(uid),
       "HOME=" + replica_dir});
  auto pid = nbos::SpawnProcess(cmd, env, -1, STDOUT_FILENO, replica_dir);
  if (!pid.ok()) {
    std::cerr << pid.status().ToString() << "\n";
    return 1;
  }
  int status = 0;
  waitpid(*pid, &status, 0);
  std::cout << "exit: " << (WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status))
            << ", oom kills: " << (cgroups.ok() ? cgroups->OomKills("probe-1") : 0) << std::endl;
  if (cgroups.ok()) {
    cgroups->Remove("probe-1");
    cgroups->RemoveGroups();
  }
  return 0;
}
