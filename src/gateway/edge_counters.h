// Counters of what the gateway's edges refused, shared by the kernel sessions (client messages)
// and the HTTP API (REST requests), read by /metrics.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <iterator>
#include <memory>

#include "gateway/client_validation.h"

namespace nbos::gateway {

struct EdgeCounters {
  std::array<std::atomic<uint64_t>, std::size(kAllRejectClasses)> rejected_messages{};
  std::atomic<uint64_t> rejected_rest_requests{0};
  // Control-plane calls (daemons') without the cluster credential; shared with gRPC's threads.
  std::shared_ptr<std::atomic<uint64_t>> refused_control_calls =
      std::make_shared<std::atomic<uint64_t>>(0);

  void Rejected(RejectClass reason) { ++rejected_messages[static_cast<size_t>(reason)]; }
};

}  // namespace nbos::gateway
