#include "sched/warm_pool.h"

#include <gtest/gtest.h>

namespace nbos::sched {
namespace {

std::vector<WarmPoolServer> Servers(std::vector<std::pair<int32_t, int32_t>> warm_starting) {
  std::vector<WarmPoolServer> out;
  int i = 0;
  for (auto [w, s] : warm_starting) out.push_back({"s" + std::to_string(i++), w, s, true});
  return out;
}

std::string Show(const std::vector<WarmPoolAction>& actions) {
  std::string s;
  for (const auto& a : actions) {
    s += a.server_id + ":+" + std::to_string(a.start) + "-" + std::to_string(a.stop) + " ";
  }
  return s;
}

struct Case {
  std::string name;
  WarmPoolOptions options;
  std::vector<std::pair<int32_t, int32_t>> pool;  // (warm, starting) per server s0, s1, ...
  double arrivals_per_min;
  std::string want;
};

TEST(WarmPoolTest, DataDriven) {
  WarmPoolOptions min1{WarmPoolPolicy::kMinimumCapacity, 1, 0, -1, 0.5};
  WarmPoolOptions min2cap1{WarmPoolPolicy::kMinimumCapacity, 2, 0, 1, 0.5};
  WarmPoolOptions fixed5{WarmPoolPolicy::kFixed, 0, 5, -1, 0.5};
  WarmPoolOptions fixed5cap2{WarmPoolPolicy::kFixed, 0, 5, 2, 0.5};
  WarmPoolOptions little{WarmPoolPolicy::kLittlesLaw, 0, 0, -1, 25};
  WarmPoolOptions none{WarmPoolPolicy::kNone, 0, 0, -1, 0.5};
  const std::vector<Case> cases = {
      {"min fills each host", min1, {{0, 0}, {1, 0}, {0, 1}}, 0, "s0:+1-0 "},
      {"min caps per host", min2cap1, {{3, 0}, {0, 0}}, 0, "s0:+0-2 s1:+1-0 "},
      {"fixed spreads to emptiest", fixed5, {{2, 0}, {0, 0}, {0, 0}}, 0, "s1:+2-0 s2:+1-0 "},
      {"fixed respects cap", fixed5cap2, {{0, 0}, {0, 0}}, 0, "s0:+2-0 s1:+2-0 "},
      {"fixed stops from fullest", fixed5, {{4, 0}, {3, 0}}, 0, "s0:+0-2 "},
      {"starting counts, cannot be stopped", fixed5, {{0, 6}}, 0, ""},
      {"little 0.2/min x 25 min = 5", little, {{0, 0}, {0, 0}}, 0.2, "s0:+3-0 s1:+2-0 "},
      {"little no arrivals drains", little, {{1, 0}, {2, 0}}, 0, "s0:+0-1 s1:+0-2 "},
      {"none stops everything", none, {{1, 0}}, 3, "s0:+0-1 "},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Show(SizeWarmPool(c.options, Servers(c.pool), c.arrivals_per_min)), c.want) << c.name;
  }
}

TEST(WarmPoolTest, NonAcceptingServerLosesItsPool) {
  WarmPoolOptions fixed{WarmPoolPolicy::kFixed, 0, 2, -1, 0.5};
  std::vector<WarmPoolServer> servers = {{"a", 2, 0, false}, {"b", 0, 0, true}};
  EXPECT_EQ(Show(SizeWarmPool(fixed, servers, 0)), "a:+0-2 b:+2-0 ");
}

TEST(WarmPoolTest, ParseNames) {
  for (auto p : {WarmPoolPolicy::kNone, WarmPoolPolicy::kMinimumCapacity, WarmPoolPolicy::kFixed,
                 WarmPoolPolicy::kLittlesLaw}) {
    auto parsed = ParseWarmPoolPolicy(WarmPoolPolicyName(p));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, p);
  }
  EXPECT_FALSE(ParseWarmPoolPolicy("bogus").ok());
}

TEST(WarmPoolTest, ArrivalWindowSlides) {
  ArrivalWindow w(60000);
  w.Add(0);
  w.Add(30000);
  EXPECT_DOUBLE_EQ(w.RatePerMinute(30000), 2.0);
  EXPECT_DOUBLE_EQ(w.RatePerMinute(60000), 1.0);  // the arrival at 0 left the window
  EXPECT_DOUBLE_EQ(w.RatePerMinute(200000), 0.0);
}

}  // namespace
}  // namespace nbos::sched
