#include "sched/forecast.h"

#include <gtest/gtest.h>

namespace nbos::sched {
namespace {

constexpr int64_t kMin = 60 * 1000;
constexpr int64_t kHour = 60 * kMin;

GapDistribution ShortAndLong() {
  GapDistribution d;
  for (int i = 0; i < 10; ++i) d.Observe(1 * kMin);
  for (int i = 0; i < 10; ++i) d.Observe(1 * kHour);
  return d;
}

TEST(GapDistributionTest, ChanceWithinConditionsOnTheIdleTimeSoFar) {
  const GapDistribution d = ShortAndLong();
  // Half the gaps end within 2 minutes of the start of a gap...
  EXPECT_NEAR(d.ChanceWithin(0, 2 * kMin, -1), 0.5, 1e-9);
  // ...none of those still idle after 10 minutes ends in the next 2...
  EXPECT_NEAR(d.ChanceWithin(10 * kMin, 2 * kMin, -1), 0.0, 1e-9);
  // ...and all of them end within 70 minutes.
  EXPECT_NEAR(d.ChanceWithin(50 * kMin, 20 * kMin, -1), 1.0, 1e-9);
}

TEST(GapDistributionTest, KernelsThatNeverReturnedLowerTheChance) {
  GapDistribution d = ShortAndLong();
  for (int i = 0; i < 20; ++i) d.ObserveNeverReturned();
  EXPECT_EQ(d.count(), 40);
  EXPECT_NEAR(d.ChanceWithin(0, 2 * kMin, -1), 0.25, 1e-9);
  EXPECT_NEAR(d.ChanceWithin(50 * kMin, 20 * kMin, -1), 10.0 / 30.0, 1e-9);
}

TEST(GapDistributionTest, FallbackOnlyWhenNothingWasSeen) {
  EXPECT_EQ(GapDistribution().ChanceWithin(0, kMin, 0.7), 0.7);
  EXPECT_EQ(ShortAndLong().ChanceWithin(2 * kHour, kMin, 0.3), 0.0);
}

TEST(KernelGapsTest, KeepsTheMostRecentAndCountsThoseBeyondTheIdleTime) {
  KernelGaps g;
  for (int64_t m : {1, 2, 3, 30, 40}) g.Add(m * kMin, 4);
  ASSERT_EQ(g.gaps_ms.size(), 4u);
  EXPECT_EQ(g.gaps_ms.front(), 2 * kMin);
  int32_t longer = 0, within = 0;
  g.Count(2 * kMin + 1, 10 * kMin, &longer, &within);  // 3 (within 12), 30, 40
  EXPECT_EQ(longer, 3);
  EXPECT_EQ(within, 1);
}

TEST(ReturnChanceTest, AKernelsOwnHistoryOutweighsThePopulationAsItGrows) {
  const GapDistribution population = ShortAndLong();  // 0.5 within 2 min from the start
  const WeekProfile week;
  ForecastOptions o;
  o.horizon_ms = 2 * kMin;
  o.prior_weight = 4;
  KernelGaps fast;  // always back within a minute
  EXPECT_NEAR(ReturnChance(population, fast, week, 0, 0, o), 0.5, 1e-9);
  for (int i = 0; i < 4; ++i) fast.Add(30 * 1000, 32);
  EXPECT_NEAR(ReturnChance(population, fast, week, 0, 0, o), (4 + 4 * 0.5) / 8, 1e-9);
  KernelGaps slow;  // always away for an hour
  for (int i = 0; i < 12; ++i) slow.Add(kHour, 32);
  EXPECT_NEAR(ReturnChance(population, slow, week, 0, 0, o), (0 + 4 * 0.5) / 16, 1e-9);
}

TEST(ReturnChanceTest, WithNothingLearnedEveryKernelIsExpectedBack) {
  EXPECT_EQ(ReturnChance({}, {}, {}, 0, 5 * kMin, ForecastOptions{}), 1.0);
}

TEST(NextNeedTest, CoversTheLargestCountLikelyEnoughAndMixesOwnHistoryIn) {
  NeedHistory population;
  for (int i = 0; i < 8; ++i) population.Observe(1, 1);
  for (int i = 0; i < 2; ++i) population.Observe(1, 8);  // 1 → 8 one time in five
  ForecastOptions o;
  o.prior_weight = 4;
  o.cover_chance = 0.25;
  GpuNeed need = NextNeed(population, {}, 1, o, 8);
  EXPECT_NEAR(need.expected_gpus, 0.8 * 1 + 0.2 * 8, 1e-9);
  EXPECT_EQ(need.cover_gpus, 1);  // 0.2 < 0.25
  NeedHistory own;                // this kernel went from 1 to 8 GPUs four times out of four
  for (int i = 0; i < 4; ++i) own.Observe(1, 8);
  need = NextNeed(population, own, 1, o, 8);
  EXPECT_NEAR(need.expected_gpus, 0.4 * 1 + 0.6 * 8, 1e-9);  // P(8) = (4 + 4 × 0.2) / 8
  EXPECT_EQ(need.cover_gpus, 8);
  // Nothing seen after a 4-GPU cell: the next one is assumed alike.
  need = NextNeed(population, own, 4, o, 8);
  EXPECT_EQ(need.expected_gpus, 4.0);
  EXPECT_EQ(need.cover_gpus, 4);
}

TEST(NextNeedTest, WholeChanceIsTheChanceTheNextCellTakesAWholeServer) {
  NeedHistory population;
  for (int i = 0; i < 6; ++i) population.Observe(1, 1);
  for (int i = 0; i < 2; ++i) population.Observe(1, 4);
  for (int i = 0; i < 2; ++i) population.Observe(1, 8);
  const ForecastOptions o;
  EXPECT_NEAR(NextNeed(population, {}, 1, o, 8).whole_chance, 0.2, 1e-9);
  EXPECT_NEAR(NextNeed(population, {}, 1, o, 4).whole_chance, 0.4, 1e-9);  // 4-GPU servers
  NeedHistory own;  // 1 → 8 four times out of four: (4 + 4 × 0.2) / 8
  for (int i = 0; i < 4; ++i) own.Observe(1, 8);
  EXPECT_NEAR(NextNeed(population, own, 1, o, 8).whole_chance, 0.6, 1e-9);
  // Nothing learned after the last cell: as large as it was.
  EXPECT_EQ(NextNeed(population, own, 8, o, 8).whole_chance, 1.0);
  EXPECT_EQ(NextNeed(population, own, 2, o, 8).whole_chance, 0.0);
}

TEST(WeekProfileTest, WeighsHoursByTheirRateOnceAWeekWasSeen) {
  WeekProfile w;
  // Busy Monday mornings (hour 9 of the week), one request in every other hour.
  for (int64_t h = 0; h < 7 * 24; ++h) {
    w.Observe(h * kHour + 1);
    if (h == 9) {
      for (int i = 0; i < 20; ++i) w.Observe(h * kHour + 2);
    }
  }
  EXPECT_EQ(w.Weight(9 * kHour), 1.0);  // not a full week yet
  w.Observe(7 * 24 * kHour + 10 * kHour);
  const double mean = (7.0 * 24 + 21) / (7 * 24);
  EXPECT_NEAR(w.Weight(9 * kHour + 5), 4.0, 1e-9);  // 21 / mean > 4: clamped
  EXPECT_NEAR(w.Weight(11 * kHour), 1.0 / mean, 1e-9);
  EXPECT_NEAR(w.Weight(7 * 24 * kHour + 11 * kHour), 1.0 / mean, 1e-9);  // the same hour
}

TEST(ReturnChanceTest, AQuietHourLowersTheChanceABusyOneRaisesIt) {
  const GapDistribution population = ShortAndLong();
  WeekProfile w;
  for (int64_t h = 0; h <= 7 * 24; ++h) {
    for (int i = 0; i < (h % 24 < 8 ? 1 : 10); ++i) w.Observe(h * kHour);
  }
  ForecastOptions o;
  o.horizon_ms = 2 * kMin;
  o.prior_weight = 4;
  const double night = ReturnChance(population, {}, w, 3 * kHour, 0, o);
  const double day = ReturnChance(population, {}, w, 14 * kHour, 0, o);
  EXPECT_LT(night, 0.5);
  EXPECT_GT(day, 0.5);
  EXPECT_LE(day, 1.0);
}

}  // namespace
}  // namespace nbos::sched
