// Scheduler: the event facade over the pure scheduling core (DESIGN §5). It owns a ClusterState,
// a SubscriptionRatio and the policy options; callers (the live gateway on a real clock, `nbos
// sim` on a virtual one) feed it events and act on the decisions it returns. Deterministic: the
// same options and the same event sequence give the same decisions. No clock, no I/O, no
// randomness; every event carries the caller's time in ms and every id comes from the caller.
//
// Every event can also be applied through the one entry point Apply(now_ms, SchedulerEvent),
// which is what the typed methods do; an optional SchedulerObserver sees each (event, outcome)
// pair, so a journal of a run can be replayed through a fresh Scheduler (journal.h).
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/status.h"
#include "sched/cluster.h"
#include "sched/executor.h"
#include "sched/forecast.h"
#include "sched/gpu_waiters.h"
#include "sched/migration.h"
#include "sched/placement.h"
#include "sched/rebalance.h"
#include "sched/scaling.h"
#include "sched/subscription.h"

namespace nbos::sched {

struct SchedulerOptions {
  double max_subscription_ratio = kDefaultMaxSubscriptionRatio;  // SR_c cap, > 0
  int32_t ratio_window = 5;                                      // SR_c samples, > 0
  // Tick() decides auto-scaling only when set. Scale decisions wait for a full ratio window (the
  // reference's canScaleIn), so the first ratio_window - 1 ticks only sample.
  bool auto_scaling = true;
  ScalingOptions scaling;
  // Executor and migration-target choice pack cells by best fit and keep wholly idle servers for
  // whole-server cells (executor.h, migration.h). Off by default (the gateway's behaviour: most
  // idle GPUs first); `nbos sim` turns it on for notebookos.
  bool pack_gpus = false;
  // Proactive rebalancing of idle kernels on Tick (rebalance.h). Off by default: the gateway
  // ignores TickDecision::rebalance; `nbos sim` turns it on for notebookos.
  RebalanceOptions rebalance;
  // Demand forecast from session state (forecast.h). When enabled, each tick adds the GPUs idle
  // kernels are expected to ask for within forecast.horizon_ms to the load that auto-scaling
  // sizes the cluster for, and rebalancing moves the kernels likeliest to run a cell soon first.
  // With scaling.release_max_pinning_replicas >= 0, scale-in also keeps the idle servers that
  // likely idle kernels rely on for their next cell's GPUs (ReliedOn), and may release others
  // whatever replicas they hold.
  // Off by default (the gateway's behaviour); `nbos sim` turns it on for notebookos.
  ForecastOptions forecast;
  // Cells waiting for GPUs are served first come, first served (gpu_waiters.h); a waiter that has
  // not asked again for this long loses its place. 0: never (`nbos sim`, whose waiting cells
  // always run in the end); the gateway, which asks again every few tens of ms, sets a bound so
  // that a cell given up while waiting (interrupted, failed) stops holding GPUs back.
  int64_t gpu_wait_expiry_ms = 0;
};

// ---- Inputs -----------------------------------------------------------------------------------

struct ServerJoined {
  ServerView server;  // subscribed must be zero (derived)
};
struct ServerUpdated {
  ServerView server;  // spec, committed, accepting replaced
};
struct ServerLeft {
  std::string server_id;
};
struct ServerAcceptingChanged {
  std::string server_id;
  bool accepting = true;
};

// A kernel (or replacement replicas of one) needs servers.
struct PlacementRequested {
  std::string kernel_id;
  Resources request;  // per replica
  int32_t replicas = kReplicasPerKernel;
  std::set<std::string, std::less<>> excluded_servers;
  // False when the cluster cannot grow (at max size): place over SR_c instead of asking for
  // scale-out (PlacementOptions::ignore_ratio_if_no_scale_out).
  bool can_scale_out = true;
  // Bind-at-placement policies (one replica that holds its GPUs, a batch container): only servers
  // with >= request.gpus idle GPUs are eligible, and SR_c does not apply.
  bool require_idle_gpus = false;
};

struct KernelPlaced {
  KernelView kernel;  // replicas recorded; becomes part of demand
};
struct KernelRemoved {
  std::string kernel_id;
};
struct ReplicaAdded {  // migration step 1: the new member joins
  std::string kernel_id;
  uint32_t replica_id = 0;
  std::string server_id;
};
struct ReplicaRemoved {  // migration step 2: the old member leaves
  std::string kernel_id;
  uint32_t replica_id = 0;
};

// A cell needs an executor.
struct ExecutorRequested {
  std::string kernel_id;
  int32_t gpus = -1;  // GPUs this cell needs; < 0 means the kernel's request
  std::set<uint32_t> excluded_replicas;
  std::optional<uint32_t> target_replica;
  // Servers holding a warm replica process: preferred migration targets.
  std::set<std::string, std::less<>> warm_servers;
};

// A daemon granted (committed) / released GPUs for an executing replica. Committed: the replica
// becomes the kernel's last executor when it is one of its replicas (replica_id 0: none, e.g. a
// grant that is not tied to a replica yet).
struct GrantCommitted {
  std::string kernel_id;
  uint32_t replica_id = 0;
  std::string server_id;
  Resources resources;
};
struct GrantReleased {
  std::string kernel_id;
  uint32_t replica_id = 0;
  std::string server_id;
  Resources resources;
};

// A replica of a kernel must move: it is lost (its server missed its heartbeats, or its daemon
// gave up restarting it), its server drains, or an operator asked. Decided as a migration with 0
// GPUs needed. replica_id 0: ChooseMigration's replica rule picks which; otherwise that one (the
// kernel's other replicas fixed). to_server_id empty: ChooseMigration's target rule picks where
// (scale_out_needed when no server fits); otherwise that server, which must exist, accept
// replicas and hold none of this kernel (the ratio is not applied: it is an operator's choice).
struct MoveRequested {
  std::string kernel_id;
  uint32_t replica_id = 0;
  std::string to_server_id;
  std::set<std::string, std::less<>> warm_servers;
};

// Periodic: sample SR_c; with auto_scaling, decide scaling.
struct Tick {};

using SchedulerEvent =
    std::variant<ServerJoined, ServerUpdated, ServerLeft, ServerAcceptingChanged,
                 PlacementRequested, KernelPlaced, KernelRemoved, ReplicaAdded, ReplicaRemoved,
                 ExecutorRequested, GrantCommitted, GrantReleased, MoveRequested, Tick>;

// Short name of the event's type ("server_joined", ...), the journal's "event" field.
std::string_view EventName(const SchedulerEvent& event);

// ---- Outputs ----------------------------------------------------------------------------------

struct ExecutorDecision {
  ExecutorChoice choice;  // candidates in order; empty when a replica must migrate first
  // Set exactly when choice.candidates is empty and the cell needs GPUs: which replica moves
  // where (or scale_out_needed). A cell needing 0 GPUs always has candidates unless the kernel
  // has no live replica, and then migration stays unset.
  std::optional<MigrationPlan> migration;
};

struct TickDecision {
  double cluster_ratio = 0;  // SR_c after this tick's sample
  int64_t demand_gpus = 0;
  int64_t busy_gpus = 0;
  // With options.forecast.enabled: Σ over idle kernels of P(a cell within the horizon) × its
  // next cell's expected GPUs (GpuNeed::expected_gpus); 0 otherwise.
  double forecast_gpus = 0;
  // With options.forecast.idle_servers_z >= 0: the wholly idle servers auto-scaling keeps for
  // whole-server cells of idle kernels (ForecastOptions::idle_servers_z); 0 otherwise.
  int32_t idle_servers_wanted = 0;
  bool scaling_evaluated = false;  // auto_scaling on and the ratio window full
  ScalingDecision scaling;         // meaningful when scaling_evaluated
  // With options.rebalance.enabled: proactive moves of idle kernels' replicas (ChooseRebalance
  // over the kernels with no GPUs committed and no executor request pending, never to a server
  // in scaling.release_server_ids). The caller carries each out like a migration (ReplicaAdded,
  // then ReplicaRemoved) and should apply them before releasing servers; a plan it skips (e.g.
  // the kernel is busy by its own reckoning) is simply dropped. The kernel counts as moved at
  // this tick for the cooldown whether or not the caller carries the plan out.
  std::vector<RebalancePlan> rebalance;
};

// What an event produced. Mutations give std::monostate (or an error Status).
using SchedulerDecision =
    std::variant<std::monostate, Placement, ExecutorDecision, TickDecision, MigrationPlan>;

struct SchedulerOutcome {
  Status status;               // not ok: the event was rejected and changed nothing
  SchedulerDecision decision;  // monostate when !status.ok()
};

// Sees every event applied and its outcome, in order. Called synchronously from Apply; must not
// call back into the Scheduler.
class SchedulerObserver {
 public:
  virtual ~SchedulerObserver() = default;
  virtual void OnEvent(int64_t now_ms, const SchedulerEvent& event,
                       const SchedulerOutcome& outcome) = 0;
};

// ---- The facade -------------------------------------------------------------------------------

class Scheduler {
 public:
  // options must be valid (asserted): ratio cap > 0, window > 0, gpus_per_host > 0.
  explicit Scheduler(SchedulerOptions options = {});

  // nullptr detaches. The observer must outlive its attachment.
  void set_observer(SchedulerObserver* observer) { observer_ = observer; }

  // The single entry point. now_ms must not go backwards (asserted); it is recorded, not read.
  SchedulerOutcome Apply(int64_t now_ms, const SchedulerEvent& event);

  // Typed conveniences over Apply.
  Status OnServerJoined(int64_t now_ms, ServerView server);
  Status OnServerUpdated(int64_t now_ms, ServerView server);
  Status OnServerLeft(int64_t now_ms, std::string server_id);
  Status OnServerAccepting(int64_t now_ms, std::string server_id, bool accepting);
  // Errors: PlaceKernel's (negative request, replicas < 1, request larger than every server).
  Result<Placement> RequestPlacement(int64_t now_ms, PlacementRequested request);
  Status OnKernelPlaced(int64_t now_ms, KernelView kernel);
  Status OnKernelRemoved(int64_t now_ms, std::string kernel_id);
  Status OnReplicaAdded(int64_t now_ms, std::string kernel_id, uint32_t replica_id,
                        std::string server_id);
  Status OnReplicaRemoved(int64_t now_ms, std::string kernel_id, uint32_t replica_id);
  // Errors: NotFound (kernel), ChooseMigration's InvalidArgument (e.g. no movable replica, or
  // more GPUs than the largest server has).
  Result<ExecutorDecision> RequestExecutor(int64_t now_ms, ExecutorRequested request);
  Status OnGrantCommitted(int64_t now_ms, GrantCommitted grant);
  Status OnGrantReleased(int64_t now_ms, GrantReleased grant);
  // Errors: NotFound (kernel, replica or target server), InvalidArgument (a target that does
  // not accept replicas or already holds one of this kernel), ChooseMigration's InvalidArgument.
  Result<MigrationPlan> RequestMove(int64_t now_ms, MoveRequested request);
  TickDecision OnTick(int64_t now_ms);

  const ClusterState& cluster() const { return cluster_; }
  const SubscriptionRatio& ratio() const { return ratio_; }
  const SchedulerOptions& options() const { return options_; }
  const GpuWaiters& gpu_waiters() const { return gpu_waiters_; }
  int64_t last_event_ms() const { return last_event_ms_; }

 private:
  SchedulerOutcome Handle(const SchedulerEvent& event);
  Result<Placement> Place(const PlacementRequested& request) const;
  Result<ExecutorDecision> Execute(const ExecutorRequested& request) const;
  // Execute with the GPUs held back for the cells waiting ahead of this one; joins the queue.
  Result<ExecutorDecision> ExecuteInTurn(const ExecutorRequested& request);
  Result<MigrationPlan> Move(const MoveRequested& request) const;
  TickDecision DoTick();
  // Bookkeeping for rebalancing, from events that the cluster view does not keep.
  void NoteEvent(const SchedulerEvent& event);

  // What the scheduler has seen a kernel do (for rebalancing), keyed by kernel id; entries are
  // made by KernelPlaced and erased by KernelRemoved.
  struct KernelActivity {
    int32_t committed_gpus = 0;     // granted to its replicas and not yet released
    bool executor_pending = false;  // an executor was requested and no grant has followed yet
    int32_t last_cell_gpus = -1;    // GPUs of its last executor request; < 0: none yet
    int64_t last_active_ms = 0;
    int64_t last_rebalanced_ms = std::numeric_limits<int64_t>::lowest();
    KernelGaps gaps;    // idle gaps that ended in an executor request (forecast)
    NeedHistory needs;  // GPUs of each cell after the one before (forecast)
    // NeedOf as of its last executor request (the population changes with every cell; a tick
    // reads this instead of recomputing it for every idle kernel).
    GpuNeed next_need{-1, -1};
    // ReturnChanceOf as computed when its idle time (since chance_since_ms) entered chance_bin
    // (GapDistribution::BinOf): every idle kernel is read on every tick, and the chance moves
    // little within a bin.
    double chance = 0;
    int32_t chance_bin = -1;
    int64_t chance_since_ms = -1;
  };
  // The forecast's view of an idle kernel: P(it asks for GPUs within the horizon), kept while
  // its idle time stays in one bin.
  double ReturnChanceOf(KernelActivity& activity);
  // Its next cell's likely GPUs (forecast), from the last cell's (or the request's).
  GpuNeed NeedOf(const KernelActivity& activity, const KernelView& kernel) const;
  // DecideScaling, with the pinning rule when the forecast is on and
  // options.scaling.release_max_pinning_replicas >= 0: the pinning replicas of a server are the
  // idle kernels that rely on it (ReliedOn).
  ScalingDecision Scale(const ScalingForecast& forecast);
  // Per server, the idle kernels at least forecast.pin_min_chance likely to run a cell within
  // the horizon that rely on it. A kernel's covering servers are its replicas' accepting servers
  // with its next cell's GPUs (NeedOf's cover_gpus) idle; when none of them has GPUs committed
  // (scale-in could take them all), it relies on one: the most subscribed, then the greatest
  // server_id (the one DecideScaling would release last). Servers relied on by none are absent.
  std::map<std::string_view, int32_t> ReliedOn();
  // The kernels rebalancing looks at: those with nothing committed and no executor request
  // pending, each with the GPUs its next cell needs (with the forecast, NeedOf's cover_gpus and,
  // per forecast.whole_cover_min_chance, a second entry for a whole server).
  std::vector<IdleKernel> IdleKernels();
  // With forecast.spare_cover_min_chance >= 0: SpareSoleCovers over the idle kernels (other
  // than kernel_id) at least that likely to run a cell within the horizon.
  void SpareCovers(const std::string& kernel_id, int32_t gpus, ExecutorChoice* choice);
  // Learns the gap that ends (or never will) for a kernel idle since activity.last_active_ms.
  void NoteGap(KernelActivity& activity, bool returned);

  SchedulerOptions options_;
  ClusterState cluster_;
  SubscriptionRatio ratio_;
  SchedulerObserver* observer_ = nullptr;
  int64_t last_event_ms_ = 0;
  std::map<std::string, KernelActivity, std::less<>> activity_;
  GpuWaiters gpu_waiters_;
  GapDistribution gap_population_;  // all kernels' idle gaps (forecast)
  WeekProfile week_profile_;        // executor requests by hour of the week (forecast)
  NeedHistory need_population_;     // all kernels' cell-to-cell GPU counts (forecast)
  // Rebalancing is recomputed on a tick only after some event, or from rebalance_quiet_until_ms_
  // on (ChooseRebalance's quiet_until_ms), or when the tick's release candidates (excluded as
  // targets) differ from those of the last choice.
  bool rebalance_stale_ = true;
  int64_t rebalance_quiet_until_ms_ = 0;
  std::vector<std::string> rebalance_excluded_;
};

}  // namespace nbos::sched
