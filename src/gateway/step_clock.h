// StepClock: how long each step of a multi-step operation took, for its log line
// (" launch 12 ms ready 80 ms"). Not thread-safe: one operation's thread owns it.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <string>

namespace nbos::gateway {

class StepClock {
 public:
  // Ends the step running since the previous one (or since construction) as `name`.
  void Step(const char* name) {
    const auto now = std::chrono::steady_clock::now();
    steps_ +=
        fmt::format(" {} {} ms", name,
                    std::chrono::duration_cast<std::chrono::milliseconds>(now - start_).count());
    start_ = now;
  }
  const std::string& steps() const { return steps_; }
  std::chrono::steady_clock::time_point started() const { return started_; }

 private:
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point start_ = started_;
  std::string steps_;
};

}  // namespace nbos::gateway
