// Auto-scaling decision (DESIGN §5), taken every scaling interval by the caller.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "sched/cluster.h"

namespace nbos::sched {

// Defaults are the reference implementation's sample configuration. Factors count to 1/1000.
struct ScalingOptions {
  double scaling_factor = 1.10;  // target hosts = ⌈load × factor / gpus_per_host⌉ ...
  double scaling_limit = 1.15;   // ... release only above ⌈load × limit / gpus_per_host⌉
  int32_t buffer_hosts = 3;      // target is at least min_hosts + buffer_hosts
  int32_t min_hosts = kReplicasPerKernel;  // one kernel needs R hosts (reference sample: 6)
  int32_t max_hosts = -1;                  // < 0: unbounded
  int32_t max_release_per_round = 2;       // k
  int32_t gpus_per_host = 8;               // > 0
  // With a pinning count (DecideScaling's `pinning`): an idle server is released only when at
  // most this many of its replicas pin it, and the least pinned go first. < 0: no such rule.
  int32_t release_max_pinning_replicas = -1;
  // With a forecast that asks for idle servers (ScalingForecast::idle_servers > 0): scale-in
  // keeps that many wholly idle accepting servers plus this many, so that a count that moves by
  // one from tick to tick does not release a server and ask for a new one the next minute.
  int32_t release_idle_servers_margin = 0;
};

// What a demand forecast (forecast.h) expects beyond the committed load. Zero: none.
struct ScalingForecast {
  double gpus = 0;  // GPUs idle kernels are expected to ask for soon
  // Wholly idle servers the cells expected soon need (cells that take a whole server): the
  // target is at least the servers with GPUs committed plus these.
  int32_t idle_servers = 0;
};

// Replicas on an idle server that should keep it (e.g. of kernels likely to run a cell soon).
using PinningCount = std::function<int32_t(const ServerView& server)>;

// The order in which scale-in releases idle servers (smaller first): fewest subscribed GPUs,
// then fewest subscribed millicpus, then server_id.
inline auto ReleaseOrder(const ServerView& server) {
  return std::tie(server.subscribed.gpus, server.subscribed.millicpus, server.server_id);
}

struct ScalingDecision {
  int32_t add_hosts = 0;
  // Idle servers to release, best first. The caller moves their standby replicas off (and marks
  // them not accepting) before releasing them.
  std::vector<std::string> release_server_ids;
  std::string reason;  // the arithmetic behind the decision, for the log
};

// load = committed GPUs over all servers; size = accepting servers (non-accepting ones are
// already on their way out). Scale out to target when size < target, capped by max_hosts.
// Otherwise release up to k accepting servers with no committed GPUs while size stays >= both
// the limit and the target, in ReleaseOrder. Never both adds and releases. Predictive scale-in
// should wait for a full SubscriptionRatio window; that gating is the caller's. forecast.gpus (>=
// 0) is added to the committed load for both the target and the limit; with forecast.idle_servers
// > 0 the target is at least the accepting servers with GPUs committed plus that many, and
// scale-in keeps that many (plus options.release_idle_servers_margin) wholly idle. pinning (with
// options.release_max_pinning_replicas >= 0): release candidates are only the idle accepting
// servers with at most that many pinning replicas, ordered by that count first (then as above).
// Called only for idle accepting servers, and only when some server may go.
ScalingDecision DecideScaling(const std::vector<ServerView>& servers,
                              const ScalingOptions& options = {},
                              const ScalingForecast& forecast = {},
                              const PinningCount* pinning = nullptr);
ScalingDecision DecideScaling(const ClusterState& cluster, const ScalingOptions& options = {},
                              const ScalingForecast& forecast = {},
                              const PinningCount* pinning = nullptr);

}  // namespace nbos::sched
