// Locks whose use clang checks at compile time (-Wthread-safety, on in the dev build): a member
// declared `GUARDED_BY(mu_)` may only be touched with `mu_` held, a function declared
// `REQUIRES(mu_)` only called with it held, `EXCLUDES(mu_)` only without it. The wrappers hold a
// std::mutex, so ThreadSanitizer and the standard library see ordinary mutexes; other compilers
// ignore the annotations.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define NBOS_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define NBOS_THREAD_ANNOTATION(x)
#endif

// Abseil (through gRPC) defines some of these names with the same meaning; ours win.
#undef CAPABILITY
#undef SCOPED_CAPABILITY
#undef GUARDED_BY
#undef PT_GUARDED_BY
#undef ACQUIRED_BEFORE
#undef ACQUIRED_AFTER
#undef REQUIRES
#undef ACQUIRE
#undef RELEASE
#undef TRY_ACQUIRE
#undef EXCLUDES
#undef RETURN_CAPABILITY
#undef NO_THREAD_SAFETY_ANALYSIS

#define CAPABILITY(x) NBOS_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY NBOS_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) NBOS_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) NBOS_THREAD_ANNOTATION(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) NBOS_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) NBOS_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define REQUIRES(...) NBOS_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) NBOS_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) NBOS_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) NBOS_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define EXCLUDES(...) NBOS_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define RETURN_CAPABILITY(x) NBOS_THREAD_ANNOTATION(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS NBOS_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace nbos {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  bool TryLock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // For code that must tell the analysis a lock is held where it cannot see it (a callback run
  // under the lock by its owner).
  void AssertHeld() const NBOS_THREAD_ANNOTATION(assert_capability(this)) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` for its scope. Unlock() and Lock() let go of it and take it again inside the scope
// (a blocking call made from a locked region); the destructor releases it only if held.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() {
    if (held_) mu_->Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() RELEASE() {
    mu_->Unlock();
    held_ = false;
  }
  void Lock() ACQUIRE() {
    mu_->Lock();
    held_ = true;
  }

 private:
  Mutex* mu_;
  bool held_ = true;
};

// A condition variable over Mutex. Wait* must be called with `mu` held; they return with it held.
class CondVar {
 public:
  void Wait(Mutex* mu) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // False on timeout.
  template <typename Clock, typename Duration>
  bool WaitUntil(Mutex* mu, std::chrono::time_point<Clock, Duration> deadline) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool signalled = cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return signalled;
  }
  template <typename Rep, typename Period>
  bool WaitFor(Mutex* mu, std::chrono::duration<Rep, Period> timeout) REQUIRES(mu) {
    return WaitUntil(mu, std::chrono::steady_clock::now() + timeout);
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace nbos
