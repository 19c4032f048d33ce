#include "gateway/cluster_history.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace nbos::gateway {

using Json = nlohmann::json;

namespace {

// Nearest-rank percentile of sorted values.
double Percentile(const std::vector<double>& sorted, double p) {
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(sorted.size())));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

Json OrNull(double v) { return v < 0 ? Json(nullptr) : Json(v); }

}  // namespace

ClusterHistory::ClusterHistory(size_t max_samples, int64_t delay_window_ms)
    : max_samples_(std::max<size_t>(max_samples, 1)), delay_window_ms_(delay_window_ms) {}

void ClusterHistory::RecordDelays(int64_t at_unix_ms, const std::vector<double>& delays_ms) {
  for (double d : delays_ms) delays_.emplace_back(at_unix_ms, d);
  delays_since_sample_ += delays_ms.size();
}

const HistorySample& ClusterHistory::Add(HistorySample sample) {
  while (!delays_.empty() && delays_.front().first <= sample.at_unix_ms - delay_window_ms_)
    delays_.pop_front();
  std::vector<double> window;
  window.reserve(delays_.size());
  for (const auto& [at, d] : delays_) window.push_back(d);
  std::sort(window.begin(), window.end());
  if (!window.empty()) {
    sample.delay_p50_ms = Percentile(window, 0.50);
    sample.delay_p95_ms = Percentile(window, 0.95);
    sample.delay_p99_ms = Percentile(window, 0.99);
  }
  sample.executions = std::exchange(delays_since_sample_, 0);
  samples_.push_back(sample);
  if (samples_.size() > max_samples_) samples_.pop_front();
  return samples_.back();
}

Json ClusterHistory::SampleJson(const HistorySample& s) {
  return Json{{"at_unix_ms", s.at_unix_ms},
              {"gpus_provisioned", s.gpus_provisioned},
              {"gpus_committed", s.gpus_committed},
              {"gpus_subscribed", s.gpus_subscribed},
              {"kernels", s.kernels},
              {"cells_waiting", s.cells_waiting},
              {"executions", s.executions},
              {"delay_p50_ms", OrNull(s.delay_p50_ms)},
              {"delay_p95_ms", OrNull(s.delay_p95_ms)},
              {"delay_p99_ms", OrNull(s.delay_p99_ms)}};
}

Json ClusterHistory::Columns() const {
  Json out = Json::object();
  for (const char* name :
       {"at_unix_ms", "gpus_provisioned", "gpus_committed", "gpus_subscribed", "kernels",
        "cells_waiting", "executions", "delay_p50_ms", "delay_p95_ms", "delay_p99_ms"}) {
    out[name] = Json::array();
  }
  for (const HistorySample& s : samples_) {
    const Json row = SampleJson(s);
    for (const auto& [name, value] : row.items()) out[name].push_back(value);
  }
  return out;
}

}  // namespace nbos::gateway
