#include "replica/fd_capture.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "replica/stream_buffer.h"

namespace nbos::replica {

namespace {
constexpr const char* kNames[2] = {"stdout", "stderr"};
}

Result<std::unique_ptr<FdCapture>> FdCapture::Start(Sink sink) {
  std::unique_ptr<FdCapture> c(new FdCapture());
  c->sink_ = std::move(sink);
  fflush(stdout);
  fflush(stderr);
  if (pipe2(c->wake_, O_CLOEXEC) != 0) return Internal(std::string("pipe: ") + strerror(errno));
  for (int i = 0; i < 2; ++i) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) return Internal(std::string("pipe: ") + strerror(errno));
    fcntl(p[0], F_SETFL, O_NONBLOCK);
    c->pipes_[i] = p[0];
    c->saved_fds_[i] = fcntl(i + 1, F_DUPFD_CLOEXEC, 3);
    if (c->saved_fds_[i] < 0 || dup2(p[1], i + 1) < 0) {
      return Internal(std::string("cannot redirect fd: ") + strerror(errno));
    }
    close(p[1]);
  }
  c->thread_ = std::thread([raw = c.get()] { raw->ReadLoop(); });
  return c;
}

FdCapture::~FdCapture() {
  if (thread_.joinable()) {
    char byte = 0;
    [[maybe_unused]] ssize_t n = write(wake_[1], &byte, 1);
    thread_.join();
  }
  for (int i = 0; i < 2; ++i) {
    if (saved_fds_[i] >= 0) {
      dup2(saved_fds_[i], i + 1);
      close(saved_fds_[i]);
    }
    if (pipes_[i] >= 0) close(pipes_[i]);
  }
  for (int fd : wake_) {
    if (fd >= 0) close(fd);
  }
}

void FdCapture::ReadAvailable(int i) {
  char buf[65536];
  for (;;) {
    ssize_t n = read(pipes_[i], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    pending_[i].append(buf, static_cast<size_t>(n));
  }
  size_t complete = CompleteUtf8Prefix(pending_[i]);
  if (complete > 0) {
    sink_(kNames[i], std::string_view(pending_[i]).substr(0, complete));
    pending_[i].erase(0, complete);
  }
}

void FdCapture::ReadLoop() {
  pollfd fds[3] = {{pipes_[0], POLLIN, 0}, {pipes_[1], POLLIN, 0}, {wake_[0], POLLIN, 0}};
  for (;;) {
    int r = poll(fds, 3, -1);
    if (r < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[2].revents != 0) return;
    MutexLock lock(&mu_);
    for (int i = 0; i < 2; ++i) {
      if (fds[i].revents != 0) ReadAvailable(i);
    }
  }
}

void FdCapture::Drain() {
  fflush(stdout);
  fflush(stderr);
  MutexLock lock(&mu_);
  ReadAvailable(0);
  ReadAvailable(1);
}

}  // namespace nbos::replica
