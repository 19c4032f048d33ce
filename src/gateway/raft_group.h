// Changes to a kernel's Raft group, asked of its replicas (nbos_membership_request), shared by
// migrations and by the cleanup of replicas the gateway does not list. Each call blocks on a
// replica's control channel: never call one on a session thread or under the registry's lock.
#pragma once

#include <chrono>

#include "common/status.h"
#include "gateway/kernel_session.h"
#include "gateway/registry.h"
#include "jupyter/message.h"

namespace nbos::gateway {

// One nbos_membership_request ({"op": "add"|"remove", ...}) through replica `via`, waiting at
// most `timeout` for its answer. The replica is asked to give up a little before that, so that
// its control channel is free again when the gateway stops waiting. Errors: what CallControl
// returns, or kUnavailable with the replica's refusal.
Status ChangeRaftGroup(KernelSession& session, ReplicaId via, jupyter::Json request,
                       std::chrono::milliseconds timeout);

// Removes `replica_id` from kernel `k`'s Raft group through each live replica of `k` other than
// it, in turn, until one confirms (removing a non-member is confirmed at once when the group has
// a leader). Ok: `replica_id` is not a voter of the group. Errors: kUnavailable with the last
// answer when no replica could confirm it (none live, or no majority to commit the change).
// Blocks up to `each` per replica asked.
Status RemoveFromRaftGroup(const KernelRecord& k, ReplicaId replica_id,
                           std::chrono::milliseconds each);

// Whether `replica_id` is a voter of kernel `k`'s Raft group, asked of every live replica of `k`
// but it ({"op": "members"}): true only when each lists it. A removal in flight is appended on
// the leader first and reaches the others later, so one that no longer lists it decides: false.
// Errors: kUnavailable when one of them does not answer within `each`, or none is live.
Result<bool> IsRaftMember(const KernelRecord& k, ReplicaId replica_id,
                          std::chrono::milliseconds each);

}  // namespace nbos::gateway
