// SIGINT, SIGTERM and SIGHUP turned into a callback, for client tools that must clean up (delete
// their gateway kernels, write their output) when stopped. While an instance lives the signals
// are blocked in the calling thread and in every thread it starts afterwards (they inherit the
// mask), and a watcher thread takes them with sigtimedwait. Construct it before starting other
// threads.
#pragma once

#include <signal.h>

#include <atomic>
#include <functional>
#include <thread>

namespace nbos::relay {

class StopSignals {
 public:
  // `on_signal` runs on the watcher thread, once per signal received.
  explicit StopSignals(std::function<void(int signal)> on_signal);
  ~StopSignals();  // joins the watcher and restores the signal mask
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  int signalled() const { return signalled_; }  // the last signal taken; 0: none

 private:
  sigset_t set_{};
  sigset_t old_{};
  std::atomic<bool> done_{false};
  std::atomic<int> signalled_{0};
  std::function<void(int)> on_signal_;
  std::thread watcher_;
};

}  // namespace nbos::relay
