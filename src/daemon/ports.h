// TCP ports a daemon hands to the replicas it prepares. A replica binds its ports only when it
// starts, so the daemon remembers what it handed out and never hands a port out twice until it
// is returned.
#pragma once

#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"

namespace nbos::daemon {

class PortAllocator {
 public:
  // Probes ports by binding `bind_ip` (an IPv4 address; "0.0.0.0" checks every local address).
  explicit PortAllocator(std::string bind_ip = "0.0.0.0") : bind_ip_(std::move(bind_ip)) {}

  // `n` distinct ports that bind now and were not handed out before (or were returned).
  // ResourceExhausted when none can be found after many tries. Thread-safe.
  Result<std::vector<int>> Reserve(int n);

  // A port P with P + 1 free too (a replica serves forwarded proposals on its Raft port + 1);
  // both are reserved. Returns P.
  Result<int> ReservePair();

  // Returns ports (unknown ones are ignored).
  void Release(const std::vector<int>& ports);

  bool IsReserved(int port) const;
  size_t reserved_count() const;

  // Whether `port` can be bound on `ip` right now (without SO_REUSEADDR: stricter than servers).
  static bool CanBind(const std::string& ip, int port);

 private:
  int ProbeEphemeral() const;  // 0 on failure

  const std::string bind_ip_;
  mutable std::mutex mu_;
  std::set<int> reserved_;  // guarded by mu_
};

}  // namespace nbos::daemon
