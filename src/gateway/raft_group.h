// Changes to a kernel's Raft group, asked of its replicas (nbos_membership_request), shared by
// migrations and by the cleanup of replicas the gateway does not list. Each call blocks on a
// replica's control channel: never call one on a session thread or under the registry's lock.
#pragma once

#include <chrono>
#include <optional>
#include <set>
#include <vector>

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

// One replica's answer to {"op": "members"}: its latest configuration, whether that one is
// committed, whether it leads, and the latest term it has seen.
struct GroupAnswer {
  ReplicaId from = 0;
  std::set<ReplicaId> members;
  bool committed = false;
  bool leading = false;
  uint64_t term = 0;
};

// Asks each replica of `k` the gateway counts live for the group it knows, waiting at most
// `each` for each; returns the answers that came.
std::vector<GroupAnswer> AskRaftGroup(const KernelRecord& k, std::chrono::milliseconds each);

// The kernel's voters as `answers` prove them: the committed configuration of the answer that
// leads with the highest term, when no answer has seen a later term. (A leader deposed since
// would not know of changes committed after it; pre-vote keeps a member that cannot win from
// raising its term.) Nothing when no answer proves it: no leader among them, or its
// configuration has a change that awaits commit.
std::optional<std::set<ReplicaId>> ProvenGroup(const std::vector<GroupAnswer>& answers);

// Where the gateway's record of `k` differs from its proven voters `group`: replicas recorded as
// leaving, with no confirmed removal, that are still voters (`kept`: they count again), and
// replicas counted as members that are not (`gone`: a committed change removed them, for good,
// since a replica id is never used twice).
struct GroupDrift {
  std::vector<ReplicaId> kept;
  std::vector<ReplicaId> gone;
};
GroupDrift DriftFrom(const KernelRecord& k, const std::set<ReplicaId>& group);

}  // namespace nbos::gateway
