// ClusterHistory: the cluster over time, for the dashboard's charts. One sample a second (the
// caller's clock): GPUs provisioned (on live servers), committed to running cells and subscribed
// by kernels, kernels, cells waiting for an executor, and the interactivity delay of the
// executions that started in the trailing `delay_window_ms` (from a cell being able to start to
// its replicas getting it; KernelRouter's ExecutionStarted) as p50/p95/p99. Keeps the newest
// `max_samples`. Not thread-safe: the dashboard's sampler thread owns it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <nlohmann/json.hpp>
#include <utility>

namespace nbos::gateway {

struct HistorySample {
  int64_t at_unix_ms = 0;
  int64_t gpus_provisioned = 0, gpus_committed = 0, gpus_subscribed = 0;
  int64_t kernels = 0, cells_waiting = 0;
  // Filled by Add from the recorded delays; -1 (shown as a gap) with none in the window.
  double delay_p50_ms = -1, delay_p95_ms = -1, delay_p99_ms = -1;
  size_t executions = 0;  // executions that started since the previous sample
};

class ClusterHistory {
 public:
  explicit ClusterHistory(size_t max_samples = 900, int64_t delay_window_ms = 60'000);

  // Delays of executions that started at about `at_unix_ms`.
  void RecordDelays(int64_t at_unix_ms, const std::vector<double>& delays_ms);
  // Completes `sample`'s delay fields and keeps it; returns it as kept.
  const HistorySample& Add(HistorySample sample);

  // Columns for charts: {"at_unix_ms": [...], "gpus_provisioned": [...], ...}, oldest first;
  // delays without executions are null.
  nlohmann::json Columns() const;
  static nlohmann::json SampleJson(const HistorySample& s);
  size_t size() const { return samples_.size(); }

 private:
  size_t max_samples_;
  int64_t delay_window_ms_;
  std::deque<HistorySample> samples_;
  std::deque<std::pair<int64_t, double>> delays_;  // (at_unix_ms, delay_ms), oldest first
  size_t delays_since_sample_ = 0;
};

}  // namespace nbos::gateway
