#include "relay/stop_signals.h"

#include <pthread.h>

#include <ctime>

namespace nbos::relay {

StopSignals::StopSignals(std::function<void(int)> on_signal) : on_signal_(std::move(on_signal)) {
  sigemptyset(&set_);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set_, sig);
  pthread_sigmask(SIG_BLOCK, &set_, &old_);
  watcher_ = std::thread([this] {
    // A short wait, so that the destructor is not held up by a watcher blocked on a signal.
    while (!done_) {
      timespec wait{0, 200 * 1000 * 1000};
      const int sig = sigtimedwait(&set_, nullptr, &wait);
      if (sig <= 0) continue;
      signalled_ = sig;
      on_signal_(sig);
    }
  });
}

StopSignals::~StopSignals() {
  done_ = true;
  watcher_.join();
  pthread_sigmask(SIG_SETMASK, &old_, nullptr);
}

}  // namespace nbos::relay
