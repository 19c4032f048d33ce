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

// An idle kernel likely to run a cell soon (forecast.h), and the GPUs its next cell likely needs.
struct LikelyKernel {
  const KernelView* kernel = nullptr;
  int32_t need_gpus = 0;  // GpuNeed::cover_gpus
  double chance = 0;      // P(a cell within the forecast's horizon)
};

// The summed chance of the `likely` kernels that would lose their only cover if a cell took
// `gpus` GPUs on `server_id`: kernels with a replica there whose other replicas' accepting servers
// all have fewer than need_gpus idle, and for which that server has need_gpus idle now but would
// not after the cell.
double SoleCoverLoss(const ClusterState& cluster, const std::string& server_id, int32_t gpus,
                     const std::vector<LikelyKernel>& likely);

// Sparing covers: reorders `choice->candidates` of `kernel`'s cell of `gpus` GPUs by
// SoleCoverLoss of each candidate's server, least first; equal losses keep ChooseExecutor's order
// (stickiness, then best fit). When two likely kernels' cells come close together, the first
// then leaves the second's only ready server alone if it has another. A requested target stays
// first.
void SpareSoleCovers(const ClusterState& cluster, const KernelView& kernel, int32_t gpus,
                     const std::vector<LikelyKernel>& likely, ExecutorChoice* choice);

}  // namespace nbos::sched
