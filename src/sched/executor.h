// Executor choice for one cell (DESIGN §3 step 2): which replicas to ask, in order, for a grant.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "sched/cluster.h"

namespace nbos::sched {

struct ExecutorChoice {
  // Replica ids to try in order; the gateway asks each one's daemon for the GPUs until one grants.
  // Empty: no replica's server can grant now, so a replica must migrate first (migration.h).
  std::vector<uint32_t> candidates;
  bool target_honoured = false;  // the requested target replica leads the list
  std::string note;              // why a requested target was not honoured, for the log

  bool migration_needed() const { return candidates.empty(); }
};

// A replica is a candidate when it is not in `excluded_replicas` (e.g. its daemon already refused
// this attempt) and its server is in the view, accepting, and has >= gpus_needed idle GPUs.
// Order: `target_replica` (from the request's metadata) if it is a candidate; else the previous
// executor if it is one (stickiness keeps GPU-warm state); then the rest by most idle GPUs, ties
// by replica id. gpus_needed is that of this cell (usually kernel.request.gpus); 0 makes every
// live replica a candidate.
// pack_gpus: the rest go fewest idle GPUs first (best fit), and the previous executor loses its
// place when its server is wholly idle, the cell needs less than the whole server, and another
// candidate's server is not wholly idle: a cell then does not break up a whole idle server that
// a whole-server cell of another kernel may need.
ExecutorChoice ChooseExecutor(const ClusterState& cluster, const KernelView& kernel,
                              int32_t gpus_needed, const std::set<uint32_t>& excluded_replicas,
                              std::optional<uint32_t> target_replica = std::nullopt,
                              bool pack_gpus = false);

}  // namespace nbos::sched
