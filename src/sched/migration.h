// Migration choice (DESIGN §5) for a cell no replica's server can grant GPUs to: which replica
// moves, and to which server. The gateway then adds the new replica to the Raft group, lets it
// catch up, removes the old one and retries the cell.
#pragma once

#include <cstdint>
#include <set>
#include <string>

#include "common/status.h"
#include "sched/cluster.h"

namespace nbos::sched {

struct MigrationPlan {
  uint32_t replica_id = 0;        // the replica to replace
  std::string from_server_id;     // its server (possibly gone from the view)
  std::string to_server_id;       // where the new replica goes
  bool target_warm = false;       // to_server_id has a warm replica process to promote
  bool scale_out_needed = false;  // no target exists; replica_id is still chosen
  std::string reason;             // with scale_out_needed, why
};

// Replica: one on a server missing from the view or not accepting first (it has to go anyway),
// then the one on the server with the highest SR_h, then fewest idle GPUs, then lowest replica
// id. Replicas in `excluded_replicas` are not moved.
// Target: accepting, >= gpus_needed idle GPUs, holds no replica of this kernel, and
// SubscriptionFits(kernel.request). Ordered: listed in `warm_servers`, then most idle GPUs (with
// pack_gpus: fewest, i.e. best fit, so that a small cell does not take a wholly idle server),
// then lowest SR_h, then server_id. The cluster ratio is deliberately not applied: a cell is
// waiting.
// Errors: InvalidArgument for gpus_needed < 0, a kernel without a movable replica, or gpus_needed
// above the largest server's GPUs (named in the message).
Result<MigrationPlan> ChooseMigration(const ClusterState& cluster, const KernelView& kernel,
                                      int32_t gpus_needed,
                                      const std::set<std::string, std::less<>>& warm_servers = {},
                                      const std::set<uint32_t>& excluded_replicas = {},
                                      bool pack_gpus = false);

}  // namespace nbos::sched
