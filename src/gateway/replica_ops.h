// The daemon calls that make and remove a kernel's replicas, shared by kernel starts, restarts and
// migrations. Each blocks on one gRPC call: never call them on a session thread or under the
// registry's lock.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "control/control.pb.h"
#include "daemon/daemon_client.h"
#include "gateway/metadata_store.h"
#include "sched/resources.h"

namespace nbos::gateway {

// Asks `client` (server `server_id`) to prepare replica `replica_id` of `meta`: its directory,
// ports and connection file. Errors name the replica and server.
Result<StoredReplica> PrepareReplica(daemon::DaemonClient& client, const StoredKernel& meta,
                                     const sched::Resources& request, const std::string& server_id,
                                     uint32_t replica_id);

// A launch of replica `replica_id` of `meta` with the kernel's start environment and KERNEL_ID.
// `peers` empty: it joins the running group (migration).
control::LaunchReplicaRequest LaunchRequest(const StoredKernel& meta, uint32_t replica_id,
                                            const std::vector<control::Peer>& peers);

// Stops replica `replica_id` of `kernel_id` and removes its data; logs a failure (the daemon's
// heartbeats report a replica that survived, and the gateway stops it as an orphan).
void StopReplica(daemon::DaemonClient& client, const std::string& kernel_id, uint32_t replica_id,
                 const std::string& server_id);

sched::Resources FromProto(const control::Resources& r);
control::Resources ToProto(const sched::Resources& r);

}  // namespace nbos::gateway
