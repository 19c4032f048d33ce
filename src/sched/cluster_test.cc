#include "sched/cluster.h"

#include <gtest/gtest.h>

#include "sched/test_util.h"

namespace nbos::sched {
namespace {

using test::Cluster;
using test::Gpus;
using test::Kernel;
using test::Req;
using test::Server;

TEST(ResourcesTest, ArithmeticAndFit) {
  Resources a{1000, 2048, 1, 100};
  Resources b{500, 1024, 2, 50};
  EXPECT_EQ(a + b, (Resources{1500, 3072, 3, 150}));
  EXPECT_EQ(a - b, (Resources{500, 1024, -1, 50}));
  EXPECT_FALSE((a - b).IsNonNegative());
  EXPECT_TRUE(b.FitsWithin(a + b));
  EXPECT_FALSE(b.FitsWithin(a));
  EXPECT_TRUE(Resources{}.IsZero());
  EXPECT_EQ(a.ToString(), "cpu=1000m mem=2048MB gpus=1 vram=100MB");
}

TEST(ClusterStateTest, SubscribedFollowsReplicas) {
  ClusterState c = Cluster({Server("a", 8), Server("b", 8), Server("c", 8), Server("d", 8)});
  ASSERT_TRUE(c.AddKernel(Kernel("k1", Req(2), {"a", "b", "c"})).ok());
  ASSERT_TRUE(c.AddKernel(Kernel("k2", Req(1), {"b", "c", "d"})).ok());
  EXPECT_EQ(c.FindServer("a")->subscribed.gpus, 2);
  EXPECT_EQ(c.FindServer("b")->subscribed.gpus, 3);
  EXPECT_EQ(c.FindServer("d")->subscribed, Req(1));
  EXPECT_EQ(c.DemandGpus(), 3);

  // Migration of k1's replica 1 from a to d.
  ASSERT_TRUE(c.AddReplica("k1", 4, "d").ok());
  ASSERT_TRUE(c.SetLastExecutor("k1", 1).ok());
  ASSERT_TRUE(c.RemoveReplica("k1", 1).ok());
  EXPECT_EQ(c.FindKernel("k1")->last_executor, 0u);
  EXPECT_TRUE(c.FindServer("a")->subscribed.IsZero());
  EXPECT_EQ(c.FindServer("d")->subscribed.gpus, 3);

  ASSERT_TRUE(c.RemoveKernel("k2").ok());
  EXPECT_EQ(c.FindServer("b")->subscribed, Req(2));
  EXPECT_EQ(c.RemoveKernel("k2").code(), StatusCode::kNotFound);
}

TEST(ClusterStateTest, RejectsBadKernels) {
  ClusterState c = Cluster({Server("a", 8), Server("b", 8)});
  EXPECT_EQ(c.AddKernel(Kernel("", Req(1), {})).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.AddKernel(Kernel("k", Req(-1), {})).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.AddKernel(Kernel("k", Req(1), {"a", "a"})).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.AddKernel(Kernel("k", Req(1), {"a", "zz"})).code(), StatusCode::kNotFound);
  KernelView bad_exec = Kernel("k", Req(1), {"a"});
  bad_exec.last_executor = 7;
  EXPECT_EQ(c.AddKernel(bad_exec).code(), StatusCode::kInvalidArgument);
  KernelView zero_id = Kernel("k", Req(1), {"a"});
  zero_id.replicas[0].replica_id = 0;
  EXPECT_EQ(c.AddKernel(zero_id).code(), StatusCode::kInvalidArgument);
  // Nothing above left a trace.
  EXPECT_TRUE(c.kernels().empty());
  EXPECT_TRUE(c.FindServer("a")->subscribed.IsZero());

  ASSERT_TRUE(c.AddKernel(Kernel("k", Req(1), {"a"})).ok());
  EXPECT_EQ(c.AddKernel(Kernel("k", Req(1), {})).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.AddReplica("k", 1, "b").code(), StatusCode::kInvalidArgument);  // id taken
  EXPECT_EQ(c.AddReplica("k", 2, "a").code(), StatusCode::kInvalidArgument);  // same server
  EXPECT_EQ(c.AddReplica("k", 2, "zz").code(), StatusCode::kNotFound);
  EXPECT_EQ(c.AddReplica("nope", 2, "b").code(), StatusCode::kNotFound);
  EXPECT_EQ(c.SetLastExecutor("k", 9).code(), StatusCode::kNotFound);
}

TEST(ClusterStateTest, ServerLifecycle) {
  ClusterState c;
  EXPECT_EQ(c.AddServer(Server("", 8)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.AddServer(Server("a", -1)).code(), StatusCode::kInvalidArgument);
  ServerView over = Server("a", 2);
  over.committed = Gpus(3);
  EXPECT_EQ(c.AddServer(over).code(), StatusCode::kInvalidArgument);
  ServerView subscribed = Server("a", 2);
  subscribed.subscribed = Gpus(1);
  EXPECT_EQ(c.AddServer(subscribed).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(c.AddServer(Server("a", 2)).ok());
  EXPECT_EQ(c.AddServer(Server("a", 2)).code(), StatusCode::kInvalidArgument);

  EXPECT_EQ(c.Commit("a", Gpus(3)).code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(c.Commit("a", Gpus(2)).ok());
  EXPECT_EQ(c.FindServer("a")->IdleGpus(), 0);
  EXPECT_EQ(c.Release("a", Gpus(3)).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(c.Release("a", Gpus(1)).ok());
  EXPECT_EQ(c.TotalCommitted(), Gpus(1));
  EXPECT_EQ(c.Commit("zz", Gpus(1)).code(), StatusCode::kNotFound);

  ServerView report = Server("a", 4);
  report.accepting = false;
  ASSERT_TRUE(c.UpdateServer(report).ok());
  EXPECT_EQ(c.FindServer("a")->spec.gpus, 4);
  EXPECT_FALSE(c.FindServer("a")->accepting);
  EXPECT_EQ(c.UpdateServer(Server("zz", 1)).code(), StatusCode::kNotFound);
  ASSERT_TRUE(c.SetAccepting("a", true).ok());
  EXPECT_EQ(c.TotalSpec().gpus, 4);
}

TEST(ClusterStateTest, RemovedServerLeavesOrphansThatCountAgainOnReturn) {
  ClusterState c = Cluster({Server("a", 8), Server("b", 8)});
  ASSERT_TRUE(c.AddKernel(Kernel("k", Req(2), {"a", "b"})).ok());
  ASSERT_TRUE(c.RemoveServer("a").ok());
  EXPECT_EQ(c.RemoveServer("a").code(), StatusCode::kNotFound);
  EXPECT_EQ(c.FindKernel("k")->replicas.size(), 2u);
  ASSERT_TRUE(c.AddServer(Server("a", 8)).ok());
  EXPECT_EQ(c.FindServer("a")->subscribed, Req(2));
  // Removing an orphan while its server is away touches no books.
  ASSERT_TRUE(c.RemoveServer("b").ok());
  ASSERT_TRUE(c.RemoveReplica("k", 2).ok());
  ASSERT_TRUE(c.AddServer(Server("b", 8)).ok());
  EXPECT_TRUE(c.FindServer("b")->subscribed.IsZero());
}

TEST(ClusterStateTest, OversizedRequestNamesLargestServer) {
  ClusterState c = Cluster({Server("small", 2), Server("big", 8), Server("mid", 4)});
  Status s = CheckRequestFitsSomeServer(c, Req(9));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'big'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("9 GPUs"), std::string::npos) << s.message();
  s = CheckRequestFitsSomeServer(c, Req(1, 100000));
  EXPECT_NE(s.message().find("millicpus"), std::string::npos) << s.message();
  EXPECT_TRUE(CheckRequestFitsSomeServer(c, Req(8)).ok());
  EXPECT_TRUE(CheckRequestFitsSomeServer(ClusterState{}, Req(100)).ok());
}

}  // namespace
}  // namespace nbos::sched
