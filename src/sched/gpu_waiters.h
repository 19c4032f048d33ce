// GpuWaiters: cells waiting for GPUs are served first come, first served. Without it a kernel that
// runs cell after cell takes back the GPUs it has just released (its next request arrives within
// milliseconds, a waiting cell asks again only on its next retry) and a waiting kernel can wait as
// long as the busy one keeps running cells.
//
// Rules (pure; the Scheduler owns one and applies them on ExecutorRequested):
// - A kernel joins the queue when it asks for an executor for a cell needing > 0 GPUs, and keeps
//   its place while it asks again; it leaves when a grant is committed for it, when it is removed,
//   when it asks for a GPU-less cell, or when it has not asked for `expiry_ms` (0: never).
// - Each waiter, oldest first, holds back GPUs on one server of its replicas (those not in its
//   last request's excluded replicas, on accepting servers): the one with the most GPUs left idle
//   after older waiters' holds (ties: the smaller server id), min(its need, those GPUs). A hold
//   may be partial: GPUs freeing one by one stay with the oldest waiter until it can start.
// - A request sees the servers' idle GPUs less the holds of the waiters ahead of it (all waiters
//   for a kernel that is not waiting yet). Holds are recomputed on every request, never stored.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>

#include "sched/cluster.h"

namespace nbos::sched {

class GpuWaiters {
 public:
  // Joins at the back, or refreshes the place already held (need and exclusions replaced).
  void Ask(std::string_view kernel_id, int32_t gpus, std::set<uint32_t> excluded_replicas,
           int64_t now_ms);
  void Leave(std::string_view kernel_id);
  // Drops the waiters that last asked before now_ms - expiry_ms; expiry_ms 0 drops none.
  void Expire(int64_t now_ms, int64_t expiry_ms);

  // GPUs held back per server for the waiters ahead of `kernel_id`.
  std::map<std::string, int32_t, std::less<>> HeldAhead(const ClusterState& cluster,
                                                        std::string_view kernel_id) const;

  size_t size() const { return by_kernel_.size(); }
  bool contains(std::string_view kernel_id) const { return by_kernel_.contains(kernel_id); }

 private:
  struct Waiter {
    uint64_t turn = 0;  // order of joining
    int32_t gpus = 0;
    std::set<uint32_t> excluded_replicas;
    int64_t asked_ms = 0;
  };
  std::map<std::string, Waiter, std::less<>> by_kernel_;
  std::map<uint64_t, std::string> by_turn_;
  uint64_t next_turn_ = 1;
};

}  // namespace nbos::sched
