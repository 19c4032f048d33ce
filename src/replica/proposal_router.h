// Gets commands into a replicated log from any member. C-Raft accepts proposals only on the
// leader, but the replica that must propose (the executor's LEAD, its delta) is often not the
// leader. Every member serves forwarded proposals on its peer endpoint, which by convention is
// its Raft port + 1 on the same IP; a follower sends its command there and waits.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "replication/raft_node.h"

namespace nbos::replica {

// "tcp://IP:(port+1)" for a Raft address "IP:port"; empty if the address is malformed.
std::string PeerEndpointFor(const std::string& raft_address);

class ProposalRouter {
 public:
  // `node` must outlive the router. Binds the peer endpoint of `raft_address` and serves
  // forwarded proposals on a thread of its own.
  static Result<std::unique_ptr<ProposalRouter>> Start(replication::RaftNode* node,
                                                       const std::string& raft_address);
  ~ProposalRouter();

  // Commits `command` through the current leader, following leader changes, until `timeout`.
  // Returns its log index. Errors: kUnavailable (no leader reachable in time) or the log's own
  // error. Thread-safe; calls are serialised.
  Result<uint64_t> Propose(std::string command, std::chrono::milliseconds timeout);
  // Commits `commands` as consecutive entries in one round trip; returns the last one's index.
  Result<uint64_t> ProposeAll(std::vector<std::string> commands, std::chrono::milliseconds timeout);

  // Asks the current leader to hand leadership to `self` (this member), so that this member's
  // next proposals commit without a forwarding hop and it learns each commit at once. Returns
  // when the leader answered; the election that follows completes on its own. Errors:
  // kUnavailable (no leader, no answer) or the leader's refusal.
  Status RequestLeadership(replication::ServerId self, std::chrono::milliseconds timeout);

  uint64_t forwarded_served() const { return served_.load(); }

 private:
  struct Impl;
  explicit ProposalRouter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::atomic<uint64_t> served_{0};
};

}  // namespace nbos::replica
