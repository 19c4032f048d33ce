#include "sched/scaling.h"

#include <gtest/gtest.h>

#include <map>

#include "sched/test_util.h"

namespace nbos::sched {
namespace {

struct HostRow {
  int32_t committed_gpus;
  int32_t subscribed_gpus;
  bool accepting = true;
};

struct ScalingCase {
  std::string name;
  std::vector<HostRow> hosts;  // ids h00, h01, ... in row order; 8 GPUs each
  int32_t want_add;
  std::vector<std::string> want_release;
  int32_t max_hosts = -1;
};

std::vector<ServerView> Hosts(const std::vector<HostRow>& rows) {
  std::vector<ServerView> out;
  for (size_t i = 0; i < rows.size(); ++i) {
    ServerView s = test::Server((i < 10 ? "h0" : "h") + std::to_string(i), 8);
    s.committed.gpus = rows[i].committed_gpus;
    s.subscribed.gpus = rows[i].subscribed_gpus;
    s.accepting = rows[i].accepting;
    out.push_back(s);
  }
  return out;
}

std::vector<HostRow> Repeat(size_t n, HostRow row) { return std::vector<HostRow>(n, row); }

std::vector<HostRow> Concat(std::vector<HostRow> a, const std::vector<HostRow>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class ScalingTableTest : public ::testing::TestWithParam<ScalingCase> {};

TEST_P(ScalingTableTest, Decides) {
  const ScalingCase& tc = GetParam();
  ScalingOptions opts;  // factor 1.10, limit 1.15, buffer 3, min 3, k 2, 8 GPUs per host
  opts.max_hosts = tc.max_hosts;
  ScalingDecision d = DecideScaling(Hosts(tc.hosts), opts);
  EXPECT_EQ(d.add_hosts, tc.want_add) << d.reason;
  EXPECT_EQ(d.release_server_ids, tc.want_release) << d.reason;
  EXPECT_FALSE(d.reason.empty());
}

INSTANTIATE_TEST_SUITE_P(
    Table, ScalingTableTest,
    ::testing::Values(
        // Idle cluster: target = min 3 + buffer 3.
        ScalingCase{"SmallIdleClusterGrowsToFloor", Repeat(3, {0, 0}), 3, {}},
        // load 80: ⌈80 × 1.10 / 8⌉ = 11 exactly (a double ceiling would say 12).
        ScalingCase{"LoadDrivesTarget", Repeat(10, {8, 8}), 1, {}},
        // target 11, limit ⌈80 × 1.15 / 8⌉ = 12.
        ScalingCase{"WithinBandNoChange", Concat(Repeat(10, {8, 8}), Repeat(2, {0, 0})), 0, {}},
        // 16 hosts, limit 12: 4 surplus, k = 2, fewest subscribed GPUs first.
        ScalingCase{"ReleasesAtMostKLeastSubscribed",
                    Concat(Repeat(10, {8, 8}), {{0, 3}, {0, 1}, {0, 2}, {0, 0}, {0, 5}, {0, 1}}),
                    0,
                    {"h13", "h11"}},
        ScalingCase{"NeverReleasesCommitted", Repeat(9, {1, 1}), 0, {}},
        ScalingCase{
            "ReleasesOnlyIdleOnes", Concat(Repeat(7, {1, 1}), {{0, 9}, {1, 0}}), 0, {"h07"}},
        // load 30: target max(⌈33/8⌉, 6) = 6; the reference's limit ⌈34.5/8⌉ = 5 would drop to
        // 5 hosts and ask for one back next round.
        ScalingCase{"NeverReleasesBelowTarget",
                    Concat({{8, 8}, {8, 8}, {8, 8}, {6, 6}}, Repeat(3, {0, 0})),
                    0,
                    {"h04"}},
        ScalingCase{"DrainingHostsDoNotCount",
                    Concat(Repeat(5, {0, 0}), {{0, 0, false}, {0, 0, false}}),
                    1,
                    {}},
        ScalingCase{"MaxHostsCapsGrowth", Repeat(3, {0, 0}), 1, {}, 4},
        ScalingCase{"FullHostsGetHeadroom", Repeat(6, {8, 8}), 1, {}},  // ⌈52.8/8⌉ = 7
        ScalingCase{"BurstAddsMany", Concat(Repeat(6, {8, 8}), Repeat(6, {8, 8})), 2, {}}),
    [](const auto& case_info) { return case_info.param.name; });

TEST(ScalingTest, ClusterStateOverloadAgrees) {
  ClusterState c = test::Cluster({test::Server("a", 8), test::Server("b", 8)});
  ASSERT_TRUE(c.Commit("a", test::Gpus(8)).ok());
  ScalingDecision d = DecideScaling(c);
  EXPECT_EQ(d.add_hosts, 4);  // target max(⌈8.8/8⌉, 6) = 6
  EXPECT_TRUE(d.release_server_ids.empty());
}

TEST(ScalingTest, ScaleInFromLargeIdleClusterStepsByK) {
  std::vector<ServerView> hosts = Hosts(Repeat(12, {0, 0}));
  ScalingOptions opts;
  int rounds = 0;
  while (true) {
    ScalingDecision d = DecideScaling(hosts, opts);
    ASSERT_EQ(d.add_hosts, 0);
    if (d.release_server_ids.empty()) break;
    ASSERT_LE(d.release_server_ids.size(), 2u);
    for (const std::string& id : d.release_server_ids) {
      std::erase_if(hosts, [&](const ServerView& s) { return s.server_id == id; });
    }
    ++rounds;
  }
  EXPECT_EQ(rounds, 3);
  EXPECT_EQ(hosts.size(), 6u);
}

TEST(ScalingTest, PinningKeepsReliedOnServersAndOrdersTheRest) {
  // 10 full hosts and 6 idle ones: limit 12, so 2 go. By subscription alone h10 and h11 would;
  // h10 is pinned by 2 replicas, h11 by 1 and h12 by none.
  std::vector<ServerView> hosts =
      Hosts(Concat(Repeat(10, {8, 8}), {{0, 0}, {0, 0}, {0, 5}, {0, 6}, {0, 7}, {0, 8}}));
  const std::map<std::string, int32_t> pins = {{"h10", 2}, {"h11", 1}, {"h13", 1}};
  int calls = 0;
  const PinningCount pinning = [&](const ServerView& server) {
    ++calls;
    EXPECT_EQ(server.committed.gpus, 0) << "only idle servers are asked about";
    const auto it = pins.find(server.server_id);
    return it == pins.end() ? 0 : it->second;
  };
  ScalingOptions opts;
  opts.release_max_pinning_replicas = 0;
  EXPECT_EQ(DecideScaling(hosts, opts, {}, &pinning).release_server_ids,
            (std::vector<std::string>{"h12", "h14"}));
  EXPECT_EQ(calls, 6);
  // Up to 1 pinning replica: unpinned first, then the least pinned, then by subscription.
  opts.release_max_pinning_replicas = 1;
  opts.max_release_per_round = 4;
  EXPECT_EQ(DecideScaling(hosts, opts, {}, &pinning).release_server_ids,
            (std::vector<std::string>{"h12", "h14", "h15", "h11"}));
  // Without the option the count plays no part and is never asked for.
  calls = 0;
  opts.release_max_pinning_replicas = -1;
  opts.max_release_per_round = 2;
  EXPECT_EQ(DecideScaling(hosts, opts, {}, &pinning).release_server_ids,
            (std::vector<std::string>{"h10", "h11"}));
  EXPECT_EQ(calls, 0);
}

TEST(ScalingTest, PinningIsNotCountedWhenNothingMayGo) {
  std::vector<ServerView> hosts = Hosts(Concat(Repeat(10, {8, 8}), Repeat(2, {0, 0})));
  int calls = 0;
  const PinningCount pinning = [&](const ServerView&) { return ++calls, 0; };
  ScalingOptions opts;
  opts.release_max_pinning_replicas = 0;
  EXPECT_TRUE(DecideScaling(hosts, opts, {}, &pinning).release_server_ids.empty());
  EXPECT_EQ(calls, 0);  // within the band: no surplus
}

TEST(ScalingTest, IdleServersWantedRaiseTheTargetAboveTheBusyOnes) {
  // 4 busy hosts and 1 idle: the factor's target is min 3 + buffer 3 = 6, so 1 is added.
  std::vector<ServerView> hosts = Hosts(Concat(Repeat(4, {8, 8}), {{0, 0}}));
  EXPECT_EQ(DecideScaling(hosts).add_hosts, 1);
  // 3 wholly idle servers wanted: target 4 busy + 3 = 7.
  ScalingDecision d = DecideScaling(hosts, {}, {.gpus = 0, .idle_servers = 3});
  EXPECT_EQ(d.add_hosts, 2) << d.reason;
  EXPECT_NE(d.reason.find("(1 idle, 3 wanted)"), std::string::npos) << d.reason;
  // A partly busy host is busy: it is no idle server for a whole-server cell.
  hosts = Hosts(Concat(Repeat(4, {8, 8}), {{1, 1}, {0, 0}, {0, 0}}));
  EXPECT_EQ(DecideScaling(hosts, {}, {.gpus = 0, .idle_servers = 3}).add_hosts, 1);
}

TEST(ScalingTest, ScaleInKeepsTheIdleServersWantedAndTheMargin) {
  // 2 busy hosts and 8 idle: the factor's limit is 6, so up to k go.
  std::vector<ServerView> hosts = Hosts(Concat(Repeat(2, {8, 8}), Repeat(8, {0, 0})));
  ScalingOptions opts;
  opts.max_release_per_round = 8;
  EXPECT_EQ(DecideScaling(hosts, opts).release_server_ids.size(), 4u);  // down to 6
  EXPECT_EQ(DecideScaling(hosts, opts, {.gpus = 0, .idle_servers = 5}).release_server_ids.size(),
            3u);  // 2 busy + 5 idle
  opts.release_idle_servers_margin = 2;
  ScalingDecision d = DecideScaling(hosts, opts, {.gpus = 0, .idle_servers = 5});
  EXPECT_EQ(d.release_server_ids.size(), 1u) << d.reason;  // 5 + 2 kept idle
  EXPECT_EQ(d.add_hosts, 0);
  // The margin alone keeps nothing: it applies only when idle servers are wanted.
  EXPECT_EQ(DecideScaling(hosts, opts).release_server_ids.size(), 4u);
}

}  // namespace
}  // namespace nbos::sched
