#include "common/test_ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <mutex>
#include <set>

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

}  // namespace

int FreeTestPort(int consecutive) {
  static std::mutex mu;
  static std::set<int> handed_out;
  // Test processes run side by side (ctest -j, pytest beside unit tests): each starts its
  // search at its own place in the range.
  static int next = static_cast<int>((static_cast<unsigned>(getpid()) * 7919u) % kPortCount);
  std::lock_guard lock(mu);
  for (int tried = 0; tried < kPortCount; ++tried) {
    const int first = kFirstPort + next;
    next = (next + consecutive) % kPortCount;
    if (first + consecutive > kFirstPort + kPortCount) continue;
    bool free = true;
    for (int p = first; free && p < first + consecutive; ++p) {
      free = handed_out.count(p) == 0 && CanBind(p);
    }
    if (!free) continue;
    for (int p = first; p < first + consecutive; ++p) handed_out.insert(p);
    return first;
  }
  return 0;
}

}  // namespace nbos::testing
