#include "sched/placement.h"

#include <fmt/format.h>

#include <algorithm>
#include <tuple>

namespace nbos::sched {

namespace {

struct Candidate {
  const ServerView* server;
  double ratio_after;  // SR_h with the new replica
  double cpu_mem_fraction_after;
  bool within_ratio;
};

double Fraction(int64_t used, int64_t total) {
  return total <= 0 ? 0.0 : static_cast<double>(used) / static_cast<double>(total);
}

bool LessLoaded(const Candidate& a, const Candidate& b) {
  return std::make_tuple(a.ratio_after, a.cpu_mem_fraction_after, -a.server->IdleGpus(),
                         std::string_view(a.server->server_id)) <
         std::make_tuple(b.ratio_after, b.cpu_mem_fraction_after, -b.server->IdleGpus(),
                         std::string_view(b.server->server_id));
}

}  // namespace

Result<Placement> PlaceKernel(const ClusterState& cluster, const Resources& request,
                              const PlacementOptions& options) {
  if (!request.IsNonNegative()) {
    return InvalidArgument("negative resource request " + request.ToString());
  }
  if (options.replicas < 1) return InvalidArgument("placement needs at least one replica");
  if (Status s = CheckRequestFitsSomeServer(cluster, request); !s.ok()) return s;

  std::vector<Candidate> candidates;
  int32_t not_accepting = 0, no_room = 0, over_ratio = 0;
  for (const auto& [id, server] : cluster.servers()) {
    if (options.excluded_servers.contains(id)) continue;
    if (!server.accepting) {
      ++not_accepting;
      continue;
    }
    if (!SubscriptionFits(server, request)) {
      ++no_room;
      continue;
    }
    Candidate c{&server, HostSubscriptionRatio(server, request), 0.0, true};
    const Resources after = server.subscribed + request;
    c.cpu_mem_fraction_after = std::max(Fraction(after.millicpus, server.spec.millicpus),
                                        Fraction(after.memory_mb, server.spec.memory_mb));
    // A GPU-less replica does not move SR_h, so the GPU ratio has no say over it.
    c.within_ratio = request.gpus == 0 || c.ratio_after < options.cluster_ratio;
    if (!c.within_ratio) ++over_ratio;
    candidates.push_back(c);
  }
  // Sorting by SR_h puts every within-ratio server before every over-ratio one.
  std::sort(candidates.begin(), candidates.end(), LessLoaded);
  const auto within = static_cast<int32_t>(candidates.size()) - over_ratio;

  Placement placement;
  const bool use_over_ratio = within < options.replicas && options.ignore_ratio_if_no_scale_out;
  const int32_t usable = use_over_ratio ? static_cast<int32_t>(candidates.size()) : within;
  const std::string counts =
      std::to_string(cluster.servers().size()) + " servers: " + std::to_string(within) +
      " within SR_c=" + fmt::format("{:.2f}", options.cluster_ratio) + ", " +
      std::to_string(over_ratio) + " over it, " + std::to_string(no_room) +
      " without CPU/memory room, " + std::to_string(not_accepting) + " not accepting, " +
      std::to_string(options.excluded_servers.size()) + " excluded";
  if (usable < options.replicas) {
    placement.scale_out_needed = true;
    placement.hosts_needed = options.replicas - usable;
    placement.reason = "scale out needed: " + std::to_string(options.replicas) + " replicas of " +
                       request.ToString() + " but " + counts;
    return placement;
  }
  for (int32_t i = 0; i < options.replicas; ++i) {
    placement.server_ids.push_back(candidates[i].server->server_id);
  }
  if (use_over_ratio) {
    placement.ratio_ignored = true;
    placement.reason = "subscription ratio ignored (no scale-out possible); " + counts;
  }
  return placement;
}

}  // namespace nbos::sched
