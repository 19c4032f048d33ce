// Subscription ratios (DESIGN §5). A host's ratio says how oversubscribed its GPUs are; the
// cluster's ratio (demand over busy GPUs) is the ceiling placement keeps every host below.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>

#include "sched/cluster.h"

namespace nbos::sched {

inline constexpr double kDefaultMaxSubscriptionRatio = 7.0;

// SR_h = subscribed GPUs / (spec GPUs × replicas_per_kernel), with `extra` added to the
// subscription (the replica about to be placed). A server without GPUs has ratio 0 while nothing
// there asks for GPUs, and +infinity once something does.
double HostSubscriptionRatio(const ServerView& server, const Resources& extra = {},
                             int32_t replicas_per_kernel = kReplicasPerKernel);

// SR_c: the moving average of the last `window` samples of demand GPUs / busy GPUs, each sample
// capped at `max_ratio`. A sample is `max_ratio` when nothing is busy and 1.0 when demand is
// below busy (a host may always hold what is running). Before the first sample the ratio is
// `max_ratio`, so an empty cluster admits freely.
class SubscriptionRatio {
 public:
  explicit SubscriptionRatio(double max_ratio = kDefaultMaxSubscriptionRatio, size_t window = 5);

  void AddSample(int64_t demand_gpus, int64_t busy_gpus);
  // demand = ClusterState::DemandGpus(), busy = committed GPUs over all servers.
  void AddSample(const ClusterState& cluster);

  double value() const;
  // Predictive scale-in should wait until the window is full (as the reference does).
  bool window_full() const { return samples_.size() == window_; }
  double max_ratio() const { return max_ratio_; }

 private:
  double max_ratio_;
  size_t window_;
  std::deque<double> samples_;
};

}  // namespace nbos::sched
