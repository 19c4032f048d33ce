// A StateMachine for tests: it records every applied command; snapshots hold the whole list.
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "replication/replicated_log.h"

namespace nbos::replication {

class ListMachine final : public StateMachine {
 public:
  void Apply(std::string_view command) override {
    std::lock_guard lock(mu_);
    commands_.emplace_back(command);
    events_.push_back("apply:" + std::string(command));
  }
  std::string Snapshot() override {
    std::lock_guard lock(mu_);
    std::string out;
    for (const auto& c : commands_) {
      out += std::to_string(c.size()) + ":" + c;
    }
    ++snapshots_;
    return out;
  }
  Status Restore(std::string_view snapshot) override {
    std::vector<std::string> restored;
    while (!snapshot.empty()) {
      size_t colon = snapshot.find(':');
      if (colon == std::string_view::npos) return InvalidArgument("corrupt snapshot");
      size_t len = std::stoul(std::string(snapshot.substr(0, colon)));
      if (colon + 1 + len > snapshot.size()) return InvalidArgument("corrupt snapshot");
      restored.emplace_back(snapshot.substr(colon + 1, len));
      snapshot.remove_prefix(colon + 1 + len);
    }
    std::lock_guard lock(mu_);
    events_.push_back("restore:" + std::to_string(restored.size()));
    commands_ = std::move(restored);
    ++restores_;
    return Status::Ok();
  }
  std::vector<std::string> commands() {
    std::lock_guard lock(mu_);
    return commands_;
  }
  size_t size() {
    std::lock_guard lock(mu_);
    return commands_.size();
  }
  // What happened, in order: "apply:<command>" and "restore:<size>".
  std::vector<std::string> events() {
    std::lock_guard lock(mu_);
    return events_;
  }
  int restores() {
    std::lock_guard lock(mu_);
    return restores_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> commands_;
  std::vector<std::string> events_;
  int snapshots_ = 0;
  int restores_ = 0;
};

}  // namespace nbos::replication
