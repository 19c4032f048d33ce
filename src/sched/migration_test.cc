#include "sched/migration.h"

#include <gtest/gtest.h>

#include "sched/test_util.h"

namespace nbos::sched {
namespace {

using test::Cluster;
using test::Gpus;
using test::Kernel;
using test::Req;
using test::Server;

// Kernel k (2 GPUs) on a, b, c, all full; d, e, f are other servers.
ClusterState MakeCluster() {
  ClusterState c = Cluster({Server("a", 4), Server("b", 4), Server("c", 4), Server("d", 4),
                            Server("e", 8), Server("f", 4)});
  EXPECT_TRUE(c.AddKernel(Kernel("k", Req(2), {"a", "b", "c"})).ok());
  for (const char* s : {"a", "b", "c"}) EXPECT_TRUE(c.Commit(s, Gpus(4)).ok());
  return c;
}

TEST(MigrationTest, PrefersMostIdleTargetThenWarm) {
  ClusterState c = MakeCluster();
  Result<MigrationPlan> plan = ChooseMigration(c, *c.FindKernel("k"), 2);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_FALSE(plan->scale_out_needed);
  EXPECT_EQ(plan->to_server_id, "e");  // 8 idle GPUs
  EXPECT_FALSE(plan->target_warm);

  plan = ChooseMigration(c, *c.FindKernel("k"), 2, {"f"});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->to_server_id, "f");
  EXPECT_TRUE(plan->target_warm);

  // A warm server that cannot grant is no better than none.
  ASSERT_TRUE(c.Commit("f", Gpus(3)).ok());
  plan = ChooseMigration(c, *c.FindKernel("k"), 2, {"f"});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->to_server_id, "e");
}

TEST(MigrationTest, PackingTakesTheTightestFitAndSparesTheWholeIdleServer) {
  ClusterState c = MakeCluster();
  Result<MigrationPlan> plan = ChooseMigration(c, *c.FindKernel("k"), 2, {}, {}, true);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->to_server_id, "d");  // 4 idle GPUs, not e's 8; d before f by id
  ASSERT_TRUE(c.Commit("f", Gpus(2)).ok());
  plan = ChooseMigration(c, *c.FindKernel("k"), 2, {}, {}, true);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->to_server_id, "f");  // exactly 2 idle
  // A whole-server need still goes where it fits; warm servers still come first.
  plan = ChooseMigration(c, *c.FindKernel("k"), 8, {}, {}, true);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->to_server_id, "e");
  plan = ChooseMigration(c, *c.FindKernel("k"), 2, {"e"}, {}, true);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->to_server_id, "e");
}

TEST(MigrationTest, MovesReplicaFromMostSubscribedServer) {
  ClusterState c = MakeCluster();
  ASSERT_TRUE(c.AddKernel(Kernel("other", Req(2), {"b"})).ok());
  Result<MigrationPlan> plan = ChooseMigration(c, *c.FindKernel("k"), 2);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->replica_id, 2u);
  EXPECT_EQ(plan->from_server_id, "b");
  // Ties fall to the lowest replica id; excluded replicas stay.
  plan = ChooseMigration(c, *c.FindKernel("k"), 2, {}, {2});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->replica_id, 1u);
}

TEST(MigrationTest, OrphanOrDrainingReplicaMovesFirst) {
  ClusterState c = MakeCluster();
  ASSERT_TRUE(c.AddKernel(Kernel("other", Req(2), {"b"})).ok());
  ASSERT_TRUE(c.SetAccepting("c", false).ok());
  Result<MigrationPlan> plan = ChooseMigration(c, *c.FindKernel("k"), 2);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->replica_id, 3u);
  ASSERT_TRUE(c.RemoveServer("a").ok());
  plan = ChooseMigration(c, *c.FindKernel("k"), 2);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->replica_id, 1u);
  EXPECT_EQ(plan->from_server_id, "a");
}

TEST(MigrationTest, NoTargetMeansScaleOut) {
  ClusterState c = MakeCluster();
  for (const char* s : {"d", "f"}) ASSERT_TRUE(c.Commit(s, Gpus(3)).ok());
  ASSERT_TRUE(c.SetAccepting("e", false).ok());
  Result<MigrationPlan> plan = ChooseMigration(c, *c.FindKernel("k"), 2);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->scale_out_needed);
  EXPECT_TRUE(plan->to_server_id.empty());
  EXPECT_NE(plan->replica_id, 0u);
  EXPECT_NE(plan->reason.find("scale out"), std::string::npos);
}

TEST(MigrationTest, TargetNeedsCpuAndMemoryRoom) {
  ClusterState c = Cluster({Server("a", 4), Server("b", 4), Server("c", 4), Server("d", 4, 1000)});
  ASSERT_TRUE(c.AddKernel(Kernel("k", Req(1, 2000), {"a", "b", "c"})).ok());
  Result<MigrationPlan> plan = ChooseMigration(c, *c.FindKernel("k"), 1);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->scale_out_needed);
}

TEST(MigrationTest, Errors) {
  ClusterState c = MakeCluster();
  const KernelView& k = *c.FindKernel("k");
  EXPECT_EQ(ChooseMigration(c, k, -1).status().code(), StatusCode::kInvalidArgument);
  Result<MigrationPlan> plan = ChooseMigration(c, k, 9);
  EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("'e'"), std::string::npos) << plan.status().message();
  EXPECT_EQ(ChooseMigration(c, k, 2, {}, {1, 2, 3}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace nbos::sched
