#include "daemon/ports.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace nbos::daemon
