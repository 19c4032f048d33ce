// Gets commands into a replicated log from any member. C-Raft accepts proposals only on the
// leader, but the replica that must propose (the executor's LEAD, its delta) is often not the
// leader. Every member serves forwarded proposals on its peer endpoint, which by convention is
// its Raft port + 1 on the same IP; a follower sends its command there and waits. Membership
// changes (a replica added or removed during a migration) go to the leader the same way.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "replication/raft_node.h"

namespace nbos::replica {

// "tcp://IP:(port+1)" for a Raft address "IP:port"; empty if the address is malformed.
std::string PeerEndpointFor(const std::string& raft_address);

struct ProposalRouterOptions {
  // How long a follower waits for the leader's answer to a forwarded proposal before it asks the
  // log again who leads and sends the proposal again.
  std::chrono::milliseconds forward_attempt_timeout{1000};
  // Test only: the first N answers to proposals this member forwarded are discarded as if the
  // network had lost them, so it retries proposals the leader already committed.
  uint64_t drop_forwarded_answers = 0;
  // PeerKeyFrom(the kernel's connection key). Each request carries PeerMac(peer_key, {"router",
  // seq, frames...}); one without the right MAC is answered "refused", counted and reported, and
  // never reaches the log. Empty: requests are not signed nor checked (tests on one machine).
  std::string peer_key;
  // Each refused request, on the serving thread.
  std::function<void(const std::string& why)> on_refused;
};

class ProposalRouter {
 public:
  // `node` must outlive the router. Binds the peer endpoint of `raft_address` and serves
  // forwarded proposals on a thread of its own.
  static Result<std::unique_ptr<ProposalRouter>> Start(replication::RaftNode* node,
                                                       const std::string& raft_address,
                                                       ProposalRouterOptions options = {});
  ~ProposalRouter();

  // Commits `command` through the current leader, following leader changes, until `timeout`.
  // Returns its log index. Errors: kUnavailable (no leader reachable in time) or the log's own
  // error. Thread-safe; calls are serialised.
  // At least once, not exactly once: an attempt whose answer was lost or late, or a proposal on a
  // leader that lost leadership before the commit, may be committed although it is retried (or
  // reported failed), so the same bytes can be committed more than once. Commands must make
  // their repetition harmless (kernel log entries carry a proposal id the state machine dedupes).
  Result<uint64_t> Propose(std::string command, std::chrono::milliseconds timeout);
  // Commits `commands` as consecutive entries in one round trip; returns the last one's index.
  Result<uint64_t> ProposeAll(std::vector<std::string> commands, std::chrono::milliseconds timeout);

  // Asks the current leader to hand leadership to `self` (this member), so that this member's
  // next proposals commit without a forwarding hop and it learns each commit at once. Returns
  // when the leader answered; the election that follows completes on its own. Errors:
  // kUnavailable (no leader, no answer) or the leader's refusal.
  Status RequestLeadership(replication::ServerId self, std::chrono::milliseconds timeout);

  // Makes `member` a voter through the current leader: the leader adds it as a spare, then
  // promotes it, which C-Raft does only after catching it up (snapshot and entries). Returns once
  // the configuration with `member` as a voter is committed. Idempotent: a member that already
  // is a voter at the same address is ok, a spare or standby at that address is promoted.
  // Errors: kInvalidArgument (id 0, malformed address, id present at another address, address
  // used by another id), kUnavailable (no leader, no answer, catch-up not finished by `timeout`),
  // kInternal (C-Raft refused).
  Status AddMember(const replication::Member& member, std::chrono::milliseconds timeout);
  // Removes member `id` through the current leader and returns once the change is committed. If
  // `id` leads, it first hands leadership to another voter and the new leader removes it.
  // Idempotent: an id that is not a member is ok. Errors: kInvalidArgument (id 0, or `id` is the
  // only voter), kUnavailable, kInternal as for AddMember.
  Status RemoveMember(replication::ServerId id, std::chrono::milliseconds timeout);

  uint64_t forwarded_served() const { return served_.load(); }
  // Leadership transfers other members asked of this one (authentic requests only).
  uint64_t transfers_served() const { return transfers_.load(); }
  // Forwarded proposals sent again after an attempt got no answer in time (or a refusal).
  uint64_t forward_retries() const { return retries_.load(); }
  // Requests refused for a missing or wrong MAC.
  uint64_t requests_refused() const { return refused_.load(); }

 private:
  struct Impl;
  explicit ProposalRouter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::atomic<uint64_t> served_{0};
  std::atomic<uint64_t> transfers_{0};
  std::atomic<uint64_t> retries_{0};
  std::atomic<uint64_t> refused_{0};
};

}  // namespace nbos::replica
