// KeyedWorkQueue: a fixed pool of threads for blocking work (RPCs, disk) that must not run on the
// thread that asked for it. Tasks posted under one key run one at a time in the order posted;
// tasks of different keys run in parallel, so a task that blocks holds up its own key and one
// thread, not the others. An exception escaping a task is caught on its thread, logged and
// counted; the pool goes on.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "common/thread_annotations.h"

namespace nbos {

class KeyedWorkQueue {
 public:
  // `name` is used in log lines. threads >= 1.
  KeyedWorkQueue(int threads, std::string name);
  ~KeyedWorkQueue();  // Stop()
  KeyedWorkQueue(const KeyedWorkQueue&) = delete;
  KeyedWorkQueue& operator=(const KeyedWorkQueue&) = delete;

  // Thread-safe. After Stop the task runs on the caller's thread at once.
  void Post(const std::string& key, std::function<void()> task) EXCLUDES(mu_);
  // Runs every task already posted, then joins the threads. Idempotent; must not be called from
  // a task.
  void Stop() EXCLUDES(mu_);

  uint64_t exceptions_caught() const EXCLUDES(mu_);

 private:
  void Work() EXCLUDES(mu_);
  static void RunGuarded(const std::string& name, const std::function<void()>& task,
                         uint64_t* exceptions);

  const std::string name_;
  std::vector<std::thread> threads_;
  mutable Mutex mu_;
  CondVar cv_;
  std::map<std::string, std::deque<std::function<void()>>> pending_ GUARDED_BY(mu_);
  std::deque<std::string> ready_ GUARDED_BY(mu_);  // keys with tasks that no thread runs now
  size_t live_workers_ GUARDED_BY(mu_) = 0;
  bool stopping_ GUARDED_BY(mu_) = false;
  uint64_t exceptions_ GUARDED_BY(mu_) = 0;
};

}  // namespace nbos
