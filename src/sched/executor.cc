#include "sched/executor.h"

#include <algorithm>
#include <cassert>
#include <utility>

namespace nbos::sched {

ExecutorChoice ChooseExecutor(const ClusterState& cluster, const KernelView& kernel,
                              int32_t gpus_needed, const std::set<uint32_t>& excluded_replicas,
                              std::optional<uint32_t> target_replica, bool pack_gpus) {
  assert(gpus_needed >= 0);
  // (idle GPUs, replica id) of every replica whose server can grant now.
  std::vector<std::pair<int32_t, uint32_t>> able;
  std::set<uint32_t> on_whole_idle_server;  // its cell would break up a wholly idle server
  for (const ReplicaView& r : kernel.replicas) {
    if (excluded_replicas.contains(r.replica_id)) continue;
    const ServerView* server = cluster.FindServer(r.server_id);
    if (server == nullptr || !server->accepting || server->IdleGpus() < gpus_needed) continue;
    able.emplace_back(server->IdleGpus(), r.replica_id);
    if (server->committed.gpus == 0 && gpus_needed < server->spec.gpus) {
      on_whole_idle_server.insert(r.replica_id);
    }
  }
  std::sort(able.begin(), able.end(), [pack_gpus](const auto& a, const auto& b) {
    if (a.first != b.first) return pack_gpus ? a.first < b.first : a.first > b.first;
    return a.second < b.second;
  });
  auto is_able = [&](uint32_t id) {
    return std::any_of(able.begin(), able.end(), [&](const auto& a) { return a.second == id; });
  };

  ExecutorChoice choice;
  uint32_t first = 0;
  if (target_replica.has_value()) {
    if (is_able(*target_replica)) {
      first = *target_replica;
      choice.target_honoured = true;
    } else if (kernel.FindReplica(*target_replica) == nullptr) {
      choice.note = "target replica " + std::to_string(*target_replica) + " is not a replica";
    } else {
      choice.note = "target replica " + std::to_string(*target_replica) +
                    " is excluded or its server cannot grant " + std::to_string(gpus_needed) +
                    " GPUs now";
    }
  }
  if (first == 0 && kernel.last_executor != 0 && is_able(kernel.last_executor)) {
    // Packing: stickiness yields to keeping a whole server idle when another replica can run
    // the cell on a server that is already partly busy.
    const bool yields = pack_gpus && on_whole_idle_server.contains(kernel.last_executor) &&
                        std::any_of(able.begin(), able.end(), [&](const auto& a) {
                          return !on_whole_idle_server.contains(a.second);
                        });
    if (!yields) first = kernel.last_executor;
  }
  if (first != 0) choice.candidates.push_back(first);
  for (const auto& [idle, id] : able) {
    if (id != first) choice.candidates.push_back(id);
  }
  return choice;
}

}  // namespace nbos::sched
