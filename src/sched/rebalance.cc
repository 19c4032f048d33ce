#include "sched/rebalance.h"

#include <algorithm>
#include <map>
#include <set>
#include <string_view>
#include <tuple>

#include "sched/subscription.h"

namespace nbos::sched {

namespace {

using Evictee = std::pair<const IdleKernel*, const ReplicaView*>;

// Lower key = a replica that gives up its place sooner (make_room_chance_ratio).
auto EvictionKey(const Evictee& e) {
  return std::make_tuple(e.first->return_chance,
                         e.second->replica_id == e.first->kernel->last_executor,
                         std::string_view(e.first->kernel->kernel_id));
}

// The first 8 bytes of an id, big-endian, zero-padded: ids whose prefixes differ order as their
// prefixes do, so only ids with equal prefixes need a string comparison.
uint64_t IdPrefix(std::string_view id) {
  uint64_t prefix = 0;
  for (size_t i = 0; i < 8; ++i) {
    prefix = (prefix << 8) | (i < id.size() ? static_cast<unsigned char>(id[i]) : 0u);
  }
  return prefix;
}

// An accepting server with at least the smallest need's idle GPUs: the only servers that can
// cover an idle kernel or take one.
struct Roomy {
  const ServerView* server;
  uint64_t id_prefix = 0;    // IdPrefix(server->server_id)
  int32_t relied = 0;        // idle kernels that count on this server alone for their GPUs
  double relied_chance = 0;  // their return chances, summed (contended_cover_chance)
  Resources added;           // replicas this decision already sends here
  // make_room_chance_ratio: the replicas here of idle kernels out of their cooldown, least
  // likely first (EvictionKey).
  std::vector<Evictee> evictees;
};

// SubscriptionFits counting the replicas this decision already sends to the server.
bool FitsWith(const ServerView& server, const Resources& added, const Resources& request) {
  if (added.IsZero()) return SubscriptionFits(server, request);
  ServerView with_planned = server;
  with_planned.subscribed += added;
  return SubscriptionFits(with_planned, request);
}

bool FitsWithPlanned(const Roomy& r, const Resources& request) {
  return FitsWith(*r.server, r.added, request);
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

// One ChooseRebalance call: the servers that can cover or take an idle kernel, and the kernels
// that move, in the order they move. Plans update the servers' counts as they are made, so later
// kernels see the earlier moves.
class RebalanceDecision {
 public:
  RebalanceDecision(const ClusterState& cluster, int64_t now_ms, const RebalanceOptions& options,
                    const std::set<std::string, std::less<>>& excluded_servers);
  void FindKernelsToMove(const std::vector<IdleKernel>& idle);
  void PlanMoves();
  RebalanceChoice Take() && { return std::move(choice_); }

 private:
  Roomy* FindRoomy(std::string_view server_id);
  void Consider(const IdleKernel& k);
  void SortMoving();
  void CountReplicas();
  int32_t ReplicasOn(std::string_view server_id) const;
  bool MayCover(const IdleKernel& k, const Roomy& r, bool* releasable) const;
  Roomy* ChooseTarget(const IdleKernel& k);
  const ReplicaView* ChooseReplica(const KernelView& kernel) const;
  void AddPlan(const IdleKernel& k, Roomy& target, const ReplicaView& moving);
  void PushPlan(const KernelView& kernel, const ReplicaView& moving,
                const std::string& to_server_id, std::string reason);
  Roomy* MakeRoom(const IdleKernel& k);
  void IndexEvictees();
  const ServerView* ChooseRefuge(const IdleKernel& evictee);
  void AddEviction(const IdleKernel& evictee, const ReplicaView& moving, Roomy& from,
                   const ServerView& to, const IdleKernel& for_kernel);

  const ClusterState& cluster_;
  const int64_t now_ms_;
  const RebalanceOptions& options_;
  const std::set<std::string, std::less<>>& excluded_servers_;
  const int32_t min_gpus_;
  const bool contention_;
  // Ordered by server_id (the map's order), for binary search. Runs every scaling interval over
  // every idle kernel's replicas, so it avoids the map's string-keyed lookups: when whole-host
  // cells keep the cluster busy, this list is short or empty.
  std::vector<Roomy> roomy_;
  int32_t max_idle_gpus_ = 0;
  std::vector<const IdleKernel*> moving_;
  std::set<const IdleKernel*> sparing_;  // covered, moving to spare a wholly idle server
  // Replicas per server, for keeping servers releasable (only when asked for and only when some
  // kernel may move: it walks every replica). Updated with this decision's own plans.
  bool spare_ = false;
  std::map<std::string_view, int32_t> replicas_on_;
  std::set<const KernelView*> planned_;  // kernels this decision moves (one plan each)
  // For make_room_chance_ratio: the idle kernels, and what this decision sends to servers
  // outside roomy_.
  const std::vector<IdleKernel>* idle_ = nullptr;
  std::map<std::string_view, Resources> added_elsewhere_;
  bool evictees_indexed_ = false;
  RebalanceChoice choice_;
};

RebalanceDecision::RebalanceDecision(const ClusterState& cluster, int64_t now_ms,
                                     const RebalanceOptions& options,
                                     const std::set<std::string, std::less<>>& excluded_servers)
    : cluster_(cluster),
      now_ms_(now_ms),
      options_(options),
      excluded_servers_(excluded_servers),
      min_gpus_(std::max(options.min_gpus, 1)),
      contention_(options.contended_cover_chance >= 0) {
  for (const auto& [id, server] : cluster.servers()) {
    if (server.accepting && server.IdleGpus() >= min_gpus_) {
      roomy_.push_back({&server, IdPrefix(server.server_id)});
    }
  }
  for (const Roomy& r : roomy_) max_idle_gpus_ = std::max(max_idle_gpus_, r.server->IdleGpus());
}

Roomy* RebalanceDecision::FindRoomy(std::string_view server_id) {
  // Called for every replica of every idle kernel on every call: comparing the ids' first bytes
  // as one integer settles nearly every step without a string comparison.
  const uint64_t prefix = IdPrefix(server_id);
  auto it = std::lower_bound(roomy_.begin(), roomy_.end(), server_id,
                             [prefix](const Roomy& r, std::string_view v) {
                               if (r.id_prefix != prefix) return r.id_prefix < prefix;
                               return std::string_view(r.server->server_id) < v;
                             });
  if (it == roomy_.end() || it->id_prefix != prefix) return nullptr;
  const std::string& found = it->server->server_id;
  return found.size() == server_id.size() && (found.size() <= 8 || found == server_id) ? &*it
                                                                                       : nullptr;
}

void RebalanceDecision::FindKernelsToMove(const std::vector<IdleKernel>& idle) {
  for (const IdleKernel* k : InCoverOrder(idle, contention_)) Consider(*k);
  idle_ = &idle;
  SortMoving();
  spare_ = options_.spare_servers_max_replicas >= 0 && !moving_.empty();
  if (spare_) CountReplicas();
}

// Two kernels relying on one server alone cannot both run there if their cells arrive together,
// so a move goes where the fewest already rely (a kernel covered by two servers relies on neither
// alone).
void RebalanceDecision::Consider(const IdleKernel& k) {
  // A kernel needing more idle GPUs than any accepting server has can be neither covered nor
  // moved.
  if (k.kernel == nullptr || k.gpus_needed < min_gpus_ || k.gpus_needed > max_idle_gpus_) return;
  Roomy* only = nullptr;
  int32_t covering = 0;
  bool covered_by_busy = false;
  for (const ReplicaView& r : k.kernel->replicas) {
    Roomy* server = FindRoomy(r.server_id);
    if (server != nullptr && server->server->IdleGpus() >= k.gpus_needed) {
      ++covering;
      only = server;
      covered_by_busy = covered_by_busy || server->server->committed.gpus > 0;
    }
  }
  const bool contestable = contention_ && covering == 1 && k.return_chance >= 0 &&
                           only->server->committed.gpus == 0 &&
                           2 * k.gpus_needed > only->server->IdleGpus();
  if (contestable) choice_.quiet_until_ms = now_ms_;  // the chances move with time
  const bool contended = contestable && only->relied_chance >= options_.contended_cover_chance;
  if (covering == 1 && !contended) {
    ++only->relied;
    only->relied_chance += std::max(k.return_chance, 0.0);
  }
  if (covering > 0 && !contended) {
    if (!WouldBreakWholeServer(k, covered_by_busy, *only->server, options_)) return;
    choice_.quiet_until_ms = now_ms_;  // its chance moves with time
    if (k.return_chance < options_.spare_whole_min_chance) return;
    sparing_.insert(&k);
  }
  if (k.return_chance >= 0 &&
      (options_.min_return_chance >= 0 || options_.releasable_target_min_chance >= 0)) {
    // A chance moves with time either way, so the answer may change without any event.
    choice_.quiet_until_ms = now_ms_;
    if (k.return_chance < options_.min_return_chance) return;
  }
  // Written so as not to overflow for a kernel that never moved (lowest()).
  if (k.last_rebalanced_ms <= now_ms_ - options_.kernel_cooldown_ms) {
    moving_.push_back(&k);
  } else {
    choice_.quiet_until_ms =
        std::min(choice_.quiet_until_ms, k.last_rebalanced_ms + options_.kernel_cooldown_ms);
  }
}

// The most recently active kernels are the likeliest to run a cell soon (notebook cells come in
// bursts), so they move first when the bound cuts the list; a forecast says it better. Covering a
// kernel comes before sparing a whole server.
void RebalanceDecision::SortMoving() {
  auto key = [&](const IdleKernel* k) {
    return std::make_tuple(sparing_.contains(k), -k->return_chance, -k->last_active_ms,
                           std::string_view(k->kernel->kernel_id));
  };
  std::sort(moving_.begin(), moving_.end(),
            [&](const IdleKernel* a, const IdleKernel* b) { return key(a) < key(b); });
}

void RebalanceDecision::CountReplicas() {
  for (const auto& [id, kernel] : cluster_.kernels()) {
    for (const ReplicaView& r : kernel.replicas) ++replicas_on_[r.server_id];
  }
}

int32_t RebalanceDecision::ReplicasOn(std::string_view server_id) const {
  const auto it = replicas_on_.find(server_id);
  return it == replicas_on_.end() ? 0 : it->second;
}

void RebalanceDecision::PlanMoves() {
  bool without_target = false;
  // A kernel listed twice (for its cover and for a whole server) moves one replica per call.
  for (const IdleKernel* k : moving_) {
    if (static_cast<int32_t>(choice_.plans.size()) >= options_.max_per_tick) {
      choice_.quiet_until_ms = now_ms_;  // cut by the bound: the next call has work
      break;
    }
    if (planned_.contains(k->kernel)) continue;
    Roomy* target = ChooseTarget(*k);
    if (target == nullptr) target = MakeRoom(*k);
    if (target == nullptr) {
      without_target = true;
      continue;
    }
    const ReplicaView* moving = ChooseReplica(*k->kernel);
    if (moving == nullptr) continue;  // a kernel without replicas has nothing to move
    AddPlan(*k, *target, *moving);
  }
  // A kernel may have lacked a target only because this decision's own plans took the room; if
  // the caller drops those plans, the next call may differ.
  if (without_target && !choice_.plans.empty()) choice_.quiet_until_ms = now_ms_;
}

// Whether `r` would be a target for `k` were there room on it; sets *releasable.
bool RebalanceDecision::MayCover(const IdleKernel& k, const Roomy& r, bool* releasable) const {
  const ServerView& server = *r.server;
  if (excluded_servers_.contains(server.server_id) || server.IdleGpus() < k.gpus_needed ||
      k.kernel->HasReplicaOn(server.server_id) ||
      (sparing_.contains(&k) && server.committed.gpus == 0)) {
    return false;
  }
  // A target the auto-scaler could release once idle: a replica there would keep it. Pinning
  // such a server pays only for a kernel likely to run a cell soon; a long-idle one waits for
  // a server that is kept anyway.
  *releasable = spare_ && ReplicasOn(server.server_id) <= options_.spare_servers_max_replicas;
  return !*releasable || MayPinReleasable(k, now_ms_, options_);
}

Roomy* RebalanceDecision::ChooseTarget(const IdleKernel& k) {
  const KernelView& kernel = *k.kernel;
  using TargetKey = std::tuple<bool, double, int32_t, int32_t, double, std::string_view>;
  Roomy* target = nullptr;
  TargetKey best_target;
  for (Roomy& r : roomy_) {
    const ServerView& server = *r.server;
    bool releasable = false;
    if (!MayCover(k, r, &releasable) || !FitsWithPlanned(r, kernel.request)) continue;
    TargetKey key{releasable,
                  contention_ ? r.relied_chance : 0.0,
                  r.relied,
                  server.IdleGpus() - k.gpus_needed,
                  HostSubscriptionRatio(server, r.added),
                  std::string_view(server.server_id)};
    if (target == nullptr || key < best_target) {
      target = &r;
      best_target = key;
    }
  }
  return target;
}

// Lower key = better replica to move. The last executor stays if another can go: its server
// holds the kernel's GPU-warm state. A source that moving one replica off makes releasable goes
// before others.
const ReplicaView* RebalanceDecision::ChooseReplica(const KernelView& kernel) const {
  using ReplicaKey = std::tuple<bool, bool, bool, double, int32_t, uint32_t>;
  const ReplicaView* moving = nullptr;
  ReplicaKey best_replica;
  for (const ReplicaView& r : kernel.replicas) {
    const ServerView* server = cluster_.FindServer(r.server_id);
    const bool doomed = server == nullptr || !server->accepting;
    const bool one_over_releasable =
        spare_ && ReplicasOn(r.server_id) == options_.spare_servers_max_replicas + 1;
    ReplicaKey key{!doomed,
                   r.replica_id == kernel.last_executor,
                   doomed || !one_over_releasable,
                   doomed ? 0.0 : -HostSubscriptionRatio(*server),
                   doomed ? 0 : server->IdleGpus(),
                   r.replica_id};
    if (moving == nullptr || key < best_replica) {
      moving = &r;
      best_replica = key;
    }
  }
  return moving;
}

void RebalanceDecision::AddPlan(const IdleKernel& k, Roomy& target, const ReplicaView& moving) {
  const KernelView& kernel = *k.kernel;
  const bool sparing = sparing_.contains(&k);
  PushPlan(
      kernel, moving, target.server->server_id,
      "proactive: " +
          std::string(sparing ? "only wholly idle replica servers of" : "no replica server of") +
          " kernel '" + kernel.kernel_id + (sparing ? "' have " : "' has ") +
          std::to_string(k.gpus_needed) + " idle GPUs; " + target.server->server_id + " has " +
          std::to_string(target.server->IdleGpus()));
  ++target.relied;
  target.relied_chance += std::max(k.return_chance, 0.0);
  target.added += kernel.request;
}

// What every plan does to this decision's view: the kernel has moved, the replica counts follow
// it, and the next call has work once the kernel's cooldown ends.
void RebalanceDecision::PushPlan(const KernelView& kernel, const ReplicaView& moving,
                                 const std::string& to_server_id, std::string reason) {
  RebalancePlan plan;
  plan.kernel_id = kernel.kernel_id;
  plan.plan.replica_id = moving.replica_id;
  plan.plan.from_server_id = moving.server_id;
  plan.plan.to_server_id = to_server_id;
  plan.plan.reason = std::move(reason);
  choice_.plans.push_back(std::move(plan));
  planned_.insert(&kernel);
  if (spare_) {
    ++replicas_on_[to_server_id];
    --replicas_on_[moving.server_id];
  }
  choice_.quiet_until_ms = std::min(choice_.quiet_until_ms, now_ms_ + options_.kernel_cooldown_ms);
}

// The likeliest kernels found the servers that would cover them full of the replicas of kernels
// that ran cells there long ago; one of those gives up its place (make_room_chance_ratio).
Roomy* RebalanceDecision::MakeRoom(const IdleKernel& k) {
  if (options_.make_room_chance_ratio < 0 || k.return_chance <= 0 ||
      static_cast<int32_t>(choice_.plans.size()) + 2 > options_.max_per_tick) {
    return nullptr;
  }
  IndexEvictees();
  const double max_chance = k.return_chance * options_.make_room_chance_ratio;
  Roomy* from = nullptr;
  Evictee evictee{};
  for (Roomy& r : roomy_) {
    bool releasable = false;
    if (r.evictees.empty() || r.evictees.front().first->return_chance > max_chance ||
        !MayCover(k, r, &releasable) || FitsWithPlanned(r, k.kernel->request)) {
      continue;
    }
    for (const Evictee& e : r.evictees) {
      if (e.first->return_chance > max_chance) break;
      if (planned_.contains(e.first->kernel)) continue;
      if (!FitsWith(*r.server, r.added - e.first->kernel->request, k.kernel->request)) continue;
      if (from == nullptr || EvictionKey(e) < EvictionKey(evictee)) {
        from = &r;
        evictee = e;
      }
      break;  // the first that fits is this server's best
    }
  }
  if (from == nullptr) return nullptr;
  const ServerView* refuge = ChooseRefuge(*evictee.first);
  if (refuge == nullptr) return nullptr;
  AddEviction(*evictee.first, *evictee.second, *from, *refuge, k);
  return from;
}

void RebalanceDecision::IndexEvictees() {
  if (evictees_indexed_) return;
  evictees_indexed_ = true;
  // A kernel may be listed twice (for its cover and for a whole server): its likeliest entry.
  std::map<const KernelView*, const IdleKernel*> likeliest;
  for (const IdleKernel& k : *idle_) {
    const IdleKernel*& entry = likeliest[k.kernel];
    if (entry == nullptr || k.return_chance > entry->return_chance) entry = &k;
  }
  for (const auto& [kernel, k] : likeliest) {
    if (k->return_chance < 0 || k->last_rebalanced_ms > now_ms_ - options_.kernel_cooldown_ms) {
      continue;
    }
    for (const ReplicaView& replica : kernel->replicas) {
      if (Roomy* r = FindRoomy(replica.server_id); r != nullptr)
        r->evictees.emplace_back(k, &replica);
    }
  }
  for (Roomy& r : roomy_) {
    std::sort(r.evictees.begin(), r.evictees.end(),
              [](const Evictee& a, const Evictee& b) { return EvictionKey(a) < EvictionKey(b); });
  }
}

const ServerView* RebalanceDecision::ChooseRefuge(const IdleKernel& evictee) {
  const KernelView& kernel = *evictee.kernel;
  using RefugeKey = std::tuple<bool, double, std::string_view>;
  const ServerView* refuge = nullptr;
  RefugeKey best;
  for (const auto& [id, server] : cluster_.servers()) {
    if (!server.accepting || excluded_servers_.contains(id) || kernel.HasReplicaOn(id)) continue;
    const Roomy* r = FindRoomy(id);
    const auto elsewhere = added_elsewhere_.find(id);
    const Resources added = r != nullptr                          ? r->added
                            : elsewhere != added_elsewhere_.end() ? elsewhere->second
                                                                  : Resources{};
    if (!FitsWith(server, added, kernel.request)) continue;
    if (spare_ && ReplicasOn(id) <= options_.spare_servers_max_replicas &&
        !MayPinReleasable(evictee, now_ms_, options_)) {
      continue;
    }
    const RefugeKey key{server.committed.gpus == 0, HostSubscriptionRatio(server, added),
                        std::string_view(id)};
    if (refuge == nullptr || key < best) {
      refuge = &server;
      best = key;
    }
  }
  return refuge;
}

void RebalanceDecision::AddEviction(const IdleKernel& evictee, const ReplicaView& moving,
                                    Roomy& from, const ServerView& to,
                                    const IdleKernel& for_kernel) {
  const KernelView& kernel = *evictee.kernel;
  PushPlan(kernel, moving, to.server_id,
           "proactive: makes room on " + from.server->server_id + " for kernel '" +
               for_kernel.kernel->kernel_id + "', likelier to run a cell soon");
  from.added -= kernel.request;
  if (Roomy* r = FindRoomy(to.server_id); r != nullptr) {
    r->added += kernel.request;
  } else {
    added_elsewhere_[to.server_id] += kernel.request;
  }
}

}  // namespace

RebalanceChoice ChooseRebalance(const ClusterState& cluster, const std::vector<IdleKernel>& idle,
                                int64_t now_ms, const RebalanceOptions& options,
                                const std::set<std::string, std::less<>>& excluded_servers) {
  if (!options.enabled || options.max_per_tick <= 0) return {};
  RebalanceDecision decision(cluster, now_ms, options, excluded_servers);
  decision.FindKernelsToMove(idle);
  decision.PlanMoves();
  return std::move(decision).Take();
}

}  // namespace nbos::sched
