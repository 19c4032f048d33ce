#include "sched/scheduler.h"

#include <gtest/gtest.h>

#include <sstream>

#include "sched/journal.h"
#include "sched/test_util.h"

namespace nbos::sched {
namespace {

using test::Req;
using test::Server;

SchedulerOptions Options() {
  SchedulerOptions o;
  o.scaling.min_hosts = 3;
  o.scaling.buffer_hosts = 0;
  o.scaling.gpus_per_host = 8;
  return o;
}

// A scheduler with `n` 8-GPU servers s0..s(n-1).
Scheduler WithServers(int n, SchedulerOptions o = Options()) {
  Scheduler s(o);
  for (int i = 0; i < n; ++i)
    EXPECT_TRUE(s.OnServerJoined(0, Server("s" + std::to_string(i), 8)).ok());
  return s;
}

TEST(SchedulerTest, PlacesOnDistinctServersAndRecordsDemand) {
  Scheduler s = WithServers(4);
  auto p = s.RequestPlacement(1, {.kernel_id = "k", .request = Req(2)});
  ASSERT_TRUE(p.ok());
  ASSERT_EQ(p->server_ids.size(), 3u);
  ASSERT_TRUE(s.OnKernelPlaced(2, test::Kernel("k", Req(2), p->server_ids)).ok());
  EXPECT_EQ(s.cluster().DemandGpus(), 2);
  EXPECT_TRUE(s.OnKernelRemoved(3, "k").ok());
  EXPECT_EQ(s.cluster().DemandGpus(), 0);
}

TEST(SchedulerTest, RequireIdleGpusSkipsBusyServers) {
  Scheduler s = WithServers(2);
  ASSERT_TRUE(s.OnGrantCommitted(1, {"", 0, "s0", Req(7, 0, 0)}).ok());
  auto p = s.RequestPlacement(
      2, {.kernel_id = "k", .request = Req(4), .replicas = 1, .require_idle_gpus = true});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->server_ids, std::vector<std::string>{"s1"});
  ASSERT_TRUE(s.OnGrantCommitted(3, {"", 0, "s1", Req(5, 0, 0)}).ok());
  p = s.RequestPlacement(
      4, {.kernel_id = "k", .request = Req(4), .replicas = 1, .require_idle_gpus = true});
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->scale_out_needed);
}

TEST(SchedulerTest, ExecutorPrefersLastExecutorThenMigrates) {
  Scheduler s = WithServers(4);
  ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel("k", Req(4), {"s0", "s1", "s2"})).ok());
  auto d = s.RequestExecutor(1, {.kernel_id = "k"});
  ASSERT_TRUE(d.ok());
  ASSERT_FALSE(d->choice.candidates.empty());
  const uint32_t first = d->choice.candidates[0];
  const std::string server = s.cluster().FindKernel("k")->FindReplica(first)->server_id;
  ASSERT_TRUE(s.OnGrantCommitted(2, {"k", first, server, Req(4, 0, 0)}).ok());
  EXPECT_EQ(s.cluster().FindKernel("k")->last_executor, first);
  ASSERT_TRUE(s.OnGrantReleased(3, {"k", first, server, Req(4, 0, 0)}).ok());
  d = s.RequestExecutor(4, {.kernel_id = "k"});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->choice.candidates[0], first);  // stickiness

  // Fill s0..s2: no replica can grant, s3 is the migration target.
  for (const char* id : {"s0", "s1", "s2"}) {
    ASSERT_TRUE(s.OnGrantCommitted(5, {"", 0, id, Req(6, 0, 0)}).ok());
  }
  d = s.RequestExecutor(6, {.kernel_id = "k"});
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->choice.candidates.empty());
  ASSERT_TRUE(d->migration.has_value());
  EXPECT_EQ(d->migration->to_server_id, "s3");
  EXPECT_FALSE(d->migration->scale_out_needed);
}

// Kernel a runs cell after cell on s0 while w waits for the same GPUs: once a's cell releases
// them they are w's, not a's next cell's.
TEST(SchedulerTest, CellsWaitingForGpusAreServedInTurn) {
  SchedulerOptions o = Options();
  o.gpu_wait_expiry_ms = 100;
  Scheduler s = WithServers(3, o);
  for (const char* id : {"a", "w"}) {
    ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel(id, Req(8), {"s0", "s1", "s2"})).ok());
  }
  for (const char* id : {"s1", "s2"}) {
    ASSERT_TRUE(s.OnGrantCommitted(0, {"", 0, id, Req(8, 0, 0)}).ok());
  }
  auto d = s.RequestExecutor(1, {.kernel_id = "a"});
  ASSERT_TRUE(d.ok());
  ASSERT_EQ(d->choice.candidates, std::vector<uint32_t>{1});
  ASSERT_TRUE(s.OnGrantCommitted(2, {"a", 1, "s0", Req(8, 0, 0)}).ok());
  EXPECT_FALSE(s.gpu_waiters().contains("a"));

  d = s.RequestExecutor(3, {.kernel_id = "w"});
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->choice.candidates.empty());
  EXPECT_TRUE(s.gpu_waiters().contains("w"));

  ASSERT_TRUE(s.OnGrantReleased(10, {"a", 1, "s0", Req(8, 0, 0)}).ok());
  d = s.RequestExecutor(11, {.kernel_id = "a"});  // a's next cell: s0 is held for w
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->choice.candidates.empty());
  d = s.RequestExecutor(12, {.kernel_id = "w"});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->choice.candidates, std::vector<uint32_t>{1});
  ASSERT_TRUE(s.OnGrantCommitted(13, {"w", 1, "s0", Req(8, 0, 0)}).ok());
  ASSERT_TRUE(s.OnGrantReleased(20, {"w", 1, "s0", Req(8, 0, 0)}).ok());
  // Now a is the one waiting: w's next cell waits behind it.
  d = s.RequestExecutor(21, {.kernel_id = "w"});
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->choice.candidates.empty());
  // A waiter that stops asking loses its place after the expiry: a last asked at 11, w at 21.
  d = s.RequestExecutor(200, {.kernel_id = "w"});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->choice.candidates, std::vector<uint32_t>{1});
  EXPECT_FALSE(s.gpu_waiters().contains("a"));
  // A GPU-less cell leaves the queue.
  d = s.RequestExecutor(201, {.kernel_id = "w", .gpus = 0});
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(s.gpu_waiters().contains("w"));
}

TEST(SchedulerTest, LostReplicaIsReplacedOnAServerWithoutAReplicaOfTheKernel) {
  Scheduler s = WithServers(5);
  ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel("k", Req(2), {"s0", "s1", "s2"})).ok());
  ASSERT_TRUE(s.OnServerAccepting(1, "s1", false).ok());
  // s3 is fuller (higher SR_h) than s4, so the replacement goes to s4 unless s3 is warm.
  ASSERT_TRUE(s.OnKernelPlaced(1, test::Kernel("other", Req(4), {"s3"})).ok());
  auto plan = s.RequestMove(2, {.kernel_id = "k", .replica_id = 2});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->replica_id, 2u);
  EXPECT_EQ(plan->from_server_id, "s1");
  EXPECT_EQ(plan->to_server_id, "s4");
  EXPECT_FALSE(plan->scale_out_needed);
  plan = s.RequestMove(3, {.kernel_id = "k", .replica_id = 2, .warm_servers = {"s3"}});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->to_server_id, "s3");
  EXPECT_TRUE(plan->target_warm);
  EXPECT_EQ(s.RequestMove(4, {.kernel_id = "k", .replica_id = 9}).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(s.RequestMove(4, {.kernel_id = "x", .replica_id = 1}).status().code(),
            StatusCode::kNotFound);
}

TEST(SchedulerTest, OperatorMoveNamesTheReplicaTheTargetOrNeither) {
  Scheduler s = WithServers(5);
  ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel("k", Req(2), {"s0", "s1", "s2"})).ok());
  auto plan = s.RequestMove(1, {.kernel_id = "k", .replica_id = 3, .to_server_id = "s3"});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->replica_id, 3u);
  EXPECT_EQ(plan->from_server_id, "s2");
  EXPECT_EQ(plan->to_server_id, "s3");
  plan = s.RequestMove(2, {.kernel_id = "k"});  // the core picks both
  ASSERT_TRUE(plan.ok());
  EXPECT_NE(plan->replica_id, 0u);
  EXPECT_TRUE(plan->to_server_id == "s3" || plan->to_server_id == "s4") << plan->to_server_id;
  EXPECT_EQ(s.RequestMove(3, {.kernel_id = "k", .to_server_id = "s1"}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(s.RequestMove(3, {.kernel_id = "k", .to_server_id = "nope"}).status().code(),
            StatusCode::kNotFound);
  ASSERT_TRUE(s.OnServerAccepting(4, "s4", false).ok());
  EXPECT_EQ(s.RequestMove(5, {.kernel_id = "k", .to_server_id = "s4"}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(SchedulerTest, ReplacementWithNoFreeServerAsksForScaleOut) {
  Scheduler s = WithServers(3);
  ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel("k", Req(2), {"s0", "s1", "s2"})).ok());
  ASSERT_TRUE(s.OnServerAccepting(1, "s2", false).ok());
  auto plan = s.RequestMove(2, {.kernel_id = "k", .replica_id = 3});
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->scale_out_needed);
  EXPECT_EQ(plan->replica_id, 3u);
}

TEST(SchedulerTest, RejectedGrantChangesNothing) {
  Scheduler s = WithServers(3);
  ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel("k", Req(1), {"s0", "s1", "s2"})).ok());
  // Wrong server for replica 1.
  EXPECT_EQ(s.OnGrantCommitted(1, {"k", 1, "s1", Req(1, 0, 0)}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(s.cluster().TotalCommitted().gpus, 0);
  EXPECT_EQ(s.cluster().FindKernel("k")->last_executor, 0u);
  // Over the spec.
  EXPECT_EQ(s.OnGrantCommitted(2, {"k", 1, "s0", Req(9, 0, 0)}).code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(s.cluster().FindKernel("k")->last_executor, 0u);
  EXPECT_EQ(s.RequestExecutor(3, {.kernel_id = "nope"}).status().code(), StatusCode::kNotFound);
}

TEST(SchedulerTest, TickSamplesAndScalesOnlyWithFullWindow) {
  SchedulerOptions o = Options();
  o.ratio_window = 3;
  Scheduler s = WithServers(3, o);
  ASSERT_TRUE(s.OnGrantCommitted(0, {"", 0, "s0", Req(8, 0, 0)}).ok());
  ASSERT_TRUE(s.OnGrantCommitted(0, {"", 0, "s1", Req(8, 0, 0)}).ok());
  ASSERT_TRUE(s.OnGrantCommitted(0, {"", 0, "s2", Req(8, 0, 0)}).ok());
  EXPECT_FALSE(s.OnTick(15000).scaling_evaluated);
  EXPECT_FALSE(s.OnTick(30000).scaling_evaluated);
  TickDecision t = s.OnTick(45000);
  EXPECT_TRUE(t.scaling_evaluated);
  EXPECT_EQ(t.busy_gpus, 24);
  EXPECT_EQ(t.scaling.add_hosts, 1);  // ⌈24 × 1.1 / 8⌉ = 4 hosts
  o.auto_scaling = false;
  Scheduler off = WithServers(3, o);
  for (int i = 1; i <= 4; ++i) EXPECT_FALSE(off.OnTick(i * 15000).scaling_evaluated);
}

SchedulerOptions RebalancingOptions() {
  SchedulerOptions o = Options();
  o.auto_scaling = false;
  o.rebalance.enabled = true;
  o.rebalance.max_per_tick = 1;
  o.rebalance.kernel_cooldown_ms = 60000;
  return o;
}

// Kernel k (8 GPUs) on s0..s2 with s3 idle: the state every rebalancing scenario starts from.
Scheduler WithIdleKernel(SchedulerOptions o = RebalancingOptions()) {
  Scheduler s = WithServers(4, o);
  EXPECT_TRUE(s.OnKernelPlaced(0, test::Kernel("k", Req(8), {"s0", "s1", "s2"})).ok());
  return s;
}

void FillReplicaServers(Scheduler& s, int64_t now_ms) {
  for (const char* id : {"s0", "s1", "s2"}) {
    ASSERT_TRUE(s.OnGrantCommitted(now_ms, {"", 0, id, Req(8, 0, 0)}).ok());
  }
}

TEST(SchedulerRebalanceTest, IdleKernelWithFullReplicaServersMovesToTheIdleServer) {
  Scheduler s = WithIdleKernel();
  FillReplicaServers(s, 1);
  TickDecision t = s.OnTick(15000);
  ASSERT_EQ(t.rebalance.size(), 1u);
  EXPECT_EQ(t.rebalance[0].kernel_id, "k");
  EXPECT_EQ(t.rebalance[0].plan.to_server_id, "s3");
  // The caller carries it out; the kernel is covered from then on.
  ASSERT_TRUE(s.OnReplicaAdded(15000, "k", 4, "s3").ok());
  ASSERT_TRUE(s.OnReplicaRemoved(15000, "k", t.rebalance[0].plan.replica_id).ok());
  EXPECT_TRUE(s.OnTick(30000).rebalance.empty());
}

TEST(SchedulerRebalanceTest, OffByDefaultAsTheGatewayRunsIt) {
  SchedulerOptions o = Options();
  o.auto_scaling = false;
  EXPECT_FALSE(o.rebalance.enabled);
  Scheduler s = WithIdleKernel(o);
  FillReplicaServers(s, 1);
  EXPECT_TRUE(s.OnTick(15000).rebalance.empty());
}

TEST(SchedulerRebalanceTest, NoMoveWhileACellRunsOrWaitsForAnExecutor) {
  Scheduler s = WithIdleKernel();
  // k's own cell runs on s0; s1 and s2 are taken by others.
  ASSERT_TRUE(s.OnGrantCommitted(1, {"k", 1, "s0", Req(8, 0, 0)}).ok());
  ASSERT_TRUE(s.OnGrantCommitted(1, {"", 0, "s1", Req(8, 0, 0)}).ok());
  ASSERT_TRUE(s.OnGrantCommitted(1, {"", 0, "s2", Req(8, 0, 0)}).ok());
  EXPECT_TRUE(s.OnTick(15000).rebalance.empty());
  // The cell ends and another kernel takes s0 at once: now k is idle and uncovered.
  ASSERT_TRUE(s.OnGrantReleased(20000, {"k", 1, "s0", Req(8, 0, 0)}).ok());
  ASSERT_TRUE(s.OnGrantCommitted(20000, {"", 0, "s0", Req(8, 0, 0)}).ok());
  // A cell asks for an executor (and, say, waits for a new server): still no proactive move.
  ASSERT_TRUE(s.OnGrantCommitted(20000, {"", 0, "s3", Req(8, 0, 0)}).ok());
  auto d = s.RequestExecutor(21000, {.kernel_id = "k"});
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->migration.has_value() && d->migration->scale_out_needed);
  ASSERT_TRUE(s.OnGrantReleased(22000, {"", 0, "s3", Req(8, 0, 0)}).ok());
  EXPECT_TRUE(s.OnTick(30000).rebalance.empty());
  // Once that cell has run and ended, the kernel may move.
  ASSERT_TRUE(s.OnReplicaAdded(31000, "k", 4, "s3").ok());
  ASSERT_TRUE(s.OnReplicaRemoved(31000, "k", 1).ok());
  ASSERT_TRUE(s.OnGrantCommitted(31000, {"k", 4, "s3", Req(8, 0, 0)}).ok());
  ASSERT_TRUE(s.OnGrantReleased(40000, {"k", 4, "s3", Req(8, 0, 0)}).ok());
  ASSERT_TRUE(s.OnGrantCommitted(40000, {"", 0, "s3", Req(8, 0, 0)}).ok());
  ASSERT_TRUE(s.OnServerJoined(41000, Server("s4", 8)).ok());
  TickDecision t = s.OnTick(45000);
  ASSERT_EQ(t.rebalance.size(), 1u);
  EXPECT_EQ(t.rebalance[0].plan.to_server_id, "s4");
}

TEST(SchedulerRebalanceTest, BoundPerTickAndCooldown) {
  SchedulerOptions o = RebalancingOptions();
  o.rebalance.max_per_tick = 2;
  Scheduler s = WithServers(6, o);
  for (const char* k : {"k1", "k2", "k3"}) {
    ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel(k, Req(8), {"s0", "s1", "s2"})).ok());
  }
  FillReplicaServers(s, 1);
  TickDecision t = s.OnTick(15000);
  ASSERT_EQ(t.rebalance.size(), 2u);
  // The caller skips both plans (e.g. it found the kernels busy): they are in cooldown anyway,
  // so the next tick moves only the third kernel.
  t = s.OnTick(30000);
  ASSERT_EQ(t.rebalance.size(), 1u);
  const std::string third = t.rebalance[0].kernel_id;
  EXPECT_TRUE(s.OnTick(45000).rebalance.empty());
  t = s.OnTick(75000);  // 60 s after the first two
  EXPECT_EQ(t.rebalance.size(), 2u);
  for (const RebalancePlan& p : t.rebalance) EXPECT_NE(p.kernel_id, third);
}

TEST(SchedulerRebalanceTest, NeverToAServerTheSameTickReleases) {
  SchedulerOptions o = RebalancingOptions();
  o.auto_scaling = true;
  o.ratio_window = 1;
  o.scaling.max_release_per_round = 1;
  Scheduler s = WithServers(5, o);  // s3, s4 idle; load 24 → target 4 (min 3): one goes
  ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel("k", Req(8), {"s0", "s1", "s2"})).ok());
  FillReplicaServers(s, 1);
  TickDecision t = s.OnTick(15000);
  ASSERT_TRUE(t.scaling_evaluated);
  ASSERT_EQ(t.scaling.release_server_ids, std::vector<std::string>{"s3"});
  ASSERT_EQ(t.rebalance.size(), 1u);
  EXPECT_EQ(t.rebalance[0].plan.to_server_id, "s4");
}

// Runs a fixed event sequence through a scheduler with a journal attached.
std::string RecordedJournal() {
  std::ostringstream out;
  SchedulerOptions o = Options();
  o.ratio_window = 2;
  Scheduler s(o);
  JournalWriter journal(out, o);
  s.set_observer(&journal);
  for (int i = 0; i < 4; ++i)
    EXPECT_TRUE(s.OnServerJoined(0, Server("s" + std::to_string(i), 8)).ok());
  auto p = s.RequestPlacement(10, {.kernel_id = "k", .request = Req(8)});
  EXPECT_TRUE(p.ok());
  EXPECT_TRUE(s.OnKernelPlaced(11, test::Kernel("k", Req(8), p->server_ids)).ok());
  auto d = s.RequestExecutor(12, {.kernel_id = "k", .warm_servers = {"s3"}});
  EXPECT_TRUE(d.ok());
  const uint32_t r = d->choice.candidates.at(0);
  const std::string server = s.cluster().FindKernel("k")->FindReplica(r)->server_id;
  EXPECT_TRUE(s.OnGrantCommitted(13, {"k", r, server, Req(8, 0, 0)}).ok());
  EXPECT_FALSE(s.OnGrantCommitted(13, {"k", r, server, Req(8, 0, 0)}).ok());  // journalled too
  s.OnTick(15000);
  s.OnTick(30000);
  EXPECT_TRUE(s.OnGrantReleased(31000, {"k", r, server, Req(8, 0, 0)}).ok());
  EXPECT_TRUE(s.OnReplicaAdded(32000, "k", 4, "s3").ok());
  EXPECT_TRUE(s.OnReplicaRemoved(32000, "k", 1).ok());
  EXPECT_TRUE(s.OnServerAccepting(33000, "s0", false).ok());
  EXPECT_TRUE(s.RequestMove(33500, {.kernel_id = "k", .replica_id = 4}).ok());
  EXPECT_TRUE(s.OnKernelRemoved(34000, "k").ok());
  EXPECT_TRUE(s.OnServerLeft(35000, "s0").ok());
  EXPECT_EQ(journal.records(), 18);
  return out.str();
}

TEST(JournalTest, RecordsReplayIdentically) {
  std::istringstream in(RecordedJournal());
  auto report = ReplayJournal(in);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->matched) << report->mismatch;
  EXPECT_EQ(report->records, 18);
}

TEST(JournalTest, EveryRecordRoundTrips) {
  std::istringstream in(RecordedJournal());
  std::string line;
  std::getline(in, line);
  ASSERT_TRUE(DecodeJournalHeader(line).ok());
  while (std::getline(in, line)) {
    auto record = DecodeJournalRecord(line);
    ASSERT_TRUE(record.ok()) << record.status().ToString();
    // Re-encoding the decoded input gives the same line (the outcome is kept as written).
    SchedulerOutcome dummy;
    std::string again = EncodeJournalRecord(record->seq, record->now_ms, record->event, dummy);
    auto a = line.substr(0, line.find("\"outcome\""));
    auto b = again.substr(0, again.find("\"outcome\""));
    EXPECT_EQ(a, b);
  }
}

TEST(JournalTest, CorruptedDecisionIsTheFirstMismatch) {
  std::string journal = RecordedJournal();
  // Replace the placement's chosen servers: record 5 is the placement.
  const size_t at = journal.find("\"server_ids\":[\"s");
  ASSERT_NE(at, std::string::npos);
  journal.replace(at, 16, "\"server_ids\":[\"x");
  std::istringstream in(journal);
  auto report = ReplayJournal(in);
  ASSERT_TRUE(report.ok());
  EXPECT_FALSE(report->matched);
  EXPECT_EQ(report->mismatch_seq, 5);
  EXPECT_NE(report->mismatch.find("placement"), std::string::npos) << report->mismatch;
}

TEST(JournalTest, RebalanceDecisionsReplayAndOldHeadersReadAsOff) {
  std::ostringstream out;
  const SchedulerOptions o = RebalancingOptions();
  {
    Scheduler s = WithIdleKernel(o);
    JournalWriter journal(out, o);
    s.set_observer(&journal);
    FillReplicaServers(s, 1);
    TickDecision t = s.OnTick(15000);
    ASSERT_EQ(t.rebalance.size(), 1u);
    ASSERT_TRUE(s.OnReplicaAdded(15000, "k", 4, "s3").ok());
    ASSERT_TRUE(s.OnReplicaRemoved(15000, "k", t.rebalance[0].plan.replica_id).ok());
    s.OnTick(30000);
  }
  // The journal starts after the servers and the kernel: prepend them so it replays alone.
  std::string journal = out.str();
  const std::string header = journal.substr(0, journal.find('\n') + 1);
  std::string prefix;
  {
    std::ostringstream pre;
    Scheduler s(o);
    JournalWriter w(pre, o);
    s.set_observer(&w);
    for (int i = 0; i < 4; ++i)
      ASSERT_TRUE(s.OnServerJoined(0, Server("s" + std::to_string(i), 8)).ok());
    ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel("k", Req(8), {"s0", "s1", "s2"})).ok());
    prefix = pre.str();
  }
  // Renumber: records only need increasing time, seq is informational.
  std::string full = prefix + journal.substr(header.size());
  EXPECT_NE(full.find("\"rebalance\":[{"), std::string::npos);
  EXPECT_NE(full.find("\"to_server_id\":\"s3\""), std::string::npos);
  std::istringstream in(full);
  auto report = ReplayJournal(in);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->matched) << report->mismatch;
  EXPECT_EQ(report->records, 5 + 3 + 1 + 2 + 1);

  // Replayed with rebalancing off, the tick's plan is a mismatch: the options matter.
  SchedulerOptions off = o;
  off.rebalance.enabled = false;
  std::istringstream mismatched(EncodeJournalHeader(off) + "\n" + full.substr(full.find('\n') + 1));
  report = ReplayJournal(mismatched);
  ASSERT_TRUE(report.ok());
  EXPECT_FALSE(report->matched);
  EXPECT_NE(report->mismatch.find("tick"), std::string::npos) << report->mismatch;

  // A header from before rebalancing existed decodes with it off.
  std::string old_header = EncodeJournalHeader(Options());
  const size_t at = old_header.find(",\"rebalance\":");
  ASSERT_NE(at, std::string::npos);
  old_header.erase(at, old_header.find('}', at) + 1 - at);
  const size_t pack = old_header.find(",\"pack_gpus\":false");
  ASSERT_NE(pack, std::string::npos);
  old_header.erase(pack, std::string(",\"pack_gpus\":false").size());
  auto decoded = DecodeJournalHeader(old_header);
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString() << " " << old_header;
  EXPECT_FALSE(decoded->rebalance.enabled);
  EXPECT_FALSE(decoded->pack_gpus);
  SchedulerOptions packed = o;
  packed.pack_gpus = true;
  packed.rebalance.spare_servers_max_replicas = 4;
  packed.rebalance.releasable_target_idle_max_ms = 123;
  auto roundtrip = DecodeJournalHeader(EncodeJournalHeader(packed));
  ASSERT_TRUE(roundtrip.ok());
  EXPECT_TRUE(roundtrip->rebalance.enabled);
  EXPECT_EQ(roundtrip->rebalance.max_per_tick, 1);
  EXPECT_EQ(roundtrip->rebalance.kernel_cooldown_ms, 60000);
  EXPECT_TRUE(roundtrip->pack_gpus);
  EXPECT_EQ(roundtrip->rebalance.spare_servers_max_replicas, 4);
  EXPECT_EQ(roundtrip->rebalance.releasable_target_idle_max_ms, 123);
}

TEST(JournalTest, MalformedJournalIsAnError) {
  std::istringstream empty("");
  EXPECT_FALSE(ReplayJournal(empty).ok());
  std::istringstream bad_header("{\"journal\":\"other\"}\n");
  EXPECT_FALSE(ReplayJournal(bad_header).ok());
  std::istringstream bad_record(EncodeJournalHeader(Options()) + "\n{\"seq\":1}\n");
  auto r = ReplayJournal(bad_record);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("line 2"), std::string::npos);
  std::istringstream unknown(EncodeJournalHeader(Options()) +
                             "\n{\"seq\":1,\"t_ms\":0,\"event\":\"boom\",\"input\":{},"
                             "\"outcome\":{}}\n");
  EXPECT_FALSE(ReplayJournal(unknown).ok());
}

}  // namespace
}  // namespace nbos::sched

namespace nbos::sched {
namespace {

// Kernel k (8 GPUs) on s0..s2 has run `cells` cells of 1 minute, each 1 minute after the last
// one ended; the last one ended at the returned time.
int64_t RunShortGappedCells(Scheduler& s, int cells) {
  EXPECT_TRUE(s.OnKernelPlaced(0, test::Kernel("k", Req(8), {"s0", "s1", "s2"})).ok());
  int64_t t = 60000;
  for (int i = 0; i < cells; ++i) {
    EXPECT_TRUE(s.RequestExecutor(t, {.kernel_id = "k", .gpus = 8}).ok());
    EXPECT_TRUE(s.OnGrantCommitted(t, {"k", 1, "s0", Req(8, 0, 0)}).ok());
    t += 60000;
    EXPECT_TRUE(s.OnGrantReleased(t, {"k", 1, "s0", Req(8, 0, 0)}).ok());
    t += 60000;
  }
  return t - 60000;
}

// Every tick scales; the forecast looks 2 minutes ahead.
SchedulerOptions ForecastOptionsTwoMinutes() {
  SchedulerOptions o = Options();
  o.ratio_window = 1;
  o.forecast.enabled = true;
  o.forecast.horizon_ms = 120000;
  return o;
}

TEST(SchedulerForecastTest, AnIdleKernelThatComesBackSoonIsLoadForScaling) {
  SchedulerOptions o = ForecastOptionsTwoMinutes();
  Scheduler s = WithServers(3, o);
  const int64_t end_ms = RunShortGappedCells(s, 5);
  // Every gap so far was 1 minute: an 8-GPU kernel idle for 15 s is back within 2 minutes.
  TickDecision t = s.OnTick(end_ms + 15000);
  EXPECT_NEAR(t.forecast_gpus, 8.0, 1e-9);
  ASSERT_TRUE(t.scaling_evaluated);
  EXPECT_EQ(t.scaling.add_hosts, 0);  // ⌈8 × 1.10 / 8⌉ = 2 < 3 hosts
  EXPECT_NE(t.scaling.reason.find("forecast 8"), std::string::npos) << t.scaling.reason;
  // Idle for 10 minutes, longer than any gap it had: the forecast no longer counts it.
  t = s.OnTick(end_ms + 600000);
  EXPECT_LT(t.forecast_gpus, 1.0);
}

TEST(SchedulerForecastTest, IdleServersAreWantedForLikelyWholeServerCells) {
  SchedulerOptions o = ForecastOptionsTwoMinutes();
  o.forecast.idle_servers_z = 3;
  Scheduler s = WithServers(3, o);
  const int64_t end_ms = RunShortGappedCells(s, 5);
  // Back within 2 minutes for sure, with 8 GPUs after 8 every time: one whole-server cell, no
  // variance.
  TickDecision t = s.OnTick(end_ms + 15000);
  EXPECT_EQ(t.idle_servers_wanted, 1);
  ASSERT_TRUE(t.scaling_evaluated);
  EXPECT_NE(t.scaling.reason.find("(3 idle, 1 wanted)"), std::string::npos) << t.scaling.reason;
  // While its cell runs the kernel is not idle: nothing is wanted for it.
  ASSERT_TRUE(s.RequestExecutor(end_ms + 20000, {.kernel_id = "k", .gpus = 8}).ok());
  ASSERT_TRUE(s.OnGrantCommitted(end_ms + 20000, {"k", 1, "s0", Req(8, 0, 0)}).ok());
  t = s.OnTick(end_ms + 30000);
  EXPECT_EQ(t.idle_servers_wanted, 0);
  EXPECT_EQ(t.scaling.reason.find("wanted"), std::string::npos) << t.scaling.reason;
  // Off (the default): none are counted.
  o.forecast.idle_servers_z = -1;
  Scheduler off = WithServers(3, o);
  EXPECT_EQ(off.OnTick(RunShortGappedCells(off, 5) + 15000).idle_servers_wanted, 0);
}

// k's 1-GPU cells are followed by an 8-GPU one one time in five, a minute apart: its cover is 1
// GPU (0.2 < cover_chance 0.25), which its replica servers s0..s2 have beside b0..b2's 4 GPUs each,
// but none has 8; s3 is wholly idle.
TEST(SchedulerForecastTest, AKernelThatMayNeedAWholeServerIsKeptNextToOne) {
  for (const double whole_min : {-1.0, 0.1, 0.3}) {
    SchedulerOptions o = ForecastOptionsTwoMinutes();
    o.auto_scaling = false;  // s3 stays
    o.rebalance.enabled = true;
    o.forecast.whole_cover_min_chance = whole_min;
    Scheduler s = WithServers(4, o);
    ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel("k", Req(8), {"s0", "s1", "s2"})).ok());
    int64_t t = 60000;
    for (const int32_t gpus : {1, 1, 1, 1, 1, 8, 1}) {
      ASSERT_TRUE(s.RequestExecutor(t, {.kernel_id = "k", .gpus = gpus}).ok());
      ASSERT_TRUE(s.OnGrantCommitted(t, {"k", 1, "s0", Req(gpus, 0, 0)}).ok());
      ASSERT_TRUE(s.OnGrantReleased(t + 60000, {"k", 1, "s0", Req(gpus, 0, 0)}).ok());
      t += 120000;
    }
    t -= 60000;  // k's last cell ended then
    const std::vector<std::string> servers = {"s0", "s1", "s2"};
    for (size_t i = 0; i < servers.size(); ++i) {
      const std::string b = "b" + std::to_string(i);
      ASSERT_TRUE(s.OnKernelPlaced(t, test::Kernel(b, Req(4), {servers[i], "s3"})).ok());
      ASSERT_TRUE(s.OnGrantCommitted(t, {b, 1, servers[i], Req(4, 0, 0)}).ok());
    }
    // Back within 2 minutes for sure; P(8 GPUs) = 0.2.
    const TickDecision tick = s.OnTick(t + 15000);
    if (whole_min < 0 || whole_min > 0.2) {
      EXPECT_TRUE(tick.rebalance.empty()) << whole_min;
    } else {
      ASSERT_EQ(tick.rebalance.size(), 1u);
      EXPECT_EQ(tick.rebalance[0].kernel_id, "k");
      EXPECT_EQ(tick.rebalance[0].plan.to_server_id, "s3");
      EXPECT_NE(tick.rebalance[0].plan.from_server_id, "s0") << "the last executor stays";
    }
  }
}

TEST(SchedulerForecastTest, OffByDefaultAsTheGatewayRunsIt) {
  SchedulerOptions o = Options();
  o.ratio_window = 1;
  EXPECT_FALSE(o.forecast.enabled);
  Scheduler s = WithServers(3, o);
  const int64_t end_ms = RunShortGappedCells(s, 5);
  TickDecision t = s.OnTick(end_ms + 15000);
  EXPECT_EQ(t.forecast_gpus, 0);
  EXPECT_EQ(t.scaling.reason.find("forecast"), std::string::npos);
}

// k (8 GPUs, on s0..s2) runs cells a minute apart while b and c hold s1 and s2 whole: of k's
// servers only s0 has its next cell's GPUs idle. s4 (c's replica) is as idle and as subscribed.
TEST(SchedulerForecastTest, ScaleInKeepsTheServerALikelyKernelReliesOnAlone) {
  for (const int32_t max_pinning : {-1, 0}) {
    SchedulerOptions o = Options();
    o.ratio_window = 1;
    o.forecast.enabled = true;
    o.forecast.horizon_ms = 120000;
    o.scaling.release_max_pinning_replicas = max_pinning;
    Scheduler s = WithServers(5, o);
    ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel("b", Req(8), {"s1", "s2", "s3"})).ok());
    ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel("c", Req(8), {"s2", "s3", "s4"})).ok());
    ASSERT_TRUE(s.OnGrantCommitted(0, {"b", 1, "s1", Req(8, 0, 0)}).ok());
    ASSERT_TRUE(s.OnGrantCommitted(0, {"c", 1, "s2", Req(8, 0, 0)}).ok());
    const int64_t end_ms = RunShortGappedCells(s, 5);
    // Load 16 + forecast 8: target and limit 4 of 5 hosts, so one idle host goes. s0 and s4 tie
    // on subscription (s0 first by id), but k, likely back within 2 minutes, relies on s0.
    TickDecision t = s.OnTick(end_ms + 15000);
    ASSERT_TRUE(t.scaling_evaluated);
    EXPECT_EQ(t.scaling.release_server_ids,
              (std::vector<std::string>{max_pinning < 0 ? "s0" : "s4"}))
        << t.scaling.reason;
    // After 10 minutes, longer than any gap k had, k pins nothing: limit 3, s0 and s4 go.
    t = s.OnTick(end_ms + 600000);
    EXPECT_EQ(t.scaling.release_server_ids, (std::vector<std::string>{"s0", "s4"}))
        << t.scaling.reason;
  }
}

// A likely kernel covered by two wholly idle servers keeps one of them, not both.
TEST(SchedulerForecastTest, AKernelCoveredByTwoIdleServersKeepsOne) {
  SchedulerOptions o = ForecastOptionsTwoMinutes();
  o.scaling.release_max_pinning_replicas = 0;
  Scheduler s = WithServers(5, o);
  ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel("b", Req(8), {"s1", "s3", "s4"})).ok());
  ASSERT_TRUE(s.OnGrantCommitted(0, {"b", 1, "s1", Req(8, 0, 0)}).ok());
  const int64_t end_ms = RunShortGappedCells(s, 5);
  // Load 8 + 8: target max(⌈17.6 / 8⌉, 3) = 3, limit 3: two of the idle s0, s2, s3, s4 go
  // (equally subscribed: by id). k's 8 GPUs are idle on s0 and s2; it keeps s2, the later one.
  TickDecision t = s.OnTick(end_ms + 15000);
  EXPECT_EQ(t.scaling.release_server_ids, (std::vector<std::string>{"s0", "s3"}))
      << t.scaling.reason;
  // Once b's GPUs are released, s1 is idle too and b is a likely idle kernel: both keep s1,
  // the most subscribed of their covering servers (a replica of each), and s0 and s2 go.
  ASSERT_TRUE(s.OnGrantReleased(end_ms + 20000, {"b", 1, "s1", Req(8, 0, 0)}).ok());
  t = s.OnTick(end_ms + 30000);
  EXPECT_EQ(t.scaling.release_server_ids, (std::vector<std::string>{"s0", "s2"}))
      << t.scaling.reason;
}

// k (8 GPUs, on s0..s2), likely back soon, has its 8 GPUs idle only on s0 (b and c hold s1 and
// s2). m's 4-GPU cell can run on s0, s3 or s4, all wholly idle: best fit alone takes s0, its first
// replica's (s0, s3 and s4 are equally idle); sparing covers takes s3 and leaves k's only cover
// whole.
TEST(SchedulerForecastTest, ExecutorChoiceSparesTheOnlyCoverOfALikelyKernel) {
  for (const double spare : {-1.0, 0.1}) {
    SchedulerOptions o = Options();
    o.pack_gpus = true;
    o.forecast.enabled = true;
    o.forecast.horizon_ms = 120000;
    o.forecast.spare_cover_min_chance = spare;
    Scheduler s = WithServers(5, o);
    ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel("b", Req(8), {"s1", "s3", "s4"})).ok());
    ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel("c", Req(8), {"s2", "s3", "s4"})).ok());
    ASSERT_TRUE(s.OnKernelPlaced(0, test::Kernel("m", Req(4), {"s0", "s3", "s4"})).ok());
    ASSERT_TRUE(s.OnGrantCommitted(0, {"b", 1, "s1", Req(8, 0, 0)}).ok());
    ASSERT_TRUE(s.OnGrantCommitted(0, {"c", 1, "s2", Req(8, 0, 0)}).ok());
    const int64_t end_ms = RunShortGappedCells(s, 5);
    auto d = s.RequestExecutor(end_ms + 15000, {.kernel_id = "m", .gpus = 4});
    ASSERT_TRUE(d.ok());
    const std::vector<uint32_t> want =
        spare < 0 ? std::vector<uint32_t>{1, 2, 3} : std::vector<uint32_t>{2, 3, 1};
    EXPECT_EQ(d->choice.candidates, want) << "spare_cover_min_chance " << spare;
  }
}

TEST(SchedulerForecastTest, TheJournalHeaderKeepsTheForecastOptions) {
  SchedulerOptions o = Options();
  o.forecast.enabled = true;
  o.forecast.horizon_ms = 90000;
  o.rebalance.min_return_chance = 0.25;
  o.forecast.pin_min_chance = 0.3;
  o.scaling.release_max_pinning_replicas = 1;
  o.rebalance.spare_whole_min_chance = 0.2;
  o.forecast.spare_cover_min_chance = 0.15;
  Result<SchedulerOptions> back = DecodeJournalHeader(EncodeJournalHeader(o));
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(back->forecast.enabled);
  EXPECT_EQ(back->forecast.horizon_ms, 90000);
  EXPECT_EQ(back->rebalance.min_return_chance, 0.25);
  EXPECT_EQ(back->forecast.pin_min_chance, 0.3);
  EXPECT_EQ(back->scaling.release_max_pinning_replicas, 1);
  EXPECT_EQ(back->rebalance.spare_whole_min_chance, 0.2);
  EXPECT_EQ(back->forecast.spare_cover_min_chance, 0.15);
  EXPECT_EQ(back->forecast.idle_servers_z, -1);  // off, and not written
  EXPECT_EQ(back->forecast.whole_cover_min_chance, -1);
  EXPECT_EQ(EncodeJournalHeader(o).find("idle_servers"), std::string::npos);
  EXPECT_EQ(EncodeJournalHeader(o).find("whole_cover"), std::string::npos);
  EXPECT_EQ(back->rebalance.make_room_chance_ratio, -1);
  EXPECT_EQ(EncodeJournalHeader(o).find("make_room"), std::string::npos);
  o.forecast.idle_servers_z = 2.5;
  o.rebalance.make_room_chance_ratio = 0.5;
  o.forecast.whole_cover_min_chance = 0.05;
  o.scaling.release_idle_servers_margin = 2;
  back = DecodeJournalHeader(EncodeJournalHeader(o));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->forecast.idle_servers_z, 2.5);
  EXPECT_EQ(back->scaling.release_idle_servers_margin, 2);
  EXPECT_EQ(back->forecast.whole_cover_min_chance, 0.05);
  EXPECT_EQ(back->rebalance.make_room_chance_ratio, 0.5);
  o.forecast.enabled = false;
  EXPECT_EQ(EncodeJournalHeader(o).find("forecast"), std::string::npos);
  EXPECT_EQ(EncodeJournalHeader(o).find("pinning"), std::string::npos);
}

}  // namespace
}  // namespace nbos::sched
