// TCP ports a daemon hands to the replicas it prepares. A replica binds its ports only when it
// starts, so the daemon remembers what it handed out and never hands a port out twice until it
// is returned.
//
// Ports come from a fixed range that should lie outside the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default): a port probed free in the
// ephemeral range can be taken by any outgoing connection before the replica binds it. Daemons
// sharing a machine (`nbos up`) get disjoint ranges.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/thread_annotations.h"

namespace nbos::daemon {

struct PortRange {
  int first = 20000;  // inclusive
  int last = 32767;   // inclusive

  // "FIRST-LAST" with 1 <= FIRST <= LAST <= 65535; InvalidArgument otherwise.
  static Result<PortRange> Parse(std::string_view text);
  int size() const { return last - first + 1; }
};

class PortAllocator {
 public:
  // Probes ports by binding `bind_ip` (an IPv4 address; "0.0.0.0" checks every local address).
  // The first port tried is range.first + start_offset % range.size(): allocators sharing a range
  // on one machine should start far apart.
  explicit PortAllocator(std::string bind_ip = "0.0.0.0", PortRange range = {},
                         uint64_t start_offset = 0)
      : bind_ip_(std::move(bind_ip)),
        range_(range),
        next_(range.first + static_cast<int>(start_offset % range.size())) {}

  // `n` distinct ports of the range that bind now and were not handed out before (or were
  // returned). Ports are handed out round-robin through the range, so a returned port is reused
  // as late as possible. ResourceExhausted when the range has too few. Thread-safe.
  Result<std::vector<int>> Reserve(int n) EXCLUDES(mu_);

  // A port P with P + 1 free too (a replica serves forwarded proposals on its Raft port + 1);
  // both are reserved. Returns P.
  Result<int> ReservePair() EXCLUDES(mu_);

  // Returns ports (unknown ones are ignored).
  void Release(const std::vector<int>& ports) EXCLUDES(mu_);

  bool IsReserved(int port) const EXCLUDES(mu_);
  size_t reserved_count() const EXCLUDES(mu_);

  // Whether `port` can be bound on `ip` right now (without SO_REUSEADDR: stricter than servers).
  static bool CanBind(const std::string& ip, int port);

 private:
  // The next port of the range after the cursor that is unreserved and binds (and, with `pair`,
  // whose successor does too); 0 after one full turn without one. Advances the cursor.
  int NextFree(bool pair) REQUIRES(mu_);

  const std::string bind_ip_;
  const PortRange range_;
  mutable Mutex mu_;
  int next_ GUARDED_BY(mu_);
  std::set<int> reserved_ GUARDED_BY(mu_);
};

}  // namespace nbos::daemon
