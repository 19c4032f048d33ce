#include "common/test_ports.h"

#include <gtest/gtest.h>

#include <set>

namespace nbos::testing {
namespace {

TEST(FreeTestPortTest, PortsAreBelowTheDaemonAndEphemeralRangesAndNeverRepeat) {
  std::set<int> seen;
  for (int i = 0; i < 50; ++i) {
    const int port = FreeTestPort(i % 2 == 0 ? 1 : 2);
    ASSERT_GE(port, 10000);
    ASSERT_LT(port, 20000);
    EXPECT_TRUE(seen.insert(port).second) << port;
    if (i % 2 == 1) {
      EXPECT_TRUE(seen.insert(port + 1).second) << port + 1;
    }
  }
}

}  // namespace
}  // namespace nbos::testing
