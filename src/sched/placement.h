// Placement of a new distributed kernel (or of replacement replicas) onto distinct servers.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "sched/cluster.h"
#include "sched/subscription.h"

namespace nbos::sched {

struct PlacementOptions {
  int32_t replicas = kReplicasPerKernel;  // how many distinct servers to choose
  // SR_c, usually SubscriptionRatio::value(); a server is admitted while its SR_h with the new
  // replica stays strictly below it.
  double cluster_ratio = kDefaultMaxSubscriptionRatio;
  // Servers not to use, e.g. those already holding the kernel's surviving replicas.
  std::set<std::string, std::less<>> excluded_servers;
  // Set when the cluster cannot grow: rather than asking for scale-out, fill up with servers
  // over the ratio (CPU and memory must still fit) and report ratio_ignored.
  bool ignore_ratio_if_no_scale_out = false;
};

struct Placement {
  std::vector<std::string> server_ids;  // `replicas` distinct servers, least loaded first
  bool ratio_ignored = false;           // some chosen server ends at or above SR_c
  bool scale_out_needed = false;        // then server_ids is empty
  int32_t hosts_needed = 0;             // with scale_out_needed: empty servers that would do
  std::string reason;                   // why scale-out is needed or the ratio was ignored
};

// Eligible servers: accepting, not excluded, SubscriptionFits(request) and, unless the request
// asks for no GPUs, SR_h with the replica < cluster_ratio. They are ordered by that SR_h, then by
// CPU/memory subscription fraction, then most idle GPUs, then server_id (so the same state
// always gives the same answer). Too few eligible servers is not an error: the Placement says
// scale_out_needed. Errors: InvalidArgument for a negative request, replicas < 1, or a request
// larger than the largest server in some dimension (the message names that server).
Result<Placement> PlaceKernel(const ClusterState& cluster, const Resources& request,
                              const PlacementOptions& options = {});

}  // namespace nbos::sched
