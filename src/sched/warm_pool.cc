#include "sched/warm_pool.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <map>
#include <string_view>
#include <tuple>

namespace nbos::sched {

std::string_view WarmPoolPolicyName(WarmPoolPolicy policy) {
  switch (policy) {
    case WarmPoolPolicy::kNone:
      return "none";
    case WarmPoolPolicy::kMinimumCapacity:
      return "minimum-capacity";
    case WarmPoolPolicy::kFixed:
      return "fixed";
    case WarmPoolPolicy::kLittlesLaw:
      return "littles-law";
  }
  return "none";
}

Result<WarmPoolPolicy> ParseWarmPoolPolicy(std::string_view name) {
  for (WarmPoolPolicy p : {WarmPoolPolicy::kNone, WarmPoolPolicy::kMinimumCapacity,
                           WarmPoolPolicy::kFixed, WarmPoolPolicy::kLittlesLaw}) {
    if (WarmPoolPolicyName(p) == name) return p;
  }
  return InvalidArgument("unknown warm pool policy '" + std::string(name) +
                         "' (none, minimum-capacity, fixed, littles-law)");
}

int64_t WarmPoolTarget(const WarmPoolOptions& options, int64_t accepting_servers,
                       double arrivals_per_min) {
  int64_t target = 0;
  switch (options.policy) {
    case WarmPoolPolicy::kNone:
      return 0;
    case WarmPoolPolicy::kMinimumCapacity:
      target = accepting_servers * std::max(options.min_per_host, 0);
      break;
    case WarmPoolPolicy::kFixed:
      target = std::max(options.fixed_total, 0);
      break;
    case WarmPoolPolicy::kLittlesLaw:
      // L = λ W; the small epsilon keeps 0.2 × 25 = 5.000000000000001 from rounding up to 6.
      target = static_cast<int64_t>(
          std::ceil(std::max(arrivals_per_min, 0.0) * options.latency_min - 1e-9));
      break;
  }
  if (options.max_per_host >= 0) {
    target = std::min<int64_t>(target, accepting_servers * options.max_per_host);
  }
  return std::max<int64_t>(target, 0);
}

namespace {

// An accepting server's holdings.
struct Slot {
  const WarmPoolServer* server;
  int32_t held;  // warm + starting, after this call's actions
};

using Actions = std::map<std::string, WarmPoolAction>;  // by id, so the output order is fixed

WarmPoolAction& ActionFor(Actions& actions, const WarmPoolServer& s) {
  WarmPoolAction& a = actions[s.server_id];
  a.server_id = s.server_id;
  return a;
}

// Starts `missing` processes, each on the emptiest server below `cap`: O(deficit × servers),
// both small.
void FillEmptiest(std::vector<Slot>& slots, int64_t missing, int32_t cap, Actions& actions) {
  for (; missing > 0; --missing) {
    Slot* best = nullptr;
    for (Slot& slot : slots) {
      if (slot.held >= cap) continue;
      if (best == nullptr || std::tie(slot.held, slot.server->server_id) <
                                 std::tie(best->held, best->server->server_id)) {
        best = &slot;
      }
    }
    if (best == nullptr) break;
    ++best->held;
    ++ActionFor(actions, *best->server).start;
  }
}

// Stops `surplus` warm processes, each on the server holding the most. Only warm processes can be
// stopped; starting ones finish and are trimmed next round.
void TrimFullest(std::vector<Slot>& slots, int64_t surplus, Actions& actions) {
  std::vector<int32_t> stoppable;
  for (Slot& slot : slots) stoppable.push_back(slot.server->warm);
  for (; surplus > 0; --surplus) {
    int best = -1;
    for (size_t i = 0; i < slots.size(); ++i) {
      if (stoppable[i] <= 0) continue;
      if (best < 0 ||
          std::make_tuple(-slots[i].held, std::string_view(slots[i].server->server_id)) <
              std::make_tuple(-slots[best].held, std::string_view(slots[best].server->server_id))) {
        best = static_cast<int>(i);
      }
    }
    if (best < 0) break;
    --slots[best].held;
    --stoppable[best];
    ++ActionFor(actions, *slots[best].server).stop;
  }
}

}  // namespace

std::vector<WarmPoolAction> SizeWarmPool(const WarmPoolOptions& options,
                                         const std::vector<WarmPoolServer>& servers,
                                         double arrivals_per_min) {
  assert(arrivals_per_min >= 0);
  Actions actions;
  const int32_t cap = options.max_per_host < 0 ? INT32_MAX : options.max_per_host;
  // Current holdings of accepting servers; non-accepting ones lose their warm processes.
  std::vector<Slot> slots;
  int64_t held_total = 0;
  for (const WarmPoolServer& s : servers) {
    if (!s.accepting) {
      if (s.warm > 0) ActionFor(actions, s).stop = s.warm;
      continue;
    }
    slots.push_back({&s, s.warm + s.starting});
    held_total += s.warm + s.starting;
  }
  const int64_t target =
      WarmPoolTarget(options, static_cast<int64_t>(slots.size()), arrivals_per_min);
  if (options.policy == WarmPoolPolicy::kMinimumCapacity) {
    // Per host, not cluster-wide: every server needs its own minimum (a migration target is
    // chosen per server). Above the minimum nothing is stopped unless over the per-host cap.
    for (Slot& slot : slots) {
      const int32_t want = std::min(std::max(options.min_per_host, 0), cap);
      if (slot.held < want) ActionFor(actions, *slot.server).start = want - slot.held;
      if (slot.held > cap) {
        ActionFor(actions, *slot.server).stop = std::min(slot.held - cap, slot.server->warm);
      }
    }
  } else if (held_total < target) {
    FillEmptiest(slots, target - held_total, cap, actions);
  } else if (held_total > target) {
    TrimFullest(slots, held_total - target, actions);
  }
  std::vector<WarmPoolAction> out;
  for (auto& [id, a] : actions) {
    if (a.start > 0 || a.stop > 0) out.push_back(std::move(a));
  }
  return out;
}

ArrivalWindow::ArrivalWindow(int64_t window_ms) : window_ms_(window_ms) { assert(window_ms > 0); }

void ArrivalWindow::Add(int64_t now_ms) {
  assert(times_ms_.empty() || now_ms >= times_ms_.back());
  times_ms_.push_back(now_ms);
  Expire(now_ms);
}

double ArrivalWindow::RatePerMinute(int64_t now_ms) {
  Expire(now_ms);
  return static_cast<double>(times_ms_.size()) * 60000.0 / static_cast<double>(window_ms_);
}

void ArrivalWindow::Expire(int64_t now_ms) {
  while (!times_ms_.empty() && times_ms_.front() <= now_ms - window_ms_) times_ms_.pop_front();
}

}  // namespace nbos::sched
