#include "replay/replay_stats.h"

#include <gtest/gtest.h>

#include "replay/replayer.h"

namespace nbos::replay {
namespace {

CellOutcome Ran(int32_t gpus, int64_t arrival_ms, int64_t body_ms, int64_t overhead_ms,
                std::vector<std::string> waits = {}) {
  CellOutcome c;
  c.gpus = gpus;
  c.duration_ms = body_ms;
  c.arrival_ms = arrival_ms;
  c.body_ms = body_ms;
  c.reply_ms = arrival_ms + body_ms + overhead_ms;
  c.waits = std::move(waits);
  c.ok = true;
  return c;
}

TEST(ReplayStatsTest, CellsAreSplitByWhyTheyWaited) {
  std::vector<CellOutcome> cells = {
      Ran(1, 0, 1000, 10),
      Ran(2, 100, 2000, 20),
      Ran(4, 200, 1000, 1500, {"waiting for 4 GPUs: moving replica 2 to host-3 (≈ 1 s)"}),
      Ran(8, 300, 1000, 5000, {"waiting for 8 GPUs: every server's GPUs are in use"}),
  };
  CellOutcome failed;
  failed.gpus = 1;
  failed.duration_ms = 500;
  cells.push_back(failed);
  const sim::SimResult r = SummarizeReplay(cells, {}, 3, 10000);
  EXPECT_EQ(r.policy, "live");
  EXPECT_EQ(r.cells, 5);
  EXPECT_EQ(r.cells_failed, 1);
  EXPECT_DOUBLE_EQ(r.pct_immediate, 50.0);
  EXPECT_EQ(r.late_migrated, 1);
  EXPECT_EQ(r.late_migration_wait, 1);
  // Delays are everything but the body: 0.01, 0.02, 1.5, 5 s.
  EXPECT_DOUBLE_EQ(r.delay_s.p50, 1.5);  // nearest rank of 4 values at 50 %: index 2
  EXPECT_DOUBLE_EQ(r.delay_s.p99, 5.0);
  EXPECT_DOUBLE_EQ(r.tct_s.p99, 6.0);
  // The oracle counts the cells that ran: 1×1 s + 2×2 s + 4×1 s + 8×1 s = 17 GPU-seconds.
  EXPECT_NEAR(r.gpu_hours_oracle, 17.0 / 3600, 1e-12);
}

TEST(ReplayStatsTest, GpuHoursIntegrateTheSamples) {
  std::vector<ClusterSample> samples = {
      {0, 2, 16, 0, 5},
      {1800000, 3, 24, 8, 6},  // a server joined half an hour in
      {2700000, 2, 16, 4, 9},
  };
  const sim::SimResult r = SummarizeReplay({}, samples, 0, 3600000);
  EXPECT_NEAR(r.gpu_hours_provisioned, 16 * 0.5 + 24 * 0.25 + 16 * 0.25, 1e-9);
  EXPECT_NEAR(r.gpu_hours_committed, 8 * 0.25 + 4 * 0.25, 1e-9);
  EXPECT_EQ(r.peak_servers, 3);
  EXPECT_NEAR(r.mean_servers, 2 * 0.5 + 3 * 0.25 + 2 * 0.25, 1e-9);
  EXPECT_EQ(r.migrations, 4);
  EXPECT_DOUBLE_EQ(r.simulated_hours, 1.0);
}

TEST(ReplayStatsTest, ComparisonTableShowsTheRatio) {
  sim::SimResult live, simulated;
  live.pct_immediate = 90;
  simulated.pct_immediate = 100;
  const std::string table = ComparisonTable(live, simulated);
  EXPECT_NE(table.find("immediate %"), std::string::npos);
  EXPECT_NE(table.find("0.90"), std::string::npos);
}

// The simulation of a replay mirrors the gateway's scheduler, not the simulator's own defaults.
TEST(ReplayStatsTest, TheSimulationMirrorsTheGateway) {
  sim::SimConfig base;
  base.provision_ms = 1500;
  sim::SimOptions fixed = SimOptionsForLive(base, 3, 8, 0, 5000, 7);
  EXPECT_FALSE(fixed.auto_scaling);
  EXPECT_EQ(fixed.initial_hosts, 3);
  EXPECT_EQ(fixed.max_hosts, 3);
  EXPECT_EQ(fixed.gpus_per_host, 8);
  EXPECT_EQ(fixed.seed, 7u);
  EXPECT_EQ(fixed.config.provision_ms, 1500);
  EXPECT_EQ(fixed.config.scaling_interval_ms, 5000);
  EXPECT_EQ(fixed.config.min_hosts, 3);
  EXPECT_EQ(fixed.config.buffer_hosts, 0);
  EXPECT_EQ(fixed.config.rebalance_per_tick, 0);
  EXPECT_FALSE(fixed.config.pack_gpus);
  EXPECT_FALSE(fixed.config.forecast);
  EXPECT_EQ(fixed.config.release_max_replicas, -1);
  sim::SimOptions growing = SimOptionsForLive(base, 3, 8, 6, 5000, 1);
  EXPECT_TRUE(growing.auto_scaling);
  EXPECT_EQ(growing.max_hosts, 6);
}

TEST(ReplayCellTest, TheCellReportsItsBody) {
  const std::string code = CellCode(1500);
  EXPECT_NE(code.find("sleep(1.500)"), std::string::npos);
  EXPECT_EQ(BodyMsFromOutput("nbos-replay-body-ms 1502.25\n"), 1502);
  EXPECT_EQ(BodyMsFromOutput("noise\nnbos-replay-body-ms 7.9\n"), 7);
  EXPECT_EQ(BodyMsFromOutput("nothing here"), -1);
  EXPECT_EQ(BodyMsFromOutput("nbos-replay-body-ms x"), -1);
}

}  // namespace
}  // namespace nbos::replay
