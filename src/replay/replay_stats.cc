#include "replay/replay_stats.h"

#include <fmt/format.h>

#include <algorithm>

namespace nbos::replay {

namespace {

constexpr double kMsPerHour = 3600000.0;

sim::Percentiles Percentiles(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return {sim::PercentileOf(values, 50), sim::PercentileOf(values, 90),
          sim::PercentileOf(values, 99)};
}

// Cells: immediacy, the causes of lateness, delays and TCTs.
void SummarizeCells(const std::vector<CellOutcome>& cells, sim::SimResult* r) {
  std::vector<double> delays_s, tcts_s;
  int64_t immediate = 0;
  for (const CellOutcome& c : cells) {
    if (!c.ok) {
      ++r->cells_failed;
      continue;
    }
    r->gpu_hours_oracle += c.gpus * static_cast<double>(c.duration_ms) / kMsPerHour;
    const bool moved = std::any_of(c.waits.begin(), c.waits.end(), [](const std::string& w) {
      return w.find("moving") != std::string::npos;
    });
    if (c.waits.empty()) {
      ++immediate;
    } else if (moved) {
      ++r->late_migrated;
    } else {
      ++r->late_migration_wait;
    }
    const auto tct_ms = static_cast<double>(c.reply_ms - c.arrival_ms);
    tcts_s.push_back(tct_ms / 1000.0);
    delays_s.push_back(std::max(0.0, tct_ms - static_cast<double>(c.body_ms)) / 1000.0);
  }
  r->cells = static_cast<int64_t>(cells.size());
  const int64_t ran = r->cells - r->cells_failed;
  r->pct_immediate =
      ran > 0 ? 100.0 * static_cast<double>(immediate) / static_cast<double>(ran) : 0;
  r->delay_s = Percentiles(delays_s);
  r->tct_s = Percentiles(tcts_s);
}

// The cluster: GPU-hours and servers over time, migrations.
void SummarizeCluster(const std::vector<ClusterSample>& samples, int64_t end_ms,
                      sim::SimResult* r) {
  if (samples.empty()) return;
  double gpu_ms = 0, committed_ms = 0, server_ms = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    const ClusterSample& s = samples[i];
    const int64_t until = i + 1 < samples.size() ? samples[i + 1].t_ms : std::max(end_ms, s.t_ms);
    const auto dt = static_cast<double>(until - s.t_ms);
    gpu_ms += dt * s.gpus;
    committed_ms += dt * s.gpus_committed;
    server_ms += dt * s.servers;
    r->peak_servers = std::max(r->peak_servers, s.servers);
  }
  r->gpu_hours_provisioned = gpu_ms / kMsPerHour;
  r->gpu_hours_committed = committed_ms / kMsPerHour;
  const int64_t span_ms = std::max(end_ms, samples.back().t_ms) - samples.front().t_ms;
  r->mean_servers = span_ms > 0 ? server_ms / static_cast<double>(span_ms) : 0;
  r->migrations = samples.back().migrations_done - samples.front().migrations_done;
}

}  // namespace

sim::SimResult SummarizeReplay(const std::vector<CellOutcome>& cells,
                               const std::vector<ClusterSample>& samples, int64_t sessions,
                               int64_t end_ms) {
  sim::SimResult r;
  r.policy = "live";
  r.sessions = sessions;
  r.simulated_hours = static_cast<double>(end_ms) / kMsPerHour;
  SummarizeCells(cells, &r);
  SummarizeCluster(samples, end_ms, &r);
  return r;
}

sim::SimOptions SimOptionsForLive(const sim::SimConfig& base, int32_t servers,
                                  int32_t gpus_per_server, int32_t max_servers,
                                  int64_t scaling_interval_ms, uint64_t seed) {
  sim::SimOptions o;
  o.policy = sim::Policy::kNotebookOS;
  o.initial_hosts = servers;
  o.gpus_per_host = gpus_per_server;
  o.auto_scaling = max_servers > servers;
  o.max_hosts = std::max(servers, max_servers);
  o.seed = seed;
  o.config = base;
  o.config.min_hosts = servers;
  o.config.buffer_hosts = 0;
  o.config.scaling_interval_ms = scaling_interval_ms;
  o.config.rebalance_per_tick = 0;
  o.config.pack_gpus = false;
  o.config.forecast = false;
  o.config.release_max_replicas = -1;  // the gateway drains any server it releases
  return o;
}

std::string ComparisonTable(const sim::SimResult& live, const sim::SimResult& simulated) {
  std::string out =
      fmt::format("{:<28} {:>12} {:>12} {:>8}\n", "", "live", "simulated", "live/sim");
  auto row = [&out](std::string_view name, double a, double b) {
    const std::string ratio = b != 0 ? fmt::format("{:.2f}", a / b) : std::string("-");
    out += fmt::format("{:<28} {:>12.4g} {:>12.4g} {:>8}\n", name, a, b, ratio);
  };
  row("cells", static_cast<double>(live.cells), static_cast<double>(simulated.cells));
  row("cells failed", static_cast<double>(live.cells_failed),
      static_cast<double>(simulated.cells_failed));
  row("immediate %", live.pct_immediate, simulated.pct_immediate);
  row("late: moved a replica", static_cast<double>(live.late_migrated),
      static_cast<double>(simulated.late_migrated));
  row("late: waited",
      static_cast<double>(live.late_migration_wait + live.late_placement_wait + live.late_other),
      static_cast<double>(simulated.late_migration_wait + simulated.late_placement_wait +
                          simulated.late_other + simulated.late_rebalance_wait));
  row("delay p50 (s)", live.delay_s.p50, simulated.delay_s.p50);
  row("delay p90 (s)", live.delay_s.p90, simulated.delay_s.p90);
  row("delay p99 (s)", live.delay_s.p99, simulated.delay_s.p99);
  row("TCT p50 (s)", live.tct_s.p50, simulated.tct_s.p50);
  row("TCT p99 (s)", live.tct_s.p99, simulated.tct_s.p99);
  row("GPU-h provisioned", live.gpu_hours_provisioned, simulated.gpu_hours_provisioned);
  row("GPU-h committed", live.gpu_hours_committed, simulated.gpu_hours_committed);
  row("GPU-h oracle", live.gpu_hours_oracle, simulated.gpu_hours_oracle);
  row("hours", live.simulated_hours, simulated.simulated_hours);
  row("peak servers", live.peak_servers, simulated.peak_servers);
  row("mean servers", live.mean_servers, simulated.mean_servers);
  row("migrations", static_cast<double>(live.migrations),
      static_cast<double>(simulated.migrations));
  return out;
}

}  // namespace nbos::replay
