#include "sched/rebalance.h"

#include <gtest/gtest.h>

#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "sched/test_util.h"

namespace nbos::sched {
namespace {

using test::Cluster;
using test::Gpus;
using test::Kernel;
using test::Req;
using test::Server;

RebalanceOptions On(int32_t max_per_tick = 4) {
  RebalanceOptions o;
  o.enabled = true;
  o.max_per_tick = max_per_tick;
  o.kernel_cooldown_ms = 60000;
  o.min_gpus = 1;
  return o;
}

RebalanceOptions Spare(int32_t max_replicas, int64_t idle_max_ms) {
  RebalanceOptions o = On();
  o.spare_servers_max_replicas = max_replicas;
  o.releasable_target_idle_max_ms = idle_max_ms;
  return o;
}

struct KernelSpec {
  std::string id;
  int32_t request_gpus;
  std::vector<std::string> servers;
  int32_t gpus_needed;
  int64_t last_active_ms = 0;
  int64_t last_rebalanced_ms = std::numeric_limits<int64_t>::lowest();
  uint32_t last_executor = 0;
};

struct Case {
  std::string name;
  std::vector<std::pair<std::string, int32_t>> committed;  // server, GPUs busy (8-GPU servers)
  std::vector<std::string> not_accepting;
  std::vector<KernelSpec> kernels;
  RebalanceOptions options = On();
  std::vector<std::string> excluded;
  // Expected plans: "kernel:replica_id:from->to", in order.
  std::vector<std::string> want;
};

std::string Show(const RebalancePlan& p) {
  return p.kernel_id + ":" + std::to_string(p.plan.replica_id) + ":" + p.plan.from_server_id +
         "->" + p.plan.to_server_id;
}

class RebalanceCase : public testing::TestWithParam<Case> {};

TEST_P(RebalanceCase, Plans) {
  const Case& c = GetParam();
  ClusterState cluster = Cluster({Server("a", 8), Server("b", 8), Server("c", 8), Server("d", 8),
                                  Server("e", 8), Server("f", 8)});
  for (const auto& [server, gpus] : c.committed)
    ASSERT_TRUE(cluster.Commit(server, Gpus(gpus)).ok());
  for (const std::string& s : c.not_accepting) ASSERT_TRUE(cluster.SetAccepting(s, false).ok());
  for (const KernelSpec& k : c.kernels) {
    KernelView v = Kernel(k.id, Req(k.request_gpus), k.servers);
    v.last_executor = k.last_executor;
    ASSERT_TRUE(cluster.AddKernel(v).ok()) << k.id;
  }
  std::vector<IdleKernel> idle;
  for (const KernelSpec& k : c.kernels) {
    idle.push_back(
        {cluster.FindKernel(k.id), k.gpus_needed, k.last_active_ms, k.last_rebalanced_ms});
  }
  const std::set<std::string, std::less<>> excluded(c.excluded.begin(), c.excluded.end());
  std::vector<std::string> got;
  for (const RebalancePlan& p :
       ChooseRebalance(cluster, idle, 1000000, c.options, excluded).plans) {
    EXPECT_FALSE(p.plan.scale_out_needed);
    EXPECT_FALSE(p.plan.reason.empty());
    got.push_back(Show(p));
  }
  EXPECT_EQ(got, c.want);
}

// Servers a..f have 8 GPUs each. "full" = a, b, c busy with 8 GPUs each.
const std::vector<std::pair<std::string, int32_t>> kFull = {{"a", 8}, {"b", 8}, {"c", 8}};

INSTANTIATE_TEST_SUITE_P(
    Cases, RebalanceCase,
    testing::Values(
        Case{.name = "MovesToTheIdleServer",
             .committed = {{"a", 8}, {"b", 8}, {"c", 8}, {"e", 8}, {"f", 8}},
             .kernels = {{"k", 8, {"a", "b", "c"}, 8}},
             .want = {"k:1:a->d"}},
        Case{.name = "NoMoveWhenAReplicaServerHasTheGpus",
             .committed = {{"a", 8}, {"b", 8}},
             .kernels = {{"k", 8, {"a", "b", "c"}, 8}},
             .want = {}},
        Case{.name = "NeedIsTheCellsNotTheRequest",  // 2 idle GPUs on c fit a 2-GPU cell
             .committed = {{"a", 8}, {"b", 8}, {"c", 6}},
             .kernels = {{"k", 8, {"a", "b", "c"}, 2}},
             .want = {}},
        Case{.name = "BelowMinGpusStays",
             .committed = kFull,
             .kernels = {{"k", 8, {"a", "b", "c"}, 4}},
             .options =
                 [] {
                   RebalanceOptions o = On();
                   o.min_gpus = 8;
                   return o;
                 }(),
             .want = {}},
        Case{.name = "DisabledPlansNothing",
             .committed = kFull,
             .kernels = {{"k", 8, {"a", "b", "c"}, 8}},
             .options = RebalanceOptions{},
             .want = {}},
        Case{.name = "BoundPerTickMostRecentlyActiveFirst",
             .committed = kFull,
             .kernels = {{"k1", 8, {"a", "b", "c"}, 8, 100},
                         {"k2", 8, {"a", "b", "c"}, 8, 300},
                         {"k3", 8, {"a", "b", "c"}, 8, 200}},
             .options = On(2),
             .want = {"k2:1:a->d", "k3:1:a->e"}},
        Case{.name = "CooldownStopsPingPong",
             .committed = kFull,
             .kernels = {{"k1", 8, {"a", "b", "c"}, 8, 0, 1000000 - 59999},
                         {"k2", 8, {"a", "b", "c"}, 8, 0, 1000000 - 60000}},
             .want = {"k2:1:a->d"}},
        Case{.name = "ReleasingServersAreNotTargets",
             .committed = kFull,
             .kernels = {{"k", 8, {"a", "b", "c"}, 8}},
             .excluded = {"d", "e"},
             .want = {"k:1:a->f"}},
        Case{.name = "NotAcceptingServersAreNotTargetsAndTheirReplicasMoveFirst",
             .committed = {{"a", 8}, {"b", 8}},
             .not_accepting = {"c", "d"},
             .kernels = {{"k", 8, {"a", "b", "c"}, 8}},
             .want = {"k:3:c->e"}},
        Case{.name = "SpreadsKernelsOverTargets",  // k1 relies on d alone, so k2 goes to e
             .committed = {{"a", 8}, {"b", 8}, {"c", 8}, {"f", 8}},
             .kernels = {{"k1", 8, {"a", "b", "d"}, 8, 500}, {"k2", 8, {"a", "b", "c"}, 8, 400}},
             .want = {"k2:1:a->e"}},
        Case{.name = "TightestFitTarget",
             .committed = {{"a", 8}, {"b", 8}, {"c", 8}, {"d", 4}, {"e", 2}},
             .kernels = {{"k", 4, {"a", "b", "c"}, 4}},
             .want = {"k:1:a->d"}},
        Case{.name = "LastExecutorStaysAndTheMostSubscribedGoes",
             .committed = kFull,
             .kernels = {{"k", 8, {"a", "b", "c"}, 8, 0, std::numeric_limits<int64_t>::lowest(), 1},
                         {"x", 1, {"c"}, 0}},
             .want = {"k:3:c->d"}},
        // spare_servers_max_replicas 2: e holds 3 replicas (x1..x3) and is kept by scale-in
        // anyway; d holds none and could be released.
        Case{.name = "TargetsThatScaleInKeepsComeFirst",
             .committed = {{"a", 8}, {"b", 8}, {"c", 8}, {"f", 8}},
             .kernels = {{"k", 8, {"a", "b", "c"}, 8, 1000000},
                         {"x1", 1, {"e"}, 0},
                         {"x2", 1, {"e"}, 0},
                         {"x3", 1, {"e"}, 0}},
             .options = Spare(2, 3600000),
             .want = {"k:1:a->e"}},
        Case{.name = "RecentKernelMayPinAReleasableServer",
             .committed = {{"a", 8}, {"b", 8}, {"c", 8}, {"e", 8}, {"f", 8}},
             .kernels = {{"k", 8, {"a", "b", "c"}, 8, 1000000 - 3600000}},
             .options = Spare(2, 3600000),
             .want = {"k:1:a->d"}},
        Case{.name = "LongIdleKernelDoesNotPinAReleasableServer",
             .committed = {{"a", 8}, {"b", 8}, {"c", 8}, {"e", 8}, {"f", 8}},
             .kernels = {{"k", 8, {"a", "b", "c"}, 8, 1000000 - 3600001}},
             .options = Spare(2, 3600000),
             .want = {}},
        Case{.name = "ReplicaWhoseMoveMakesItsServerReleasableGoesFirst",
             // b holds 3 replicas (k, x1, x2), one over the limit; c holds 4 and a higher SR_h.
             .committed = {{"a", 8}, {"b", 8}, {"c", 8}, {"e", 8}, {"f", 8}},
             .kernels = {{"k", 8, {"a", "b", "c"}, 8, 1000000},
                         {"x1", 1, {"b"}, 0},
                         {"x2", 1, {"b"}, 0},
                         {"x3", 2, {"c"}, 0},
                         {"x4", 2, {"c"}, 0},
                         {"x5", 2, {"c"}, 0}},
             .options = Spare(2, 3600000),
             .want = {"k:2:b->d"}},
        Case{.name = "NoTargetNoPlan",
             .committed = {{"a", 8}, {"b", 8}, {"c", 8}, {"d", 8}, {"e", 8}, {"f", 8}},
             .kernels = {{"k", 8, {"a", "b", "c"}, 8}},
             .want = {}}),
    [](const testing::TestParamInfo<Case>& p) { return p.param.name; });

TEST(RebalanceTest, CountsThisDecisionsReplicasAgainstTargetRoom) {
  // d has CPU room for one more 1-core replica only: the second kernel must go elsewhere.
  ClusterState cluster = Cluster(
      {Server("a", 8), Server("b", 8), Server("c", 8), Server("d", 8, 1000), Server("e", 8)});
  for (const char* s : {"a", "b", "c"}) ASSERT_TRUE(cluster.Commit(s, Gpus(8)).ok());
  ASSERT_TRUE(cluster.AddKernel(Kernel("k1", Req(8), {"a", "b", "c"})).ok());
  ASSERT_TRUE(cluster.AddKernel(Kernel("k2", Req(8), {"a", "b", "c"})).ok());
  std::vector<IdleKernel> idle = {{cluster.FindKernel("k1"), 8, 2},
                                  {cluster.FindKernel("k2"), 8, 1}};
  const auto plans = ChooseRebalance(cluster, idle, 0, On()).plans;
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(plans[0].plan.to_server_id, "d");
  EXPECT_EQ(plans[1].plan.to_server_id, "e");
}

// k's 1-GPU cell would run on a (wholly idle) or break it up: b and c are full, d holds 4 GPUs
// busy, e and f are wholly idle. u has no replica server with 8 idle GPUs.
struct SpareWhole {
  ClusterState cluster = Cluster({Server("a", 8), Server("b", 8), Server("c", 8), Server("d", 8),
                                  Server("e", 8), Server("f", 8)});
  SpareWhole() {
    for (const auto& [server, gpus] :
         std::vector<std::pair<std::string, int32_t>>{{"b", 8}, {"c", 8}, {"d", 4}}) {
      EXPECT_TRUE(cluster.Commit(server, Gpus(gpus)).ok());
    }
    EXPECT_TRUE(cluster.AddKernel(Kernel("k", Req(8), {"a", "b", "c"})).ok());
    EXPECT_TRUE(cluster.AddKernel(Kernel("u", Req(8), {"b", "c", "d"})).ok());
  }
  std::vector<std::string> Plans(int32_t k_needs, double k_chance, const RebalanceOptions& o,
                                 bool with_u = false) {
    std::vector<IdleKernel> idle = {
        {cluster.FindKernel("k"), k_needs, 0, std::numeric_limits<int64_t>::lowest(), k_chance}};
    if (with_u) {
      idle.push_back({cluster.FindKernel("u"), 8, 0, std::numeric_limits<int64_t>::lowest(), 0.05});
    }
    std::vector<std::string> got;
    for (const RebalancePlan& p : ChooseRebalance(cluster, idle, 1000000, o).plans) {
      got.push_back(Show(p));
    }
    return got;
  }
};

TEST(RebalanceTest, ALikelySmallCellSparesAWhollyIdleServer) {
  SpareWhole c;
  RebalanceOptions o = On();
  EXPECT_EQ(c.Plans(1, 0.5, o), std::vector<std::string>{});  // off by default
  o.spare_whole_min_chance = 0.1;
  // To d (partly busy), not to e or f; a replica on a full server (b or c) goes, not a's.
  const std::vector<std::string> got = c.Plans(1, 0.5, o);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].substr(0, 2), "k:");
  EXPECT_EQ(got[0].substr(got[0].size() - 3), "->d");
  EXPECT_EQ(got[0].find(":a->"), std::string::npos) << "the covering replica stays";
  // Not for an unlikely kernel, nor for a whole-server cell, nor when d has no room.
  EXPECT_EQ(c.Plans(1, 0.05, o), std::vector<std::string>{});
  EXPECT_EQ(c.Plans(8, 0.5, o), std::vector<std::string>{});
  EXPECT_EQ(c.Plans(5, 0.5, o), std::vector<std::string>{});
  // An uncovered kernel moves first when the bound allows one plan only.
  o.max_per_tick = 1;
  const std::vector<std::string> first = c.Plans(1, 0.5, o, /*with_u=*/true);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].substr(0, 2), "u:");
}

TEST(RebalanceTest, ASmallCellCoveredByAPartlyBusyServerStays) {
  SpareWhole c;
  ASSERT_TRUE(c.cluster.Release("b", Gpus(4)).ok());  // b: 4 of 8 busy, so it covers k's 1 GPU
  RebalanceOptions o = On();
  o.spare_whole_min_chance = 0.1;
  EXPECT_EQ(c.Plans(1, 0.5, o), std::vector<std::string>{});
}

// Two likely 8-GPU kernels rely on a alone (b, c, d are full); e is wholly idle too. The
// likelier one keeps a, the other moves to e when their chances together reach the threshold.
TEST(RebalanceTest, AKernelWhoseOnlyWholeServerLikelierKernelsRelyOnMoves) {
  ClusterState cluster =
      Cluster({Server("a", 8), Server("b", 8), Server("c", 8), Server("d", 8), Server("e", 8)});
  for (const char* s : {"b", "c", "d"}) ASSERT_TRUE(cluster.Commit(s, Gpus(8)).ok());
  ASSERT_TRUE(cluster.AddKernel(Kernel("k1", Req(8), {"a", "b", "c"})).ok());
  ASSERT_TRUE(cluster.AddKernel(Kernel("k2", Req(8), {"a", "c", "d"})).ok());
  const int64_t never = std::numeric_limits<int64_t>::lowest();
  auto plans = [&](double k1_chance, double k2_chance, int32_t k2_needs, double threshold) {
    RebalanceOptions o = On();
    o.contended_cover_chance = threshold;
    // k2 first: the order of the list must not matter, only the chances.
    std::vector<IdleKernel> idle = {{cluster.FindKernel("k2"), k2_needs, 0, never, k2_chance},
                                    {cluster.FindKernel("k1"), 8, 0, never, k1_chance}};
    std::vector<std::string> got;
    for (const RebalancePlan& p : ChooseRebalance(cluster, idle, 1000000, o).plans) {
      got.push_back(Show(p));
    }
    return got;
  };
  EXPECT_EQ(plans(0.6, 0.4, 8, -1), std::vector<std::string>{});  // off
  const std::vector<std::string> moved = plans(0.6, 0.4, 8, 0.3);
  ASSERT_EQ(moved.size(), 1u);
  EXPECT_EQ(moved[0].substr(0, 3), "k2:");
  EXPECT_EQ(moved[0].substr(moved[0].size() - 3), "->e");
  EXPECT_EQ(moved[0].find(":a->"), std::string::npos) << "the covering replica stays";
  // The likelier kernel stays whichever comes first in the list.
  const std::vector<std::string> other = plans(0.3, 0.5, 8, 0.3);
  ASSERT_EQ(other.size(), 1u);
  EXPECT_EQ(other[0].substr(0, 3), "k1:");
  // Not while the likelier one's chance is below the threshold, nor for a cell that two could
  // share (4 of 8 GPUs).
  EXPECT_EQ(plans(0.2, 0.1, 8, 0.3), std::vector<std::string>{});
  EXPECT_EQ(plans(0.6, 0.4, 4, 0.3), std::vector<std::string>{});
}

// k is listed twice, once for 1 GPU and once for a whole server, and neither is covered (a, b,
// c are full); d and e are wholly idle. It moves one replica, for the likelier entry's need.
TEST(RebalanceTest, AKernelListedTwiceMovesOneReplicaPerCall) {
  ClusterState cluster =
      Cluster({Server("a", 8), Server("b", 8), Server("c", 8), Server("d", 8), Server("e", 8)});
  for (const char* s : {"a", "b", "c"}) ASSERT_TRUE(cluster.Commit(s, Gpus(8)).ok());
  ASSERT_TRUE(cluster.AddKernel(Kernel("k", Req(8), {"a", "b", "c"})).ok());
  const int64_t never = std::numeric_limits<int64_t>::lowest();
  const std::vector<IdleKernel> idle = {{cluster.FindKernel("k"), 1, 0, never, 0.5},
                                        {cluster.FindKernel("k"), 8, 0, never, 0.5}};
  const auto plans = ChooseRebalance(cluster, idle, 1000000, On()).plans;
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].kernel_id, "k");
  // The same kernel once per entry on a cluster with room for both is still one plan.
  EXPECT_EQ(ChooseRebalance(cluster, {idle[1], idle[1]}, 1000000, On()).plans.size(), 1u);
}

// k (likely, needs a whole server) has its replicas on busy servers a, b, c. e is wholly idle
// but has memory for three replicas only, and holds those of idle kernels u1, u2, u3. d (4 of
// 8 GPUs busy) and g (a wholly idle 4-GPU server) have room.
struct FullCover {
  ClusterState cluster = Cluster({Server("a", 8), Server("b", 8), Server("c", 8), Server("d", 8),
                                  Server("e", 8, 64000, 3 * 1024), Server("g", 4)});
  FullCover() {
    for (const char* s : {"a", "b", "c"}) EXPECT_TRUE(cluster.Commit(s, Gpus(8)).ok());
    EXPECT_TRUE(cluster.Commit("d", Gpus(4)).ok());
    EXPECT_TRUE(cluster.AddKernel(Kernel("k", Req(8), {"a", "b", "c"})).ok());
    EXPECT_TRUE(cluster.AddKernel(Kernel("u1", Req(1), {"e", "a", "b"})).ok());
    EXPECT_TRUE(cluster.AddKernel(Kernel("u2", Req(1), {"e", "b", "c"})).ok());
    EXPECT_TRUE(cluster.AddKernel(Kernel("u3", Req(1), {"e", "a", "c"})).ok());
  }
  // u1's chance is 0.05, u2's 0.2, u3's 0.5; k's 0.6.
  std::vector<std::string> Plans(const RebalanceOptions& o, int64_t u1_rebalanced_ms,
                                 const std::set<std::string, std::less<>>& excluded = {}) const {
    const int64_t never = std::numeric_limits<int64_t>::lowest();
    const std::vector<IdleKernel> idle = {{cluster.FindKernel("u3"), 1, 0, never, 0.5},
                                          {cluster.FindKernel("k"), 8, 0, never, 0.6},
                                          {cluster.FindKernel("u1"), 1, 0, u1_rebalanced_ms, 0.05},
                                          {cluster.FindKernel("u2"), 1, 0, never, 0.2}};
    std::vector<std::string> got;
    for (const RebalancePlan& p : ChooseRebalance(cluster, idle, 1000000, o, excluded).plans) {
      got.push_back(Show(p));
    }
    return got;
  }
};

TEST(RebalanceTest, ALikelyKernelTakesThePlaceOfAnUnlikelyOneOnAFullServer) {
  FullCover c;
  const int64_t never = std::numeric_limits<int64_t>::lowest();
  RebalanceOptions o = On();
  EXPECT_EQ(c.Plans(o, never), std::vector<std::string>{});  // off by default: e is full
  o.make_room_chance_ratio = 0.5;
  // u1, the least likely, leaves e for d (GPUs committed, before the wholly idle g); then k's
  // replica goes to e.
  const std::vector<std::string> want = {"u1:1:e->d", "k:1:a->e"};
  EXPECT_EQ(c.Plans(o, never), want);
  // u1 moved proactively a moment ago: u2 (0.2 <= 0.5 x 0.6) gives up its place instead.
  const std::vector<std::string> in_cooldown = {"u2:1:e->d", "k:1:a->e"};
  EXPECT_EQ(c.Plans(o, 990000), in_cooldown);
  // Nobody on e is at most a tenth as likely as k (0.06): nothing moves.
  o.make_room_chance_ratio = 0.1;
  EXPECT_EQ(c.Plans(o, 990000), std::vector<std::string>{});
  // Both moves or neither: the bound leaves room for one plan only.
  o.make_room_chance_ratio = 0.5;
  o.max_per_tick = 1;
  EXPECT_EQ(c.Plans(o, never), std::vector<std::string>{});
}

// With c and d on their way out, the only server that can take u1's replica is g, wholly idle.
// (k's replica on c, which is leaving, is the one that moves.)
TEST(RebalanceTest, AnUnlikelyKernelLeavesForAWhollyIdleServerOnlyWithoutABusyOne) {
  FullCover c;
  ASSERT_TRUE(c.cluster.SetAccepting("c", false).ok());
  ASSERT_TRUE(c.cluster.SetAccepting("d", false).ok());
  RebalanceOptions o = On();
  o.make_room_chance_ratio = 0.5;
  const std::vector<std::string> want = {"u1:1:e->g", "k:3:c->e"};
  EXPECT_EQ(c.Plans(o, std::numeric_limits<int64_t>::lowest()), want);
  // Nor to a server the caller excludes: then nothing moves.
  EXPECT_EQ(c.Plans(o, std::numeric_limits<int64_t>::lowest(), {"g"}), std::vector<std::string>{});
}

}  // namespace
}  // namespace nbos::sched
