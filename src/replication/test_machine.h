// A StateMachine for tests: it records every applied command; snapshots hold the whole list.
#pragma once

#include <string>
#include <vector>

#include "common/thread_annotations.h"
#include "replication/replicated_log.h"

namespace nbos::replication {

class ListMachine final : public StateMachine {
 public:
  void Apply(std::string_view command) EXCLUDES(mu_) override {
    MutexLock lock(&mu_);
    commands_.emplace_back(command);
    events_.push_back("apply:" + std::string(command));
  }
  std::string Snapshot() EXCLUDES(mu_) override {
    MutexLock lock(&mu_);
    std::string out;
    for (const auto& c : commands_) {
      out += std::to_string(c.size()) + ":" + c;
    }
    ++snapshots_;
    return out;
  }
  Status Restore(std::string_view snapshot) EXCLUDES(mu_) override {
    std::vector<std::string> restored;
    while (!snapshot.empty()) {
      size_t colon = snapshot.find(':');
      if (colon == std::string_view::npos) return InvalidArgument("corrupt snapshot");
      size_t len = std::stoul(std::string(snapshot.substr(0, colon)));
      if (colon + 1 + len > snapshot.size()) return InvalidArgument("corrupt snapshot");
      restored.emplace_back(snapshot.substr(colon + 1, len));
      snapshot.remove_prefix(colon + 1 + len);
    }
    MutexLock lock(&mu_);
    events_.push_back("restore:" + std::to_string(restored.size()));
    commands_ = std::move(restored);
    ++restores_;
    return Status::Ok();
  }
  std::vector<std::string> commands() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return commands_;
  }
  size_t size() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return commands_.size();
  }
  // What happened, in order: "apply:<command>" and "restore:<size>".
  std::vector<std::string> events() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return events_;
  }
  int restores() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return restores_;
  }

 private:
  Mutex mu_;
  std::vector<std::string> commands_ GUARDED_BY(mu_);
  std::vector<std::string> events_ GUARDED_BY(mu_);
  int snapshots_ GUARDED_BY(mu_) = 0;
  int restores_ GUARDED_BY(mu_) = 0;
};

}  // namespace nbos::replication
