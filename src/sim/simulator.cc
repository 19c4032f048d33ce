#include "sim/simulator.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>

#include "common/check.h"
#include "sim/random.h"

namespace nbos::sim {

double PercentileOf(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const auto rank = static_cast<size_t>(std::llround(p / 100.0 * (sorted.size() - 1)));
  return sorted[std::min(rank, sorted.size() - 1)];
}

namespace {

using nlohmann::json;

// Every SimConfig field, once: the config file reader and the report writer both use this list.
// clang-format off (it reflows this list differently on every run)
#define NBOS_SIM_CONFIG_FIELDS(X)     \
  X(process_start_ms)                 \
  X(warm_promote_ms)                  \
  X(raft_commit_ms)                   \
  X(migration_catchup_ms)             \
  X(state_restore_ms)                 \
  X(state_write_ms)                   \
  X(provision_ms)                     \
  X(scaling_interval_ms)              \
  X(warm_pool_interval_ms)            \
  X(jitter)                           \
  X(replica_millicpus)                \
  X(replica_memory_mb)                \
  X(host_millicpus)                   \
  X(host_memory_mb)                   \
  X(min_hosts)                        \
  X(buffer_hosts)                     \
  X(scaling_factor)                   \
  X(scaling_limit)                    \
  X(max_release_per_round)            \
  X(release_max_replicas)             \
  X(max_subscription_ratio)           \
  X(rebalance_per_tick)               \
  X(rebalance_cooldown_ms)            \
  X(rebalance_min_gpus)               \
  X(rebalance_releasable_idle_max_ms) \
  X(pack_gpus)                        \
  X(forecast)                         \
  X(forecast_horizon_ms)              \
  X(forecast_prior_weight)            \
  X(forecast_cover_chance)            \
  X(forecast_scaling_factor)          \
  X(forecast_scaling_limit)           \
  X(rebalance_min_return_chance)      \
  X(rebalance_releasable_min_chance)  \
  X(forecast_rebalance_cooldown_ms)   \
  X(release_max_pinning_replicas)     \
  X(release_pin_min_chance)           \
  X(rebalance_spare_whole_min_chance) \
  X(rebalance_contended_cover_chance) \
  X(rebalance_make_room_ratio)        \
  X(executor_spare_cover_chance)      \
  X(forecast_idle_servers_z)          \
  X(release_idle_servers_margin)      \
  X(rebalance_whole_cover_chance)     \
  X(warm_per_host)                    \
  X(lcp_warm_per_host)                \
  X(gpu_hour_cost_usd)                \
  X(gpu_hour_price_usd)               \
  X(standby_price_fraction)
// clang-format on

constexpr double kMsPerHour = 3600e3;

enum class Ev : uint8_t {
  kServerJoin,
  kSessionStart,
  kCellArrive,
  kCellEnd,
  kSessionStop,
  kIdleCheck,
  kWarmStarted,
  kTick,
  kWarmTick,
};

struct Event {
  int64_t t_ms;
  int64_t seq;  // FIFO among equal times: the order events were scheduled
  Ev type;
  int32_t a;  // session or server index
  int32_t b;  // cell index or count
  int64_t c;  // idle generation
};

struct Later {
  bool operator()(const Event& x, const Event& y) const {
    return x.t_ms != y.t_ms ? x.t_ms > y.t_ms : x.seq > y.seq;
  }
};

enum class HostState : uint8_t { kProvisioning, kAlive, kReleased };

struct Host {
  std::string id;
  int64_t requested_ms = 0;
  int64_t released_ms = 0;
  HostState state = HostState::kProvisioning;
  int32_t warm = 0;
  int32_t starting = 0;
};

struct QueuedCell {
  int32_t cell;
  int64_t arrival_ms;
};

enum class Late : uint8_t { kNone, kMigrationWait, kPlacementWait };

struct SessionState {
  std::string kernel_id;
  bool open = false, closing = false, done = false;
  bool held = false;     // a kernel is placed in the scheduler (reservation, notebookos)
  bool waiting = false;  // in the wait list (scale-out or GPUs)
  bool restore = false;  // the next placement restores state (after reclamation)
  bool had_cell = false;
  int64_t ready_ms = 0;              // replicas up
  int64_t rebalancing_until_ms = 0;  // a proactive migration of a replica completes then
  std::deque<QueuedCell> queue;
  bool running = false;
  int64_t last_end_ms = 0;
  uint32_t next_replica_id = 1;
  uint32_t exec_replica = 0;
  std::string exec_server;
  std::string exec_kernel;
  int64_t idle_gen = 0;
  int64_t held_since_ms = 0;
  Late wait_cause = Late::kNone;  // why the head of the queue waited (first cause)
  // While in the wait list for scale-out: servers this session asked for, and whether it needs
  // them for itself (idle GPUs to bind, so waiters add up) or only to subscribe (a notebookos
  // kernel's replicas, which waiters can share).
  int32_t hosts_wanted = 0;
  bool hosts_shared = false;
};

class Sim {
 public:
  Sim(const Workload& workload, const SimOptions& options)
      : w_(workload),
        o_(options),
        c_(options.config),
        sched_(SchedulerOptionsFor(options)),
        rng_(options.seed) {
    sched_.set_observer(options.observer);
    sessions_.resize(w_.sessions.size());
    for (size_t i = 0; i < sessions_.size(); ++i) sessions_[i].kernel_id = "k" + std::to_string(i);
    warm_options_.policy = sched::WarmPoolPolicy::kNone;
    if (o_.policy == Policy::kNotebookOS && c_.warm_per_host > 0) {
      warm_options_ = {sched::WarmPoolPolicy::kMinimumCapacity, c_.warm_per_host, 0, -1, 0.5};
    } else if (o_.policy == Policy::kNotebookOSLcp && c_.lcp_warm_per_host > 0) {
      warm_options_ = {sched::WarmPoolPolicy::kMinimumCapacity, c_.lcp_warm_per_host, 0,
                       c_.lcp_warm_per_host, 0.5};
    }
  }

  SimResult Run() {
    for (int32_t i = 0; i < o_.initial_hosts; ++i) RequestHost(0, /*instant=*/true);
    for (size_t i = 0; i < w_.sessions.size(); ++i) {
      const Session& s = w_.sessions[i];
      Push(s.start_ms, Ev::kSessionStart, static_cast<int32_t>(i), 0);
      for (size_t k = 0; k < s.cells.size(); ++k) {
        Push(s.cells[k].submit_ms, Ev::kCellArrive, static_cast<int32_t>(i),
             static_cast<int32_t>(k));
      }
      Push(s.stop_ms, Ev::kSessionStop, static_cast<int32_t>(i), 0);
    }
    Push(c_.scaling_interval_ms, Ev::kTick, 0, 0);
    if (warm_options_.policy != sched::WarmPoolPolicy::kNone) Push(0, Ev::kWarmTick, 0, 0);
    int64_t now = 0;
    while (!events_.empty() && sessions_done_ < sessions_.size()) {
      const Event e = events_.top();
      events_.pop();
      now = e.t_ms;
      Dispatch(e);
    }
    return Finish(now);
  }

 private:
  bool MultiReplica() const { return o_.policy == Policy::kNotebookOS; }
  bool HoldsKernel() const {
    return o_.policy == Policy::kNotebookOS || o_.policy == Policy::kReservation;
  }

  void Push(int64_t t_ms, Ev type, int32_t a, int32_t b, int64_t c = 0) {
    events_.push(Event{t_ms, seq_++, type, a, b, c});
  }

  int64_t Lat(int64_t ms) {
    if (ms <= 0 || c_.jitter <= 0) return std::max<int64_t>(ms, 0);
    const double f = 1.0 + c_.jitter * (2.0 * rng_.Uniform() - 1.0);
    return std::max<int64_t>(0, std::llround(static_cast<double>(ms) * f));
  }

  static int32_t HostIndex(std::string_view id) {
    return static_cast<int32_t>(std::strtol(std::string(id.substr(1)).c_str(), nullptr, 10));
  }

  // ---- accounting ----

  void Advance(int64_t now) {
    const double dt = static_cast<double>(now - last_ms_);
    committed_gpu_ms_ += dt * busy_gpus_;
    server_ms_ += dt * alive_hosts_;
    last_ms_ = now;
  }

  void HostsChanged(int64_t now, int32_t delta) {
    Advance(now);
    alive_hosts_ += delta;
    peak_hosts_ = std::max(peak_hosts_, alive_hosts_);
    const auto hour = static_cast<size_t>(now / static_cast<int64_t>(kMsPerHour));
    if (hourly_max_.size() <= hour) hourly_max_.resize(hour + 1, -1);
    hourly_max_[hour] = std::max(hourly_max_[hour], alive_hosts_);
  }

  bool CanGrow() const { return o_.max_hosts < 0 || alive_hosts_ + pending_hosts_ < o_.max_hosts; }

  void RequestHost(int64_t now, bool instant) {
    if (!CanGrow()) return;
    const auto idx = static_cast<int32_t>(hosts_.size());
    hosts_.push_back(Host{fmt::format("h{:05d}", idx), now});
    ++pending_hosts_;
    if (instant) {
      JoinHost(now, idx);
    } else {
      ++result_.hosts_added;
      Push(now + Lat(c_.provision_ms), Ev::kServerJoin, idx, 0);
    }
  }

  // Periodic scale-out: makes at least n servers pending.
  void RequestHosts(int64_t now, int32_t n) {
    const int32_t missing = n - pending_hosts_;
    if (missing <= 0) return;
    ++result_.scale_out_events;
    for (int32_t i = 0; i < missing; ++i) RequestHost(now, false);
  }

  // Reactive scale-out (the reference's placement / migration failure path): session i waits
  // for `n` new servers. Each waiter that must bind GPUs gets its own servers; waiters that only
  // subscribe share theirs. Pending servers are kept at least at what the waiters need, so k
  // cells waiting at once get k servers in one provisioning round, not one per round.
  void AskForHosts(int64_t now, int32_t i, int32_t n, bool shared) {
    SessionState& s = sessions_[i];
    s.hosts_wanted = std::max(n, 0);
    s.hosts_shared = shared;
    Wait(i);
    int32_t own = 0, shared_max = 0;
    for (int32_t w : waiting_) {
      const SessionState& ws = sessions_[w];
      if (ws.hosts_shared) {
        shared_max = std::max(shared_max, ws.hosts_wanted);
      } else {
        own += ws.hosts_wanted;
      }
    }
    const int32_t missing = own + shared_max - pending_hosts_;
    if (missing <= 0 || !CanGrow()) return;
    ++result_.scale_out_events;
    for (int32_t k = 0; k < missing; ++k) RequestHost(now, false);
  }

  void JoinHost(int64_t now, int32_t idx) {
    Host& h = hosts_[idx];
    --pending_hosts_;
    h.state = HostState::kAlive;
    sched::ServerView v;
    v.server_id = h.id;
    v.spec = {c_.host_millicpus, c_.host_memory_mb, o_.gpus_per_host, 0};
    Status s = sched_.OnServerJoined(now, v);
    NBOS_CHECK(s.ok(), "a new host's id is unique");
    HostsChanged(now, +1);
    Replenish(now, idx);
    RetryWaiting(now);
  }

  void Commit(int64_t now, const std::string& kernel, uint32_t replica, const std::string& server,
              int32_t gpus) {
    Status s = sched_.OnGrantCommitted(now, {kernel, replica, server, {0, 0, gpus, 0}});
    NBOS_CHECK(s.ok(), "the scheduler chose a server that cannot grant");
    Advance(now);
    busy_gpus_ += gpus;
  }

  void Release(int64_t now, const std::string& kernel, uint32_t replica, const std::string& server,
               int32_t gpus) {
    Status s = sched_.OnGrantReleased(now, {kernel, replica, server, {0, 0, gpus, 0}});
    NBOS_CHECK(s.ok(), "released a grant the scheduler did not commit");
    Advance(now);
    busy_gpus_ -= gpus;
  }

  // Start latency of a replica process on `server`: promote a warm one if there is one.
  // Replaces `replica` of the session's kernel by a new one on `to` (the scheduler learns both
  // membership steps now). Returns the new replica's id and when it has started and caught up.
  std::pair<uint32_t, int64_t> MoveReplica(int64_t now, SessionState& s,
                                           const std::string& kernel_id, uint32_t replica,
                                           const std::string& to) {
    const uint32_t fresh = s.next_replica_id++;
    Status st = sched_.OnReplicaAdded(now, kernel_id, fresh, to);
    NBOS_CHECK(st.ok(), "adding a replica to a placed kernel");
    st = sched_.OnReplicaRemoved(now, kernel_id, replica);
    NBOS_CHECK(st.ok(), "removing a replica of a placed kernel");
    ++result_.migrations;
    return {fresh, now + StartOn(now, to) + Lat(c_.migration_catchup_ms)};
  }

  int64_t StartOn(int64_t now, const std::string& server) {
    const int32_t idx = HostIndex(server);
    Host& h = hosts_[idx];
    if (h.warm > 0) {
      --h.warm;
      ++result_.warm_promotions;
      Replenish(now, idx);
      return Lat(c_.warm_promote_ms);
    }
    ++result_.cold_starts;
    return Lat(c_.process_start_ms);
  }

  // The reference's replenish-on-use (and a new host's initial pool): a minimum-capacity pool
  // below its minimum starts the missing processes at once instead of at the next pool round.
  void Replenish(int64_t now, int32_t idx) {
    Host& h = hosts_[idx];
    if (warm_options_.policy != sched::WarmPoolPolicy::kMinimumCapacity ||
        h.state != HostState::kAlive) {
      return;
    }
    const int32_t missing = warm_options_.min_per_host - h.warm - h.starting;
    if (missing <= 0) return;
    h.starting += missing;
    Push(now + Lat(c_.process_start_ms), Ev::kWarmStarted, idx, missing);
  }

  sched::Resources Request(int32_t gpus) const {
    return {c_.replica_millicpus, c_.replica_memory_mb, gpus, 0};
  }

  // ---- events ----

  void Dispatch(const Event& e) {
    switch (e.type) {
      case Ev::kServerJoin:
        JoinHost(e.t_ms, e.a);
        break;
      case Ev::kSessionStart:
        StartSession(e.t_ms, e.a);
        break;
      case Ev::kCellArrive:
        CellArrive(e.t_ms, e.a, e.b);
        break;
      case Ev::kCellEnd:
        CellEnd(e.t_ms, e.a, e.b);
        break;
      case Ev::kSessionStop:
        StopSession(e.t_ms, e.a);
        break;
      case Ev::kIdleCheck:
        IdleCheck(e.t_ms, e.a, e.c);
        break;
      case Ev::kWarmStarted: {
        Host& h = hosts_[e.a];
        h.starting -= e.b;
        if (h.state == HostState::kAlive) h.warm += e.b;
        break;
      }
      case Ev::kTick:
        Tick(e.t_ms);
        break;
      case Ev::kWarmTick:
        WarmTick(e.t_ms);
        break;
    }
  }

  void StartSession(int64_t now, int32_t i) {
    SessionState& s = sessions_[i];
    s.open = true;
    if (HoldsKernel() && !PlaceSessionKernel(now, i)) Blame(i, Late::kPlacementWait);
  }

  // Places the session's kernel (3 replicas, or 1 holding its GPUs for reservation). False when
  // it must wait for scale-out.
  bool PlaceSessionKernel(int64_t now, int32_t i) {
    SessionState& s = sessions_[i];
    const Session& session = w_.sessions[i];
    sched::PlacementRequested req;
    req.kernel_id = s.kernel_id;
    req.request = Request(session.gpus);
    req.replicas = MultiReplica() ? sched::kReplicasPerKernel : 1;
    req.can_scale_out = CanGrow();
    req.require_idle_gpus = o_.policy == Policy::kReservation;
    Result<sched::Placement> p = sched_.RequestPlacement(now, req);
    NBOS_CHECK(p.ok(), "requests are validated against the host size up front");
    if (p->scale_out_needed) {
      AskForHosts(now, i, p->hosts_needed, /*shared=*/MultiReplica());
      return false;
    }
    sched::KernelView k;
    k.kernel_id = s.kernel_id;
    k.request = req.request;
    int64_t start_ms = 0;
    for (const std::string& server : p->server_ids) {
      k.replicas.push_back({s.kernel_id, s.next_replica_id++, server});
      start_ms = std::max(start_ms, StartOn(now, server));
    }
    Status st = sched_.OnKernelPlaced(now, k);
    NBOS_CHECK(st.ok(), "placing a kernel on the servers the scheduler chose");
    if (s.restore) start_ms += Lat(c_.state_restore_ms);
    s.restore = false;
    s.ready_ms = now + start_ms;
    s.held = true;
    s.held_since_ms = now;
    if (o_.policy == Policy::kReservation) {
      Commit(now, s.kernel_id, k.replicas[0].replica_id, k.replicas[0].server_id, session.gpus);
    }
    return true;
  }

  void Unhold(int64_t now, int32_t i) {
    SessionState& s = sessions_[i];
    if (!s.held) return;
    if (o_.policy == Policy::kReservation) {
      const sched::KernelView* k = sched_.cluster().FindKernel(s.kernel_id);
      NBOS_CHECK(k != nullptr && !k->replicas.empty(), "a held kernel is placed");
      const sched::ReplicaView r = k->replicas[0];
      Release(now, s.kernel_id, r.replica_id, r.server_id, w_.sessions[i].gpus);
    }
    Status st = sched_.OnKernelRemoved(now, s.kernel_id);
    NBOS_CHECK(st.ok(), "removing a held kernel");
    held_gpu_ms_ += static_cast<double>(now - s.held_since_ms) * w_.sessions[i].gpus;
    s.held = false;
  }

  static void Blame(SessionState& s, Late cause) {
    if (s.wait_cause == Late::kNone) s.wait_cause = cause;
  }
  void Blame(int32_t i, Late cause) { Blame(sessions_[i], cause); }

  void Wait(int32_t i) {
    SessionState& s = sessions_[i];
    if (s.waiting) return;
    s.waiting = true;
    waiting_.push_back(i);
  }

  void RetryWaiting(int64_t now) {
    if (waiting_.empty()) return;
    std::deque<int32_t> retry;
    retry.swap(waiting_);
    for (int32_t i : retry) {
      SessionState& s = sessions_[i];
      s.waiting = false;
      s.hosts_wanted = 0;
      if (s.done) continue;
      if (HoldsKernel() && !s.held && s.open && !(s.closing && s.queue.empty())) {
        if (!PlaceSessionKernel(now, i)) continue;
      }
      if (!s.running) TryRunNext(now, i);
    }
  }

  void CellArrive(int64_t now, int32_t i, int32_t cell) {
    SessionState& s = sessions_[i];
    ++s.idle_gen;  // cancels a pending idle check
    if (s.queue.empty() && !s.running && !s.waiting) s.wait_cause = Late::kNone;
    s.queue.push_back({cell, now});
    if (!s.running && !s.waiting) TryRunNext(now, i);
  }

  void TryRunNext(int64_t now, int32_t i) {
    SessionState& s = sessions_[i];
    if (s.queue.empty() || s.running) return;
    if (HoldsKernel() && !s.held) {
      // Reclaimed (or never placed): placement again, state restored on the critical path.
      if (!PlaceSessionKernel(now, i)) {
        Blame(i, Late::kPlacementWait);
        return;
      }
    }
    const QueuedCell q = s.queue.front();
    const Cell& cell = w_.sessions[i].cells[q.cell];
    const int64_t arrival_ms = std::max(q.arrival_ms, s.last_end_ms);
    int64_t start_ms = 0;
    bool reuse = false;
    bool migrated = false;
    switch (o_.policy) {
      case Policy::kReservation:
        start_ms = std::max(now, s.ready_ms);
        reuse = s.had_cell;
        break;
      case Policy::kNotebookOS: {
        sched::ExecutorRequested req;
        req.kernel_id = s.kernel_id;
        req.gpus = cell.gpus;
        for (const Host& h : hosts_) {
          if (h.state == HostState::kAlive && h.warm > 0) req.warm_servers.insert(h.id);
        }
        Result<sched::ExecutorDecision> d = sched_.RequestExecutor(now, std::move(req));
        NBOS_CHECK(d.ok(), "asking an executor for a held kernel");
        const sched::KernelView* k = sched_.cluster().FindKernel(s.kernel_id);
        if (!d->choice.candidates.empty()) {
          const uint32_t r = d->choice.candidates[0];
          reuse = k->last_executor != 0 && r == k->last_executor;
          s.exec_replica = r;
          s.exec_server = k->FindReplica(r)->server_id;
          Commit(now, s.kernel_id, r, s.exec_server, cell.gpus);
          start_ms = std::max(now, s.ready_ms) + Lat(c_.raft_commit_ms);
        } else {
          const sched::MigrationPlan& plan = *d->migration;
          if (plan.scale_out_needed) {
            Blame(i, Late::kMigrationWait);
            AskForHosts(now, i, 1, /*shared=*/false);
            return;
          }
          // Add the new member, drop the old one, bind the GPUs on the target now and start
          // the cell once the replica is up and caught up.
          const auto [fresh, caught_up_ms] =
              MoveReplica(now, s, s.kernel_id, plan.replica_id, plan.to_server_id);
          s.exec_replica = fresh;
          s.exec_server = plan.to_server_id;
          Commit(now, s.kernel_id, fresh, s.exec_server, cell.gpus);
          start_ms = std::max(now, s.ready_ms) + (caught_up_ms - now) + Lat(c_.raft_commit_ms);
          migrated = true;
        }
        break;
      }
      case Policy::kBatch:
      case Policy::kNotebookOSLcp: {
        const std::string kernel = s.kernel_id + "c" + std::to_string(q.cell);
        sched::PlacementRequested req;
        req.kernel_id = kernel;
        req.request = Request(cell.gpus);
        req.replicas = 1;
        req.can_scale_out = CanGrow();
        req.require_idle_gpus = true;
        Result<sched::Placement> p = sched_.RequestPlacement(now, std::move(req));
        NBOS_CHECK(p.ok(), "requests are validated against the host size up front");
        if (p->scale_out_needed) {
          Blame(i, Late::kPlacementWait);
          AskForHosts(now, i, p->hosts_needed, /*shared=*/false);
          return;
        }
        sched::KernelView k;
        k.kernel_id = kernel;
        k.request = Request(cell.gpus);
        k.replicas.push_back({kernel, 1, p->server_ids[0]});
        Status st = sched_.OnKernelPlaced(now, k);
        NBOS_CHECK(st.ok(), "placing a cell's kernel on the server the scheduler chose");
        s.exec_kernel = kernel;
        s.exec_replica = 1;
        s.exec_server = p->server_ids[0];
        Commit(now, kernel, 1, s.exec_server, cell.gpus);
        int64_t latency = o_.policy == Policy::kBatch
                              ? (++result_.cold_starts, Lat(c_.process_start_ms))
                              : StartOn(now, s.exec_server);
        if (s.had_cell) latency += Lat(c_.state_restore_ms);
        start_ms = now + latency;
        break;
      }
    }
    s.queue.pop_front();
    s.running = true;
    s.had_cell = true;
    int64_t end_ms = start_ms + cell.duration_ms;
    if (o_.policy == Policy::kBatch || o_.policy == Policy::kNotebookOSLcp) {
      end_ms += Lat(c_.state_write_ms);
    }
    ++cells_run_;
    // A cell that arrives while a proactive move of its kernel is in flight waits for it.
    const bool rebalancing = arrival_ms < s.rebalancing_until_ms;
    if (now == arrival_ms && !migrated && !rebalancing) {
      ++immediate_;
    } else {
      if (now == arrival_ms && migrated) {
        ++result_.late_migrated;
      } else if (now == arrival_ms) {
        ++result_.late_rebalance_wait;
      } else if (s.wait_cause == Late::kMigrationWait) {
        ++result_.late_migration_wait;
      } else if (s.wait_cause == Late::kPlacementWait) {
        ++result_.late_placement_wait;
      } else {
        ++result_.late_other;
      }
      if (cell.gpus >= o_.gpus_per_host) ++result_.late_whole_host;
    }
    s.wait_cause = Late::kNone;
    if (reuse) ++reused_;
    delays_s_.push_back(static_cast<double>(start_ms - arrival_ms) / 1000.0);
    tcts_s_.push_back(static_cast<double>(end_ms - arrival_ms) / 1000.0);
    Push(end_ms, Ev::kCellEnd, i, q.cell);
  }

  void CellEnd(int64_t now, int32_t i, int32_t cell_index) {
    SessionState& s = sessions_[i];
    const Cell& cell = w_.sessions[i].cells[cell_index];
    switch (o_.policy) {
      case Policy::kReservation:
        break;
      case Policy::kNotebookOS:
        Release(now, s.kernel_id, s.exec_replica, s.exec_server, cell.gpus);
        break;
      case Policy::kBatch:
      case Policy::kNotebookOSLcp: {
        Release(now, s.exec_kernel, 1, s.exec_server, cell.gpus);
        Status st = sched_.OnKernelRemoved(now, s.exec_kernel);
        NBOS_CHECK(st.ok(), "removing a finished cell's kernel");
        // LCP returns the container to the pool; the pool policy trims it.
        Host& h = hosts_[HostIndex(s.exec_server)];
        if (o_.policy == Policy::kNotebookOSLcp && h.state == HostState::kAlive) ++h.warm;
        break;
      }
    }
    s.running = false;
    s.last_end_ms = now;
    if (!s.queue.empty()) {
      TryRunNext(now, i);
    } else if (s.closing) {
      Teardown(now, i);
    } else if (o_.idle_reclaim_ms > 0 && s.held) {
      Push(now + o_.idle_reclaim_ms, Ev::kIdleCheck, i, 0, ++s.idle_gen);
    }
    RetryWaiting(now);
  }

  void StopSession(int64_t now, int32_t i) {
    SessionState& s = sessions_[i];
    s.closing = true;
    if (!s.running && s.queue.empty()) Teardown(now, i);
  }

  void Teardown(int64_t now, int32_t i) {
    SessionState& s = sessions_[i];
    if (s.done) return;
    Unhold(now, i);
    s.done = true;
    ++sessions_done_;
    RetryWaiting(now);
  }

  void IdleCheck(int64_t now, int32_t i, int64_t gen) {
    SessionState& s = sessions_[i];
    if (gen != s.idle_gen || s.running || !s.queue.empty() || !s.held || s.closing) return;
    Unhold(now, i);
    s.restore = true;
    ++result_.reclaims;
    RetryWaiting(now);
  }

  void Tick(int64_t now) {
    const sched::TickDecision d = sched_.OnTick(now);
    // Proactive moves before scale-in: their targets are never servers this tick releases, and a
    // replica moved off a release candidate is one fewer to move there.
    for (const sched::RebalancePlan& p : d.rebalance) Rebalance(now, p);
    if (d.scaling_evaluated) {
      if (d.scaling.add_hosts > 0) RequestHosts(now, d.scaling.add_hosts);
      bool released = false;
      for (const std::string& id : d.scaling.release_server_ids) released |= ReleaseHost(now, id);
      if (released) ++result_.scale_in_events;
    }
    if (sessions_done_ < sessions_.size()) Push(now + c_.scaling_interval_ms, Ev::kTick, 0, 0);
  }

  // Carries out a proactive move as a migration off the critical path: the new replica starts
  // (warm promotion or cold start) and catches up; a cell arriving before then waits for it and
  // is not immediate. Skipped when the session is busy by the simulator's own reckoning.
  void Rebalance(int64_t now, const sched::RebalancePlan& p) {
    const auto i = static_cast<int32_t>(std::strtol(p.kernel_id.c_str() + 1, nullptr, 10));
    SessionState& s = sessions_[i];
    const sched::KernelView* k = sched_.cluster().FindKernel(p.kernel_id);
    const sched::ServerView* to = sched_.cluster().FindServer(p.plan.to_server_id);
    if (!s.held || s.running || s.waiting || !s.queue.empty() || k == nullptr ||
        k->FindReplica(p.plan.replica_id) == nullptr || to == nullptr || !to->accepting ||
        k->HasReplicaOn(p.plan.to_server_id) || !sched::SubscriptionFits(*to, k->request)) {
      return;
    }
    const int64_t done_ms =
        MoveReplica(now, s, p.kernel_id, p.plan.replica_id, p.plan.to_server_id).second;
    s.ready_ms = std::max(s.ready_ms, done_ms);
    s.rebalancing_until_ms = std::max(s.rebalancing_until_ms, done_ms);
    ++result_.proactive_migrations;
  }

  // Moves the standby replicas off `id`, then releases it. False (and the server keeps
  // accepting) when a replica has nowhere to go.
  bool ReleaseHost(int64_t now, const std::string& id) {
    // The reference's ReleaseIdleHosts only takes servers with few containers on them; checked
    // before walking the kernels (every replica subscribes replica_millicpus). The scheduler's
    // pinning rule, when on, has chosen by the replicas that matter instead.
    const int32_t max_replicas =
        sched_.options().scaling.release_max_pinning_replicas >= 0 ? -1 : c_.release_max_replicas;
    const sched::ServerView* server = sched_.cluster().FindServer(id);
    if (server != nullptr && max_replicas >= 0 && c_.replica_millicpus > 0 &&
        server->subscribed.millicpus > int64_t{max_replicas} * c_.replica_millicpus) {
      return false;
    }
    Status st = sched_.OnServerAccepting(now, id, false);
    NBOS_CHECK(st.ok(), "the scheduler picked a server it knows for release");
    std::vector<std::pair<std::string, uint32_t>> moving;
    for (const auto& [kid, k] : sched_.cluster().kernels()) {
      for (const sched::ReplicaView& r : k.replicas) {
        if (r.server_id == id) moving.emplace_back(kid, r.replica_id);
      }
    }
    if (max_replicas >= 0 && static_cast<int64_t>(moving.size()) > max_replicas) {
      st = sched_.OnServerAccepting(now, id, true);
      NBOS_CHECK(st.ok(), "reopening a server kept from release");
      return false;
    }
    std::vector<std::pair<std::string, std::string>> targets;  // kernel, server
    for (const auto& [kid, replica] : moving) {
      const sched::KernelView* k = sched_.cluster().FindKernel(kid);
      sched::PlacementRequested req;
      req.kernel_id = kid;
      req.request = k->request;
      req.replicas = 1;
      req.can_scale_out = false;
      for (const sched::ReplicaView& r : k->replicas) req.excluded_servers.insert(r.server_id);
      for (const auto& [tk, ts] : targets) {
        if (tk == kid) req.excluded_servers.insert(ts);
      }
      Result<sched::Placement> p = sched_.RequestPlacement(now, std::move(req));
      if (!p.ok() || p->scale_out_needed || p->ratio_ignored) {
        st = sched_.OnServerAccepting(now, id, true);
        NBOS_CHECK(st.ok(), "reopening a server kept from release");
        return false;
      }
      targets.emplace_back(kid, p->server_ids[0]);
    }
    for (size_t m = 0; m < moving.size(); ++m) {
      const auto& [kid, replica] = moving[m];
      SessionState& s = sessions_[std::strtol(kid.c_str() + 1, nullptr, 10)];
      s.ready_ms =
          std::max(s.ready_ms, MoveReplica(now, s, kid, replica, targets[m].second).second);
    }
    st = sched_.OnServerLeft(now, id);
    NBOS_CHECK(st.ok(), "releasing a server emptied of replicas");
    Host& h = hosts_[HostIndex(id)];
    h.state = HostState::kReleased;
    h.released_ms = now;
    h.warm = 0;
    ++result_.hosts_released;
    HostsChanged(now, -1);
    return true;
  }

  void WarmTick(int64_t now) {
    std::vector<sched::WarmPoolServer> pool;
    for (const auto& [id, server] : sched_.cluster().servers()) {
      const Host& h = hosts_[HostIndex(id)];
      pool.push_back({id, h.warm, h.starting, server.accepting});
    }
    for (const sched::WarmPoolAction& a : sched::SizeWarmPool(warm_options_, pool, 0)) {
      const int32_t idx = HostIndex(a.server_id);
      Host& h = hosts_[idx];
      h.warm -= std::min(a.stop, h.warm);
      if (a.start > 0) {
        h.starting += a.start;
        Push(now + Lat(c_.process_start_ms), Ev::kWarmStarted, idx, a.start);
      }
    }
    if (sessions_done_ < sessions_.size()) {
      Push(now + c_.warm_pool_interval_ms, Ev::kWarmTick, 0, 0);
    }
  }

  SimResult Finish(int64_t end_ms) {
    Advance(end_ms);
    SimResult& r = result_;
    r.policy = std::string(PolicyName(o_.policy));
    r.idle_reclaim_min = o_.idle_reclaim_ms / 60000;
    r.sessions = static_cast<int64_t>(w_.sessions.size());
    r.cells = w_.cells();
    r.cells_failed = r.cells - cells_run_;
    r.simulated_hours = static_cast<double>(end_ms) / kMsPerHour;
    double provisioned_ms = 0;
    for (const Host& h : hosts_) {
      const int64_t until = h.state == HostState::kReleased ? h.released_ms : end_ms;
      provisioned_ms += static_cast<double>(until - h.requested_ms) * o_.gpus_per_host;
    }
    r.gpu_hours_provisioned = provisioned_ms / kMsPerHour;
    r.gpu_hours_committed = committed_gpu_ms_ / kMsPerHour;
    double oracle_ms = 0;
    for (const Session& s : w_.sessions) {
      for (const Cell& c : s.cells) oracle_ms += static_cast<double>(c.duration_ms) * c.gpus;
    }
    r.gpu_hours_oracle = oracle_ms / kMsPerHour;
    const double n = std::max<double>(1, static_cast<double>(cells_run_));
    r.pct_immediate = 100.0 * static_cast<double>(immediate_) / n;
    r.pct_executor_reuse = 100.0 * static_cast<double>(reused_) / n;
    std::sort(delays_s_.begin(), delays_s_.end());
    std::sort(tcts_s_.begin(), tcts_s_.end());
    r.delay_s = {PercentileOf(delays_s_, 50), PercentileOf(delays_s_, 90),
                 PercentileOf(delays_s_, 99)};
    r.tct_s = {PercentileOf(tcts_s_, 50), PercentileOf(tcts_s_, 90), PercentileOf(tcts_s_, 99)};
    for (int p = 0; p <= 100; ++p) {
      r.delay_cdf_s.push_back(PercentileOf(delays_s_, p));
      r.tct_cdf_s.push_back(PercentileOf(tcts_s_, p));
    }
    r.peak_servers = peak_hosts_;
    r.mean_servers = end_ms > 0 ? server_ms_ / static_cast<double>(end_ms) : 0;
    int32_t carry = 0;
    for (size_t h = 0; h < hourly_max_.size(); ++h) {
      if (hourly_max_[h] >= 0) carry = hourly_max_[h];
      r.servers_over_time.emplace_back(static_cast<double>(h), carry);
    }
    // Cost model (docs/decisions/0004-simulator.md): the provider pays for provisioned GPU-hours;
    // users pay for the GPU-hours their kernels hold (reservation) or execute (others), and
    // NotebookOS sessions also pay a standby fee for their idle GPU request.
    for (size_t i = 0; i < sessions_.size(); ++i) {
      if (sessions_[i].held) {
        held_gpu_ms_ +=
            static_cast<double>(end_ms - sessions_[i].held_since_ms) * w_.sessions[i].gpus;
      }
    }
    r.provider_cost_usd = r.gpu_hours_provisioned * c_.gpu_hour_cost_usd;
    r.revenue_usd = r.gpu_hours_committed * c_.gpu_hour_price_usd;
    if (o_.policy == Policy::kNotebookOS) {
      const double standby_h = std::max(0.0, held_gpu_ms_ / kMsPerHour - r.gpu_hours_committed);
      r.revenue_usd += standby_h * c_.gpu_hour_price_usd * c_.standby_price_fraction;
    }
    r.margin_pct =
        r.revenue_usd > 0 ? 100.0 * (r.revenue_usd - r.provider_cost_usd) / r.revenue_usd : 0;
    return r;
  }

  const Workload& w_;
  const SimOptions& o_;
  const SimConfig& c_;
  sched::Scheduler sched_;
  Rng rng_;
  sched::WarmPoolOptions warm_options_;
  std::priority_queue<Event, std::vector<Event>, Later> events_;
  int64_t seq_ = 0;
  std::vector<Host> hosts_;
  std::vector<SessionState> sessions_;
  std::deque<int32_t> waiting_;
  size_t sessions_done_ = 0;
  int32_t pending_hosts_ = 0;
  int32_t alive_hosts_ = 0;
  int32_t peak_hosts_ = 0;
  int64_t busy_gpus_ = 0;
  int64_t last_ms_ = 0;
  double committed_gpu_ms_ = 0, server_ms_ = 0, held_gpu_ms_ = 0;
  std::vector<int32_t> hourly_max_;
  int64_t cells_run_ = 0, immediate_ = 0, reused_ = 0;
  std::vector<double> delays_s_, tcts_s_;
  SimResult result_;
};

}  // namespace

std::string_view PolicyName(Policy policy) {
  switch (policy) {
    case Policy::kReservation:
      return "reservation";
    case Policy::kBatch:
      return "batch";
    case Policy::kNotebookOS:
      return "notebookos";
    case Policy::kNotebookOSLcp:
      return "notebookos-lcp";
  }
  return "?";
}

Result<Policy> ParsePolicy(std::string_view name) {
  for (Policy p :
       {Policy::kReservation, Policy::kBatch, Policy::kNotebookOS, Policy::kNotebookOSLcp}) {
    if (PolicyName(p) == name) return p;
  }
  return InvalidArgument("unknown policy '" + std::string(name) +
                         "' (reservation, batch, notebookos, notebookos-lcp)");
}

Result<SimConfig> LoadSimConfig(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound("cannot open config '" + path + "'");
  SimConfig c;
  try {
    const json j = json::parse(in);
    if (!j.is_object()) return InvalidArgument(path + ": the config must be a JSON object");
    for (const auto& [key, value] : j.items()) {
      bool known = false;
#define NBOS_READ(name)                     \
  if (key == #name) {                       \
    c.name = value.get<decltype(c.name)>(); \
    known = true;                           \
  }
      NBOS_SIM_CONFIG_FIELDS(NBOS_READ)
#undef NBOS_READ
      if (!known) return InvalidArgument(path + ": unknown config field '" + key + "'");
    }
  } catch (const json::exception& e) {
    return InvalidArgument(path + ": " + e.what());
  }
  if (c.scaling_interval_ms <= 0 || c.warm_pool_interval_ms <= 0 || c.jitter < 0 || c.jitter >= 1 ||
      c.max_subscription_ratio <= 0) {
    return InvalidArgument(path + ": intervals must be positive and jitter in [0, 1)");
  }
  return c;
}

std::string SimConfigJson(const SimConfig& c) {
  json j;
#define NBOS_WRITE(name) j[#name] = c.name;
  NBOS_SIM_CONFIG_FIELDS(NBOS_WRITE)
#undef NBOS_WRITE
  return j.dump(1);
}

sched::SchedulerOptions SchedulerOptionsFor(const SimOptions& options) {
  const SimConfig& c = options.config;
  sched::SchedulerOptions s;
  s.max_subscription_ratio = c.max_subscription_ratio;
  s.auto_scaling = options.auto_scaling;
  s.scaling.scaling_factor = c.scaling_factor;
  s.scaling.scaling_limit = c.scaling_limit;
  s.scaling.buffer_hosts = c.buffer_hosts;
  s.scaling.min_hosts = c.min_hosts;
  s.scaling.max_hosts = options.max_hosts;
  s.scaling.max_release_per_round = c.max_release_per_round;
  s.scaling.gpus_per_host = options.gpus_per_host;
  s.rebalance.enabled = options.policy == Policy::kNotebookOS && c.rebalance_per_tick > 0;
  s.rebalance.max_per_tick = std::max(c.rebalance_per_tick, 0);
  s.rebalance.kernel_cooldown_ms = c.rebalance_cooldown_ms;
  s.rebalance.min_gpus = c.rebalance_min_gpus;
  // Moves should not pin a server that scale-in could release (sched::RebalanceOptions).
  s.rebalance.spare_servers_max_replicas = c.release_max_replicas;
  s.rebalance.releasable_target_idle_max_ms = c.rebalance_releasable_idle_max_ms;
  s.pack_gpus = options.policy == Policy::kNotebookOS && c.pack_gpus;
  if (options.policy == Policy::kNotebookOS && c.forecast) {
    s.forecast.enabled = true;
    s.forecast.horizon_ms = c.forecast_horizon_ms;
    s.forecast.prior_weight = c.forecast_prior_weight;
    s.forecast.cover_chance = c.forecast_cover_chance;
    // The forecast adds the idle kernels' likely demand to the load, which may call for a
    // different headroom on top than the plain factor (off by default).
    if (c.forecast_scaling_factor > 0) s.scaling.scaling_factor = c.forecast_scaling_factor;
    if (c.forecast_scaling_limit > 0) s.scaling.scaling_limit = c.forecast_scaling_limit;
    s.rebalance.min_return_chance = c.rebalance_min_return_chance;
    s.rebalance.releasable_target_min_chance = c.rebalance_releasable_min_chance;
    if (c.forecast_rebalance_cooldown_ms >= 0) {
      s.rebalance.kernel_cooldown_ms = c.forecast_rebalance_cooldown_ms;
    }
    s.forecast.pin_min_chance = c.release_pin_min_chance;
    s.rebalance.spare_whole_min_chance = c.rebalance_spare_whole_min_chance;
    s.rebalance.contended_cover_chance = c.rebalance_contended_cover_chance;
    s.rebalance.make_room_chance_ratio = c.rebalance_make_room_ratio;
    s.forecast.spare_cover_min_chance = c.executor_spare_cover_chance;
    s.scaling.release_max_pinning_replicas = c.release_max_pinning_replicas;
    s.forecast.idle_servers_z = c.forecast_idle_servers_z;
    s.scaling.release_idle_servers_margin = c.release_idle_servers_margin;
    s.forecast.whole_cover_min_chance = c.rebalance_whole_cover_chance;
    // Scale-in no longer goes by replica counts, so neither do rebalancing's targets: a move
    // keeps a server only by making a likely kernel rely on it, which the pinning rule sees.
    if (c.release_max_pinning_replicas >= 0) s.rebalance.spare_servers_max_replicas = -1;
  }
  return s;
}

Result<SimResult> Simulate(const Workload& workload, const SimOptions& options) {
  if (options.initial_hosts < 0 || options.gpus_per_host <= 0) {
    return InvalidArgument("hosts must be >= 0 and GPUs per host > 0");
  }
  if (options.initial_hosts < 1 && options.max_hosts == 0) {
    return InvalidArgument("no hosts and no room to add any");
  }
  // Otherwise the kernels would wait for servers that never come, and the clock tick forever.
  const bool replicated = options.policy == Policy::kNotebookOS;
  const int32_t most_hosts = options.auto_scaling ? options.max_hosts : options.initial_hosts;
  if (replicated && most_hosts >= 0 && most_hosts < sched::kReplicasPerKernel) {
    return InvalidArgument(
        std::string(PolicyName(options.policy)) + " places " +
        std::to_string(sched::kReplicasPerKernel) +
        " replicas per kernel on distinct servers; the cluster can have at most " +
        std::to_string(most_hosts));
  }
  for (const Session& s : workload.sessions) {
    if (s.gpus > options.gpus_per_host) {
      return InvalidArgument("session '" + s.id + "' wants " + std::to_string(s.gpus) +
                             " GPUs but hosts have " + std::to_string(options.gpus_per_host));
    }
  }
  Sim sim(workload, options);
  return sim.Run();
}

std::string ResultJson(const SimResult& r) {
  auto pct = [](const Percentiles& p) {
    return json{{"p50", p.p50}, {"p90", p.p90}, {"p99", p.p99}};
  };
  json servers = json::array();
  for (const auto& [h, n] : r.servers_over_time) servers.push_back({h, n});
  json j{{"policy", r.policy},
         {"idle_reclaim_min", r.idle_reclaim_min},
         {"sessions", r.sessions},
         {"cells", r.cells},
         {"cells_failed", r.cells_failed},
         {"simulated_hours", r.simulated_hours},
         {"gpu_hours_provisioned", r.gpu_hours_provisioned},
         {"gpu_hours_committed", r.gpu_hours_committed},
         {"gpu_hours_oracle", r.gpu_hours_oracle},
         {"pct_immediate", r.pct_immediate},
         {"pct_executor_reuse", r.pct_executor_reuse},
         {"not_immediate",
          {{"migrated_at_once", r.late_migrated},
           {"migration_wait", r.late_migration_wait},
           {"placement_wait", r.late_placement_wait},
           {"rebalance_wait", r.late_rebalance_wait},
           {"other", r.late_other},
           {"whole_host_cells", r.late_whole_host}}},
         {"delay_s", pct(r.delay_s)},
         {"tct_s", pct(r.tct_s)},
         {"delay_cdf_s", r.delay_cdf_s},
         {"tct_cdf_s", r.tct_cdf_s},
         {"migrations", r.migrations},
         {"proactive_migrations", r.proactive_migrations},
         {"hosts_added", r.hosts_added},
         {"hosts_released", r.hosts_released},
         {"scale_out_events", r.scale_out_events},
         {"scale_in_events", r.scale_in_events},
         {"reclaims", r.reclaims},
         {"warm_promotions", r.warm_promotions},
         {"cold_starts", r.cold_starts},
         {"peak_servers", r.peak_servers},
         {"mean_servers", r.mean_servers},
         {"servers_over_time", servers},
         {"provider_cost_usd", r.provider_cost_usd},
         {"revenue_usd", r.revenue_usd},
         {"margin_pct", r.margin_pct}};
  return j.dump();
}

std::string ResultTable(const std::vector<SimResult>& results) {
  std::string out = fmt::format(
      "{:<16} {:>5} {:>10} {:>10} {:>9} {:>7} {:>6} {:>6} {:>8} {:>8} {:>8} {:>9} {:>6} {:>5} "
      "{:>5} {:>9} {:>9}\n",
      "policy", "idle", "GPU-h prov", "GPU-h busy", "oracle", "x orcl", "immed%", "reuse%",
      "delay50", "delay99", "tct50", "tct99", "migr", "peak", "mean", "cost $", "margin%");
  for (const SimResult& r : results) {
    const std::string idle = r.idle_reclaim_min == 0 ? "none" : std::to_string(r.idle_reclaim_min);
    out += fmt::format(
        "{:<16} {:>5} {:>10.1f} {:>10.1f} {:>9.1f} {:>7.2f} {:>6.1f} {:>6.1f} {:>8.2f} {:>8.2f} "
        "{:>8.1f} {:>9.1f} {:>6} {:>5} {:>5.1f} {:>9.0f} {:>9.1f}\n",
        r.policy, idle, r.gpu_hours_provisioned, r.gpu_hours_committed, r.gpu_hours_oracle,
        r.gpu_hours_oracle > 0 ? r.gpu_hours_provisioned / r.gpu_hours_oracle : 0, r.pct_immediate,
        r.pct_executor_reuse, r.delay_s.p50, r.delay_s.p99, r.tct_s.p50, r.tct_s.p99, r.migrations,
        r.peak_servers, r.mean_servers, r.provider_cost_usd, r.margin_pct);
  }
  return out;
}

}  // namespace nbos::sim
