#include "sched/subscription.h"

#include <algorithm>
#include <cassert>
#include <limits>

namespace nbos::sched {

double HostSubscriptionRatio(const ServerView& server, const Resources& extra,
                             int32_t replicas_per_kernel) {
  assert(replicas_per_kernel > 0);
  const int64_t subscribed = int64_t{server.subscribed.gpus} + extra.gpus;
  if (server.spec.gpus <= 0) {
    return subscribed <= 0 ? 0.0 : std::numeric_limits<double>::infinity();
  }
  return static_cast<double>(subscribed) /
         (static_cast<double>(server.spec.gpus) * replicas_per_kernel);
}

SubscriptionRatio::SubscriptionRatio(double max_ratio, size_t window)
    : max_ratio_(max_ratio), window_(window) {
  assert(max_ratio > 0 && window > 0);
}

void SubscriptionRatio::AddSample(int64_t demand_gpus, int64_t busy_gpus) {
  double raw;
  if (busy_gpus <= 0) {
    raw = max_ratio_;
  } else if (demand_gpus < busy_gpus) {
    raw = 1.0;
  } else {
    raw = std::min(max_ratio_, static_cast<double>(demand_gpus) / static_cast<double>(busy_gpus));
  }
  samples_.push_back(raw);
  if (samples_.size() > window_) samples_.pop_front();
}

void SubscriptionRatio::AddSample(const ClusterState& cluster) {
  AddSample(cluster.DemandGpus(), cluster.TotalCommitted().gpus);
}

double SubscriptionRatio::value() const {
  if (samples_.empty()) return max_ratio_;
  // Summed afresh (the window is tiny) so the value never carries floating-point drift.
  double sum = 0;
  for (double s : samples_) sum += s;
  return sum / static_cast<double>(samples_.size());
}

}  // namespace nbos::sched
