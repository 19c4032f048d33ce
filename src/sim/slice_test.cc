#include "sim/slice.h"

#include <gtest/gtest.h>

#include "sim/simulator.h"

namespace nbos::sim {
namespace {

Session MakeSession(std::string id, int64_t start_ms, std::vector<Cell> cells) {
  Session s{std::move(id), start_ms, 0, 0, std::move(cells)};
  for (const Cell& c : s.cells) {
    s.gpus = std::max(s.gpus, c.gpus);
    s.stop_ms = std::max(s.stop_ms, c.submit_ms + c.duration_ms);
  }
  return s;
}

Workload ThreeSessions() {
  Workload w;
  w.sessions = {MakeSession("a", 0, {{60000, 600000, 4}, {7200000, 60000, 8}}),
                MakeSession("b", 3600000, {{3660000, 120000, 1}, {3900000, 30000, 2}}),
                MakeSession("c", 9000000, {{9060000, 60000, 1}})};
  return w;
}

TEST(SliceTest, KeepsTheWindowsCellsShiftedAndCompressed) {
  auto w = SliceWorkload(ThreeSessions(), {3000000, 8000000, 60.0, 0});
  ASSERT_TRUE(w.ok()) << w.status().message();
  ASSERT_EQ(w->sessions.size(), 2u);
  const Session& a = w->sessions[0];  // open before the window: starts at its beginning
  EXPECT_EQ(a.id, "a");
  EXPECT_EQ(a.start_ms, 0);
  ASSERT_EQ(a.cells.size(), 1u);
  EXPECT_EQ(a.cells[0].submit_ms, (7200000 - 3000000) / 60);
  EXPECT_EQ(a.cells[0].duration_ms, 1000);
  EXPECT_EQ(a.gpus, 8);  // the request of the kept cells only
  EXPECT_EQ(a.stop_ms, a.cells[0].submit_ms + 1000);
  const Session& b = w->sessions[1];
  EXPECT_EQ(b.start_ms, 10000);
  ASSERT_EQ(b.cells.size(), 2u);
  EXPECT_EQ(b.cells[0].submit_ms, 11000);
  EXPECT_EQ(b.cells[1].duration_ms, 500);
  EXPECT_EQ(b.gpus, 2);
}

TEST(SliceTest, ACellRunningPastTheWindowIsKeptWhole) {
  auto w = SliceWorkload(ThreeSessions(), {0, 120000, 1.0, 0});
  ASSERT_TRUE(w.ok());
  ASSERT_EQ(w->sessions.size(), 1u);
  EXPECT_EQ(w->sessions[0].cells[0].duration_ms, 600000);
}

TEST(SliceTest, MaxSessionsSpreadsOverTheWindow) {
  Workload many;
  for (int i = 0; i < 10; ++i) {
    many.sessions.push_back(MakeSession("s" + std::to_string(i), i * 1000, {{i * 1000, 10, 1}}));
  }
  auto w = SliceWorkload(many, {0, -1, 1.0, 3});
  ASSERT_TRUE(w.ok());
  ASSERT_EQ(w->sessions.size(), 3u);
  EXPECT_EQ(w->sessions[0].id, "s0");
  EXPECT_EQ(w->sessions[1].id, "s3");
  EXPECT_EQ(w->sessions[2].id, "s6");
  auto all = SliceWorkload(many, {0, -1, 1.0, 50});
  EXPECT_EQ(all->sessions.size(), 10u);
}

TEST(SliceTest, DurationsNeverCompressToZero) {
  auto w = SliceWorkload(ThreeSessions(), {0, -1, 1e9, 0});
  ASSERT_TRUE(w.ok());
  for (const Session& s : w->sessions) {
    for (const Cell& c : s.cells) EXPECT_GE(c.duration_ms, 1);
  }
}

TEST(SliceTest, RejectsBadOptions) {
  EXPECT_FALSE(SliceWorkload(ThreeSessions(), {0, -1, 0.0, 0}).ok());
  EXPECT_FALSE(SliceWorkload(ThreeSessions(), {5000, 5000, 1.0, 0}).ok());
}

TEST(SliceTest, ParsesWindows) {
  auto w = ParseWindow("566h-568h");
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->first, 566LL * 3600000);
  EXPECT_EQ(w->second, 568LL * 3600000);
  EXPECT_EQ(ParseWindow("0-90m")->second, 5400000);
  EXPECT_EQ(ParseWindow("1.5d-2d")->first, 129600000);
  EXPECT_EQ(ParseWindow("30s-1m")->first, 30000);
  for (const char* bad : {"566h", "10-20h", "2h-1h", "1h-1h", "xh-2h", "-1h-2h", "1h-2w"}) {
    EXPECT_FALSE(ParseWindow(bad).ok()) << bad;
  }
}

// A slice may be simulated on a cluster smaller than a kernel's replica set; that is refused rather
// than left to wait for servers that never come.
TEST(SliceTest, ASimulationTooSmallForThreeReplicasIsRefused) {
  SimOptions o;
  o.initial_hosts = o.max_hosts = 2;
  o.auto_scaling = false;
  auto r = Simulate(ThreeSessions(), o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("3 replicas"), std::string::npos) << r.status().message();
  o.auto_scaling = true;
  EXPECT_FALSE(Simulate(ThreeSessions(), o).ok());
  o.policy = Policy::kBatch;  // one process per cell: two servers do
  EXPECT_TRUE(Simulate(ThreeSessions(), o).ok());
}

}  // namespace
}  // namespace nbos::sim
