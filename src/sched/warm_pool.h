// Warm pool sizing (DESIGN §5): how many pre-started replica processes each server should keep,
// so that placement and migration promote a warm process instead of starting a cold one. Pure:
// the caller passes the pool's state and the recent arrival rate and starts/stops processes.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace nbos::sched {

enum class WarmPoolPolicy {
  kNone,             // never start warm processes
  kMinimumCapacity,  // at least min_per_host on every accepting server
  kFixed,            // fixed_total across the cluster, on the servers with the fewest
  kLittlesLaw,       // ⌈arrivals per minute × start latency in minutes⌉ across the cluster
};

// "none", "minimum-capacity", "fixed", "littles-law".
std::string_view WarmPoolPolicyName(WarmPoolPolicy policy);
Result<WarmPoolPolicy> ParseWarmPoolPolicy(std::string_view name);

struct WarmPoolOptions {
  WarmPoolPolicy policy = WarmPoolPolicy::kMinimumCapacity;
  int32_t min_per_host = 1;   // kMinimumCapacity
  int32_t fixed_total = 0;    // kFixed
  int32_t max_per_host = -1;  // every policy; < 0: unlimited
  // kLittlesLaw: W, how long a warm process takes to replace (start latency), in minutes.
  double latency_min = 0.5;
};

struct WarmPoolServer {
  std::string server_id;
  int32_t warm = 0;       // ready to promote
  int32_t starting = 0;   // being started; counts toward the target
  bool accepting = true;  // false: it gets nothing new and its warm processes are stopped
};

struct WarmPoolAction {
  std::string server_id;
  int32_t start = 0;  // processes to start here
  int32_t stop = 0;   // warm processes to stop here (never more than `warm`)
};

// Actions (only non-empty ones, ordered by server_id) that move the pool to the policy's target.
// Cluster-wide targets go to the accepting servers with the fewest warm + starting processes
// (ties by server_id), and surpluses are stopped from those with the most warm ones. Servers
// must have distinct ids; arrivals_per_min >= 0 (only kLittlesLaw reads it).
std::vector<WarmPoolAction> SizeWarmPool(const WarmPoolOptions& options,
                                         const std::vector<WarmPoolServer>& servers,
                                         double arrivals_per_min);

// The cluster-wide target a policy aims at for `accepting_servers` servers.
int64_t WarmPoolTarget(const WarmPoolOptions& options, int64_t accepting_servers,
                       double arrivals_per_min);

// Arrivals (events that want a replica process) over a sliding window of virtual time.
class ArrivalWindow {
 public:
  explicit ArrivalWindow(int64_t window_ms = 10 * 60 * 1000);
  // now_ms must not go backwards (asserted).
  void Add(int64_t now_ms);
  double RatePerMinute(int64_t now_ms);

 private:
  void Expire(int64_t now_ms);
  int64_t window_ms_;
  std::deque<int64_t> times_ms_;
};

}  // namespace nbos::sched
