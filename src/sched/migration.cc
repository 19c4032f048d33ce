#include "sched/migration.h"

#include <algorithm>
#include <tuple>

#include "sched/subscription.h"

namespace nbos::sched {

Result<MigrationPlan> ChooseMigration(const ClusterState& cluster, const KernelView& kernel,
                                      int32_t gpus_needed,
                                      const std::set<std::string, std::less<>>& warm_servers,
                                      const std::set<uint32_t>& excluded_replicas, bool pack_gpus) {
  if (gpus_needed < 0) return InvalidArgument("negative GPU need");
  Resources need = kernel.request;
  need.gpus = std::max(need.gpus, gpus_needed);
  if (Status s = CheckRequestFitsSomeServer(cluster, need); !s.ok()) return s;

  // Lower key = better replica to move.
  using ReplicaKey = std::tuple<bool, double, int32_t, uint32_t>;
  const ReplicaView* moving = nullptr;
  ReplicaKey best_replica;
  for (const ReplicaView& r : kernel.replicas) {
    if (excluded_replicas.contains(r.replica_id)) continue;
    const ServerView* server = cluster.FindServer(r.server_id);
    const bool doomed = server == nullptr || !server->accepting;
    ReplicaKey key{!doomed, doomed ? 0.0 : -HostSubscriptionRatio(*server),
                   doomed ? 0 : server->IdleGpus(), r.replica_id};
    if (moving == nullptr || key < best_replica) {
      moving = &r;
      best_replica = key;
    }
  }
  if (moving == nullptr) {
    return InvalidArgument("kernel '" + kernel.kernel_id + "' has no replica that may migrate");
  }

  MigrationPlan plan;
  plan.replica_id = moving->replica_id;
  plan.from_server_id = moving->server_id;

  using TargetKey = std::tuple<bool, int32_t, double, std::string_view>;
  const ServerView* target = nullptr;
  TargetKey best_target;
  for (const auto& [id, server] : cluster.servers()) {
    if (!server.accepting || server.IdleGpus() < gpus_needed || kernel.HasReplicaOn(id) ||
        !SubscriptionFits(server, kernel.request)) {
      continue;
    }
    TargetKey key{!warm_servers.contains(id), pack_gpus ? server.IdleGpus() : -server.IdleGpus(),
                  HostSubscriptionRatio(server), std::string_view(id)};
    if (target == nullptr || key < best_target) {
      target = &server;
      best_target = key;
    }
  }
  if (target == nullptr) {
    plan.scale_out_needed = true;
    plan.reason = "scale out needed: no accepting server without a replica of kernel '" +
                  kernel.kernel_id + "' has " + std::to_string(gpus_needed) +
                  " idle GPUs and CPU/memory room for " + kernel.request.ToString();
    return plan;
  }
  plan.to_server_id = target->server_id;
  plan.target_warm = warm_servers.contains(target->server_id);
  return plan;
}

}  // namespace nbos::sched
