#include "common/ids.h"

#include <gtest/gtest.h>

#include <set>

namespace nbos {
namespace {

TEST(IdsTest, UuidIsCanonicalVersion4AndUnique) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    std::string id = NewUuid();
    ASSERT_EQ(id.size(), 36u);
    EXPECT_EQ(id[8], '-');
    EXPECT_EQ(id[14], '4');
    EXPECT_TRUE(id[19] == '8' || id[19] == '9' || id[19] == 'a' || id[19] == 'b') << id;
    EXPECT_TRUE(seen.insert(id).second);
  }
}

TEST(IdsTest, IsoFormatHasMicrosecondsAndZ) {
  using namespace std::chrono;
  system_clock::time_point t{seconds{1704067200} + microseconds{42}};
  EXPECT_EQ(FormatIsoUtc(t), "2024-01-01T00:00:00.000042Z");
}

}  // namespace
}  // namespace nbos
