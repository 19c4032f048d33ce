#include "sched/scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include "common/check.h"
#include "common/overloaded.h"

namespace nbos::sched {

namespace {}  // namespace

std::string_view EventName(const SchedulerEvent& event) {
  static constexpr std::string_view kNames[] = {"server_joined",
                                                "server_updated",
                                                "server_left",
                                                "server_accepting",
                                                "placement",
                                                "kernel_placed",
                                                "kernel_removed",
                                                "replica_added",
                                                "replica_removed",
                                                "executor",
                                                "grant_committed",
                                                "grant_released",
                                                "move",
                                                "tick"};
  static_assert(std::size(kNames) == std::variant_size_v<SchedulerEvent>);
  return kNames[event.index()];
}

Scheduler::Scheduler(SchedulerOptions options)
    : options_(std::move(options)),
      ratio_(options_.max_subscription_ratio, static_cast<size_t>(options_.ratio_window)) {
  NBOS_CHECK(options_.max_subscription_ratio > 0 && options_.ratio_window > 0,
             "scheduler options: the subscription ratio and its window must be positive");
  NBOS_CHECK(options_.scaling.gpus_per_host > 0,
             "scheduler options: GPUs per host must be positive");
}

SchedulerOutcome Scheduler::Apply(int64_t now_ms, const SchedulerEvent& event) {
  NBOS_CHECK(now_ms >= last_event_ms_, "time must not go backwards");
  last_event_ms_ = now_ms;
  SchedulerOutcome outcome = Handle(event);
  if (outcome.status.ok()) {
    NoteEvent(event);
    if (!std::holds_alternative<Tick>(event)) rebalance_stale_ = true;
  }
  if (observer_ != nullptr) observer_->OnEvent(now_ms, event, outcome);
  return outcome;
}

SchedulerOutcome Scheduler::Handle(const SchedulerEvent& event) {
  auto status_only = [](Status s) { return SchedulerOutcome{std::move(s), std::monostate{}}; };
  auto from_result = [](auto result) {
    if (!result.ok()) return SchedulerOutcome{result.status(), std::monostate{}};
    return SchedulerOutcome{Status::Ok(), std::move(result).value()};
  };
  return std::visit(
      Overloaded{
          [&](const ServerJoined& e) { return status_only(cluster_.AddServer(e.server)); },
          [&](const ServerUpdated& e) { return status_only(cluster_.UpdateServer(e.server)); },
          [&](const ServerLeft& e) { return status_only(cluster_.RemoveServer(e.server_id)); },
          [&](const ServerAcceptingChanged& e) {
            return status_only(cluster_.SetAccepting(e.server_id, e.accepting));
          },
          [&](const PlacementRequested& e) { return from_result(Place(e)); },
          [&](const KernelPlaced& e) { return status_only(cluster_.AddKernel(e.kernel)); },
          [&](const KernelRemoved& e) { return status_only(cluster_.RemoveKernel(e.kernel_id)); },
          [&](const ReplicaAdded& e) {
            return status_only(cluster_.AddReplica(e.kernel_id, e.replica_id, e.server_id));
          },
          [&](const ReplicaRemoved& e) {
            return status_only(cluster_.RemoveReplica(e.kernel_id, e.replica_id));
          },
          [&](const ExecutorRequested& e) { return from_result(ExecuteInTurn(e)); },
          [&](const GrantCommitted& e) {
            // Validate the replica before committing so that a rejected grant changes nothing.
            const KernelView* kernel = nullptr;
            if (e.replica_id != 0) {
              kernel = cluster_.FindKernel(e.kernel_id);
              if (kernel == nullptr)
                return status_only(NotFound("no kernel '" + e.kernel_id + "'"));
              const ReplicaView* r = kernel->FindReplica(e.replica_id);
              if (r == nullptr || r->server_id != e.server_id) {
                return status_only(InvalidArgument("kernel '" + e.kernel_id + "' has no replica " +
                                                   std::to_string(e.replica_id) + " on server '" +
                                                   e.server_id + "'"));
              }
            }
            if (Status s = cluster_.Commit(e.server_id, e.resources); !s.ok()) {
              return status_only(std::move(s));
            }
            if (kernel != nullptr) {
              Status s = cluster_.SetLastExecutor(e.kernel_id, e.replica_id);
              NBOS_CHECK(s.ok(), "the kernel and its replica were found above");
            }
            return status_only(Status::Ok());
          },
          [&](const GrantReleased& e) {
            return status_only(cluster_.Release(e.server_id, e.resources));
          },
          [&](const MoveRequested& e) { return from_result(Move(e)); },
          [&](const Tick&) {
            return SchedulerOutcome{Status::Ok(), DoTick()};
          },
      },
      event);
}

Result<Placement> Scheduler::Place(const PlacementRequested& request) const {
  PlacementOptions options;
  options.replicas = request.replicas;
  options.excluded_servers = request.excluded_servers;
  options.ignore_ratio_if_no_scale_out = !request.can_scale_out;
  if (request.require_idle_gpus) {
    // Binding at placement: the GPUs must be idle now, which already bounds what a server holds,
    // so the oversubscription ceiling has nothing to add.
    options.cluster_ratio = std::numeric_limits<double>::infinity();
    for (const auto& [id, server] : cluster_.servers()) {
      if (server.IdleGpus() < request.request.gpus) options.excluded_servers.insert(id);
    }
  } else {
    options.cluster_ratio = ratio_.value();
  }
  return PlaceKernel(cluster_, request.request, options);
}

Result<ExecutorDecision> Scheduler::Execute(const ExecutorRequested& request) const {
  const KernelView* kernel = cluster_.FindKernel(request.kernel_id);
  if (kernel == nullptr) return NotFound("no kernel '" + request.kernel_id + "'");
  const int32_t gpus = request.gpus < 0 ? kernel->request.gpus : request.gpus;
  ExecutorDecision decision;
  decision.choice = ChooseExecutor(cluster_, *kernel, gpus, request.excluded_replicas,
                                   request.target_replica, options_.pack_gpus);
  if (decision.choice.candidates.empty() && gpus > 0) {
    Result<MigrationPlan> plan = ChooseMigration(cluster_, *kernel, gpus, request.warm_servers,
                                                 request.excluded_replicas, options_.pack_gpus);
    if (!plan.ok()) return plan.status();
    decision.migration = std::move(plan).value();
  }
  return decision;
}

Result<ExecutorDecision> Scheduler::ExecuteInTurn(const ExecutorRequested& request) {
  const KernelView* kernel = cluster_.FindKernel(request.kernel_id);
  if (kernel == nullptr) return NotFound("no kernel '" + request.kernel_id + "'");
  const int32_t gpus = request.gpus < 0 ? kernel->request.gpus : request.gpus;
  gpu_waiters_.Expire(last_event_ms_, options_.gpu_wait_expiry_ms);
  if (gpus <= 0) {
    gpu_waiters_.Leave(request.kernel_id);
    return Execute(request);
  }
  // The holds are committed for the choice only, so that executor and migration-target choice
  // both see them as busy GPUs, and given back before anything else sees the cluster.
  const auto held = gpu_waiters_.HeldAhead(cluster_, request.kernel_id);
  for (const auto& [server_id, n] : held) {
    NBOS_CHECK(cluster_.Commit(server_id, Resources{0, 0, n, 0}).ok(),
               "a hold never exceeds the server's idle GPUs");
  }
  Result<ExecutorDecision> decision = Execute(request);
  if (decision.ok()) SpareCovers(request.kernel_id, gpus, &decision->choice);
  for (const auto& [server_id, n] : held) {
    NBOS_CHECK(cluster_.Release(server_id, Resources{0, 0, n, 0}).ok(),
               "the hold was committed just above");
  }
  if (decision.ok()) {
    gpu_waiters_.Ask(request.kernel_id, gpus, request.excluded_replicas, last_event_ms_);
  }
  return decision;
}

Result<MigrationPlan> Scheduler::Move(const MoveRequested& request) const {
  const KernelView* kernel = cluster_.FindKernel(request.kernel_id);
  if (kernel == nullptr) return NotFound("no kernel '" + request.kernel_id + "'");
  std::set<uint32_t> fixed;
  if (request.replica_id != 0) {
    if (kernel->FindReplica(request.replica_id) == nullptr) {
      return NotFound("kernel '" + request.kernel_id + "' has no replica " +
                      std::to_string(request.replica_id));
    }
    for (const ReplicaView& r : kernel->replicas) {
      if (r.replica_id != request.replica_id) fixed.insert(r.replica_id);
    }
  }
  Result<MigrationPlan> plan =
      ChooseMigration(cluster_, *kernel, 0, request.warm_servers, fixed, options_.pack_gpus);
  if (!plan.ok() || request.to_server_id.empty()) return plan;
  const ServerView* to = cluster_.FindServer(request.to_server_id);
  if (to == nullptr) return NotFound("no server '" + request.to_server_id + "'");
  if (!to->accepting) {
    return InvalidArgument("server '" + request.to_server_id + "' does not accept replicas");
  }
  for (const ReplicaView& r : kernel->replicas) {
    if (r.server_id == request.to_server_id) {
      return InvalidArgument("server '" + request.to_server_id + "' already holds replica " +
                             std::to_string(r.replica_id) + " of kernel '" + request.kernel_id +
                             "'");
    }
  }
  plan->to_server_id = request.to_server_id;
  plan->target_warm = request.warm_servers.count(request.to_server_id) > 0;
  plan->scale_out_needed = false;
  plan->reason.clear();
  return plan;
}

TickDecision Scheduler::DoTick() {
  ratio_.AddSample(cluster_);
  TickDecision tick;
  tick.cluster_ratio = ratio_.value();
  tick.demand_gpus = cluster_.DemandGpus();
  tick.busy_gpus = cluster_.TotalCommitted().gpus;
  // How many whole-server cells come within the horizon: a sum of independent Bernoulli
  // variables, one per idle kernel, of this mean and variance.
  double whole_cells_mean = 0;
  double whole_cells_variance = 0;
  if (options_.forecast.enabled) {
    for (auto& [id, a] : activity_) {
      if (a.committed_gpus > 0 || a.executor_pending) continue;
      // next_need is set from placement on, so no kernel lookup is needed here.
      const double chance = ReturnChanceOf(a);
      tick.forecast_gpus += chance * a.next_need.expected_gpus;
      const double whole = chance * a.next_need.whole_chance;
      whole_cells_mean += whole;
      whole_cells_variance += whole * (1 - whole);
    }
    if (options_.forecast.idle_servers_z >= 0) {
      tick.idle_servers_wanted = static_cast<int32_t>(
          std::ceil(whole_cells_mean +
                    options_.forecast.idle_servers_z * std::sqrt(whole_cells_variance) - 1e-9));
    }
  }
  if (options_.auto_scaling && ratio_.window_full()) {
    tick.scaling_evaluated = true;
    tick.scaling = Scale({tick.forecast_gpus, tick.idle_servers_wanted});
  }
  if (options_.rebalance.enabled &&
      (rebalance_stale_ || last_event_ms_ >= rebalance_quiet_until_ms_ ||
       tick.scaling.release_server_ids != rebalance_excluded_)) {
    const std::vector<IdleKernel> idle = IdleKernels();
    const std::set<std::string, std::less<>> releasing(tick.scaling.release_server_ids.begin(),
                                                       tick.scaling.release_server_ids.end());
    RebalanceChoice choice =
        ChooseRebalance(cluster_, idle, last_event_ms_, options_.rebalance, releasing);
    tick.rebalance = std::move(choice.plans);
    rebalance_stale_ = false;
    rebalance_quiet_until_ms_ = choice.quiet_until_ms;
    // The release candidates shape the choice and can change without an event (the ratio
    // window), so a change of them also calls for a new choice.
    rebalance_excluded_ = tick.scaling.release_server_ids;
    for (const RebalancePlan& p : tick.rebalance) {
      activity_[p.kernel_id].last_rebalanced_ms = last_event_ms_;
    }
  }
  return tick;
}

std::vector<IdleKernel> Scheduler::IdleKernels() {
  std::vector<IdleKernel> idle;
  const int32_t server_gpus = options_.scaling.gpus_per_host;
  for (auto& [id, a] : activity_) {
    if (a.committed_gpus > 0 || a.executor_pending) continue;
    const KernelView* kernel = cluster_.FindKernel(id);
    NBOS_CHECK(kernel != nullptr, "activity is kept for placed kernels only");
    if (!options_.forecast.enabled) {
      // The last cell's GPU count predicts the next one better than the request (the session's
      // largest cell): moving an 8-GPU kernel whose cells now take 1 GPU would only churn.
      const int32_t gpus = a.last_cell_gpus >= 0 ? a.last_cell_gpus : kernel->request.gpus;
      idle.push_back({kernel, gpus, a.last_active_ms, a.last_rebalanced_ms, -1.0});
      continue;
    }
    // With the forecast, the most the next cell needs with a fair chance (a 1-GPU cell is often
    // followed by an 8-GPU one).
    const GpuNeed need = NeedOf(a, *kernel);
    const double chance = ReturnChanceOf(a);
    idle.push_back({kernel, need.cover_gpus, a.last_active_ms, a.last_rebalanced_ms, chance});
    // A kernel that may well need a whole server soon, though less likely than its cover, is
    // kept next to one too: the idle servers auto-scaling keeps are there for such cells.
    const double whole_min = options_.forecast.whole_cover_min_chance;
    if (whole_min >= 0 && need.cover_gpus < server_gpus &&
        chance * need.whole_chance >= whole_min) {
      idle.push_back({kernel, server_gpus, a.last_active_ms, a.last_rebalanced_ms, chance});
    }
  }
  return idle;
}

ScalingDecision Scheduler::Scale(const ScalingForecast& forecast) {
  if (!options_.forecast.enabled || options_.scaling.release_max_pinning_replicas < 0) {
    return DecideScaling(cluster_, options_.scaling, forecast);
  }
  // Counted on first use only: most ticks release nothing and never ask.
  std::map<std::string_view, int32_t> relied;
  bool counted = false;
  const PinningCount pinning = [&](const ServerView& server) {
    if (!counted) {
      relied = ReliedOn();
      counted = true;
    }
    const auto it = relied.find(server.server_id);
    return it == relied.end() ? 0 : it->second;
  };
  return DecideScaling(cluster_, options_.scaling, forecast, &pinning);
}

std::map<std::string_view, int32_t> Scheduler::ReliedOn() {
  std::map<std::string_view, int32_t> relied;
  for (auto& [id, a] : activity_) {
    // A busy kernel gets its own GPUs back when its cell ends; an unlikely one may wait (its
    // replicas move off a released server, and rebalancing covers it again if it comes back).
    if (a.committed_gpus > 0 || a.executor_pending) continue;
    if (ReturnChanceOf(a) < options_.forecast.pin_min_chance) continue;
    const KernelView* kernel = cluster_.FindKernel(id);
    NBOS_CHECK(kernel != nullptr, "activity is kept for placed kernels only");
    const int32_t need = NeedOf(a, *kernel).cover_gpus;
    // Scale-in takes only wholly idle servers, so a kernel covered by a busy one keeps its
    // cover. Otherwise one of its covering servers is pinned: the one scale-in would take last
    // (most subscribed), so that a round releasing several never takes all of them.
    const ServerView* kept = nullptr;
    bool covered_by_busy = false;
    for (const ReplicaView& r : kernel->replicas) {
      const ServerView* server = cluster_.FindServer(r.server_id);
      if (server == nullptr || !server->accepting || server->IdleGpus() < need) continue;
      covered_by_busy = covered_by_busy || server->committed.gpus > 0;
      if (kept == nullptr || ReleaseOrder(*server) > ReleaseOrder(*kept)) kept = server;
    }
    // One covered by none is rebalancing's to move, and pins nothing.
    if (kept != nullptr && !covered_by_busy) ++relied[kept->server_id];
  }
  return relied;
}

void Scheduler::SpareCovers(const std::string& kernel_id, int32_t gpus, ExecutorChoice* choice) {
  const double min_chance = options_.forecast.spare_cover_min_chance;
  if (!options_.forecast.enabled || min_chance < 0 || choice->candidates.size() < 2) return;
  std::vector<LikelyKernel> likely;
  for (auto& [id, a] : activity_) {
    if (id == kernel_id || a.committed_gpus > 0 || a.executor_pending) continue;
    const double chance = ReturnChanceOf(a);
    if (chance < min_chance) continue;
    const KernelView* kernel = cluster_.FindKernel(id);
    NBOS_CHECK(kernel != nullptr, "activity is kept for placed kernels only");
    likely.push_back({kernel, NeedOf(a, *kernel).cover_gpus, chance});
  }
  SpareSoleCovers(cluster_, *cluster_.FindKernel(kernel_id), gpus, likely, choice);
}

double Scheduler::ReturnChanceOf(KernelActivity& activity) {
  const int64_t idle_ms = last_event_ms_ - activity.last_active_ms;
  const int bin = GapDistribution::BinOf(idle_ms);
  if (bin != activity.chance_bin || activity.chance_since_ms != activity.last_active_ms) {
    activity.chance = ReturnChance(gap_population_, activity.gaps, week_profile_, last_event_ms_,
                                   idle_ms, options_.forecast);
    activity.chance_bin = bin;
    activity.chance_since_ms = activity.last_active_ms;
  }
  return activity.chance;
}

GpuNeed Scheduler::NeedOf(const KernelActivity& activity, const KernelView& kernel) const {
  if (activity.next_need.cover_gpus >= 0) return activity.next_need;
  const int32_t last = activity.last_cell_gpus >= 0 ? activity.last_cell_gpus : kernel.request.gpus;
  return NextNeed(need_population_, activity.needs, last, options_.forecast,
                  options_.scaling.gpus_per_host);
}

void Scheduler::NoteGap(KernelActivity& activity, bool returned) {
  // Only a kernel idle (nothing granted, nothing asked for) is in a gap; a cell queued behind a
  // running one is asked for as that one ends, a gap of 0.
  if (!options_.forecast.enabled || activity.committed_gpus > 0 || activity.executor_pending) {
    return;
  }
  if (!returned) {
    gap_population_.ObserveNeverReturned();
    return;
  }
  const int64_t gap_ms = std::max<int64_t>(last_event_ms_ - activity.last_active_ms, 0);
  gap_population_.Observe(gap_ms);
  activity.gaps.Add(gap_ms, options_.forecast.kernel_history);
  week_profile_.Observe(last_event_ms_);
}

void Scheduler::NoteEvent(const SchedulerEvent& event) {
  const int64_t now_ms = last_event_ms_;
  auto touch = [&](const std::string& kernel_id) -> KernelActivity* {
    const auto it = activity_.find(kernel_id);
    if (it == activity_.end()) return nullptr;
    it->second.last_active_ms = now_ms;
    return &it->second;
  };
  std::visit(
      Overloaded{
          [&](const KernelPlaced& e) {
            KernelActivity& a = activity_[e.kernel.kernel_id];
            a = KernelActivity{.last_active_ms = now_ms};
            if (options_.forecast.enabled) {
              a.next_need = NextNeed(need_population_, a.needs, e.kernel.request.gpus,
                                     options_.forecast, options_.scaling.gpus_per_host);
            }
          },
          [&](const KernelRemoved& e) {
            if (const auto it = activity_.find(e.kernel_id); it != activity_.end()) {
              NoteGap(it->second, /*returned=*/false);
            }
            activity_.erase(e.kernel_id);
            gpu_waiters_.Leave(e.kernel_id);
          },
          [&](const ExecutorRequested& e) {
            if (const auto it = activity_.find(e.kernel_id); it != activity_.end()) {
              NoteGap(it->second, /*returned=*/true);
            }
            KernelActivity* a = touch(e.kernel_id);
            if (a == nullptr) return;
            const KernelView* k = cluster_.FindKernel(e.kernel_id);
            const int32_t gpus = e.gpus < 0 ? k->request.gpus : e.gpus;
            // A new cell (not a waiting one asking again) after an earlier one.
            if (options_.forecast.enabled && !a->executor_pending && a->last_cell_gpus >= 0) {
              need_population_.Observe(a->last_cell_gpus, gpus);
              a->needs.Observe(a->last_cell_gpus, gpus);
            }
            a->last_cell_gpus = gpus;
            if (options_.forecast.enabled) {
              a->next_need = NextNeed(need_population_, a->needs, gpus, options_.forecast,
                                      options_.scaling.gpus_per_host);
            }
            // A GPU-less cell gets no grant, so it would never clear the flag.
            a->executor_pending = a->last_cell_gpus > 0;
          },
          [&](const GrantCommitted& e) {
            gpu_waiters_.Leave(e.kernel_id);
            if (KernelActivity* a = touch(e.kernel_id)) {
              a->committed_gpus += e.resources.gpus;
              a->executor_pending = false;
            }
          },
          [&](const GrantReleased& e) {
            if (KernelActivity* a = touch(e.kernel_id)) {
              a->committed_gpus -= std::min(a->committed_gpus, e.resources.gpus);
            }
          },
          [](const auto&) {},
      },
      event);
}

// ---- Typed conveniences -----------------------------------------------------------------------

Status Scheduler::OnServerJoined(int64_t now_ms, ServerView server) {
  return Apply(now_ms, ServerJoined{std::move(server)}).status;
}
Status Scheduler::OnServerUpdated(int64_t now_ms, ServerView server) {
  return Apply(now_ms, ServerUpdated{std::move(server)}).status;
}
Status Scheduler::OnServerLeft(int64_t now_ms, std::string server_id) {
  return Apply(now_ms, ServerLeft{std::move(server_id)}).status;
}
Status Scheduler::OnServerAccepting(int64_t now_ms, std::string server_id, bool accepting) {
  return Apply(now_ms, ServerAcceptingChanged{std::move(server_id), accepting}).status;
}
Result<Placement> Scheduler::RequestPlacement(int64_t now_ms, PlacementRequested request) {
  SchedulerOutcome out = Apply(now_ms, std::move(request));
  if (!out.status.ok()) return out.status;
  return std::get<Placement>(std::move(out.decision));
}
Status Scheduler::OnKernelPlaced(int64_t now_ms, KernelView kernel) {
  return Apply(now_ms, KernelPlaced{std::move(kernel)}).status;
}
Status Scheduler::OnKernelRemoved(int64_t now_ms, std::string kernel_id) {
  return Apply(now_ms, KernelRemoved{std::move(kernel_id)}).status;
}
Status Scheduler::OnReplicaAdded(int64_t now_ms, std::string kernel_id, uint32_t replica_id,
                                 std::string server_id) {
  return Apply(now_ms, ReplicaAdded{std::move(kernel_id), replica_id, std::move(server_id)}).status;
}
Status Scheduler::OnReplicaRemoved(int64_t now_ms, std::string kernel_id, uint32_t replica_id) {
  return Apply(now_ms, ReplicaRemoved{std::move(kernel_id), replica_id}).status;
}
Result<ExecutorDecision> Scheduler::RequestExecutor(int64_t now_ms, ExecutorRequested request) {
  SchedulerOutcome out = Apply(now_ms, std::move(request));
  if (!out.status.ok()) return out.status;
  return std::get<ExecutorDecision>(std::move(out.decision));
}
Status Scheduler::OnGrantCommitted(int64_t now_ms, GrantCommitted grant) {
  return Apply(now_ms, std::move(grant)).status;
}
Status Scheduler::OnGrantReleased(int64_t now_ms, GrantReleased grant) {
  return Apply(now_ms, std::move(grant)).status;
}
Result<MigrationPlan> Scheduler::RequestMove(int64_t now_ms, MoveRequested request) {
  SchedulerOutcome out = Apply(now_ms, std::move(request));
  if (!out.status.ok()) return out.status;
  return std::get<MigrationPlan>(std::move(out.decision));
}
TickDecision Scheduler::OnTick(int64_t now_ms) {
  return std::get<TickDecision>(Apply(now_ms, Tick{}).decision);
}

}  // namespace nbos::sched
