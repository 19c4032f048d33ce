// A replicated log: commands proposed on one member are committed by a quorum and applied, in
// the same order, to the state machine of every member. The kernel's replicas keep their
// election outcomes and namespace deltas identical through one of these.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace nbos::replication {

using ServerId = uint64_t;

// Driven by the log with committed commands, in log order. Called on the log's own thread, so it
// must be quick: hand heavy work (running Python) to another thread.
class StateMachine {
 public:
  virtual ~StateMachine() = default;
  virtual void Apply(std::string_view command) = 0;
  // The whole state after the last applied command, for catching up new or lagging members.
  virtual std::string Snapshot() = 0;
  // Replaces the state with `snapshot`'s. An error aborts the restore (the member stops).
  virtual Status Restore(std::string_view snapshot) = 0;
};

enum class Role {
  kVoter,    // replicates the log and counts towards quorum
  kStandby,  // replicates the log, no vote
  kSpare,    // neither (a member being added)
};

struct Member {
  ServerId id = 0;
  std::string address;  // "IPv4:port", also the member's identity in the configuration
  Role role = Role::kVoter;
  bool operator==(const Member&) const = default;
};

class ReplicatedLog {
 public:
  using Done = std::function<void(Status)>;
  using Committed = std::function<void(Result<uint64_t> index)>;

  virtual ~ReplicatedLog() = default;

  virtual ServerId id() const = 0;
  // `done` runs, on the log's thread, once `command` is committed and applied on this member,
  // with its log index. Only the leader accepts proposals; elsewhere `done` gets kUnavailable
  // whose message names the leader when it is known. Proposals made while others are in flight
  // wait and go out together, in order.
  virtual void Propose(std::string command, Committed done) = 0;
  // `done` runs once everything proposed before it is applied on this member (leader only).
  virtual void Barrier(Committed done) = 0;
  // Membership changes, one at a time, leader only: a new member joins as a spare, is then
  // promoted (the leader first catches it up), and members are removed.
  virtual void AddSpare(const Member& member, Done done) = 0;
  virtual void Assign(ServerId id, Role role, Done done) = 0;
  virtual void Remove(ServerId id, Done done) = 0;
  // Hands leadership to `to` (a voter), e.g. before a planned migration of the leader.
  virtual void TransferLeadership(ServerId to, Done done) = 0;
  // The leader as this member knows it; id 0 when unknown. Thread-safe.
  virtual Member Leader() = 0;
};

}  // namespace nbos::replication
