#include "daemon/supervisor.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "daemon/test_util.h"

namespace nbos::daemon {
namespace {

using namespace std::chrono_literals;
using testing::Eventually;
using testing::ProcessGone;
using testing::ReadFile;

class SupervisorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    options_.nbos_binary = testing::WriteFakeNbos(tmp_.path());
    options_.restart_delay = 20ms;
    options_.stop_grace = 2s;
    options_.poll_interval = 10ms;
    options_.on_exit = [this](const ReplicaKey&, int code, bool restarting) {
      exits_++;
      last_code_ = code;
      if (restarting) restarting_exits_++;
    };
  }

  std::unique_ptr<Supervisor> Make() { return std::make_unique<Supervisor>(options_); }

  std::string Dir(const ReplicaKey& key) {
    return tmp_.path() + "/" + key.kernel_id + "-" + std::to_string(key.replica_id);
  }

  void Prepare(Supervisor& s, const ReplicaKey& key) {
    jupyter::ConnectionInfo c;
    c.shell_port = 1001;
    c.key = "secret";
    ASSERT_TRUE(s.Prepare(key, Dir(key), c, "127.0.0.1:5000").ok());
  }

  Result<pid_t> Launch(Supervisor& s, const ReplicaKey& key, const std::string& mode) {
    return s.Launch(key, {{1, "127.0.0.1:5000"}, {2, "127.0.0.1:5002"}}, "dir:///tmp/blobs",
                    {{"FAKE_MODE", mode}, {"EXTRA", "yes"}});
  }

  testing::TempDir tmp_;
  SupervisorOptions options_;
  std::atomic<int> exits_{0};
  std::atomic<int> restarting_exits_{0};
  std::atomic<int> last_code_{0};
};

TEST_F(SupervisorTest, PrepareWritesConnectionFileAndLaunchPassesArgumentsAndEnvironment) {
  auto s = Make();
  ReplicaKey key{"k1", 1};
  Prepare(*s, key);
  auto conn = jupyter::ReadConnectionFile(Dir(key) + "/connection.json");
  ASSERT_TRUE(conn.ok()) << conn.status().ToString();
  EXPECT_EQ(conn->shell_port, 1001);
  EXPECT_EQ(conn->key, "secret");
  EXPECT_TRUE(std::filesystem::is_directory(Dir(key) + "/data"));
  EXPECT_EQ(s->Get(key)->state, ReplicaState::kPrepared);

  auto pid = Launch(*s, key, "sleep");
  ASSERT_TRUE(pid.ok()) << pid.status().ToString();
  EXPECT_GT(*pid, 0);
  EXPECT_EQ(s->Get(key)->state, ReplicaState::kRunning);
  std::string log;
  ASSERT_TRUE(Eventually([&] {
    log = ReadFile(Dir(key) + "/replica.log");
    return log.find("ids:") != std::string::npos;
  }));
  std::string expect_args = "args: replica -f " + Dir(key) + "/connection.json --id 1 --raft " +
                            "127.0.0.1:5000 --data-dir " + Dir(key) +
                            "/data --blob-store dir:///tmp/blobs --log-level info " +
                            "--peer=1=127.0.0.1:5000 --peer=2=127.0.0.1:5002";
  EXPECT_NE(log.find(expect_args), std::string::npos) << log;
  EXPECT_NE(log.find("ids: k1 1 PCI_BUS_ID yes"), std::string::npos) << log;

  // A repeated launch keeps the process.
  auto again = Launch(*s, key, "sleep");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *pid);

  ASSERT_TRUE(s->Stop(key, /*keep_data=*/false).ok());
  EXPECT_TRUE(ProcessGone(*pid));
  EXPECT_FALSE(std::filesystem::exists(Dir(key)));
  EXPECT_FALSE(s->Get(key).has_value());
  EXPECT_EQ(exits_, 0) << "a requested stop is not an unexpected exit";
}

TEST_F(SupervisorTest, ARaftLogRootHoldsEachReplicasLogWhichGoesWithTheReplica) {
  namespace fs = std::filesystem;
  options_.raft_log_root = tmp_.path() + "/ram";
  auto s = Make();
  ReplicaKey kept{"k1", 1}, removed{"k1", 2};
  fs::create_directories(options_.raft_log_root + "/k1-1/stale");  // an earlier replica's
  Prepare(*s, kept);
  Prepare(*s, removed);
  EXPECT_TRUE(fs::is_directory(options_.raft_log_root + "/k1-1"));
  EXPECT_FALSE(fs::exists(options_.raft_log_root + "/k1-1/stale"));
  EXPECT_FALSE(fs::exists(Dir(kept) + "/data"));
  EXPECT_EQ(s->Get(kept)->raft_dir, options_.raft_log_root + "/k1-1");
  ASSERT_TRUE(Launch(*s, kept, "sleep").ok());
  std::string log;
  ASSERT_TRUE(Eventually([&] {
    log = ReadFile(Dir(kept) + "/replica.log");
    return log.find("args:") != std::string::npos;
  }));
  EXPECT_NE(log.find("--data-dir " + options_.raft_log_root + "/k1-1 "), std::string::npos) << log;
  ASSERT_TRUE(s->Stop(kept, /*keep_data=*/true).ok());
  EXPECT_TRUE(fs::exists(Dir(kept) + "/replica.log"));
  EXPECT_FALSE(fs::exists(options_.raft_log_root + "/k1-1"));
  ASSERT_TRUE(s->Stop(removed, /*keep_data=*/false).ok());
  EXPECT_FALSE(fs::exists(Dir(removed)));
  EXPECT_FALSE(fs::exists(options_.raft_log_root + "/k1-2"));
}

TEST_F(SupervisorTest, ErrorsForUnknownAndDuplicateReplicasAndMissingBinary) {
  auto s = Make();
  ReplicaKey key{"k1", 1};
  EXPECT_EQ(Launch(*s, key, "sleep").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s->Stop(key, false).code(), StatusCode::kNotFound);
  Prepare(*s, key);
  jupyter::ConnectionInfo c;
  EXPECT_EQ(s->Prepare(key, Dir(key), c, "x").code(), StatusCode::kInvalidArgument);

  options_.nbos_binary = tmp_.path() + "/does-not-exist";
  auto broken = Make();
  ReplicaKey other{"k2", 1};
  Prepare(*broken, other);
  EXPECT_EQ(Launch(*broken, other, "sleep").status().code(), StatusCode::kInternal);
  EXPECT_EQ(broken->Get(other)->state, ReplicaState::kPrepared);
}

TEST_F(SupervisorTest, KilledReplicaIsRestartedFromTheSameDirectory) {
  auto s = Make();
  ReplicaKey key{"k1", 2};
  Prepare(*s, key);
  auto pid = Launch(*s, key, "sleep");
  ASSERT_TRUE(pid.ok());
  ASSERT_EQ(kill(*pid, SIGKILL), 0);
  ASSERT_TRUE(Eventually([&] {
    auto p = s->Get(key);
    return p->state == ReplicaState::kRunning && p->pid != *pid && p->pid > 0;
  }));
  auto p = s->Get(key);
  EXPECT_EQ(p->restarts, 1u);
  EXPECT_EQ(p->exit_code, -SIGKILL);
  EXPECT_EQ(exits_, 1);
  EXPECT_EQ(restarting_exits_, 1);
  // Both runs logged into the same file.
  std::string log = ReadFile(Dir(key) + "/replica.log");
  EXPECT_NE(log.find("(restart 1)"), std::string::npos) << log;
}

// Bubblewrap around the stand-in: a PID namespace, no daemon secrets, the directory given to the
// kernel's user id, and a stop that reaches the replica rather than bubblewrap.
TEST_F(SupervisorTest, SandboxedReplicaIsAloneOwnsItsDirectoryAndStopsGracefully) {
  if (geteuid() != 0 || FindExecutable("bwrap").find('/') == std::string::npos) {
    GTEST_SKIP() << "needs root and bubblewrap";
  }
  options_.sandbox = true;
  options_.sandbox_users = true;
  options_.sandbox_policy.bwrap = FindExecutable("bwrap");
  options_.sandbox_policy.writable = {tmp_.path()};
  options_.sandbox_policy.env_passed = {"PATH"};
  setenv("DAEMON_SECRET", "s3cret", 1);
  auto s = Make();
  ReplicaKey key{"k-sandboxed", 1};
  Prepare(*s, key);
  ASSERT_TRUE(s->Launch(key, {}, "dir://" + tmp_.path() + "/blobs", {{"FAKE_MODE", "probe"}}).ok());
  std::string log;
  ASSERT_TRUE(Eventually([&] {
    log = ReadFile(Dir(key) + "/replica.log");
    return log.find("procs:") != std::string::npos;
  }));
  unsetenv("DAEMON_SECRET");
  // bubblewrap's init, the shell, a subshell, `ls` and `grep`: never the host's processes.
  const size_t procs = std::stoul(log.substr(log.find("procs: ") + 7));
  EXPECT_LE(procs, 5u) << log;
  EXPECT_NE(log.find("secret: none"), std::string::npos) << log;
  const uint32_t uid =
      SandboxUserId("k-sandboxed", options_.sandbox_uid_base, options_.sandbox_uid_range);
  EXPECT_EQ(s->Get(key)->uid, uid);
  EXPECT_NE(log.find(fmt::format("--run-as={}:{}", uid, uid)), std::string::npos) << log;
  struct stat st {};
  ASSERT_EQ(stat(Dir(key).c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, uid);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(stat((Dir(key) + "/connection.json").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, uid);
  ASSERT_TRUE(s->Stop(key, /*keep_data=*/true).ok());

  ReplicaKey graceful{"k-sandboxed", 2};
  Prepare(*s, graceful);
  ASSERT_TRUE(
      s->Launch(graceful, {}, "dir://" + tmp_.path() + "/blobs", {{"FAKE_MODE", "graceful"}}).ok());
  ASSERT_TRUE(Eventually([&] { return ReadFile(Dir(graceful) + "/replica.log").size() > 0; }));
  std::this_thread::sleep_for(200ms);  // the trap is set
  ASSERT_TRUE(s->Stop(graceful, /*keep_data=*/true).ok());
  EXPECT_EQ(ReadFile(Dir(graceful) + "/term.log"), "got-term\n");
  EXPECT_EQ(exits_, 0);
}

TEST_F(SupervisorTest, RestartBudgetIsLimited) {
  options_.max_restarts = 2;
  auto s = Make();
  ReplicaKey key{"k1", 1};
  Prepare(*s, key);
  ASSERT_TRUE(Launch(*s, key, "exit3").ok());
  ASSERT_TRUE(Eventually([&] { return s->Get(key)->state == ReplicaState::kExited; }));
  auto p = s->Get(key);
  EXPECT_EQ(p->restarts, 2u);
  EXPECT_EQ(p->exit_code, 3);
  EXPECT_EQ(p->pid, 0);
  // on_exit runs just after the state changes, outside the lock.
  EXPECT_TRUE(Eventually([&] { return exits_ == 3; }));
  EXPECT_EQ(restarting_exits_, 2);
  EXPECT_EQ(last_code_, 3);
  // An exited replica can be launched again (fresh budget).
  ASSERT_TRUE(Launch(*s, key, "sleep").ok());
  EXPECT_EQ(s->Get(key)->state, ReplicaState::kRunning);
}

TEST_F(SupervisorTest, CleanExitIsNotRestarted) {
  auto s = Make();
  ReplicaKey key{"k1", 1};
  Prepare(*s, key);
  ASSERT_TRUE(Launch(*s, key, "exit0").ok());
  ASSERT_TRUE(Eventually([&] { return s->Get(key)->state == ReplicaState::kExited; }));
  EXPECT_EQ(s->Get(key)->restarts, 0u);
  EXPECT_EQ(s->Get(key)->exit_code, 0);
}

TEST_F(SupervisorTest, StopEscalatesToSigkillAfterTheGrace) {
  options_.stop_grace = 300ms;
  auto s = Make();
  ReplicaKey key{"k1", 1};
  Prepare(*s, key);
  auto pid = Launch(*s, key, "ignore_term");
  ASSERT_TRUE(pid.ok());
  // Let the shell install its trap before signalling.
  ASSERT_TRUE(Eventually(
      [&] { return ReadFile(Dir(key) + "/replica.log").find("ids:") != std::string::npos; }));
  std::this_thread::sleep_for(100ms);
  auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(s->Stop(key, /*keep_data=*/true).ok());
  EXPECT_GE(std::chrono::steady_clock::now() - start, 300ms);
  EXPECT_TRUE(ProcessGone(*pid));
  EXPECT_TRUE(std::filesystem::exists(Dir(key) + "/replica.log")) << "keep_data keeps the dir";
}

TEST_F(SupervisorTest, StopKillsTheWholeProcessGroup) {
  auto s = Make();
  ReplicaKey key{"k1", 1};
  Prepare(*s, key);
  auto pid = Launch(*s, key, "child");
  ASSERT_TRUE(pid.ok());
  pid_t child = 0;
  ASSERT_TRUE(Eventually([&] {
    child = std::atoi(ReadFile(Dir(key) + "/child.pid").c_str());
    return child > 0;
  }));
  ASSERT_FALSE(ProcessGone(child));
  ASSERT_TRUE(s->Stop(key, /*keep_data=*/false).ok());
  EXPECT_TRUE(ProcessGone(*pid));
  EXPECT_TRUE(Eventually([&] { return ProcessGone(child); }, 2s)) << "grandchild " << child;
}

TEST_F(SupervisorTest, DestructorStopsEverythingAndKeepsData) {
  std::vector<pid_t> pids;
  std::vector<ReplicaKey> keys = {{"a", 1}, {"a", 2}, {"b", 1}};
  {
    auto s = Make();
    for (const ReplicaKey& key : keys) {
      Prepare(*s, key);
      auto pid = Launch(*s, key, "sleep");
      ASSERT_TRUE(pid.ok());
      pids.push_back(*pid);
    }
    EXPECT_EQ(s->List().size(), 3u);
  }
  for (pid_t pid : pids) EXPECT_TRUE(ProcessGone(pid)) << pid;
  for (const ReplicaKey& key : keys) EXPECT_TRUE(std::filesystem::exists(Dir(key)));
}

TEST_F(SupervisorTest, LaunchesPromoteWarmProcessesAndThePoolIsToppedUp) {
  options_.warm_pool_size = 2;
  options_.warm_dir = tmp_.path() + "/warm";
  options_.warm_preload = {"torch"};
  std::filesystem::create_directories(options_.warm_dir);
  auto s = Make();
  ASSERT_TRUE(Eventually([&] { return s->warm_pool().ready == 2; }));
  ReplicaKey key{"k1", 1};
  Prepare(*s, key);
  auto pid = Launch(*s, key, "sleep");
  ASSERT_TRUE(pid.ok()) << pid.status().ToString();
  EXPECT_EQ(s->warm_pool().promoted, 1u);
  EXPECT_EQ(s->warm_pool().cold, 0u);
  const std::string promoted = options_.warm_dir + "/promoted-" + std::to_string(*pid) + ".json";
  std::string line;
  ASSERT_TRUE(Eventually([&] {
    line = ReadFile(promoted);
    return !line.empty();
  }));
  auto promotion = nlohmann::json::parse(line);
  std::vector<std::string> argv = promotion["argv"];
  ASSERT_GE(argv.size(), 4u);
  EXPECT_EQ(argv[0], "-f");
  EXPECT_EQ(argv[1], Dir(key) + "/connection.json");
  EXPECT_EQ(argv.back(), "--peer=2=127.0.0.1:5002");
  EXPECT_EQ(promotion["cwd"], Dir(key));
  EXPECT_EQ(promotion["log"], Dir(key) + "/replica.log");
  std::vector<std::string> env = promotion["env"];
  for (const char* want : {"NBOS_KERNEL_ID=k1", "NBOS_REPLICA_ID=1", "EXTRA=yes"}) {
    EXPECT_NE(std::find(env.begin(), env.end(), want), env.end()) << want;
  }
  EXPECT_NE(ReadFile(Dir(key) + "/replica.log").find("starting replica k1/1"), std::string::npos);
  // The pool refills, and the promoted process is supervised like any replica.
  ASSERT_TRUE(Eventually([&] { return s->warm_pool().ready == 2; }));
  kill(*pid, SIGKILL);
  ASSERT_TRUE(Eventually([&] { return restarting_exits_ == 1; }));
  ASSERT_TRUE(Eventually([&] {
    auto p = s->Get(key);
    return p && p->state == ReplicaState::kRunning && p->pid > 0 && p->pid != *pid;
  }));
  EXPECT_EQ(s->warm_pool().promoted, 2u) << "a restart takes a warm process too";
  s->StopAll(/*keep_data=*/true);
  EXPECT_EQ(s->warm_pool().ready, 0);
  EXPECT_TRUE(ProcessGone(*pid));
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(s->warm_pool().ready, 0) << "a stopped pool stays empty";
}

TEST_F(SupervisorTest, ThePoolIsToppedUpOnlyTheRefillDelayAfterAPromotion) {
  options_.warm_pool_size = 1;
  options_.warm_dir = tmp_.path() + "/warm";
  options_.warm_refill_delay = 1500ms;
  std::filesystem::create_directories(options_.warm_dir);
  auto s = Make();
  ASSERT_TRUE(Eventually([&] { return s->warm_pool().ready == 1; }))
      << "the first fill does not wait";
  ReplicaKey key{"k1", 1};
  Prepare(*s, key);
  const auto promoted_at = std::chrono::steady_clock::now();
  ASSERT_TRUE(Launch(*s, key, "sleep").ok());
  ASSERT_EQ(s->warm_pool().promoted, 1u);
  // Many watch rounds (25 ms each), none of which may start a replacement yet.
  std::this_thread::sleep_for(400ms);
  if (std::chrono::steady_clock::now() - promoted_at < 1500ms) {
    WarmPoolStats pool = s->warm_pool();
    EXPECT_EQ(pool.ready + pool.starting, 0);
  }
  ASSERT_TRUE(Eventually([&] { return s->warm_pool().ready == 1; }));
  EXPECT_GE(std::chrono::steady_clock::now() - promoted_at, 1500ms);
}

TEST_F(SupervisorTest, WarmProcessesThatKeepDyingTurnThePoolOffAndLaunchesGoCold) {
  options_.warm_pool_size = 1;
  options_.max_restarts = 2;
  options_.warm_dir = tmp_.path() + "/warm";
  std::filesystem::create_directories(options_.warm_dir);
  { std::ofstream(options_.warm_dir + "/die") << ""; }
  auto s = Make();
  ASSERT_TRUE(Eventually([&] { return s->warm_pool().disabled; }));
  EXPECT_GE(s->warm_pool().died, 3u);
  ReplicaKey key{"k1", 1};
  Prepare(*s, key);
  auto pid = Launch(*s, key, "sleep");
  ASSERT_TRUE(pid.ok());
  EXPECT_EQ(s->warm_pool().cold, 1u);
  EXPECT_EQ(s->warm_pool().promoted, 0u);
  std::string log;
  ASSERT_TRUE(Eventually([&] {
    log = ReadFile(Dir(key) + "/replica.log");
    return log.find("ids: k1 1") != std::string::npos;
  }));
}

}  // namespace
}  // namespace nbos::daemon
