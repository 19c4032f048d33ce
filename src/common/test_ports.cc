#include "common/test_ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <set>

#include "common/thread_annotations.h"

namespace nbos::testing {
namespace {

constexpr int kFirstPort = 10000;
constexpr int kPortCount = 10000;

bool CanBind(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return bound;
}

// The ports this process handed out, and where its next search starts.
struct HandedOut {
  Mutex mu;
  std::set<int> ports GUARDED_BY(mu);
  // Test processes run side by side (ctest -j, pytest beside unit tests): each starts its
  // search at its own place in the range.
  int next GUARDED_BY(mu) = static_cast<int>((static_cast<unsigned>(getpid()) * 7919u) %
                                             kPortCount);
};

}  // namespace

int FreeTestPort(int consecutive) {
  static HandedOut handed;
  MutexLock lock(&handed.mu);
  for (int tried = 0; tried < kPortCount; ++tried) {
    const int first = kFirstPort + handed.next;
    handed.next = (handed.next + consecutive) % kPortCount;
    if (first + consecutive > kFirstPort + kPortCount) continue;
    bool free = true;
    for (int p = first; free && p < first + consecutive; ++p) {
      free = handed.ports.count(p) == 0 && CanBind(p);
    }
    if (!free) continue;
    for (int p = first; p < first + consecutive; ++p) handed.ports.insert(p);
    return first;
  }
  return 0;
}

}  // namespace nbos::testing
