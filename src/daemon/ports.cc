#include "daemon/ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace nbos::daemon {
namespace {

constexpr int kMaxTries = 1000;

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

int PortAllocator::ProbeEphemeral() const { return BindOnce(bind_ip_, 0); }

Result<std::vector<int>> PortAllocator::Reserve(int n) {
  std::lock_guard lock(mu_);
  std::vector<int> ports;
  for (int tries = 0; static_cast<int>(ports.size()) < n && tries < kMaxTries; ++tries) {
    int port = ProbeEphemeral();
    if (port == 0 || reserved_.contains(port)) continue;
    reserved_.insert(port);
    ports.push_back(port);
  }
  if (static_cast<int>(ports.size()) < n) {
    for (int p : ports) reserved_.erase(p);
    return ResourceExhausted("no free TCP ports");
  }
  return ports;
}

Result<int> PortAllocator::ReservePair() {
  std::lock_guard lock(mu_);
  for (int tries = 0; tries < kMaxTries; ++tries) {
    int port = ProbeEphemeral();
    if (port == 0 || port >= 65535 || reserved_.contains(port) || reserved_.contains(port + 1)) {
      continue;
    }
    if (!CanBind(bind_ip_, port + 1)) continue;
    reserved_.insert(port);
    reserved_.insert(port + 1);
    return port;
  }
  return ResourceExhausted("no free TCP port pair");
}

void PortAllocator::Release(const std::vector<int>& ports) {
  std::lock_guard lock(mu_);
  for (int p : ports) reserved_.erase(p);
}

bool PortAllocator::IsReserved(int port) const {
  std::lock_guard lock(mu_);
  return reserved_.contains(port);
}

size_t PortAllocator::reserved_count() const {
  std::lock_guard lock(mu_);
  return reserved_.size();
}

}  // namespace nbos::daemon
