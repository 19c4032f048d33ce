// What a GatewayLink's reader thread hands to the thread driving a kernel: its messages in order,
// and once the kernel is gone, why. Thread-safe.
#pragma once

#include <chrono>
#include <deque>
#include <optional>

#include "common/status.h"
#include "common/thread_annotations.h"
#include "jupyter/websocket_codec.h"

namespace nbos::relay {

class Inbox {
 public:
  using Clock = std::chrono::steady_clock;

  void Push(jupyter::WsMessage m) EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      messages_.push_back(std::move(m));
    }
    cv_.SignalAll();
  }
  // Marks the kernel gone; the first reason is kept. Pop returns what is queued, then nullopt.
  void Gone(const Status& why) EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      if (!gone_) gone_ = why;
    }
    cv_.SignalAll();
  }
  // The next message before `deadline`; nullopt on timeout or once the kernel is gone (then
  // `gone()` says why).
  std::optional<jupyter::WsMessage> Pop(Clock::time_point deadline) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    while (messages_.empty() && !gone_.has_value() && cv_.WaitUntil(&mu_, deadline)) {
    }
    if (messages_.empty()) return std::nullopt;
    jupyter::WsMessage m = std::move(messages_.front());
    messages_.pop_front();
    return m;
  }
  std::optional<Status> gone() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return gone_;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::deque<jupyter::WsMessage> messages_ GUARDED_BY(mu_);
  std::optional<Status> gone_ GUARDED_BY(mu_);
};

}  // namespace nbos::relay
