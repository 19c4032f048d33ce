#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "sched/journal.h"
#include "sim/report.h"
#include "sim/simulator.h"
#include "sim/trace.h"

namespace nbos::sim {
namespace {

// Two sessions on one 8-GPU host, hand-made so that the expected numbers can be worked out.
Workload Tiny() {
  Workload w;
  Session a{"a", 0, 0, 0, {{60000, 600000, 4}, {1200000, 300000, 4}}};
  Session b{"b", 0, 0, 0, {{60000, 600000, 8}}};
  for (Session* s : {&a, &b}) {
    s->gpus = 0;
    for (const Cell& c : s->cells) s->gpus = std::max(s->gpus, c.gpus);
    s->stop_ms = s->cells.back().submit_ms + s->cells.back().duration_ms;
  }
  w.sessions = {a, b};
  return w;
}

SimOptions Opts(Policy p) {
  SimOptions o;
  o.policy = p;
  o.initial_hosts = 3;
  o.config.jitter = 0;
  o.config.buffer_hosts = 0;
  return o;
}

int64_t NotImmediate(const SimResult& r) {
  return r.late_migrated + r.late_migration_wait + r.late_placement_wait + r.late_rebalance_wait +
         r.late_other;
}

TEST(SimTest, OracleIsPolicyIndependent) {
  for (Policy p :
       {Policy::kReservation, Policy::kBatch, Policy::kNotebookOS, Policy::kNotebookOSLcp}) {
    auto r = Simulate(Tiny(), Opts(p));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    // 4 GPUs × 10 min + 4 × 5 min + 8 × 10 min = 140 GPU-minutes.
    EXPECT_NEAR(r->gpu_hours_oracle, 140.0 / 60, 1e-9) << PolicyName(p);
    EXPECT_EQ(r->cells, 3);
    EXPECT_EQ(r->cells_failed, 0) << PolicyName(p);
    EXPECT_GE(r->gpu_hours_provisioned, r->gpu_hours_committed) << PolicyName(p);
  }
}

TEST(SimTest, ReservationHoldsWholeSessions) {
  auto r = Simulate(Tiny(), Opts(Policy::kReservation));
  ASSERT_TRUE(r.ok());
  // Session a holds 4 GPUs for 25 min (stop at 25 min), b holds 8 for 11 min.
  EXPECT_NEAR(r->gpu_hours_committed, (4 * 25.0 + 8 * 11.0) / 60, 1e-6);
  EXPECT_DOUBLE_EQ(r->pct_immediate, 100.0);
  EXPECT_DOUBLE_EQ(r->delay_s.p99, 0.0);
}

TEST(SimTest, NotebookOSBindsOnlyWhileCellsRun) {
  auto r = Simulate(Tiny(), Opts(Policy::kNotebookOS));
  ASSERT_TRUE(r.ok());
  // Executing time plus the 5 ms election per cell.
  EXPECT_NEAR(r->gpu_hours_committed, 140.0 / 60, 0.001);
  EXPECT_DOUBLE_EQ(r->pct_immediate, 100.0);
  EXPECT_NEAR(r->pct_executor_reuse, 100.0 / 3, 1e-9);  // a's second cell reuses its executor
  EXPECT_NEAR(r->delay_s.p50, 0.005, 1e-9);
}

TEST(SimTest, BatchPaysStartAndRestoreOnTheCriticalPath) {
  auto r = Simulate(Tiny(), Opts(Policy::kBatch));
  ASSERT_TRUE(r.ok());
  // First cells: process start (1.3 s); a's second cell: start + restore (4.3 s).
  EXPECT_DOUBLE_EQ(r->delay_cdf_s.front(), 1.3);
  EXPECT_DOUBLE_EQ(r->delay_cdf_s.back(), 4.3);
  EXPECT_DOUBLE_EQ(r->pct_executor_reuse, 0.0);
}

TEST(SimTest, IdleReclamationRestoresState) {
  SimOptions o = Opts(Policy::kNotebookOS);
  o.idle_reclaim_ms = 5 * 60000;  // a idles 10 min between its cells
  auto r = Simulate(Tiny(), o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->reclaims, 1);
  // a's second cell waits for 3 replica starts (one warm host each at best) and the restore.
  EXPECT_GE(r->delay_cdf_s.back(), 3.0);
}

TEST(SimTest, ContentionForcesMigrationOrScaleOut) {
  // Four 8-GPU sessions whose cells all overlap, on 3 hosts: someone must move or wait.
  Workload w;
  for (int i = 0; i < 4; ++i) {
    Session s{"s" + std::to_string(i), 0, 3600000, 8, {{60000 + i * 1000, 1800000, 8}}};
    w.sessions.push_back(s);
  }
  auto r = Simulate(w, Opts(Policy::kNotebookOS));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->cells_failed, 0);
  EXPECT_LT(r->pct_immediate, 100.0);
  EXPECT_GE(r->migrations + r->hosts_added, 1);
  // The causes account for every late cell.
  EXPECT_NEAR(100.0 * static_cast<double>(r->cells - NotImmediate(*r)) / r->cells, r->pct_immediate,
              1e-9);
}

// n sessions, each opening at 0 with one whole-host cell at 60 s lasting 30 min.
Workload WholeHostBurst(int n) {
  Workload w;
  for (int i = 0; i < n; ++i) {
    w.sessions.push_back(
        Session{"s" + std::to_string(i), 0, 60000 + 1800000, 8, {{60000, 1800000, 8}}});
  }
  return w;
}

TEST(SimTest, CellsWaitingAtOnceGetTheirServersInOneProvisioningRound) {
  // 6 whole-host cells at once on 3 hosts: 3 wait for scale-out. Each needs its own server, so
  // all 3 must be requested together (one provisioning delay), not one per round.
  for (Policy p : {Policy::kBatch, Policy::kNotebookOS}) {
    SimOptions o = Opts(p);
    o.auto_scaling = false;  // only the reactive path adds servers
    auto r = Simulate(WholeHostBurst(6), o);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->cells_failed, 0);
    EXPECT_EQ(r->hosts_added, 3) << PolicyName(p);
    const double provision_s = static_cast<double>(o.config.provision_ms) / 1000;
    EXPECT_GT(r->delay_cdf_s.back(), provision_s) << PolicyName(p);
    EXPECT_LT(r->delay_cdf_s.back(), 1.5 * provision_s) << PolicyName(p);
    EXPECT_EQ(NotImmediate(*r), 3) << PolicyName(p);
    EXPECT_NEAR(r->pct_immediate, 50.0, 1e-9);
    EXPECT_EQ(p == Policy::kBatch ? r->late_placement_wait : r->late_migration_wait, 3);
    EXPECT_EQ(r->late_whole_host, 3);
  }
}

TEST(SimTest, FixedClusterNeverScalesAndCellsWaitForGpus) {
  SimOptions o = Opts(Policy::kNotebookOS);
  o.auto_scaling = false;
  o.max_hosts = o.initial_hosts;
  auto r = Simulate(WholeHostBurst(6), o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->cells_failed, 0);
  EXPECT_EQ(r->hosts_added, 0);
  EXPECT_EQ(r->hosts_released, 0);
  EXPECT_EQ(r->peak_servers, 3);
  EXPECT_EQ(r->late_migration_wait, 3);
  // The late cells wait for the first ones' 30 minutes, then bind at once.
  EXPECT_GE(r->delay_cdf_s.back(), 1800.0);
}

// `n` 1-GPU sessions idle for 3 hours, then one minute-long cell each.
Workload IdleSessions(int n) {
  Workload w;
  for (int i = 0; i < n; ++i) {
    w.sessions.push_back(
        Session{"s" + std::to_string(i), 0, 3 * 3600000, 1, {{3 * 3600000 - 120000, 60000, 1}}});
  }
  return w;
}

TEST(SimTest, ScaleInSkipsServersHoldingManyReplicas) {
  // 20 idle notebookos sessions (60 replicas) on 8 hosts, no load: the auto-scaler wants 3 hosts.
  // The reference only releases servers with <= 4 containers, so none of these goes.
  Workload w = IdleSessions(20);
  SimOptions o = Opts(Policy::kNotebookOS);
  o.initial_hosts = 8;
  o.config.release_max_pinning_replicas = -1;  // the reference's rule, not the forecast's
  auto kept = Simulate(w, o);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->hosts_released, 0);
  EXPECT_EQ(kept->peak_servers, 8);
  o.config.release_max_replicas = -1;  // any server may be drained
  auto drained = Simulate(w, o);
  ASSERT_TRUE(drained.ok());
  EXPECT_GT(drained->hosts_released, 0);
  EXPECT_GT(drained->migrations, 0);
}

TEST(SimTest, ScaleInByRelianceDrainsServersNoLikelyKernelReliesOnAlone) {
  // The same idle sessions: each kernel has 3 wholly idle servers for its 1-GPU cell, so none
  // relies on any one alone, and the default (forecast) rule drains down to the target.
  Workload w = IdleSessions(20);
  SimOptions o = Opts(Policy::kNotebookOS);
  o.initial_hosts = 8;
  ASSERT_GE(o.config.release_max_pinning_replicas, 0);
  auto r = Simulate(w, o);
  ASSERT_TRUE(r.ok());
  EXPECT_GT(r->hosts_released, 0);
  EXPECT_GT(r->migrations, 0);
  EXPECT_EQ(r->cells_failed, 0);
  // Without the forecast the reference's replica rule applies again.
  o.config.forecast = false;
  auto kept = Simulate(w, o);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->hosts_released, 0);
}

// Session a (8 GPUs) idles after its first cell while b, c, d take all 3 hosts for an hour; the
// auto-scaler adds a 4th host, which joins at 420 s (and a 5th once a's second cell runs too).
// a's second cell comes at `second_ms`.
Workload IdleKernelCrowdedOut(int64_t second_ms) {
  Workload w;
  w.sessions.push_back(
      Session{"a", 0, second_ms + 60000, 8, {{60000, 60000, 8}, {second_ms, 60000, 8}}});
  for (const char* id : {"b", "c", "d"}) {
    w.sessions.push_back(Session{id, 0, 300000 + 3600000, 8, {{300000, 3600000, 8}}});
  }
  return w;
}

SimOptions CrowdedOptions(bool rebalance) {
  SimOptions o = Opts(Policy::kNotebookOS);
  if (!rebalance) o.config.rebalance_per_tick = 0;
  // The move itself, without the forecast: with four kernels' gaps seen, none as long as a's
  // idle time, the forecast gives a no chance to return and keeps it off the new (releasable)
  // host.
  o.config.forecast = false;
  return o;
}

TEST(SimTest, ProactiveRebalancingMovesAnIdleKernelOffTheCriticalPath) {
  auto off = Simulate(IdleKernelCrowdedOut(1800000), CrowdedOptions(false));
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->proactive_migrations, 0);
  EXPECT_EQ(off->late_migrated, 1);  // a's second cell migrates when it arrives
  auto on = Simulate(IdleKernelCrowdedOut(1800000), CrowdedOptions(true));
  ASSERT_TRUE(on.ok());
  EXPECT_EQ(on->proactive_migrations, 1);  // at the tick after the 4th host joined
  EXPECT_EQ(on->migrations, 1);
  EXPECT_DOUBLE_EQ(on->pct_immediate, 100.0);
  EXPECT_EQ(NotImmediate(*on), 0);
}

TEST(SimTest, ACellArrivingDuringAProactiveMoveWaitsAndIsNotImmediate) {
  // The move starts at the 420 s tick: a cold start (1.3 s) and catch-up (1 s) later it is done.
  auto r = Simulate(IdleKernelCrowdedOut(421000), CrowdedOptions(true));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->proactive_migrations, 1);
  EXPECT_EQ(r->late_rebalance_wait, 1);
  EXPECT_EQ(NotImmediate(*r), 1);
  EXPECT_NEAR(r->delay_cdf_s.back(), 420.0 + 1.3 + 1.0 + 0.005 - 421.0, 1e-9);
}

TEST(SimTest, RejectsSessionsLargerThanAHost) {
  SimOptions o = Opts(Policy::kNotebookOS);
  o.gpus_per_host = 4;
  EXPECT_FALSE(Simulate(Tiny(), o).ok());
}

TEST(SimTest, SameSeedSameOutputDifferentSeedDifferentJitter) {
  GeneratorOptions g;
  g.hours = 6;
  g.sessions_per_hour = 6;
  g.seed = 7;
  auto w = Generate(g);
  ASSERT_TRUE(w.ok());
  SimOptions o = Opts(Policy::kNotebookOS);
  o.config.jitter = 0.1;  // the seed drives the latency jitter
  o.seed = 3;
  auto a = Simulate(*w, o), b = Simulate(*w, o);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(ResultJson(*a), ResultJson(*b));
  o.seed = 4;
  auto c = Simulate(*w, o);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(ResultJson(*a), ResultJson(*c));
  auto w2 = Generate(g);
  std::ostringstream t1, t2;
  WriteTemplateJson(*w, t1);
  WriteTemplateJson(*w2, t2);
  EXPECT_EQ(t1.str(), t2.str());
}

TEST(SimTest, TemplateRoundTrips) {
  GeneratorOptions g;
  g.hours = 3;
  auto w = Generate(g);
  ASSERT_TRUE(w.ok());
  ASSERT_GT(w->sessions.size(), 0u);
  const std::string path = ::testing::TempDir() + "/nbos_sim_template.json";
  {
    std::ofstream out(path);
    WriteTemplateJson(*w, out);
  }
  auto back = LoadTemplateJson(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->sessions.size(), w->sessions.size());
  EXPECT_EQ(back->cells(), w->cells());
  for (size_t i = 0; i < w->sessions.size(); ++i) {
    EXPECT_EQ(back->sessions[i].start_ms, w->sessions[i].start_ms);
    EXPECT_EQ(back->sessions[i].stop_ms, w->sessions[i].stop_ms);
    EXPECT_EQ(back->sessions[i].gpus, w->sessions[i].gpus);
  }
}

TEST(SimTest, AdobeCsvReconstructionRule) {
  const std::string path = ::testing::TempDir() + "/nbos_sim_mini.csv";
  {
    std::ofstream out(path);
    out << "job_id,num_gpu,submit_time,iterations,model_name,duration,interval\n"
           "0,1,10,0,m,2,0\n1,4,20,0,m,3,0\n2,8,5,0,m,1,0\n3,1,7,0,m,1,0\n";
  }
  auto w = LoadAdobeCsv(path, 60000);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_EQ(w->sessions.size(), 2u);  // submit_time drops from 20 to 5
  // Sorted by start: the second run (opens at minute 4) first.
  EXPECT_EQ(w->sessions[0].gpus, 8);
  EXPECT_EQ(w->sessions[0].start_ms, 4 * 60000);
  EXPECT_EQ(w->sessions[0].stop_ms, 8 * 60000);
  EXPECT_EQ(w->sessions[1].gpus, 4);
  EXPECT_EQ(w->sessions[1].stop_ms, 23 * 60000);
  std::ofstream(path) << "job_id,num_gpu,submit_time,iterations,model_name,duration,interval\n"
                         "0,1,x,0,m,2,0\n";
  auto bad = LoadAdobeCsv(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(":2:"), std::string::npos);
}

TEST(SimTest, JournalOfASimulationReplays) {
  GeneratorOptions g;
  g.hours = 4;
  g.sessions_per_hour = 8;
  auto w = Generate(g);
  ASSERT_TRUE(w.ok());
  for (Policy p : {Policy::kReservation, Policy::kNotebookOS, Policy::kNotebookOSLcp}) {
    SimOptions o = Opts(p);
    std::ostringstream journal;
    sched::SchedulerOptions so;  // header options are rewritten below from the sim's own
    auto dummy = Simulate(*w, o);
    ASSERT_TRUE(dummy.ok());
    // Record through an observer that knows the scheduler options the simulator used.
    struct Capture : sched::SchedulerObserver {
      std::vector<std::string> lines;
      int64_t seq = 0;
      void OnEvent(int64_t t, const sched::SchedulerEvent& e,
                   const sched::SchedulerOutcome& out) override {
        lines.push_back(sched::EncodeJournalRecord(++seq, t, e, out));
      }
    } capture;
    o.observer = &capture;
    ASSERT_TRUE(Simulate(*w, o).ok());
    ASSERT_GT(capture.lines.size(), 10u);
    so = SchedulerOptionsFor(o);
    journal << sched::EncodeJournalHeader(so) << '\n';
    for (const std::string& l : capture.lines) journal << l << '\n';
    std::istringstream in(journal.str());
    auto report = sched::ReplayJournal(in);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_TRUE(report->matched) << PolicyName(p) << ": " << report->mismatch;
  }
}

TEST(SimTest, IdleServersForWholeServerCellsComeWithTheForecast) {
  SimOptions o = Opts(Policy::kNotebookOS);
  sched::SchedulerOptions so = SchedulerOptionsFor(o);
  EXPECT_GE(so.forecast.idle_servers_z, 0);
  EXPECT_EQ(so.forecast.idle_servers_z, o.config.forecast_idle_servers_z);
  EXPECT_EQ(so.scaling.release_idle_servers_margin, o.config.release_idle_servers_margin);
  EXPECT_GE(so.forecast.whole_cover_min_chance, 0);
  EXPECT_EQ(so.forecast.whole_cover_min_chance, o.config.rebalance_whole_cover_chance);
  o.config.forecast = false;
  EXPECT_LT(SchedulerOptionsFor(o).forecast.idle_servers_z, 0);
  EXPECT_LT(SchedulerOptionsFor(o).forecast.whole_cover_min_chance, 0);
  EXPECT_LT(SchedulerOptionsFor(Opts(Policy::kBatch)).forecast.idle_servers_z, 0);
}

TEST(SimTest, ReportsRender) {
  auto r = Simulate(Tiny(), Opts(Policy::kNotebookOS));
  ASSERT_TRUE(r.ok());
  std::vector<SimResult> rs = {*r};
  EXPECT_NE(CdfSvg(rs, false).find("<polyline"), std::string::npos);
  EXPECT_NE(ServersSvg(rs).find("<polyline"), std::string::npos);
  EXPECT_NE(MarkdownReport(rs, "t", "c").find("| notebookos | none |"), std::string::npos);
  EXPECT_NE(ResultTable(rs).find("notebookos"), std::string::npos);
}

}  // namespace
}  // namespace nbos::sim
