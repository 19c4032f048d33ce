#include "sched/scaling.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <tuple>

namespace nbos::sched {

namespace {

// ⌈load × factor / gpus_per_host⌉ in integers: with doubles, 80 × 1.10 / 8 is 11.000000000000002
// and its ceiling 12.
int64_t HostsFor(int64_t load_gpus, double factor, int32_t gpus_per_host) {
  const int64_t per_mille = std::llround(factor * 1000);
  const int64_t denominator = int64_t{gpus_per_host} * 1000;
  return (load_gpus * per_mille + denominator - 1) / denominator;
}

// The decision over server pointers, so that the ClusterState overload (called every scaling
// interval by the simulator) does not copy every ServerView.
ScalingDecision Decide(const std::vector<const ServerView*>& servers, const ScalingOptions& options,
                       const ScalingForecast& forecast, const PinningCount* pinning) {
  assert(options.gpus_per_host > 0 && options.min_hosts >= 0 && options.buffer_hosts >= 0);
  int64_t load = 0;
  int64_t size = 0;
  int64_t wholly_idle = 0;
  for (const ServerView* s : servers) {
    load += s->committed.gpus;
    if (s->accepting) ++size;
    if (s->accepting && s->committed.gpus == 0) ++wholly_idle;
  }
  // Whole GPUs, rounded up: a forecast of 0.2 GPUs is still a cell that needs a GPU.
  const int64_t committed = load;
  load += static_cast<int64_t>(std::ceil(std::max(forecast.gpus, 0.0) - 1e-9));
  const int64_t floor_hosts = int64_t{options.min_hosts} + options.buffer_hosts;
  const int64_t idle_needed = std::max(forecast.idle_servers, 0);
  int64_t target =
      std::max(HostsFor(load, options.scaling_factor, options.gpus_per_host), floor_hosts);
  if (idle_needed > 0) target = std::max(target, size - wholly_idle + idle_needed);
  if (options.max_hosts >= 0) target = std::min<int64_t>(target, options.max_hosts);
  // The reference lets limit fall below target (e.g. load 30, 8 GPUs/host, min 3, buffer 3:
  // limit 5, target 6), releasing a host one round and requesting it back the next.
  const int64_t limit =
      std::max(HostsFor(load, options.scaling_limit, options.gpus_per_host), target);

  ScalingDecision decision;
  decision.reason = "load " + std::to_string(committed) + " GPUs" +
                    (load > committed ? " + forecast " + std::to_string(load - committed) : "") +
                    ", " + std::to_string(size) + " accepting hosts" +
                    (idle_needed > 0 ? " (" + std::to_string(wholly_idle) + " idle, " +
                                           std::to_string(idle_needed) + " wanted)"
                                     : "") +
                    ", target " + std::to_string(target) + ", limit " + std::to_string(limit);
  if (size < target) {
    decision.add_hosts = static_cast<int32_t>(target - size);
    return decision;
  }
  // Scale-in takes only wholly idle servers, so keeping some of them idle bounds it too.
  const int64_t idle_kept = idle_needed > 0 ? idle_needed + options.release_idle_servers_margin : 0;
  const int64_t surplus = std::min(
      {size - limit, int64_t{std::max(options.max_release_per_round, 0)}, wholly_idle - idle_kept});
  if (surplus <= 0) return decision;

  // (pinning replicas, server): the count is 0 for all when no pinning rule applies.
  const bool pins = pinning != nullptr && options.release_max_pinning_replicas >= 0;
  std::vector<std::pair<int32_t, const ServerView*>> idle;
  for (const ServerView* s : servers) {
    if (!s->accepting || s->committed.gpus != 0) continue;
    const int32_t pinned = pins ? (*pinning)(*s) : 0;
    if (pinned <= options.release_max_pinning_replicas || !pins) idle.emplace_back(pinned, s);
  }
  std::sort(idle.begin(), idle.end(), [](const auto& x, const auto& y) {
    return std::tuple_cat(std::tie(x.first), ReleaseOrder(*x.second)) <
           std::tuple_cat(std::tie(y.first), ReleaseOrder(*y.second));
  });
  for (int64_t i = 0; i < surplus && i < static_cast<int64_t>(idle.size()); ++i) {
    decision.release_server_ids.push_back(idle[i].second->server_id);
  }
  return decision;
}

}  // namespace

ScalingDecision DecideScaling(const std::vector<ServerView>& servers, const ScalingOptions& options,
                              const ScalingForecast& forecast, const PinningCount* pinning) {
  std::vector<const ServerView*> pointers;
  pointers.reserve(servers.size());
  for (const ServerView& s : servers) pointers.push_back(&s);
  return Decide(pointers, options, forecast, pinning);
}

ScalingDecision DecideScaling(const ClusterState& cluster, const ScalingOptions& options,
                              const ScalingForecast& forecast, const PinningCount* pinning) {
  std::vector<const ServerView*> pointers;
  pointers.reserve(cluster.servers().size());
  for (const auto& [id, s] : cluster.servers()) pointers.push_back(&s);
  return Decide(pointers, options, forecast, pinning);
}

}  // namespace nbos::sched
