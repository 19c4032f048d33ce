#include "gateway/heartbeat_monitor.h"

#include <gtest/gtest.h>

#include <limits>

namespace nbos::gateway {
namespace {

using Change = std::pair<ReplicaId, bool>;

TEST(HeartbeatMonitorTest, PingsEachReplicaEveryInterval) {
  HeartbeatMonitor m({.interval_ms = 250, .timeout_ms = 1000});
  m.Add(1, 0);
  m.Add(2, 100);
  EXPECT_EQ(m.Advance(0).ping, std::vector<ReplicaId>{1});
  EXPECT_EQ(m.next_due_ms(), 100);
  EXPECT_EQ(m.Advance(100).ping, std::vector<ReplicaId>{2});
  EXPECT_TRUE(m.Advance(200).ping.empty());
  EXPECT_EQ(m.Advance(250).ping, std::vector<ReplicaId>{1});
}

TEST(HeartbeatMonitorTest, AnUnansweredPingPastTheTimeoutMakesAReplicaUnreachable) {
  HeartbeatMonitor m({.interval_ms = 250, .timeout_ms = 1000});
  m.Add(1, 0);
  m.Add(2, 0);
  m.Echo(1);  // both have answered once
  m.Echo(2);
  for (int64_t t = 0; t <= 1000; t += 250) {
    m.Advance(t);
    m.Echo(2);
  }
  // Replica 1's first ping (t=0) is still unanswered, but not for longer than the timeout.
  EXPECT_TRUE(m.Advance(1000).reachable.empty());
  EXPECT_EQ(m.next_due_ms(), 1001);
  EXPECT_EQ(m.Advance(1001).reachable, (std::vector<Change>{{1, false}}));
  EXPECT_TRUE(m.Advance(5000).reachable.empty());  // reported once
  EXPECT_TRUE(m.Echo(1));                          // back with its next echo
  EXPECT_FALSE(m.Echo(1));
  m.Advance(5250);
  EXPECT_TRUE(m.Advance(6000).reachable.empty());
}

TEST(HeartbeatMonitorTest, AReplicaIsJudgedOnlyOnceItHasEchoed) {
  HeartbeatMonitor m({.interval_ms = 250, .timeout_ms = 1000});
  m.Add(1, 0);
  for (int64_t t = 0; t <= 5000; t += 250) EXPECT_TRUE(m.Advance(t).reachable.empty()) << t;
  EXPECT_FALSE(m.Echo(1));
  m.Advance(5250);
  EXPECT_EQ(m.Advance(6251).reachable, (std::vector<Change>{{1, false}}));
}

TEST(HeartbeatMonitorTest, EchoesReadBeforeAdvanceKeepASlowGatewayFromBlamingReplicas) {
  HeartbeatMonitor m({.interval_ms = 250, .timeout_ms = 1000});
  m.Add(1, 0);
  m.Echo(1);
  m.Advance(0);
  // The gateway looked again only after 3 s; the echo of the t=0 ping was waiting for it.
  m.Echo(1);
  const HeartbeatMonitor::Tick tick = m.Advance(3000);
  EXPECT_TRUE(tick.reachable.empty());
  EXPECT_EQ(tick.ping, std::vector<ReplicaId>{1});
}

TEST(HeartbeatMonitorTest, RemovedReplicasAreForgotten) {
  HeartbeatMonitor m({.interval_ms = 250, .timeout_ms = 1000});
  m.Add(1, 0);
  m.Advance(0);
  m.Remove(1);
  EXPECT_FALSE(m.Echo(1));
  EXPECT_TRUE(m.Advance(5000).reachable.empty());
  EXPECT_EQ(m.next_due_ms(), std::numeric_limits<int64_t>::max());
}

}  // namespace
}  // namespace nbos::gateway
