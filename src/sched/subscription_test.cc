#include "sched/subscription.h"

#include <gtest/gtest.h>

#include <cmath>

#include "sched/test_util.h"

namespace nbos::sched {
namespace {

using test::Gpus;
using test::Server;

TEST(HostSubscriptionRatioTest, SubscribedOverSpecTimesReplicas) {
  ServerView s = Server("a", 8);
  EXPECT_DOUBLE_EQ(HostSubscriptionRatio(s), 0.0);
  s.subscribed = Gpus(12);
  EXPECT_DOUBLE_EQ(HostSubscriptionRatio(s), 0.5);
  EXPECT_DOUBLE_EQ(HostSubscriptionRatio(s, Gpus(12)), 1.0);
  EXPECT_DOUBLE_EQ(HostSubscriptionRatio(s, {}, 1), 1.5);
  ServerView cpu_only = Server("c", 0);
  EXPECT_DOUBLE_EQ(HostSubscriptionRatio(cpu_only), 0.0);
  EXPECT_TRUE(std::isinf(HostSubscriptionRatio(cpu_only, Gpus(1))));
}

TEST(SubscriptionRatioTest, StartsAtMaxAndAveragesLastFiveSamples) {
  SubscriptionRatio r;
  EXPECT_DOUBLE_EQ(r.value(), 7.0);
  r.AddSample(6, 2);  // 3
  EXPECT_DOUBLE_EQ(r.value(), 3.0);
  r.AddSample(4, 4);  // 1
  EXPECT_DOUBLE_EQ(r.value(), 2.0);
  r.AddSample(100, 1);  // capped at 7
  r.AddSample(1, 4);    // demand below busy: 1
  EXPECT_FALSE(r.window_full());
  r.AddSample(5, 0);  // nothing busy: max
  EXPECT_TRUE(r.window_full());
  EXPECT_DOUBLE_EQ(r.value(), (3 + 1 + 7 + 1 + 7) / 5.0);
  r.AddSample(2, 1);  // the 3 falls out
  EXPECT_DOUBLE_EQ(r.value(), (1 + 7 + 1 + 7 + 2) / 5.0);
}

TEST(SubscriptionRatioTest, SamplesClusterDemandAndCommittedGpus) {
  ClusterState c = test::Cluster({Server("a", 4), Server("b", 4), Server("c", 4)});
  ASSERT_TRUE(c.AddKernel(test::Kernel("k1", test::Req(2), {"a", "b", "c"})).ok());
  ASSERT_TRUE(c.AddKernel(test::Kernel("k2", test::Req(2), {"a", "b", "c"})).ok());
  ASSERT_TRUE(c.Commit("a", Gpus(1)).ok());
  SubscriptionRatio r(5.0, 2);
  r.AddSample(c);  // demand 4 / busy 1, capped at 5 → 4
  EXPECT_DOUBLE_EQ(r.value(), 4.0);
  EXPECT_DOUBLE_EQ(r.max_ratio(), 5.0);
}

}  // namespace
}  // namespace nbos::sched
