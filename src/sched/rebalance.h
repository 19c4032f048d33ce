// Proactive rebalancing of idle kernels: off the critical path, move one replica of a kernel
// whose replica servers cannot grant the GPUs its next cell is likely to need to a server that
// can, so that the next cell finds GPUs on a replica server instead of migrating on arrival.
// Pure: the caller (Scheduler::OnTick) says which kernels are idle, what they need and when they
// last moved; the answer is a bounded list of MigrationPlans for the caller to carry out.
#pragma once

#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "sched/cluster.h"
#include "sched/migration.h"

namespace nbos::sched {

struct RebalanceOptions {
  // Off: no proactive migrations (the gateway's default; the simulator turns it on for its
  // notebookos policy, docs/decisions/0004-simulator.md).
  bool enabled = false;
  int32_t max_per_tick = 4;  // plans per decision, >= 0
  // A kernel moved proactively is not moved proactively again for this long (against ping-pong
  // when the server it moved to is taken by another kernel's cell soon after).
  int64_t kernel_cooldown_ms = 300000;
  // Only kernels whose need is at least this many GPUs are considered (smaller cells nearly
  // always find GPUs on some replica server, and moving for them churns replicas).
  int32_t min_gpus = 1;
  // Servers holding at most this many replicas are ones the auto-scaler may release when idle
  // (the simulator's release_max_replicas, the reference's ReleaseIdleHosts rule): targets
  // holding more come first, so that moves do not pin a releasable server, and a replica on a
  // server holding one more than this moves first, so that its server becomes releasable.
  // < 0: replica counts play no part.
  int32_t spare_servers_max_replicas = -1;
  // With spare_servers_max_replicas >= 0: a kernel idle for longer than this (since it last
  // asked for or released GPUs) never moves to a releasable server, only to one that is kept
  // anyway. On the Adobe trace this is what keeps the GPU-hours down (docs/evaluation.md).
  int64_t releasable_target_idle_max_ms = 2 * 3600 * 1000;
  // For kernels with a forecast (IdleKernel::return_chance >= 0): a kernel less likely than this
  // to run a cell within the horizon does not move at all (moving it would only churn), and one
  // less likely than releasable_target_min_chance never moves to a releasable server (instead
  // of the idle-time rule above). Negative: the rule is off.
  double min_return_chance = -1;
  double releasable_target_min_chance = -1;
  // For kernels with a forecast: one at least this likely to run a cell within the horizon whose
  // next cell needs less than a whole server and that only wholly idle servers cover also moves,
  // after the uncovered kernels, to a partly busy server with room, so that its cell leaves the
  // idle server whole for a whole-server cell. Negative: off.
  double spare_whole_min_chance = -1;
  // For kernels with a forecast, likeliest first: a kernel whose cell needs more than half of
  // the one wholly idle server that alone covers it counts as uncovered when likelier kernels
  // relying on that server alone add up to at least this chance (their cells would race for
  // it), and moves like an uncovered one. Negative: off.
  double contended_cover_chance = -1;
  // For kernels with a forecast: a kernel that finds no target only because the servers that
  // would cover it are full (SubscriptionFits) takes the place of a replica of an idle kernel at
  // most this fraction as likely to return, on one of them. That replica moves first, to a
  // server with room, one with GPUs committed first, so that it fills no other idle server. The
  // two moves are two plans. Wholly idle servers collect the replicas of every kernel whose cells
  // ran there; without this, the likeliest kernels found them full. Negative: off.
  double make_room_chance_ratio = -1;
};

// One proactive move: which kernel's replica goes where.
struct RebalancePlan {
  std::string kernel_id;
  MigrationPlan plan;  // scale_out_needed never set; reason says why the kernel moves
};

// An idle kernel (no cell running or waiting for an executor) as the caller sees it.
struct IdleKernel {
  const KernelView* kernel = nullptr;  // must be in the cluster the decision is taken over
  int32_t gpus_needed = 0;             // its next cell's likely GPU count (last cell's, or request)
  int64_t last_active_ms = 0;          // when it last asked for or released GPUs
  // When it last moved proactively; lowest() if never.
  int64_t last_rebalanced_ms = std::numeric_limits<int64_t>::lowest();
  // P(it asks for GPUs within the forecast horizon), forecast.h; < 0: no forecast (recency
  // decides, as without one).
  double return_chance = -1;
};

// A kernel is covered when one of its replicas is on an accepting server with >= gpus_needed
// idle GPUs (and, with contended_cover_chance, that cover is not contended). For uncovered kernels
// with gpus_needed >= min_gpus that are out of their cooldown (now_ms - last_rebalanced_ms >=
// kernel_cooldown_ms) and, with a forecast, at least min_return_chance likely to return, likeliest
// first (forecast, then most recently active, then kernel_id), then likewise for the kernels that
// spare_whole_min_chance moves (covered by wholly idle servers only; their targets must have GPUs
// committed), at most max_per_tick plans:
// - Target: accepting, not in `excluded_servers` (e.g. servers the same tick releases), holds no
//   replica of the kernel, >= gpus_needed idle GPUs, SubscriptionFits(request) counting the
//   replicas this decision already sends there, and not releasable (see
//   spare_servers_max_replicas) when the kernel has been idle for more than
//   releasable_target_idle_max_ms (with a forecast and releasable_target_min_chance >= 0:
//   when its return chance is below that). Ordered: not releasable (more than
//   spare_servers_max_replicas replicas, when that is >= 0) first, then (with
//   contended_cover_chance) by the summed return chances of the idle kernels that already rely
//   on it alone for their GPUs, then by how many do (fewest first; both counting this
//   decision's earlier plans), then the tightest fit (fewest idle GPUs beyond gpus_needed), then
//   lowest SR_h, then server_id.
// - Replica: one on a server missing from the view or not accepting first, then not the last
//   executor, then one whose server holds spare_servers_max_replicas + 1 replicas (when that is
//   >= 0), then highest SR_h, then fewest idle GPUs, then lowest replica id.
// - With make_room_chance_ratio >= 0 and no target: among the full servers that would otherwise
//   be targets, the replica there of the least likely idle kernel (return chance at most the
//   ratio times this kernel's, out of its cooldown, not moved yet by this decision; then not its
//   last executor, then kernel_id) whose leaving makes room, and a refuge for it: accepting, not
//   excluded, holds no replica of its kernel, fits, not releasable unless that kernel may pin
//   it (as for targets), GPUs committed first, then lowest SR_h, then server_id. Its plan
//   comes first, then this kernel's to the server it left; only when both fit within
//   max_per_tick. The evicted kernel needs a forecast (return_chance >= 0).
// A kernel with no eligible target gets no plan (no scale-out is asked for: nothing waits). A
// kernel may be listed more than once with different gpus_needed; it gets at most one plan per
// call (its first in the order above).
// quiet_until_ms: until then, the same call over the same cluster and kernels (nothing changed
// but the time) gives no plans, so a caller may skip it (the scheduler does, to keep a tick cheap).
struct RebalanceChoice {
  std::vector<RebalancePlan> plans;
  int64_t quiet_until_ms = std::numeric_limits<int64_t>::max();
};
RebalanceChoice ChooseRebalance(const ClusterState& cluster, const std::vector<IdleKernel>& idle,
                                int64_t now_ms, const RebalanceOptions& options,
                                const std::set<std::string, std::less<>>& excluded_servers = {});

}  // namespace nbos::sched
