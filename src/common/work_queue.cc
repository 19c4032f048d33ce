#include "common/work_queue.h"

#include <spdlog/spdlog.h>

#include <exception>

#include "common/check.h"

namespace nbos {

KeyedWorkQueue::KeyedWorkQueue(int threads, std::string name) : name_(std::move(name)) {
  NBOS_CHECK(threads >= 1, "a work queue needs a thread");
  {
    MutexLock lock(&mu_);
    live_workers_ = static_cast<size_t>(threads);
  }
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Work(); });
}

KeyedWorkQueue::~KeyedWorkQueue() { Stop(); }

void KeyedWorkQueue::Post(const std::string& key, std::function<void()> task) {
  {
    MutexLock lock(&mu_);
    if (live_workers_ > 0) {
      auto [it, fresh] = pending_.try_emplace(key);
      // A key already in pending_ is either ready or being run: its thread picks this task up.
      if (fresh) ready_.push_back(key);
      it->second.push_back(std::move(task));
      cv_.Signal();
      return;
    }
  }
  uint64_t exceptions = 0;
  RunGuarded(name_, task, &exceptions);
  MutexLock lock(&mu_);
  exceptions_ += exceptions;
}

void KeyedWorkQueue::Work() {
  MutexLock lock(&mu_);
  for (;;) {
    while (ready_.empty() && !(stopping_ && pending_.empty())) cv_.Wait(&mu_);
    if (ready_.empty()) {  // stopping, and nothing is left to run
      --live_workers_;
      return;
    }
    const std::string key = std::move(ready_.front());
    ready_.pop_front();
    for (;;) {
      auto it = pending_.find(key);
      if (it->second.empty()) {
        pending_.erase(it);
        break;
      }
      std::function<void()> task = std::move(it->second.front());
      it->second.pop_front();
      uint64_t exceptions = 0;
      lock.Unlock();
      RunGuarded(name_, task, &exceptions);
      lock.Lock();
      exceptions_ += exceptions;
    }
    if (stopping_ && pending_.empty()) cv_.SignalAll();
  }
}

void KeyedWorkQueue::RunGuarded(const std::string& name, const std::function<void()>& task,
                                uint64_t* exceptions) {
  try {
    task();
  } catch (const std::exception& e) {
    ++*exceptions;
    spdlog::error("{}: a task failed with an exception: {}", name, e.what());
  } catch (...) {
    ++*exceptions;
    spdlog::error("{}: a task failed with an unknown exception", name);
  }
}

void KeyedWorkQueue::Stop() {
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    cv_.SignalAll();
  }
  for (std::thread& t : threads_) t.join();
}

uint64_t KeyedWorkQueue::exceptions_caught() const {
  MutexLock lock(&mu_);
  return exceptions_;
}

}  // namespace nbos
