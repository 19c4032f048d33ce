#include "sched/executor.h"

#include <gtest/gtest.h>

#include "sched/test_util.h"

namespace nbos::sched {
namespace {

using test::Cluster;
using test::Gpus;
using test::Kernel;
using test::Req;
using test::Server;

using Ids = std::vector<uint32_t>;

// Servers a, b, c with 4 GPUs each; committed GPUs per server as given. Kernel k has replicas
// 1@a, 2@b, 3@c.
ClusterState MakeCluster(int32_t a, int32_t b, int32_t c, uint32_t last_executor = 0) {
  ClusterState cluster = Cluster({Server("a", 4), Server("b", 4), Server("c", 4)});
  KernelView k = Kernel("k", Req(2), {"a", "b", "c"});
  k.last_executor = last_executor;
  EXPECT_TRUE(cluster.AddKernel(k).ok());
  EXPECT_TRUE(cluster.Commit("a", Gpus(a)).ok());
  EXPECT_TRUE(cluster.Commit("b", Gpus(b)).ok());
  EXPECT_TRUE(cluster.Commit("c", Gpus(c)).ok());
  return cluster;
}

struct ExecutorCase {
  std::string name;
  int32_t committed_a, committed_b, committed_c;
  uint32_t last_executor;
  int32_t gpus_needed;
  std::set<uint32_t> excluded;
  std::optional<uint32_t> target;
  Ids want;
  bool want_target_honoured = false;
  bool pack_gpus = false;
};

class ExecutorTableTest : public ::testing::TestWithParam<ExecutorCase> {};

TEST_P(ExecutorTableTest, Orders) {
  const ExecutorCase& tc = GetParam();
  ClusterState c = MakeCluster(tc.committed_a, tc.committed_b, tc.committed_c, tc.last_executor);
  ExecutorChoice choice =
      ChooseExecutor(c, *c.FindKernel("k"), tc.gpus_needed, tc.excluded, tc.target, tc.pack_gpus);
  EXPECT_EQ(choice.candidates, tc.want);
  EXPECT_EQ(choice.migration_needed(), tc.want.empty());
  EXPECT_EQ(choice.target_honoured, tc.want_target_honoured);
  if (tc.target && !tc.want_target_honoured) {
    EXPECT_FALSE(choice.note.empty());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Table, ExecutorTableTest,
    ::testing::Values(
        ExecutorCase{"AllIdleByReplicaId", 0, 0, 0, 0, 2, {}, {}, {1, 2, 3}},
        ExecutorCase{"MostIdleFirst", 2, 0, 1, 0, 2, {}, {}, {2, 3, 1}},
        ExecutorCase{"StickyWhenPreviousCanGrant", 2, 0, 1, 1, 2, {}, {}, {1, 2, 3}},
        ExecutorCase{"NotStickyWhenPreviousCannot", 3, 0, 1, 1, 2, {}, {}, {2, 3}},
        ExecutorCase{"ExcludedSkipped", 0, 0, 0, 2, 2, {2}, {}, {1, 3}},
        ExecutorCase{"NoneCanGrantMeansMigration", 3, 4, 3, 1, 2, {}, {}, {}},
        ExecutorCase{"ZeroGpusEveryoneQualifies", 4, 4, 4, 3, 0, {}, {}, {3, 1, 2}},
        ExecutorCase{"TargetOverridesStickiness", 0, 0, 0, 1, 2, {}, 3u, {3, 1, 2}, true},
        ExecutorCase{"TargetThatCannotGrantIgnored", 0, 0, 3, 1, 2, {}, 3u, {1, 2}},
        ExecutorCase{"TargetNotAReplicaIgnored", 0, 1, 0, 0, 2, {}, 9u, {1, 3, 2}},
        ExecutorCase{"ExcludedTargetIgnored", 0, 0, 0, 0, 2, {3}, 3u, {1, 2}},
        // pack_gpus: best fit, and a whole idle server is kept for whole-server cells.
        ExecutorCase{"PackFewestIdleFirst", 2, 0, 1, 0, 2, {}, {}, {1, 3, 2}, false, true},
        ExecutorCase{"PackStickinessYieldsToKeepAWholeServerIdle",
                     0,
                     2,
                     2,
                     1,
                     2,
                     {},
                     {},
                     {2, 3, 1},
                     false,
                     true},
        ExecutorCase{"PackStickyWhenEveryCandidateIsWhollyIdle",
                     0,
                     0,
                     0,
                     2,
                     2,
                     {},
                     {},
                     {2, 1, 3},
                     false,
                     true},
        ExecutorCase{
            "PackStickyWhenTheCellNeedsTheWholeServer", 0, 0, 1, 1, 4, {}, {}, {1, 2}, false, true},
        ExecutorCase{"PackTargetStillFirst", 0, 2, 2, 1, 2, {}, 1u, {1, 2, 3}, true, true}),
    [](const auto& case_info) { return case_info.param.name; });

TEST(ExecutorTest, SkipsOrphansAndDrainingServers) {
  ClusterState c = MakeCluster(0, 0, 0, 1);
  ASSERT_TRUE(c.SetAccepting("a", false).ok());
  ASSERT_TRUE(c.RemoveServer("b").ok());
  ExecutorChoice choice = ChooseExecutor(c, *c.FindKernel("k"), 1, {});
  EXPECT_EQ(choice.candidates, Ids{3});
}

TEST(ExecutorTest, IsDeterministic) {
  ClusterState c = MakeCluster(1, 1, 1, 0);
  const ExecutorChoice first = ChooseExecutor(c, *c.FindKernel("k"), 1, {});
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(ChooseExecutor(c, *c.FindKernel("k"), 1, {}).candidates, first.candidates);
  }
}

// Servers a, b, c, d with 4 GPUs each: k (replicas 1@a, 2@b, 3@c) can run a 2-GPU cell on a or
// b, 2 GPUs idle on each (best fit: a first, the lower replica id); c and d are full. x, idle,
// has replicas on a and d: a is its only server with 2 GPUs idle, which k's cell there would
// take; y is the same on b.
struct SpareCase {
  ClusterState cluster = Cluster({Server("a", 4), Server("b", 4), Server("c", 4), Server("d", 4)});
  SpareCase() {
    EXPECT_TRUE(cluster.AddKernel(Kernel("k", Req(2), {"a", "b", "c"})).ok());
    EXPECT_TRUE(cluster.AddKernel(Kernel("x", Req(2), {"a", "d"})).ok());
    EXPECT_TRUE(cluster.AddKernel(Kernel("y", Req(2), {"b", "d"})).ok());
    for (const auto& [server, gpus] : {std::pair{"a", 2}, {"b", 2}, {"c", 4}, {"d", 4}}) {
      EXPECT_TRUE(cluster.Commit(server, Gpus(gpus)).ok());
    }
  }
  const KernelView* Find(const std::string& id) const { return cluster.FindKernel(id); }
  ExecutorChoice Spare(const std::vector<LikelyKernel>& likely,
                       std::optional<uint32_t> target = std::nullopt) const {
    ExecutorChoice choice = ChooseExecutor(cluster, *Find("k"), 2, {}, target, true);
    SpareSoleCovers(cluster, *Find("k"), 2, likely, &choice);
    return choice;
  }
};

TEST(SpareSoleCoversTest, TheCellLeavesALikelyKernelsOnlyCoverAlone) {
  SpareCase c;
  EXPECT_EQ(c.Spare({}).candidates, (Ids{1, 2}));
  EXPECT_EQ(c.Spare({{c.Find("x"), 2, 0.5}}).candidates, (Ids{2, 1}));
  EXPECT_DOUBLE_EQ(SoleCoverLoss(c.cluster, "a", 2, {{c.Find("x"), 2, 0.5}}), 0.5);
  // Both would lose their cover: the less likely one does.
  EXPECT_EQ(c.Spare({{c.Find("x"), 2, 0.5}, {c.Find("y"), 2, 0.3}}).candidates, (Ids{2, 1}));
  EXPECT_EQ(c.Spare({{c.Find("x"), 2, 0.5}, {c.Find("y"), 2, 0.6}}).candidates, (Ids{1, 2}));
  // Equal losses keep ChooseExecutor's order.
  EXPECT_EQ(c.Spare({{c.Find("x"), 2, 0.5}, {c.Find("y"), 2, 0.5}}).candidates, (Ids{1, 2}));
}

TEST(SpareSoleCoversTest, OnlyALostOnlyCoverCounts) {
  SpareCase c;
  // x needs more than a has idle: a covers it neither before nor after.
  EXPECT_EQ(SoleCoverLoss(c.cluster, "a", 2, {{c.Find("x"), 4, 0.5}}), 0);
  // A 1-GPU cell leaves x's 1 GPU on a.
  EXPECT_EQ(SoleCoverLoss(c.cluster, "a", 1, {{c.Find("x"), 1, 0.5}}), 0);
  // With d's GPUs free, x has another cover.
  ASSERT_TRUE(c.cluster.Release("d", Gpus(2)).ok());
  EXPECT_EQ(SoleCoverLoss(c.cluster, "a", 2, {{c.Find("x"), 2, 0.5}}), 0);
  // ... unless d stops accepting.
  ASSERT_TRUE(c.cluster.SetAccepting("d", false).ok());
  EXPECT_DOUBLE_EQ(SoleCoverLoss(c.cluster, "a", 2, {{c.Find("x"), 2, 0.5}}), 0.5);
  // A server without x's replica is no cover of x's.
  EXPECT_EQ(SoleCoverLoss(c.cluster, "b", 2, {{c.Find("x"), 2, 0.5}}), 0);
}

TEST(SpareSoleCoversTest, ARequestedTargetStaysFirst) {
  SpareCase c;
  const ExecutorChoice choice = c.Spare({{c.Find("x"), 2, 0.5}}, 1u);
  EXPECT_TRUE(choice.target_honoured);
  EXPECT_EQ(choice.candidates, (Ids{1, 2}));
}

}  // namespace
}  // namespace nbos::sched
