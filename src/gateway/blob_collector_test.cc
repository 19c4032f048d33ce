#include "gateway/blob_collector.h"

#include <gtest/gtest.h>

namespace nbos::gateway {
namespace {

using namespace std::chrono_literals;

std::vector<std::string> Keys(const BlobGcDecision& d) {
  std::vector<std::string> keys;
  for (const auto& b : d.to_delete) keys.push_back(b.key);
  return keys;
}

TEST(BlobCollectorTest, DeletesOnlyWhatEveryRoundForTheWholeGraceFoundUnreferenced) {
  BlobCollector gc(1000ms);
  const std::vector<store::StoredBlob> stored{{"live", 10}, {"dead", 20}, {"late", 40}};
  auto d = gc.Round({stored, {"live", "late"}, true, 0});
  EXPECT_TRUE(d.to_delete.empty());
  EXPECT_EQ(d.candidates, 1u);
  EXPECT_EQ(d.bytes_stored, 70u);
  EXPECT_EQ(d.bytes_referenced, 50u);
  // "late" is dropped by its kernel at 500 ms: its grace starts then.
  d = gc.Round({stored, {"live"}, true, 500});
  EXPECT_TRUE(d.to_delete.empty());
  EXPECT_EQ(d.candidates, 2u);
  d = gc.Round({stored, {"live"}, true, 1000});
  EXPECT_EQ(Keys(d), std::vector<std::string>{"dead"});
  EXPECT_EQ(d.to_delete[0].size_bytes, 20u);
  d = gc.Round({{{"live", 10}, {"late", 40}}, {"live"}, true, 1499});
  EXPECT_TRUE(d.to_delete.empty());
  d = gc.Round({{{"live", 10}, {"late", 40}}, {"live"}, true, 1500});
  EXPECT_EQ(Keys(d), std::vector<std::string>{"late"});
}

TEST(BlobCollectorTest, AReferenceAgainOrASilentKernelStartsTheGraceOver) {
  BlobCollector gc(1000ms);
  const std::vector<store::StoredBlob> stored{{"a", 1}, {"b", 1}};
  gc.Round({stored, {}, true, 0});
  gc.Round({stored, {"a"}, true, 600});         // "a" is used again (the same bytes put anew)
  auto d = gc.Round({stored, {}, false, 900});  // a kernel did not answer
  EXPECT_TRUE(d.to_delete.empty());
  EXPECT_EQ(d.candidates, 0u);
  d = gc.Round({stored, {}, true, 1000});  // both start over here
  EXPECT_TRUE(d.to_delete.empty());
  d = gc.Round({stored, {}, true, 2000});
  EXPECT_EQ(Keys(d), (std::vector<std::string>{"a", "b"}));
}

TEST(BlobCollectorTest, ZeroGraceDeletesAtTheFirstCompleteRound) {
  BlobCollector gc(0ms);
  EXPECT_EQ(Keys(gc.Round({{{"x", 1}}, {}, true, 5})), std::vector<std::string>{"x"});
  EXPECT_TRUE(gc.Round({{{"y", 1}}, {}, false, 6}).to_delete.empty());
}

}  // namespace
}  // namespace nbos::gateway
