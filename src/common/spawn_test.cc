#include "common/spawn.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

namespace nbos {
namespace {

// Waits up to `ms` for `pid` to exit; true if it did (it is reaped then).
bool ExitsWithin(pid_t pid, int ms) {
  for (int waited = 0; waited < ms; waited += 10) {
    if (waitpid(pid, nullptr, WNOHANG) == pid) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST(SpawnProcessTest, AChildOutlivesTheThreadThatStartedIt) {
  // The child asks to be killed when its parent dies, as bubblewrap's --die-with-parent does.
  std::vector<std::string> argv = {"/usr/bin/setpriv", "--pdeathsig", "KILL", "--",
                                   "/bin/sleep",       "30"};
  std::vector<std::string> env = BuildEnvironment({});
  int log_fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
  ASSERT_GE(log_fd, 0);
  Result<pid_t> pid = Internal("not started");
  std::thread caller([&] {
    pid = SpawnProcess(argv, env, -1, log_fd, "/");
    // Time for setpriv to ask for the signal before this thread exits, as a gRPC worker may.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  });
  caller.join();
  close(log_fd);
  ASSERT_TRUE(pid.ok()) << pid.status().ToString();
  const bool died = ExitsWithin(*pid, 500);
  EXPECT_FALSE(died) << "the child died with the thread that started it";
  if (!died) {
    kill(*pid, SIGKILL);
    EXPECT_TRUE(ExitsWithin(*pid, 5000));
  }
}

TEST(SpawnProcessTest, AMissingProgramIsAClearError) {
  std::vector<std::string> argv = {"/nonexistent/program"};
  std::vector<std::string> env;
  int log_fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
  Result<pid_t> pid = SpawnProcess(argv, env, -1, log_fd, "/");
  close(log_fd);
  ASSERT_FALSE(pid.ok());
  EXPECT_NE(pid.status().message().find("/nonexistent/program"), std::string::npos);
}

}  // namespace
}  // namespace nbos
