#include "daemon/ports.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <set>

namespace nbos::daemon {
namespace {

TEST(PortAllocatorTest, NeverHandsOutAPortTwice) {
  PortAllocator ports;
  std::set<int> seen;
  for (int i = 0; i < 20; ++i) {
    auto batch = ports.Reserve(5);
    ASSERT_TRUE(batch.ok()) << batch.status().ToString();
    for (int p : *batch) {
      EXPECT_TRUE(seen.insert(p).second) << "port " << p << " handed out twice";
      EXPECT_TRUE(ports.IsReserved(p));
    }
    auto pair = ports.ReservePair();
    ASSERT_TRUE(pair.ok());
    EXPECT_TRUE(seen.insert(*pair).second);
    EXPECT_TRUE(seen.insert(*pair + 1).second) << "P + 1 must be reserved with P";
  }
  EXPECT_EQ(ports.reserved_count(), seen.size());
}

TEST(PortAllocatorTest, ReservedPortsBindAndReleaseReturnsThem) {
  PortAllocator ports("127.0.0.1");
  auto pair = ports.ReservePair();
  ASSERT_TRUE(pair.ok());
  EXPECT_TRUE(PortAllocator::CanBind("127.0.0.1", *pair));
  EXPECT_TRUE(PortAllocator::CanBind("127.0.0.1", *pair + 1));
  ports.Release({*pair, *pair + 1});
  EXPECT_FALSE(ports.IsReserved(*pair));
  EXPECT_EQ(ports.reserved_count(), 0u);
}

TEST(PortAllocatorTest, StaysInItsRangeAndSaysWhenItIsSpent) {
  auto range = PortRange::Parse("24100-24109");
  ASSERT_TRUE(range.ok()) << range.status().ToString();
  PortAllocator ports("127.0.0.1", *range);
  auto pair = ports.ReservePair();
  ASSERT_TRUE(pair.ok());
  auto rest = ports.Reserve(8);
  ASSERT_TRUE(rest.ok()) << rest.status().ToString();
  std::set<int> seen(rest->begin(), rest->end());
  seen.insert({*pair, *pair + 1});
  EXPECT_EQ(seen.size(), 10u);
  EXPECT_EQ(*seen.begin(), 24100);
  EXPECT_EQ(*seen.rbegin(), 24109);
  auto more = ports.Reserve(1);
  EXPECT_EQ(more.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(more.status().message().find("24100-24109"), std::string::npos);
  EXPECT_EQ(ports.reserved_count(), 10u) << "a failed reservation keeps nothing";
  ports.Release({*pair});
  auto again = ports.Reserve(1);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->front(), *pair);
}

TEST(PortAllocatorTest, SkipsPortsSomeoneElseHolds) {
  PortAllocator probe("127.0.0.1", {24200, 24299});
  auto held = probe.Reserve(1);
  ASSERT_TRUE(held.ok());
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(held->front()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  PortAllocator ports("127.0.0.1", {held->front(), held->front() + 1});
  auto got = ports.Reserve(1);
  close(fd);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->front(), held->front() + 1);
}

TEST(PortRangeTest, ParsesAndRejects) {
  auto r = PortRange::Parse("1000-2000");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first, 1000);
  EXPECT_EQ(r->last, 2000);
  EXPECT_EQ(r->size(), 1001);
  for (const char* bad : {"", "1000", "2000-1000", "0-10", "10-70000", "a-b", "10-20x", "-5"}) {
    EXPECT_EQ(PortRange::Parse(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace nbos::daemon
