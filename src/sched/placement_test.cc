#include "sched/placement.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "sched/test_util.h"

namespace nbos::sched {
namespace {

using test::Cluster;
using test::Kernel;
using test::Req;
using test::Server;

// One row: servers (id, GPUs, subscribed GPUs, accepting), a request, options → expected result.
struct ServerRow {
  std::string id;
  int32_t gpus;
  int32_t subscribed_gpus;
  bool accepting = true;
};

struct PlacementCase {
  std::string name;
  std::vector<ServerRow> servers;
  Resources request;
  double cluster_ratio;
  bool ignore_ratio;
  std::vector<std::string> want_servers;  // empty: want scale-out
  bool want_ratio_ignored = false;
  int32_t want_hosts_needed = 0;
};

// Subscription is set up through one-replica filler kernels, as the state only derives it.
ClusterState Build(const std::vector<ServerRow>& rows) {
  ClusterState c;
  for (const ServerRow& r : rows) {
    ServerView s = Server(r.id, r.gpus);
    s.accepting = r.accepting;
    EXPECT_TRUE(c.AddServer(s).ok());
    if (r.subscribed_gpus > 0) {
      EXPECT_TRUE(c.AddKernel(Kernel("fill-" + r.id, Req(r.subscribed_gpus, 0, 0), {r.id})).ok());
    }
  }
  return c;
}

class PlacementTableTest : public ::testing::TestWithParam<PlacementCase> {};

TEST_P(PlacementTableTest, Decides) {
  const PlacementCase& tc = GetParam();
  ClusterState c = Build(tc.servers);
  PlacementOptions opts;
  opts.cluster_ratio = tc.cluster_ratio;
  opts.ignore_ratio_if_no_scale_out = tc.ignore_ratio;
  Result<Placement> p = PlaceKernel(c, tc.request, opts);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->server_ids, tc.want_servers) << p->reason;
  EXPECT_EQ(p->scale_out_needed, tc.want_servers.empty()) << p->reason;
  EXPECT_EQ(p->ratio_ignored, tc.want_ratio_ignored) << p->reason;
  EXPECT_EQ(p->hosts_needed, tc.want_hosts_needed);
  if (p->scale_out_needed || p->ratio_ignored) {
    EXPECT_FALSE(p->reason.empty());
  }
}

// With 8 GPUs per server and R = 3, SR_h = subscribed / 24.
INSTANTIATE_TEST_SUITE_P(
    Table, PlacementTableTest,
    ::testing::Values(
        PlacementCase{"EmptyClusterByIdTieBreak",
                      {{"s1", 8, 0}, {"s2", 8, 0}, {"s3", 8, 0}, {"s4", 8, 0}},
                      Req(1),
                      7.0,
                      false,
                      {"s1", "s2", "s3"}},
        PlacementCase{"LeastSubscribedFirst",
                      {{"s1", 8, 6}, {"s2", 8, 0}, {"s3", 8, 3}, {"s4", 8, 1}},
                      Req(1),
                      7.0,
                      false,
                      {"s2", "s4", "s3"}},
        PlacementCase{"RatioNormalisesBySpec",  // 4/48 < 2/8
                      {{"big", 16, 4}, {"s1", 8, 2}, {"s2", 8, 3}, {"s3", 8, 0}},
                      Req(1),
                      7.0,
                      false,
                      {"s3", "big", "s1"}},
        PlacementCase{"NotAcceptingSkipped",
                      {{"s1", 8, 0, false}, {"s2", 8, 0}, {"s3", 8, 0}, {"s4", 8, 0}},
                      Req(1),
                      7.0,
                      false,
                      {"s2", "s3", "s4"}},
        PlacementCase{"RatioExcludesHotServer",  // s1 would reach 24/24 = 1.0, not < 1.0
                      {{"s1", 8, 23}, {"s2", 8, 20}, {"s3", 8, 20}, {"s4", 8, 20}},
                      Req(1),
                      1.0,
                      false,
                      {"s2", "s3", "s4"}},
        PlacementCase{"TooFewWithinRatioScalesOut",
                      {{"s1", 8, 23}, {"s2", 8, 23}, {"s3", 8, 0}},
                      Req(1),
                      1.0,
                      false,
                      {},
                      false,
                      2},
        PlacementCase{"IgnoreRatioWhenNoScaleOut",
                      {{"s1", 8, 23}, {"s2", 8, 30}, {"s3", 8, 0}},
                      Req(1),
                      1.0,
                      true,
                      {"s3", "s1", "s2"},
                      true},
        PlacementCase{"IgnoreRatioUnusedWhenNotNeeded",
                      {{"s1", 8, 0}, {"s2", 8, 0}, {"s3", 8, 0}},
                      Req(1),
                      1.0,
                      true,
                      {"s1", "s2", "s3"}},
        PlacementCase{
            "TooFewServers", {{"s1", 8, 0}, {"s2", 8, 0}}, Req(1), 7.0, true, {}, false, 1},
        PlacementCase{"NoServersAtAll", {}, Req(1), 7.0, false, {}, false, 3},
        PlacementCase{"SmallServersCannotHoldOneReplica",
                      {{"a", 2, 0}, {"b", 2, 0}, {"c", 8, 0}},
                      Req(4),
                      7.0,
                      true,
                      {},
                      false,
                      2},
        PlacementCase{"CpuOnlyKernelIgnoresGpuRatio",
                      {{"s1", 8, 40}, {"s2", 8, 40}, {"s3", 8, 40}},
                      Req(0),
                      1.0,
                      false,
                      {"s1", "s2", "s3"}}),
    [](const auto& case_info) { return case_info.param.name; });

TEST(PlacementTest, CpuAndMemorySubscriptionMustFit) {
  ClusterState c = Cluster({Server("s1", 8, 4000), Server("s2", 8, 4000), Server("s3", 8, 4000),
                            Server("s4", 8, 4000, 2048)});
  ASSERT_TRUE(c.AddKernel(Kernel("k1", Req(0, 3000), {"s1"})).ok());
  Result<Placement> p = PlaceKernel(c, Req(1, 2000, 1024));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->server_ids, (std::vector<std::string>{"s2", "s3", "s4"}));
  // Now s1 lacks CPU and s4 lacks memory for a third replica.
  ASSERT_TRUE(c.AddKernel(Kernel("k2", Req(1, 2000, 1024), p->server_ids)).ok());
  p = PlaceKernel(c, Req(1, 2000, 1536));
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->scale_out_needed);
  EXPECT_NE(p->reason.find("2 without CPU/memory room"), std::string::npos) << p->reason;
}

TEST(PlacementTest, CpuOnlyClusterSpreadsByCpuSubscription) {
  ClusterState c = Cluster({Server("a", 0), Server("b", 0), Server("c", 0), Server("d", 0)});
  ASSERT_TRUE(c.AddKernel(Kernel("k1", Req(0, 8000), {"a", "b", "c"})).ok());
  Result<Placement> p = PlaceKernel(c, Req(0, 8000));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->server_ids.front(), "d");
}

TEST(PlacementTest, OversizedRequestIsAnErrorNamingLargestServer) {
  ClusterState c = Cluster({Server("s1", 4), Server("s2", 8), Server("s3", 8)});
  Result<Placement> p = PlaceKernel(c, Req(9));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("'s2'"), std::string::npos) << p.status().message();
  EXPECT_NE(p.status().message().find("has 8"), std::string::npos) << p.status().message();
  p = PlaceKernel(c, Req(1, 1000, 1024, 100000));
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("VRAM"), std::string::npos) << p.status().message();
}

TEST(PlacementTest, RejectsMalformedInput) {
  ClusterState c = Cluster({Server("s1", 8)});
  EXPECT_EQ(PlaceKernel(c, Req(-1)).status().code(), StatusCode::kInvalidArgument);
  PlacementOptions opts;
  opts.replicas = 0;
  EXPECT_EQ(PlaceKernel(c, Req(1), opts).status().code(), StatusCode::kInvalidArgument);
}

TEST(PlacementTest, ReplacementReplicaAvoidsExcludedServers) {
  ClusterState c = Cluster({Server("s1", 8), Server("s2", 8), Server("s3", 8), Server("s4", 8)});
  PlacementOptions opts;
  opts.replicas = 1;
  opts.excluded_servers = {"s1", "s3"};
  Result<Placement> p = PlaceKernel(c, Req(1), opts);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->server_ids, std::vector<std::string>{"s2"});
}

TEST(PlacementTest, SameStateInAnyInsertionOrderGivesSameAnswer) {
  std::vector<ServerView> servers;
  for (int i = 0; i < 8; ++i) servers.push_back(Server("s" + std::to_string(i), 4 + i % 3 * 2));
  std::optional<std::vector<std::string>> first;
  std::sort(servers.begin(), servers.end(),
            [](const auto& a, const auto& b) { return a.server_id < b.server_id; });
  do {
    ClusterState c = Cluster(servers);
    ASSERT_TRUE(c.AddKernel(Kernel("k", Req(2), {"s1", "s4", "s6"})).ok());
    Result<Placement> p = PlaceKernel(c, Req(2));
    ASSERT_TRUE(p.ok());
    if (!first) first = p->server_ids;
    EXPECT_EQ(p->server_ids, *first);
  } while (std::next_permutation(
      servers.begin(), servers.begin() + 4,
      [](const auto& a, const auto& b) { return a.server_id < b.server_id; }));
  EXPECT_EQ(first->size(), 3u);
}

}  // namespace
}  // namespace nbos::sched
