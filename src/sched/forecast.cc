#include "sched/forecast.h"

#include <algorithm>
#include <cassert>
#include <cmath>

namespace nbos::sched {

namespace {

constexpr int64_t kMsPerHour = 3600 * 1000;
constexpr int64_t kMsPerWeek = 7 * 24 * kMsPerHour;

// Lower edge of bin i in ms: 1 s × 2^(i / 4); bin 0 also takes gaps under 1 s.
double EdgeMs(int i) { return 1000.0 * std::exp2(i / 4.0); }

}  // namespace

int GapDistribution::BinOf(int64_t gap_ms) {
  if (gap_ms < 1000) return 0;
  const int bin = static_cast<int>(std::floor(4.0 * std::log2(static_cast<double>(gap_ms) / 1000)));
  return std::clamp(bin, 0, kBins - 1);
}

void GapDistribution::Observe(int64_t gap_ms) {
  assert(gap_ms >= 0);
  const int bin = BinOf(gap_ms);
  ++counts_[bin];
  for (int i = 0; i <= bin; ++i) ++from_[i];
  ++total_;
}

double GapDistribution::Above(int64_t t_ms) const {
  const int bin = BinOf(t_ms);
  const double above = static_cast<double>(never_ + from_[bin + 1]);
  // The part of t's own bin above t, as if its gaps were spread evenly over the bin (bin 0 from
  // 0 ms, the last one up to its upper edge).
  const double lo = bin == 0 ? 0.0 : EdgeMs(bin);
  const double hi = EdgeMs(bin + 1);
  const double share = std::clamp((hi - static_cast<double>(t_ms)) / (hi - lo), 0.0, 1.0);
  return above + share * static_cast<double>(counts_[bin]);
}

double GapDistribution::ChanceWithin(int64_t idle_ms, int64_t horizon_ms, double fallback) const {
  if (count() == 0) return fallback;
  const double longer = Above(std::max<int64_t>(idle_ms, 0));
  // Idle for longer than (nearly) every gap seen: nothing says it will come back.
  if (longer < 1.0) return 0.0;
  const double still_idle = Above(std::max<int64_t>(idle_ms, 0) + std::max<int64_t>(horizon_ms, 0));
  return std::clamp((longer - still_idle) / longer, 0.0, 1.0);
}

void KernelGaps::Add(int64_t gap_ms, int32_t history) {
  gaps_ms.push_back(gap_ms);
  while (static_cast<int32_t>(gaps_ms.size()) > std::max(history, 1)) gaps_ms.pop_front();
}

void KernelGaps::Count(int64_t idle_ms, int64_t horizon_ms, int32_t* longer,
                       int32_t* within) const {
  *longer = 0;
  *within = 0;
  for (int64_t g : gaps_ms) {
    if (g <= idle_ms) continue;
    ++*longer;
    if (g <= idle_ms + horizon_ms) ++*within;
  }
}

void WeekProfile::Observe(int64_t now_ms) {
  if (first_ms_ < 0) first_ms_ = now_ms;
  last_ms_ = std::max(last_ms_, now_ms);
  ++counts_[(now_ms % kMsPerWeek) / kMsPerHour];
  ++total_;
}

double WeekProfile::Weight(int64_t now_ms) const {
  // Before a whole week has been seen some hours have no sample yet, and a rate per hour of the
  // week would say they are dead.
  if (first_ms_ < 0 || last_ms_ - first_ms_ < kMsPerWeek || total_ == 0) return 1.0;
  const double mean = static_cast<double>(total_) / kHours;
  const double hour = static_cast<double>(counts_[(now_ms % kMsPerWeek) / kMsPerHour]);
  return std::clamp(hour / mean, 0.25, 4.0);
}

double ReturnChance(const GapDistribution& population, const KernelGaps& own,
                    const WeekProfile& week, int64_t now_ms, int64_t idle_ms,
                    const ForecastOptions& options) {
  // With nothing learned yet every idle kernel is assumed to come back: the forecast then errs
  // towards capacity, as the plain factor does.
  const double base = population.ChanceWithin(idle_ms, options.horizon_ms, 1.0);
  // The population's chance is an average over hours; the hour of the week scales its hazard
  // (1 - p)^w, which stays a probability.
  const double weight = week.Weight(now_ms);
  const double weighted = weight == 1.0 ? base : 1.0 - std::pow(1.0 - base, weight);
  int32_t longer = 0, within = 0;
  own.Count(idle_ms, options.horizon_ms, &longer, &within);
  const double w = std::max(options.prior_weight, 0.0);
  if (longer + w <= 0) return weighted;
  return std::clamp((within + w * weighted) / (longer + w), 0.0, 1.0);
}

int64_t NeedHistory::After(int32_t last_gpus) const {
  const std::map<int32_t, int64_t>* next = Next(last_gpus);
  int64_t n = 0;
  if (next != nullptr) {
    for (const auto& [gpus, count] : *next) n += count;
  }
  return n;
}

int64_t NeedHistory::AfterAtLeast(int32_t last_gpus, int32_t gpus) const {
  const std::map<int32_t, int64_t>* next = Next(last_gpus);
  int64_t n = 0;
  if (next != nullptr) {
    for (auto it = next->lower_bound(gpus); it != next->end(); ++it) n += it->second;
  }
  return n;
}

const std::map<int32_t, int64_t>* NeedHistory::Next(int32_t last_gpus) const {
  const auto it = counts_.find(last_gpus);
  return it == counts_.end() ? nullptr : &it->second;
}

GpuNeed NextNeed(const NeedHistory& population, const NeedHistory& own, int32_t last_gpus,
                 const ForecastOptions& options, int32_t server_gpus) {
  const auto pop_n = static_cast<double>(population.After(last_gpus));
  const auto own_n = static_cast<double>(own.After(last_gpus));
  const double w = pop_n > 0 ? std::max(options.prior_weight, 0.0) : 0.0;
  if (own_n + w <= 0) {
    return {static_cast<double>(last_gpus), last_gpus, last_gpus >= server_gpus ? 1.0 : 0.0};
  }
  // P(next >= g) mixed as in ReturnChance; the candidates are the counts either history saw.
  auto at_least = [&](int32_t g) {
    const double pop = pop_n > 0 ? population.AfterAtLeast(last_gpus, g) / pop_n : 0.0;
    return (own.AfterAtLeast(last_gpus, g) + w * pop) / (own_n + w);
  };
  std::map<int32_t, bool> seen;
  for (const NeedHistory* h : {&population, &own}) {
    if (const auto* next = h->Next(last_gpus)) {
      for (const auto& [g, count] : *next) seen[g] = true;
    }
  }
  GpuNeed need;
  double previous_ge = 1.0;  // P(next >= the count before g)
  int32_t previous_g = 0;
  for (const auto& [g, unused] : seen) {
    const double ge = at_least(g);
    need.expected_gpus += (previous_ge - ge) * previous_g;
    if (ge >= options.cover_chance) need.cover_gpus = g;
    previous_ge = ge;
    previous_g = g;
  }
  need.expected_gpus += previous_ge * previous_g;
  need.whole_chance = at_least(server_gpus);
  return need;
}

}  // namespace nbos::sched
