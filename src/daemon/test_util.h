// Test support for the daemon's tests: temporary directories, a stand-in `nbos` script, and
// process probes.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>

namespace nbos::daemon::testing {

// A fresh directory under $TMPDIR, removed by the destructor.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "nbos-daemon-XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Whether `pid` is gone (or a zombie nobody reaped yet, which is as good as gone).
inline bool ProcessGone(pid_t pid) {
  if (pid <= 0) return true;
  if (kill(pid, 0) != 0) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  size_t paren = text.rfind(')');
  return paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] == 'Z';
}

inline bool Eventually(const std::function<bool()>& pred,
                       std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A stand-in for `nbos` that ignores its arguments (it prints them) and behaves per $FAKE_MODE:
// "sleep" (default) runs until killed, "exit0"/"exit3" exit at once, "ignore_term" ignores
// SIGTERM, "child" leaves a background child in its process group (pid in ./child.pid).
inline std::string WriteFakeNbos(const std::string& dir) {
  std::string path = dir + "/fake-nbos";
  std::ofstream out(path);
  out << R"(#!/bin/sh
if [ "$2" = "--warm" ]; then
  # A warm replica: dies at once when WARM_DIR/die exists, else records its promotion.
  [ -e die ] && exit 1
  echo ready >&0
  read -r line || exit 0
  printf '%s\n' "$line" > "promoted-$$.json"
  exec sleep 1000
fi
echo "args: $*"
echo "ids: $NBOS_KERNEL_ID $NBOS_REPLICA_ID $CUDA_DEVICE_ORDER $EXTRA"
case "$FAKE_MODE" in
  exit0) exit 0 ;;
  exit3) exit 3 ;;
  ignore_term) trap '' TERM; while true; do sleep 0.05; done ;;
  child) sleep 1000 & echo $! > child.pid; exec sleep 1000 ;;
  probe) echo "procs: $(ls /proc | grep -c '^[0-9]') secret: ${DAEMON_SECRET:-none}"
         exec sleep 1000 ;;
  graceful) trap 'echo got-term > term.log; exit 0' TERM; while true; do sleep 0.05; done ;;
  *) exec sleep 1000 ;;
esac
)";
  out.close();
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  return path;
}

}  // namespace nbos::daemon::testing
