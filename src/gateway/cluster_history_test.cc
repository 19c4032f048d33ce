#include "gateway/cluster_history.h"

#include <gtest/gtest.h>

namespace nbos::gateway {
namespace {

TEST(ClusterHistory, DelayPercentilesCoverTheTrailingWindowOnly) {
  ClusterHistory h(/*max_samples=*/10, /*delay_window_ms=*/5'000);
  std::vector<double> delays;
  for (int i = 1; i <= 100; ++i) delays.push_back(i);
  h.RecordDelays(1'000, delays);
  const HistorySample& first = h.Add({.at_unix_ms = 2'000, .gpus_provisioned = 8});
  EXPECT_EQ(first.delay_p50_ms, 50);
  EXPECT_EQ(first.delay_p95_ms, 95);
  EXPECT_EQ(first.delay_p99_ms, 99);
  EXPECT_EQ(first.executions, 100u);

  h.RecordDelays(5'500, {1000});
  const HistorySample& second = h.Add({.at_unix_ms = 6'000});
  EXPECT_EQ(second.delay_p50_ms, 1000) << "delays older than the window are dropped";
  EXPECT_EQ(second.executions, 1u);

  const HistorySample& third = h.Add({.at_unix_ms = 20'000});
  EXPECT_LT(third.delay_p50_ms, 0) << "no execution in the window: no delay";
  EXPECT_EQ(third.executions, 0u);
}

TEST(ClusterHistory, ColumnsKeepTheNewestSamplesWithGapsForMissingDelays) {
  ClusterHistory h(/*max_samples=*/3);
  for (int i = 0; i < 5; ++i) h.Add({.at_unix_ms = i * 1000, .gpus_committed = i});
  const nlohmann::json c = h.Columns();
  EXPECT_EQ(c["at_unix_ms"], nlohmann::json({2000, 3000, 4000}));
  EXPECT_EQ(c["gpus_committed"], nlohmann::json({2, 3, 4}));
  EXPECT_TRUE(c["delay_p95_ms"][0].is_null());
  EXPECT_EQ(h.size(), 3u);
}

}  // namespace
}  // namespace nbos::gateway
