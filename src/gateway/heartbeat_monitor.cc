#include "gateway/heartbeat_monitor.h"

#include <algorithm>
#include <limits>

namespace nbos::gateway {

void HeartbeatMonitor::Add(ReplicaId replica, int64_t now_ms) {
  peers_[replica] = Peer{.next_ping_ms = now_ms};
}

void HeartbeatMonitor::Remove(ReplicaId replica) { peers_.erase(replica); }

bool HeartbeatMonitor::Echo(ReplicaId replica) {
  auto it = peers_.find(replica);
  if (it == peers_.end()) return false;
  it->second.unanswered_since_ms = -1;
  it->second.echoed = true;
  const bool was_unreachable = !it->second.reachable;
  it->second.reachable = true;
  return was_unreachable;
}

HeartbeatMonitor::Tick HeartbeatMonitor::Advance(int64_t now_ms) {
  Tick tick;
  for (auto& [replica, peer] : peers_) {
    if (peer.reachable && peer.echoed && peer.unanswered_since_ms >= 0 &&
        now_ms - peer.unanswered_since_ms > options_.timeout_ms) {
      peer.reachable = false;
      tick.reachable.emplace_back(replica, false);
    }
    if (now_ms < peer.next_ping_ms) continue;
    tick.ping.push_back(replica);
    if (peer.unanswered_since_ms < 0) peer.unanswered_since_ms = now_ms;
    peer.next_ping_ms = now_ms + options_.interval_ms;
  }
  return tick;
}

int64_t HeartbeatMonitor::next_due_ms() const {
  int64_t due = std::numeric_limits<int64_t>::max();
  for (const auto& [replica, peer] : peers_) {
    due = std::min(due, peer.next_ping_ms);
    if (peer.reachable && peer.echoed && peer.unanswered_since_ms >= 0)
      due = std::min(due, peer.unanswered_since_ms + options_.timeout_ms + 1);
  }
  return due;
}

}  // namespace nbos::gateway
