#include "daemon/ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <charconv>

namespace nbos::daemon {
namespace {

// Binds a fresh TCP socket to ip:port; returns the bound port, or 0 when binding failed.
int BindOnce(const std::string& ip, int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  // No SO_REUSEADDR: stricter than the replica's own bind (ZeroMQ and libuv set it), so a port
  // that passes here binds there, and the kernel never picks one another socket shares.
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  int bound = 0;
  if (inet_pton(AF_INET, ip.c_str(), &addr.sin_addr) == 1 &&
      bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    socklen_t len = sizeof addr;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
      bound = ntohs(addr.sin_port);
  }
  close(fd);
  return bound;
}

}  // namespace

bool PortAllocator::CanBind(const std::string& ip, int port) {
  return port > 0 && port < 65536 && BindOnce(ip, port) == port;
}

Result<PortRange> PortRange::Parse(std::string_view text) {
  PortRange r;
  size_t dash = text.find('-');
  auto number = [](std::string_view digits, int* out) {
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), *out);
    return ec == std::errc() && end == digits.data() + digits.size();
  };
  if (dash == std::string_view::npos || !number(text.substr(0, dash), &r.first) ||
      !number(text.substr(dash + 1), &r.last) || r.first < 1 || r.last > 65535 ||
      r.first > r.last) {
    return InvalidArgument("a port range is FIRST-LAST within 1-65535, got '" + std::string(text) +
                           "'");
  }
  return r;
}

int PortAllocator::NextFree(bool pair) {
  for (int tries = 0; tries < range_.size(); ++tries) {
    int port = next_;
    next_ = next_ == range_.last ? range_.first : next_ + 1;
    if (reserved_.contains(port) || !CanBind(bind_ip_, port)) continue;
    if (pair &&
        (port == range_.last || reserved_.contains(port + 1) || !CanBind(bind_ip_, port + 1))) {
      continue;
    }
    return port;
  }
  return 0;
}

Result<std::vector<int>> PortAllocator::Reserve(int n) {
  MutexLock lock(&mu_);
  std::vector<int> ports;
  while (static_cast<int>(ports.size()) < n) {
    int port = NextFree(/*pair=*/false);
    if (port == 0) {
      for (int p : ports) reserved_.erase(p);
      return ResourceExhausted("no free TCP ports in " + std::to_string(range_.first) + "-" +
                               std::to_string(range_.last));
    }
    reserved_.insert(port);
    ports.push_back(port);
  }
  return ports;
}

Result<int> PortAllocator::ReservePair() {
  MutexLock lock(&mu_);
  int port = NextFree(/*pair=*/true);
  if (port == 0) {
    return ResourceExhausted("no free TCP port pair in " + std::to_string(range_.first) + "-" +
                             std::to_string(range_.last));
  }
  reserved_.insert(port);
  reserved_.insert(port + 1);
  return port;
}

void PortAllocator::Release(const std::vector<int>& ports) {
  MutexLock lock(&mu_);
  for (int p : ports) reserved_.erase(p);
}

bool PortAllocator::IsReserved(int port) const {
  MutexLock lock(&mu_);
  return reserved_.contains(port);
}

size_t PortAllocator::reserved_count() const {
  MutexLock lock(&mu_);
  return reserved_.size();
}

}  // namespace nbos::daemon
