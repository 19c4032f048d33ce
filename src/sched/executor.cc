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

double SoleCoverLoss(const ClusterState& cluster, const std::string& server_id, int32_t gpus,
                     const std::vector<LikelyKernel>& likely) {
  const ServerView* server = cluster.FindServer(server_id);
  if (server == nullptr) return 0;
  const int32_t idle = server->IdleGpus();
  double loss = 0;
  for (const LikelyKernel& k : likely) {
    // Only a need the server meets now and would not meet after the cell is a loss.
    if (idle < k.need_gpus || idle - gpus >= k.need_gpus || !k.kernel->HasReplicaOn(server_id)) {
      continue;
    }
    const bool covered_elsewhere =
        std::any_of(k.kernel->replicas.begin(), k.kernel->replicas.end(), [&](const auto& r) {
          const ServerView* other = cluster.FindServer(r.server_id);
          return r.server_id != server_id && other != nullptr && other->accepting &&
                 other->IdleGpus() >= k.need_gpus;
        });
    if (!covered_elsewhere) loss += k.chance;
  }
  return loss;
}

void SpareSoleCovers(const ClusterState& cluster, const KernelView& kernel, int32_t gpus,
                     const std::vector<LikelyKernel>& likely, ExecutorChoice* choice) {
  std::vector<uint32_t>& candidates = choice->candidates;
  if (candidates.size() < 2 || likely.empty()) return;
  std::vector<std::pair<double, uint32_t>> by_loss;
  for (size_t i = 0; i < candidates.size(); ++i) {
    // A requested target is what the user asked for, whatever it costs others.
    const double loss =
        i == 0 && choice->target_honoured
            ? -1
            : SoleCoverLoss(cluster, kernel.FindReplica(candidates[i])->server_id, gpus, likely);
    by_loss.emplace_back(loss, candidates[i]);
  }
  std::stable_sort(by_loss.begin(), by_loss.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 0; i < by_loss.size(); ++i) candidates[i] = by_loss[i].second;
}

}  // namespace nbos::sched
