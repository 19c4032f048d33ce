// Which replicas answer the gateway's heartbeats. Pure: the session pings each replica's
// heartbeat socket (a ZeroMQ echo) when told to, reports each echo, and passes the time in.
//
// Rules. Each replica is pinged every `interval_ms`. It turns unreachable when a ping has gone
// unanswered for longer than `timeout_ms`, and reachable again with the next echo. A replica is
// reachable when added, and judged only once it has echoed: a replica still starting has not
// bound its heartbeat socket yet (its daemon's heartbeats cover that time). Echoes are not matched
// to pings: any echo answers every ping before it, which is what an in-order echo means. The owner
// reads every echo that arrived before it calls Advance, so a gateway that was itself slow to look
// does not blame the replicas.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "gateway/output_merger.h"  // ReplicaId

namespace nbos::gateway {

class HeartbeatMonitor {
 public:
  struct Options {
    int64_t interval_ms = 250;
    int64_t timeout_ms = 1000;
  };
  struct Tick {
    std::vector<ReplicaId> ping;                        // send a ping to each, now
    std::vector<std::pair<ReplicaId, bool>> reachable;  // changes: replica, reachable now
  };

  explicit HeartbeatMonitor(Options options) : options_(options) {}

  void Add(ReplicaId replica, int64_t now_ms);
  void Remove(ReplicaId replica);
  // An echo from `replica`. Returns true when it was unreachable (it is reachable now).
  bool Echo(ReplicaId replica);
  Tick Advance(int64_t now_ms);
  // When Advance next has something to do; INT64_MAX with no replica.
  int64_t next_due_ms() const;

 private:
  struct Peer {
    int64_t next_ping_ms = 0;
    int64_t unanswered_since_ms = -1;  // the oldest unanswered ping, -1 when none
    bool echoed = false;               // at least once
    bool reachable = true;
  };
  Options options_;
  std::map<ReplicaId, Peer> peers_;
};

}  // namespace nbos::gateway
