#include "sched/gpu_waiters.h"

#include <algorithm>
#include <iterator>
#include <utility>

namespace nbos::sched {

void GpuWaiters::Ask(std::string_view kernel_id, int32_t gpus, std::set<uint32_t> excluded_replicas,
                     int64_t now_ms) {
  auto it = by_kernel_.find(kernel_id);
  if (it == by_kernel_.end()) {
    it = by_kernel_.emplace(std::string(kernel_id), Waiter{.turn = next_turn_++}).first;
    by_turn_.emplace(it->second.turn, it->first);
  }
  it->second.gpus = gpus;
  it->second.excluded_replicas = std::move(excluded_replicas);
  it->second.asked_ms = now_ms;
}

void GpuWaiters::Leave(std::string_view kernel_id) {
  const auto it = by_kernel_.find(kernel_id);
  if (it == by_kernel_.end()) return;
  by_turn_.erase(it->second.turn);
  by_kernel_.erase(it);
}

void GpuWaiters::Expire(int64_t now_ms, int64_t expiry_ms) {
  if (expiry_ms <= 0) return;
  for (auto it = by_kernel_.begin(); it != by_kernel_.end();) {
    if (it->second.asked_ms + expiry_ms >= now_ms) {
      ++it;
      continue;
    }
    by_turn_.erase(it->second.turn);
    it = by_kernel_.erase(it);
  }
}

std::map<std::string, int32_t, std::less<>> GpuWaiters::HeldAhead(
    const ClusterState& cluster, std::string_view kernel_id) const {
  std::map<std::string, int32_t, std::less<>> held;
  const auto self = by_kernel_.find(kernel_id);
  const auto end = self == by_kernel_.end() ? by_turn_.end() : by_turn_.find(self->second.turn);
  for (auto t = by_turn_.begin(); t != end; ++t) {
    const Waiter& w = by_kernel_.find(t->second)->second;
    const KernelView* kernel = cluster.FindKernel(t->second);
    if (kernel == nullptr) continue;
    const ServerView* best = nullptr;
    int32_t best_left = 0;
    for (const ReplicaView& r : kernel->replicas) {
      if (w.excluded_replicas.contains(r.replica_id)) continue;
      const ServerView* server = cluster.FindServer(r.server_id);
      if (server == nullptr || !server->accepting) continue;
      const auto h = held.find(server->server_id);
      const int32_t left = server->IdleGpus() - (h == held.end() ? 0 : h->second);
      if (best == nullptr || left > best_left ||
          (left == best_left && server->server_id < best->server_id)) {
        best = server;
        best_left = left;
      }
    }
    if (best != nullptr && best_left > 0) held[best->server_id] += std::min(w.gpus, best_left);
  }
  return held;
}

}  // namespace nbos::sched
