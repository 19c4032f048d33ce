// Captures what the process writes to file descriptors 1 and 2 (C extensions, subprocesses,
// os.write) and hands it to a sink as UTF-8 text, the way ipykernel captures fd output.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "common/status.h"
#include "common/thread_annotations.h"

namespace nbos::replica {

class FdCapture {
 public:
  using Sink = std::function<void(std::string_view stream_name, std::string_view text)>;

  // Redirects fds 1 and 2 into pipes read by a background thread. The original stderr stays
  // reachable through original_stderr_fd() for logs.
  static Result<std::unique_ptr<FdCapture>> Start(Sink sink);
  ~FdCapture();  // restores fds 1 and 2 and stops the thread

  int original_stderr_fd() const { return saved_fds_[1]; }
  // Delivers everything written to fds 1 and 2 before this call.
  void Drain() EXCLUDES(mu_);

 private:
  FdCapture() = default;
  void ReadLoop() EXCLUDES(mu_);
  // Reads what is available on pipe i without blocking and hands complete text to the sink.
  void ReadAvailable(int i) REQUIRES(mu_);

  Sink sink_;
  int pipes_[2] = {-1, -1};      // read ends for fd 1 and fd 2
  int saved_fds_[2] = {-1, -1};  // the original fd 1 and fd 2
  int wake_[2] = {-1, -1};
  Mutex mu_;  // held while a pipe is read and its text handed to the sink
  std::string pending_[2] GUARDED_BY(mu_);  // incomplete UTF-8 tails
  std::thread thread_;
};

}  // namespace nbos::replica
