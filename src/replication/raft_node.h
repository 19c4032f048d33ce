// A member of a replicated log running canonical C-Raft with its libuv backend: on-disk log and
// snapshots in `data_dir`, TCP transport between members. One thread per node runs the libuv
// loop; every public method is thread-safe and every callback runs on that thread.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "replication/replicated_log.h"

namespace nbos::replication {

struct RaftNodeOptions {
  ServerId id = 0;
  std::string address;   // "IPv4:port" this member listens on
  std::string data_dir;  // created if missing
  // Initial voters, written only into a pristine data_dir. A member that joins an existing group
  // (added with AddSpare) starts with this empty.
  std::vector<Member> bootstrap;
  // C-Raft's defaults (1000/100 ms) make failover slow; these keep it under a second while leaving
  // a loaded 2-core machine enough slack not to flap. Pre-vote stops a partitioned member from
  // disrupting the group when it returns. C-Raft 0.15 tells followers about a new commit index
  // only with its next message, so the heartbeat interval is how late a follower applies what
  // the leader committed (a standby's reply waits for that): keep it short.
  unsigned election_timeout_ms = 300;
  unsigned heartbeat_timeout_ms = 10;
  unsigned snapshot_threshold = 1024;  // entries between snapshots
  unsigned snapshot_trailing = 128;    // entries kept after a snapshot
  // How long the leader waits for a member to install a snapshot before it tries again. A member
  // busy taking its own snapshot drops an incoming one without an answer, and C-Raft's default
  // (30 s) then left a catching-up member that long without entries. A slow install that outlasts
  // this only gets the snapshot sent again.
  unsigned install_snapshot_timeout_ms = 2000;
  // Between attempts to connect to a peer that is not listening yet (C-Raft's default, 1000 ms,
  // made every replica that starts after its peers, and every migration target, wait a second).
  // A migration target starts listening some 50 ms after its launch, and what is sent to it waits
  // for the next attempt: the delay is added to every join. A refused connection costs a SYN.
  unsigned connect_retry_delay_ms = 10;
  // Proposals are submitted in batches, one batch at a time: at most this many entries each.
  size_t max_batch = 64;
  // ... and at most this many bytes in all; a proposal alone over it is refused
  // (kInvalidArgument). libraft 0.15 crashed on a 37 MB batch and never committed a 32 MB one;
  // 16-18 MB went through.
  size_t max_batch_bytes = size_t{16} << 20;
  // After a batch commits with nothing else waiting, the leader appends a nudge (EncodeNudge) so
  // that followers learn the commit at once instead of at the next heartbeat: a standby applies
  // a cell about one round trip after the executor, and a follower executor's proposal needs no
  // heartbeat to be known committed. It costs one log entry per idle-ending batch.
  bool nudge_followers = true;
  // PeerKeyFrom(the kernel's connection key): a connection reaches Raft only once its other end
  // proved it holds this (AuthenticatedTransport). Empty: plain TCP, any process that can reach
  // the port is a peer (tests on one machine only).
  std::string peer_key;
  // Each refused connection, on the loop thread (with peer_key set).
  std::function<void(const std::string& why)> on_refused_peer;
};

class RaftNode final : public ReplicatedLog {
 public:
  // `machine` must outlive the node. The first Start sets SIGPIPE to be ignored in the process
  // (a peer closing its socket must not kill us). Errors: kInvalidArgument for bad options,
  // kUnavailable when the data directory or the address cannot be used.
  static Result<std::unique_ptr<RaftNode>> Start(const RaftNodeOptions& options,
                                                 StateMachine* machine);
  ~RaftNode() override;  // Close()

  // Stops the member: pending callbacks run with errors, the loop thread exits. Idempotent.
  // A leader should TransferLeadership first: closing does not hand leadership over.
  void Close();

  ServerId id() const override;
  void Propose(std::string command, Committed done) override;
  void Barrier(Committed done) override;
  void AddSpare(const Member& member, Done done) override;
  void Assign(ServerId id, Role role, Done done) override;
  void Remove(ServerId id, Done done) override;
  void TransferLeadership(ServerId to, Done done) override;
  // Leader, LastApplied and Members answer at once, without waiting for the loop: on other
  // threads they give the member's view as of the end of the loop's last turn (the last event
  // it handled), on the loop thread its view now. No leader, no members and 0 once the member
  // is closing.
  Member Leader() override;
  // Index of the last command applied on this member.
  uint64_t LastApplied();
  // The configuration as this member knows it: the latest one it appended, committed or not
  // (C-Raft's view). Empty for a member that has not joined yet or is closed.
  std::vector<Member> Members();
  // Whether this member leads and member `id` holds every entry of its log (C-Raft's match index
  // for it). Waits for the loop. C-Raft 0.15 may hand leadership to a member that lacks the
  // leader's last entries (a promotion just committed), and the new leader then decides on an
  // older configuration; a leader waits for this before it hands leadership over.
  bool HasAllEntries(ServerId id);
  // What this member knows of its group, read on the loop (it waits for it): what a gateway
  // needs to tell which replicas are voters when its own records may be stale.
  struct GroupView {
    std::vector<Member> members;  // as Members()
    bool committed = false;       // no configuration change of `members` awaits commit
    bool leading = false;         // this member is the leader
    uint64_t term = 0;            // the latest term this member has seen
  };
  GroupView Group();

 private:
  struct Impl;
  explicit RaftNode(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace nbos::replication
