#include "daemon/sandbox.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace nbos::daemon {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::IsSupersetOf;

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(SandboxCommand, HidesStateBindsBackWhatIsNeededAndEndsWithTheCommand) {
  SandboxPolicy policy;
  policy.bwrap = "/usr/bin/bwrap";
  policy.hidden = {"/srv/nbos/host-1", "/srv/nbos"};
  policy.hidden_files = {"/etc/nbos/cluster.credential"};
  policy.writable = {"/srv/nbos/host-1/replicas"};
  policy.readable = {"/srv/nbos/bin/nbos"};
  policy.devices = {"/dev/nvidia0"};
  std::vector<std::string> cmd = SandboxCommand(policy, {"/usr/bin/nbos", "replica", "-f", "x"});
  ASSERT_GE(cmd.size(), 5u);
  EXPECT_EQ(cmd.front(), "/usr/bin/bwrap");
  EXPECT_THAT(std::vector<std::string>(cmd.end() - 5, cmd.end()),
              ElementsAre("--", "/usr/bin/nbos", "replica", "-f", "x"));
  auto at = [&](std::vector<std::string> seq) {
    return std::search(cmd.begin(), cmd.end(), seq.begin(), seq.end()) - cmd.begin();
  };
  // Order matters to bubblewrap: the read-only root first, the tmpfs over the state directory,
  // then the replica directories bound back inside it.
  const auto root = at({"--ro-bind", "/", "/"});
  const auto hide = at({"--tmpfs", "/srv/nbos/host-1"});
  const auto back = at({"--bind", "/srv/nbos/host-1/replicas", "/srv/nbos/host-1/replicas"});
  EXPECT_LT(at({"--tmpfs", "/srv/nbos"}), hide);
  EXPECT_LT(root, hide);
  EXPECT_LT(hide, back);
  EXPECT_LT(back, static_cast<long>(cmd.size()));
  EXPECT_LT(hide, at({"--ro-bind", "/srv/nbos/bin/nbos", "/srv/nbos/bin/nbos"}));
  EXPECT_LT(at({"--ro-bind", "/dev/null", "/etc/nbos/cluster.credential"}),
            static_cast<long>(cmd.size()));
  EXPECT_LT(at({"--dev-bind", "/dev/nvidia0", "/dev/nvidia0"}), static_cast<long>(cmd.size()));
  EXPECT_THAT(cmd, IsSupersetOf({"--unshare-pid", "--unshare-ipc", "--proc", "--dev"}));
  EXPECT_LT(at({"--tmpfs", "/tmp"}), static_cast<long>(cmd.size()));
}

TEST(SandboxEnvironment, KeepsOnlyWhatThePolicyNamesThenAddsTheReplicasOwn) {
  SandboxPolicy policy;
  policy.env_passed = DefaultPassedEnvironment("dir:///srv/blobs");
  const std::vector<std::string> daemon_env = {
      "PATH=/usr/bin", "LC_ALL=C.UTF-8", "AWS_SECRET_ACCESS_KEY=s3cret",
      "NBOS_TOKEN=t",  "HOME=/root",     "CUDA_HOME=/c",
      "BROKEN"};
  EXPECT_THAT(
      SandboxEnvironment(policy, daemon_env, {"HOME=/r", "KERNEL_GPUS=1"}),
      ElementsAre("CUDA_HOME=/c", "HOME=/r", "KERNEL_GPUS=1", "LC_ALL=C.UTF-8", "PATH=/usr/bin"));
  // An S3 store is reached with the daemon's credentials: the replica needs them.
  policy.env_passed = DefaultPassedEnvironment("s3://bucket/prefix");
  EXPECT_THAT(SandboxEnvironment(policy, daemon_env, {}),
              ElementsAre("AWS_SECRET_ACCESS_KEY=s3cret", "CUDA_HOME=/c", "LC_ALL=C.UTF-8",
                          "PATH=/usr/bin"));
}

TEST(SanitizerPathsIn, NamesReportDirectoriesAndSuppressionsOfEverySanitizer) {
  const SanitizerPaths paths = SanitizerPathsIn(
      {"TSAN_OPTIONS=log_path=/tmp/r/report halt_on_error=0 suppressions=/tmp/s/tsan.supp",
       "ASAN_OPTIONS=detect_leaks=0:log_path=/var/a/log,suppressions=relative.supp",
       "UBSAN_OPTIONS=log_path=stderr", "NOT_A_SAN=log_path=/x/y", "BROKEN"});
  EXPECT_THAT(paths.writable, ElementsAre("/tmp/r", "/var/a"));
  EXPECT_THAT(paths.readable, ElementsAre("/tmp/s/tsan.supp"));
  SandboxPolicy policy;
  policy.env_passed = DefaultPassedEnvironment("");
  EXPECT_THAT(SandboxEnvironment(policy, {"TSAN_OPTIONS=a=1", "HOME=/root"}, {}),
              ElementsAre("TSAN_OPTIONS=a=1"));
}

TEST(SandboxUserId, IsStablePerKernelAndInRange) {
  const uint32_t a = SandboxUserId("5f0c2a9e-aaaa", 1u << 30, 1u << 24);
  EXPECT_EQ(a, SandboxUserId("5f0c2a9e-aaaa", 1u << 30, 1u << 24));
  EXPECT_NE(a, SandboxUserId("5f0c2a9e-aaab", 1u << 30, 1u << 24));
  EXPECT_GE(a, 1u << 30);
  EXPECT_LT(a, (1u << 30) + (1u << 24));
  EXPECT_EQ(SandboxUserId("k", 5000, 1), 5000u);
}

TEST(SandboxProbe, ReportsAMissingBubblewrap) {
  SandboxPolicy policy;
  policy.bwrap = "/nonexistent/bwrap";
  Status s = ProbeSandbox(policy);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), ::testing::HasSubstr("/nonexistent/bwrap"));
}

class CgroupTreeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("nbos-cgroup-test-" + std::to_string(getpid()));
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  void Touch(const fs::path& p, const std::string& text = "") {
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  fs::path root_;
};

TEST_F(CgroupTreeTest, Version1LimitsMemoryAndWeighsCpuUnderTheDaemonsOwnGroups) {
  fs::create_directories(root_ / "memory/svc/d1");
  fs::create_directories(root_ / "cpu/svc");
  const std::string self = "12:cpu,cpuacct:/svc\n4:memory:/svc/d1\n0::/\n";
  auto c = ReplicaCgroups::Open(root_.string(), self, "nbos-host-1");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_FALSE(c->unified());
  const fs::path mem = root_ / "memory/svc/d1/nbos-host-1/k-1";
  // A real cgroup directory comes with its files; here the test makes the ones read back.
  Touch(mem / "memory.memsw.limit_in_bytes");
  auto dirs = c->Create("k-1", 512, 1500);
  ASSERT_TRUE(dirs.ok()) << dirs.status().ToString();
  EXPECT_THAT(*dirs, ElementsAre(mem.string(), (root_ / "cpu/svc/nbos-host-1/k-1").string()));
  EXPECT_EQ(Read(mem / "memory.limit_in_bytes"), std::to_string(512ll << 20));
  EXPECT_EQ(Read(mem / "memory.memsw.limit_in_bytes"), std::to_string(512ll << 20));
  EXPECT_EQ(Read(root_ / "cpu/svc/nbos-host-1/k-1/cpu.shares"), "1536");
  EXPECT_EQ(c->OomKills("k-1"), 0u);
  Touch(mem / "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n");
  EXPECT_EQ(c->OomKills("k-1"), 2u);
  // No subscription lifts the limit.
  ASSERT_TRUE(c->Create("k-1", 0, 0).ok());
  EXPECT_EQ(Read(mem / "memory.limit_in_bytes"), "-1");
  EXPECT_THAT(c->group_dirs(), ElementsAre((root_ / "memory/svc/d1/nbos-host-1").string(),
                                           (root_ / "cpu/svc/nbos-host-1").string()));
}

TEST_F(CgroupTreeTest, Version2DelegatesFromALeafAndLimitsMemoryAndSwap) {
  Touch(root_ / "cgroup.controllers", "cpu memory");
  Touch(root_ / "system.slice/nbos.service/cgroup.controllers", "cpu memory");
  auto c = ReplicaCgroups::Open(root_.string(), "0::/system.slice/nbos.service\n", "nbos-h");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->unified());
  const fs::path own = root_ / "system.slice/nbos.service";
  EXPECT_EQ(Read(own / "cgroup.subtree_control"), "+memory +cpu");
  EXPECT_EQ(Read(own / "nbos-h/cgroup.subtree_control"), "+memory +cpu");
  auto dirs = c->Create("k-2", 1024, 250);
  ASSERT_TRUE(dirs.ok());
  EXPECT_THAT(*dirs, ElementsAre((own / "nbos-h/k-2").string()));
  EXPECT_EQ(Read(own / "nbos-h/k-2/memory.max"), std::to_string(1024ll << 20));
  EXPECT_EQ(Read(own / "nbos-h/k-2/memory.swap.max"), "0");
  EXPECT_EQ(Read(own / "nbos-h/k-2/cpu.weight"), "25");
  Touch(own / "nbos-h/k-2/memory.events", "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n");
  EXPECT_EQ(c->OomKills("k-2"), 1u);
}

TEST_F(CgroupTreeTest, NoMemoryControllerIsUnavailable) {
  fs::create_directories(root_);
  auto c = ReplicaCgroups::Open(root_.string(), "1:name=systemd:/\n", "nbos-h");
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
  // v2 where the parent delegates no memory controller (seen in a GPU machine's VM).
  Touch(root_ / "cgroup.controllers", "cpu memory");
  Touch(root_ / "job/cgroup.controllers", "cpu pids");
  c = ReplicaCgroups::Open(root_.string(), "0::/job\n", "nbos-h");
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(c.status().message(), ::testing::HasSubstr("not delegated"));
}

}  // namespace
}  // namespace nbos::daemon
