// What a GatewayLink's reader thread hands to the thread driving a kernel: its messages in order,
// and once the kernel is gone, why. Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>

#include "common/status.h"
#include "jupyter/websocket_codec.h"

namespace nbos::relay {

class Inbox {
 public:
  using Clock = std::chrono::steady_clock;

  void Push(jupyter::WsMessage m) {
    {
      std::lock_guard lock(mu_);
      messages_.push_back(std::move(m));
    }
    cv_.notify_all();
  }
  // Marks the kernel gone; the first reason is kept. Pop returns what is queued, then nullopt.
  void Gone(const Status& why) {
    {
      std::lock_guard lock(mu_);
      if (!gone_) gone_ = why;
    }
    cv_.notify_all();
  }
  // The next message before `deadline`; nullopt on timeout or once the kernel is gone (then
  // `gone()` says why).
  std::optional<jupyter::WsMessage> Pop(Clock::time_point deadline) {
    std::unique_lock lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return !messages_.empty() || gone_.has_value(); });
    if (messages_.empty()) return std::nullopt;
    jupyter::WsMessage m = std::move(messages_.front());
    messages_.pop_front();
    return m;
  }
  std::optional<Status> gone() {
    std::lock_guard lock(mu_);
    return gone_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<jupyter::WsMessage> messages_;
  std::optional<Status> gone_;
};

}  // namespace nbos::relay
