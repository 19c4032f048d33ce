#include "sched/rebalance.h"

#include <algorithm>
#include <map>
#include <string_view>
#include <tuple>

#include "sched/subscription.h"

namespace nbos::sched {

namespace {

// An accepting server with at least the smallest need's idle GPUs: the only servers that can
// cover an idle kernel or take one.
struct Roomy {
  const ServerView* server;
  int32_t relied = 0;        // idle kernels that count on this server alone for their GPUs
  double relied_chance = 0;  // their return chances, summed (contended_cover_chance)
  Resources added;           // replicas this decision already sends here
};

// SubscriptionFits counting the replicas this decision already sends to the server.
bool FitsWithPlanned(const Roomy& r, const Resources& request) {
  if (r.added.IsZero()) return SubscriptionFits(*r.server, request);
  ServerView with_planned = *r.server;
  with_planned.subscribed += r.added;
  return SubscriptionFits(with_planned, request);
}

// Whether a kernel is likely enough to run a cell soon to pin a server scale-in could release.
bool MayPinReleasable(const IdleKernel& k, int64_t now_ms, const RebalanceOptions& options) {
  if (k.return_chance >= 0 && options.releasable_target_min_chance >= 0) {
    return k.return_chance >= options.releasable_target_min_chance;
  }
  return k.last_active_ms >= now_ms - options.releasable_target_idle_max_ms;
}

// Whether a covered kernel's cell, smaller than a server, would break up a wholly idle one
// (only such servers cover it), so that it may move to spare it (spare_whole_min_chance).
bool WouldBreakWholeServer(const IdleKernel& k, bool covered_by_busy, const ServerView& covering,
                           const RebalanceOptions& options) {
  return options.spare_whole_min_chance >= 0 && k.return_chance >= 0 && !covered_by_busy &&
         k.gpus_needed < covering.spec.gpus;
}

// The order in which kernels claim their covers: as given, or likeliest first when covers can be
// contended (a likelier kernel keeps its cover, a less likely one moves).
std::vector<const IdleKernel*> InCoverOrder(const std::vector<IdleKernel>& idle, bool by_chance) {
  std::vector<const IdleKernel*> order;
  order.reserve(idle.size());
  for (const IdleKernel& k : idle) order.push_back(&k);
  if (by_chance) {
    std::stable_sort(order.begin(), order.end(), [](const IdleKernel* a, const IdleKernel* b) {
      return a->return_chance > b->return_chance;
    });
  }
  return order;
}

}  // namespace

RebalanceChoice ChooseRebalance(const ClusterState& cluster, const std::vector<IdleKernel>& idle,
                                int64_t now_ms, const RebalanceOptions& options,
                                const std::set<std::string, std::less<>>& excluded_servers) {
  RebalanceChoice choice;
  std::vector<RebalancePlan>& plans = choice.plans;
  if (!options.enabled || options.max_per_tick <= 0) return choice;
  const int32_t min_gpus = std::max(options.min_gpus, 1);
  // Ordered by server_id (the map's order), for binary search. Runs every scaling interval over
  // every idle kernel's replicas, so it avoids the map's string-keyed lookups: when whole-host
  // cells keep the cluster busy, this list is short or empty.
  std::vector<Roomy> roomy;
  for (const auto& [id, server] : cluster.servers()) {
    if (server.accepting && server.IdleGpus() >= min_gpus) roomy.push_back({&server});
  }
  auto find_roomy = [&](std::string_view id) -> Roomy* {
    auto it =
        std::lower_bound(roomy.begin(), roomy.end(), id, [](const Roomy& r, std::string_view v) {
          return std::string_view(r.server->server_id) < v;
        });
    return it != roomy.end() && it->server->server_id == id ? &*it : nullptr;
  };
  int32_t max_idle_gpus = 0;
  for (const Roomy& r : roomy) max_idle_gpus = std::max(max_idle_gpus, r.server->IdleGpus());

  // Two kernels relying on one server alone cannot both run there if their cells arrive
  // together, so a move goes where the fewest already rely (a kernel covered by two servers
  // relies on neither alone).
  std::vector<const IdleKernel*> uncovered;
  std::set<const IdleKernel*> sparing;  // covered, moving to spare a wholly idle server
  const bool contention = options.contended_cover_chance >= 0;
  for (const IdleKernel* kp : InCoverOrder(idle, contention)) {
    const IdleKernel& k = *kp;
    // A kernel needing more idle GPUs than any accepting server has can be neither covered nor
    // moved.
    if (k.kernel == nullptr || k.gpus_needed < min_gpus || k.gpus_needed > max_idle_gpus) {
      continue;
    }
    Roomy* only = nullptr;
    int32_t covering = 0;
    bool covered_by_busy = false;
    for (const ReplicaView& r : k.kernel->replicas) {
      Roomy* server = find_roomy(r.server_id);
      if (server != nullptr && server->server->IdleGpus() >= k.gpus_needed) {
        ++covering;
        only = server;
        covered_by_busy = covered_by_busy || server->server->committed.gpus > 0;
      }
    }
    const bool contestable = contention && covering == 1 && k.return_chance >= 0 &&
                             only->server->committed.gpus == 0 &&
                             2 * k.gpus_needed > only->server->IdleGpus();
    if (contestable) choice.quiet_until_ms = now_ms;  // the chances move with time
    const bool contended = contestable && only->relied_chance >= options.contended_cover_chance;
    if (covering == 1 && !contended) {
      ++only->relied;
      only->relied_chance += std::max(k.return_chance, 0.0);
    }
    if (covering > 0 && !contended) {
      if (!WouldBreakWholeServer(k, covered_by_busy, *only->server, options)) continue;
      choice.quiet_until_ms = now_ms;  // its chance moves with time
      if (k.return_chance < options.spare_whole_min_chance) continue;
      sparing.insert(&k);
    }
    if (k.return_chance >= 0 &&
        (options.min_return_chance >= 0 || options.releasable_target_min_chance >= 0)) {
      // A chance moves with time either way, so the answer may change without any event.
      choice.quiet_until_ms = now_ms;
      if (k.return_chance < options.min_return_chance) continue;
    }
    // Written so as not to overflow for a kernel that never moved (lowest()).
    if (k.last_rebalanced_ms <= now_ms - options.kernel_cooldown_ms) {
      uncovered.push_back(&k);
    } else {
      choice.quiet_until_ms =
          std::min(choice.quiet_until_ms, k.last_rebalanced_ms + options.kernel_cooldown_ms);
    }
  }
  // The most recently active kernels are the likeliest to run a cell soon (notebook cells come
  // in bursts), so they move first when the bound cuts the list; a forecast says it better.
  // Covering a kernel comes before sparing a whole server.
  std::sort(uncovered.begin(), uncovered.end(), [&](const IdleKernel* a, const IdleKernel* b) {
    return std::make_tuple(sparing.contains(a), -a->return_chance, -a->last_active_ms,
                           std::string_view(a->kernel->kernel_id)) <
           std::make_tuple(sparing.contains(b), -b->return_chance, -b->last_active_ms,
                           std::string_view(b->kernel->kernel_id));
  });

  // Replicas per server, for keeping servers releasable (only when asked for and only when some
  // kernel may move: it walks every replica). Updated with this decision's own plans.
  const bool spare = options.spare_servers_max_replicas >= 0 && !uncovered.empty();
  std::map<std::string_view, int32_t> replicas_on;
  if (spare) {
    for (const auto& [id, kernel] : cluster.kernels()) {
      for (const ReplicaView& r : kernel.replicas) ++replicas_on[r.server_id];
    }
  }
  auto count = [&](std::string_view server_id) {
    const auto it = replicas_on.find(server_id);
    return it == replicas_on.end() ? 0 : it->second;
  };
  // A target the auto-scaler could release once idle: a replica there would keep it.
  auto releasable = [&](std::string_view server_id) {
    return spare && count(server_id) <= options.spare_servers_max_replicas;
  };
  // A source that moving one replica off makes releasable.
  auto one_over_releasable = [&](std::string_view server_id) {
    return spare && count(server_id) == options.spare_servers_max_replicas + 1;
  };

  bool without_target = false;
  for (const IdleKernel* k : uncovered) {
    if (static_cast<int32_t>(plans.size()) >= options.max_per_tick) {
      choice.quiet_until_ms = now_ms;  // cut by the bound: the next call has work
      break;
    }
    const KernelView& kernel = *k->kernel;

    using TargetKey = std::tuple<bool, double, int32_t, int32_t, double, std::string_view>;
    Roomy* target = nullptr;
    TargetKey best_target;
    for (Roomy& r : roomy) {
      const ServerView& server = *r.server;
      if (excluded_servers.contains(server.server_id) || server.IdleGpus() < k->gpus_needed ||
          kernel.HasReplicaOn(server.server_id) ||
          (sparing.contains(k) && server.committed.gpus == 0)) {
        continue;
      }
      if (!FitsWithPlanned(r, kernel.request)) continue;
      // Pinning a server that scale-in could release pays only for a kernel likely to run a
      // cell soon; a long-idle one waits for a server that is kept anyway.
      if (releasable(server.server_id) && !MayPinReleasable(*k, now_ms, options)) continue;
      TargetKey key{releasable(server.server_id),
                    contention ? r.relied_chance : 0.0,
                    r.relied,
                    server.IdleGpus() - k->gpus_needed,
                    HostSubscriptionRatio(server, r.added),
                    std::string_view(server.server_id)};
      if (target == nullptr || key < best_target) {
        target = &r;
        best_target = key;
      }
    }
    if (target == nullptr) {
      without_target = true;
      continue;
    }

    // Lower key = better replica to move. The last executor stays if another can go: its
    // server holds the kernel's GPU-warm state.
    using ReplicaKey = std::tuple<bool, bool, bool, double, int32_t, uint32_t>;
    const ReplicaView* moving = nullptr;
    ReplicaKey best_replica;
    for (const ReplicaView& r : kernel.replicas) {
      const ServerView* server = cluster.FindServer(r.server_id);
      const bool doomed = server == nullptr || !server->accepting;
      ReplicaKey key{!doomed,
                     r.replica_id == kernel.last_executor,
                     doomed || !one_over_releasable(r.server_id),
                     doomed ? 0.0 : -HostSubscriptionRatio(*server),
                     doomed ? 0 : server->IdleGpus(),
                     r.replica_id};
      if (moving == nullptr || key < best_replica) {
        moving = &r;
        best_replica = key;
      }
    }
    if (moving == nullptr) continue;  // a kernel without replicas has nothing to move

    RebalancePlan plan;
    plan.kernel_id = kernel.kernel_id;
    plan.plan.replica_id = moving->replica_id;
    plan.plan.from_server_id = moving->server_id;
    plan.plan.to_server_id = target->server->server_id;
    plan.plan.reason = "proactive: " +
                       std::string(sparing.contains(k) ? "only wholly idle replica servers of"
                                                       : "no replica server of") +
                       " kernel '" + kernel.kernel_id +
                       (sparing.contains(k) ? "' have " : "' has ") +
                       std::to_string(k->gpus_needed) + " idle GPUs; " + target->server->server_id +
                       " has " + std::to_string(target->server->IdleGpus());
    plans.push_back(std::move(plan));
    ++target->relied;
    target->relied_chance += std::max(k->return_chance, 0.0);
    target->added += kernel.request;
    if (spare) {
      ++replicas_on[target->server->server_id];
      --replicas_on[moving->server_id];
    }
    choice.quiet_until_ms = std::min(choice.quiet_until_ms, now_ms + options.kernel_cooldown_ms);
  }
  // A kernel may have lacked a target only because this decision's own plans took the room; if
  // the caller drops those plans, the next call may differ.
  if (without_target && !plans.empty()) choice.quiet_until_ms = now_ms;
  return choice;
}

}  // namespace nbos::sched
