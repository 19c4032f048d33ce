#include "sched/gpu_waiters.h"

#include <gtest/gtest.h>

#include "sched/test_util.h"

namespace nbos::sched {
namespace {

using test::Gpus;
using test::Kernel;
using test::Req;
using test::Server;

using Held = std::map<std::string, int32_t, std::less<>>;

// Servers a, b, c with 4 GPUs each, committed as given; kernels w1@{a,b}, w2@{a,c}, k@{a,b,c}.
ClusterState MakeCluster(int32_t a, int32_t b, int32_t c) {
  ClusterState cluster = test::Cluster({Server("a", 4), Server("b", 4), Server("c", 4)});
  EXPECT_TRUE(cluster.AddKernel(Kernel("w1", Req(2), {"a", "b"})).ok());
  EXPECT_TRUE(cluster.AddKernel(Kernel("w2", Req(2), {"a", "c"})).ok());
  EXPECT_TRUE(cluster.AddKernel(Kernel("k", Req(2), {"a", "b", "c"})).ok());
  EXPECT_TRUE(cluster.Commit("a", Gpus(a)).ok());
  EXPECT_TRUE(cluster.Commit("b", Gpus(b)).ok());
  EXPECT_TRUE(cluster.Commit("c", Gpus(c)).ok());
  return cluster;
}

TEST(GpuWaitersTest, NothingIsHeldWithoutWaiters) {
  GpuWaiters w;
  EXPECT_EQ(w.HeldAhead(MakeCluster(0, 0, 0), "k"), Held{});
}

TEST(GpuWaitersTest, OldestWaiterHoldsOnItsServerWithTheMostIdleGpus) {
  GpuWaiters w;
  w.Ask("w1", 2, {}, 0);
  // w1's servers: a has 1 idle, b 3 idle: b, and only what w1 needs.
  EXPECT_EQ(w.HeldAhead(MakeCluster(3, 1, 0), "k"), (Held{{"b", 2}}));
  // A waiter sees nothing held ahead of itself.
  EXPECT_EQ(w.HeldAhead(MakeCluster(3, 1, 0), "w1"), Held{});
}

TEST(GpuWaitersTest, HoldsArePartialAndTakenInTurn) {
  GpuWaiters w;
  w.Ask("w1", 2, {}, 0);
  w.Ask("w2", 2, {}, 1);
  // a has 3 idle, b and c none: w1 holds 2 on a, w2 the 1 left there.
  ClusterState c = MakeCluster(1, 4, 4);
  EXPECT_EQ(w.HeldAhead(c, "k"), (Held{{"a", 3}}));
  EXPECT_EQ(w.HeldAhead(c, "w2"), (Held{{"a", 2}}));
  // Asking again keeps the place: w1 is still first.
  w.Ask("w1", 2, {}, 5);
  EXPECT_EQ(w.HeldAhead(c, "w2"), (Held{{"a", 2}}));
  // w1 leaves (granted): w2 is first and holds 2 of a's 3.
  w.Leave("w1");
  EXPECT_EQ(w.HeldAhead(c, "k"), (Held{{"a", 2}}));
  EXPECT_EQ(w.HeldAhead(c, "w2"), Held{});
}

TEST(GpuWaitersTest, ExcludedReplicasAndNonAcceptingServersHoldNothing) {
  GpuWaiters w;
  w.Ask("w1", 2, {2}, 0);  // replica 2 (on b) excluded
  ClusterState c = MakeCluster(4, 0, 0);
  EXPECT_EQ(w.HeldAhead(c, "k"), Held{});
  w.Ask("w1", 2, {}, 1);
  EXPECT_EQ(w.HeldAhead(c, "k"), (Held{{"b", 2}}));
  ASSERT_TRUE(c.SetAccepting("b", false).ok());
  EXPECT_EQ(w.HeldAhead(c, "k"), Held{});
}

TEST(GpuWaitersTest, WaitersThatStopAskingExpire) {
  GpuWaiters w;
  w.Ask("w1", 2, {}, 0);
  w.Ask("w2", 2, {}, 900);
  w.Expire(1000, 0);  // 0: never
  EXPECT_EQ(w.size(), 2u);
  w.Expire(1000, 1000);
  EXPECT_EQ(w.size(), 2u);  // w1 asked exactly 1000 ms ago
  w.Expire(1001, 1000);
  EXPECT_FALSE(w.contains("w1"));
  EXPECT_TRUE(w.contains("w2"));
  // A removed kernel's waiter holds nothing.
  ClusterState c = MakeCluster(0, 0, 0);
  ASSERT_TRUE(c.RemoveKernel("w2").ok());
  EXPECT_EQ(w.HeldAhead(c, "k"), Held{});
}

}  // namespace
}  // namespace nbos::sched
