// The discrete-event simulator behind `nbos sim`: sessions, cells, replicas, servers, GPU grants,
// migrations, the warm pool, auto-scaling and idle-session reclamation on a virtual clock. Every
// scheduling decision comes from sched::Scheduler (the gateway's core); this file only models
// what the live system would do with the decisions and how long it would take.
// Deterministic: the same workload, options and seed give the same SimResult.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "sched/scheduler.h"
#include "sched/warm_pool.h"
#include "sim/trace.h"

namespace nbos::sim {

enum class Policy { kReservation, kBatch, kNotebookOS, kNotebookOSLcp };
std::string_view PolicyName(Policy policy);  // "reservation", "batch", "notebookos", ...
Result<Policy> ParsePolicy(std::string_view name);

// Latencies the simulator does not execute, prices and sizes. Every field has a documented
// default (docs/decisions/0004-simulator.md); a JSON config file overrides any subset by name.
struct SimConfig {
  int64_t process_start_ms = 1300;      // cold replica / container process start (loopback)
  int64_t warm_promote_ms = 500;        // promote a warm process into a replica (loopback)
  int64_t raft_commit_ms = 5;           // executor election round before a cell starts
  int64_t migration_catchup_ms = 1000;  // new replica catches up from snapshot + blobs
  int64_t state_restore_ms = 3000;      // read kernel state from the blob store (batch, LCP,
                                        // after reclamation), on the critical path
  int64_t state_write_ms = 2000;        // write state after a cell (batch, LCP), critical path
  int64_t provision_ms = 120000;        // a new server joins after this
  int64_t scaling_interval_ms = 15000;  // Tick period
  int64_t warm_pool_interval_ms = 60000;
  double jitter = 0.1;               // each latency × U(1 - jitter, 1 + jitter)
  int64_t replica_millicpus = 1000;  // per replica (the trace has no CPU/memory)
  int64_t replica_memory_mb = 4096;
  int64_t host_millicpus = 64000;
  int64_t host_memory_mb = 128000;
  int32_t min_hosts = 3;  // auto-scaling floor (+ buffer_hosts)
  int32_t buffer_hosts = 3;
  double scaling_factor = 1.10;
  double scaling_limit = 1.15;
  int32_t max_release_per_round = 2;
  int32_t release_max_replicas = 4;  // scale-in skips a server holding more replicas (< 0: any)
  double max_subscription_ratio = 7.0;
  // notebookos: proactive rebalancing of idle kernels on every scaling tick
  // (sched::RebalanceOptions); 0 turns it off.
  int32_t rebalance_per_tick = 4;          // moves per tick
  int64_t rebalance_cooldown_ms = 300000;  // a kernel moves proactively at most this often
  int32_t rebalance_min_gpus = 1;          // only kernels whose next cell needs this many GPUs
  // without the forecast: a kernel idle longer than this moves only to servers that scale-in
  // would not release
  int64_t rebalance_releasable_idle_max_ms = 7200000;
  // notebookos: executor and migration target by best fit, sparing wholly idle servers
  // (sched::SchedulerOptions::pack_gpus); false: most idle GPUs first.
  bool pack_gpus = true;
  // notebookos: demand forecast from session state (sched::ForecastOptions). Each scaling tick
  // adds Σ P(idle kernel runs a cell within forecast_horizon_ms) × its next cell's expected GPUs
  // to the committed load auto-scaling sizes for, scaled by forecast_scaling_factor / _limit
  // (<= 0: scaling_factor / scaling_limit); rebalancing moves the likeliest kernels first and
  // keeps each next to the GPUs its next cell needs with forecast_cover_chance. false: as before
  // the forecast (last cell's GPUs, most recent first, the idle window below).
  bool forecast = true;
  int64_t forecast_horizon_ms = 180000;
  double forecast_prior_weight = 4.0;  // a kernel's own gaps vs the population's (forecast.h)
  // rebalancing keeps an idle kernel next to the most GPUs its next cell needs with this chance
  double forecast_cover_chance = 0.25;
  double forecast_scaling_factor = 1.05;
  double forecast_scaling_limit = 1.15;
  // With the forecast: kernels less likely than this to return within the horizon are not
  // moved proactively, and ones less likely than the second never pin a releasable server
  // (instead of rebalance_releasable_idle_max_ms). < 0: off.
  double rebalance_min_return_chance = -1;
  double rebalance_releasable_min_chance = 0.1;
  // With the forecast, rebalancing's cooldown (< 0: rebalance_cooldown_ms). Scale-in by
  // reliance (below) releases servers that unlikely kernels were covered by, so kernels need
  // to move again sooner.
  int64_t forecast_rebalance_cooldown_ms = 60000;
  // With the forecast and >= 0: scale-in releases an idle server only when at most this many
  // idle kernels at least release_pin_min_chance likely to run a cell within the horizon rely on
  // it for their next cell's GPUs (sched::Scheduler::ReliedOn: the one wholly idle server kept
  // per kernel not covered by a busy one), whatever else it holds (the other replicas move
  // off), and rebalancing ignores replica counts (replaces release_max_replicas). < 0: off.
  int32_t release_max_pinning_replicas = 0;
  double release_pin_min_chance = 0.1;
  // With the forecast: an idle kernel at least this likely to return whose next cell is smaller
  // than a server and only wholly idle servers cover moves next to a partly busy server with
  // room (sched::RebalanceOptions::spare_whole_min_chance). < 0: off.
  double rebalance_spare_whole_min_chance = 0.1;
  // With the forecast: a kernel that needs most of the one wholly idle server covering it moves
  // when likelier kernels relying on that server alone add up to this chance
  // (sched::RebalanceOptions::contended_cover_chance). < 0: off.
  double rebalance_contended_cover_chance = 0.3;
  // With the forecast: a kernel whose covering servers are all full takes the place of a replica
  // of an idle kernel at most this fraction as likely to return, which moves elsewhere
  // (sched::RebalanceOptions::make_room_chance_ratio). < 0: off.
  double rebalance_make_room_ratio = 0.5;
  // With the forecast: executor choice puts a cell first on the replica whose server is the only
  // cover of the fewest idle kernels at least this likely to return, sparing their covers
  // (sched::ForecastOptions::spare_cover_min_chance). < 0: off.
  double executor_spare_cover_chance = 0.2;
  // With the forecast: auto-scaling keeps ⌈E + z·σ⌉ wholly idle servers for the whole-server
  // cells idle kernels are expected to run within the horizon, and scale-in keeps that many plus
  // the margin (sched::ForecastOptions::idle_servers_z,
  // sched::ScalingOptions::release_idle_servers_margin). z < 0: off.
  double forecast_idle_servers_z = 2.5;
  int32_t release_idle_servers_margin = 1;
  // With the forecast: rebalancing also keeps an idle kernel whose cover is smaller than a server
  // next to a wholly idle one when it is at least this likely to run a whole-server cell within
  // the horizon (sched::ForecastOptions::whole_cover_min_chance). < 0: off.
  double rebalance_whole_cover_chance = 0.01;
  int32_t warm_per_host = 1;             // notebookos: minimum-capacity pool per host
  int32_t lcp_warm_per_host = 8;         // notebookos-lcp: the large pool, per host
  double gpu_hour_cost_usd = 2.00;       // provider's cost of a provisioned GPU-hour
  double gpu_hour_price_usd = 4.00;      // billed per GPU-hour held (reservation) or executing
  double standby_price_fraction = 0.10;  // notebookos: idle session GPU-hour billed at this share
};
// Overrides fields named in the JSON object at `path`; unknown names are InvalidArgument.
Result<SimConfig> LoadSimConfig(const std::string& path);
std::string SimConfigJson(const SimConfig& config);  // every field, for reports

struct SimOptions {
  Policy policy = Policy::kNotebookOS;
  int32_t initial_hosts = 6;
  int32_t gpus_per_host = 8;
  int32_t max_hosts = -1;       // < 0: unbounded
  bool auto_scaling = true;     // false: the cluster stays at initial_hosts (no scale-in/out)
  int64_t idle_reclaim_ms = 0;  // 0: never reclaim idle sessions
  uint64_t seed = 1;
  SimConfig config;
  sched::SchedulerObserver* observer = nullptr;  // e.g. a JournalWriter
};

struct Percentiles {
  double p50 = 0, p90 = 0, p99 = 0;
};
// The value at percentile p (0..100) of ascending `sorted`, by nearest rank; 0 when empty.
double PercentileOf(const std::vector<double>& sorted, double p);

struct SimResult {
  std::string policy;
  int64_t idle_reclaim_min = 0;
  int64_t sessions = 0, cells = 0, cells_failed = 0;
  double simulated_hours = 0;
  double gpu_hours_provisioned = 0;  // Σ server GPUs × (requested .. released)
  double gpu_hours_committed = 0;    // ∫ committed GPUs (held by executors or reservations)
  double gpu_hours_oracle = 0;       // Σ cell GPUs × cell duration
  double pct_immediate = 0;          // cells whose GPUs were committed when they arrived
  double pct_executor_reuse = 0;     // cells run by the previous cell's executor
  // Why the other cells were not immediate (the five sum to cells - immediate cells):
  int64_t late_migrated = 0;        // no replica's server could grant; a replica migrated to a
                                    // running server with idle GPUs at once (no wait)
  int64_t late_migration_wait = 0;  // no replica's server could grant and no running server
                                    // could take a replica: waited for a new server or freed GPUs
  int64_t late_placement_wait = 0;  // the kernel / container / reservation waited for placement
  int64_t late_rebalance_wait = 0;  // arrived while its kernel's replica moved proactively
  int64_t late_other = 0;
  int64_t late_whole_host = 0;  // of all the not-immediate cells, those asking for a whole host
  Percentiles delay_s, tct_s;   // interactivity delay; task completion time
  std::vector<double> delay_cdf_s, tct_cdf_s;  // values at percentiles 0, 1, ..., 100
  int64_t migrations = 0;                      // all: on a cell's path, scale-in and proactive
  int64_t proactive_migrations = 0;            // of which proactive (rebalancing idle kernels)
  int64_t hosts_added = 0, hosts_released = 0, scale_out_events = 0, scale_in_events = 0,
          reclaims = 0, warm_promotions = 0, cold_starts = 0;
  int32_t peak_servers = 0;
  double mean_servers = 0;
  std::vector<std::pair<double, int32_t>> servers_over_time;  // (hour, max servers that hour)
  double provider_cost_usd = 0, revenue_usd = 0, margin_pct = 0;
};

// The scheduler options a simulation with `options` uses (for a journal header).
sched::SchedulerOptions SchedulerOptionsFor(const SimOptions& options);

// Runs the whole workload. InvalidArgument for options that cannot work (no hosts, a session
// wanting more GPUs than a host has).
Result<SimResult> Simulate(const Workload& workload, const SimOptions& options);

// JSON object of a result (stable key order), and a fixed-width table of several.
std::string ResultJson(const SimResult& result);
std::string ResultTable(const std::vector<SimResult>& results);

}  // namespace nbos::sim
