// Membership requests of a replicated kernel (live migration). A gateway moves a replica by
// starting a new `nbos replica` without peers and sending any live replica, on its control
// channel, an `nbos_membership_request` to add the new replica and then one to remove the old.
#pragma once

#include <chrono>
#include <string>

#include "common/status.h"
#include "jupyter/message.h"
#include "replication/replicated_log.h"

namespace nbos::replica {

struct MembershipChange {
  enum class Op { kAdd, kRemove };
  Op op = Op::kAdd;
  replication::ServerId replica_id = 0;
  std::string raft_address;  // kAdd only: the new replica's "IPv4:port"
  // How long the asker waits for the answer; 0: not said (the replica's own limit applies).
  std::chrono::milliseconds timeout{0};
};

// A Raft address a replica can use: "a.b.c.d:port", port in 1..65534 (port + 1 serves the
// replica's peer endpoint).
bool IsRaftAddress(const std::string& address);

// Reads the content of an nbos_membership_request:
//   {"op": "add", "replica_id": N, "raft_address": "IPv4:port"}  or
//   {"op": "remove", "replica_id": N}
// either with an optional "timeout_ms": a positive integer, how long the asker waits.
// ({"op": "members"} is a question, not a change: the kernel server answers it at once with the
// group as the replica knows it, {"status": "ok", "members": [ids of its latest configuration],
// "committed": whether that one is committed, "leading": whether it leads, "term": N}.)
// Errors: kInvalidArgument naming the missing or malformed field (op not "add"/"remove",
// replica_id not a positive integer, raft_address missing or not IPv4:port for "add",
// timeout_ms present but not a positive integer).
Result<MembershipChange> ParseMembershipRequest(const jupyter::Json& content);

}  // namespace nbos::replica
