#include "sched/cluster.h"

#include <algorithm>
#include <set>

#include "common/check.h"

namespace nbos::sched {

namespace {

std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

Status ValidateServer(const ServerView& server) {
  if (server.server_id.empty()) return InvalidArgument("server id is empty");
  if (!server.spec.IsNonNegative()) {
    return InvalidArgument("server " + Quote(server.server_id) + " has a negative spec " +
                           server.spec.ToString());
  }
  if (!server.committed.IsNonNegative() || !server.committed.FitsWithin(server.spec)) {
    return InvalidArgument("server " + Quote(server.server_id) + " committed " +
                           server.committed.ToString() + " is not within its spec " +
                           server.spec.ToString());
  }
  return Status::Ok();
}

Status NoServer(std::string_view id) { return NotFound("no server " + Quote(id)); }
Status NoKernel(std::string_view id) { return NotFound("no kernel " + Quote(id)); }

}  // namespace

const ReplicaView* KernelView::FindReplica(uint32_t replica_id) const {
  for (const ReplicaView& r : replicas) {
    if (r.replica_id == replica_id) return &r;
  }
  return nullptr;
}

bool KernelView::HasReplicaOn(std::string_view server_id) const {
  return std::any_of(replicas.begin(), replicas.end(),
                     [&](const ReplicaView& r) { return r.server_id == server_id; });
}

Status ClusterState::AddServer(ServerView server) {
  if (Status s = ValidateServer(server); !s.ok()) return s;
  if (!server.subscribed.IsZero()) {
    return InvalidArgument("server " + Quote(server.server_id) +
                           ": subscribed is derived from the kernels' replicas, pass zero");
  }
  if (servers_.contains(server.server_id)) {
    return InvalidArgument("server " + Quote(server.server_id) + " already exists");
  }
  // Orphaned replicas that name this id (a server coming back) count again.
  for (const auto& [id, kernel] : kernels_) {
    if (kernel.HasReplicaOn(server.server_id)) server.subscribed += kernel.request;
  }
  std::string id = server.server_id;
  servers_.emplace(std::move(id), std::move(server));
  return Status::Ok();
}

Status ClusterState::UpdateServer(const ServerView& server) {
  if (Status s = ValidateServer(server); !s.ok()) return s;
  ServerView* existing = MutableServer(server.server_id);
  if (existing == nullptr) return NoServer(server.server_id);
  existing->spec = server.spec;
  existing->committed = server.committed;
  existing->accepting = server.accepting;
  return Status::Ok();
}

Status ClusterState::RemoveServer(std::string_view server_id) {
  auto it = servers_.find(server_id);
  if (it == servers_.end()) return NoServer(server_id);
  servers_.erase(it);
  return Status::Ok();
}

Status ClusterState::SetAccepting(std::string_view server_id, bool accepting) {
  ServerView* server = MutableServer(server_id);
  if (server == nullptr) return NoServer(server_id);
  server->accepting = accepting;
  return Status::Ok();
}

Status ClusterState::Commit(std::string_view server_id, const Resources& resources) {
  ServerView* server = MutableServer(server_id);
  if (server == nullptr) return NoServer(server_id);
  if (!resources.IsNonNegative()) return InvalidArgument("negative commit " + resources.ToString());
  if (!resources.FitsWithin(server->Idle())) {
    return ResourceExhausted("server " + Quote(server_id) + " cannot commit " +
                             resources.ToString() + ", idle " + server->Idle().ToString());
  }
  server->committed += resources;
  return Status::Ok();
}

Status ClusterState::Release(std::string_view server_id, const Resources& resources) {
  ServerView* server = MutableServer(server_id);
  if (server == nullptr) return NoServer(server_id);
  if (!resources.IsNonNegative() || !resources.FitsWithin(server->committed)) {
    return InvalidArgument("server " + Quote(server_id) + " cannot release " +
                           resources.ToString() + ", committed " + server->committed.ToString());
  }
  server->committed -= resources;
  return Status::Ok();
}

Status ClusterState::AddKernel(KernelView kernel) {
  const std::string& kid = kernel.kernel_id;
  if (kid.empty()) return InvalidArgument("kernel id is empty");
  if (kernels_.contains(kid)) return InvalidArgument("kernel " + Quote(kid) + " already exists");
  if (!kernel.request.IsNonNegative()) {
    return InvalidArgument("kernel " + Quote(kid) + " has a negative request " +
                           kernel.request.ToString());
  }
  std::set<uint32_t> ids;
  std::set<std::string> on;
  for (ReplicaView& r : kernel.replicas) {
    if (r.kernel_id.empty()) r.kernel_id = kid;
    if (r.kernel_id != kid) {
      return InvalidArgument("replica of kernel " + Quote(r.kernel_id) + " listed under " +
                             Quote(kid));
    }
    if (r.replica_id == 0 || !ids.insert(r.replica_id).second) {
      return InvalidArgument("kernel " + Quote(kid) + ": replica id " +
                             std::to_string(r.replica_id) + " is zero or repeated");
    }
    if (!servers_.contains(r.server_id)) return NoServer(r.server_id);
    if (!on.insert(r.server_id).second) {
      return InvalidArgument("kernel " + Quote(kid) + " has two replicas on server " +
                             Quote(r.server_id));
    }
  }
  if (kernel.last_executor != 0 && !ids.contains(kernel.last_executor)) {
    return InvalidArgument("kernel " + Quote(kid) + ": last executor " +
                           std::to_string(kernel.last_executor) + " is not a replica");
  }
  for (const ReplicaView& r : kernel.replicas) Subscribe(r.server_id, kernel.request, true);
  std::string key = kid;
  kernels_.emplace(std::move(key), std::move(kernel));
  return Status::Ok();
}

Status ClusterState::RemoveKernel(std::string_view kernel_id) {
  auto it = kernels_.find(kernel_id);
  if (it == kernels_.end()) return NoKernel(kernel_id);
  for (const ReplicaView& r : it->second.replicas) {
    Subscribe(r.server_id, it->second.request, false);
  }
  kernels_.erase(it);
  return Status::Ok();
}

Status ClusterState::AddReplica(std::string_view kernel_id, uint32_t replica_id,
                                std::string_view server_id) {
  KernelView* kernel = MutableKernel(kernel_id);
  if (kernel == nullptr) return NoKernel(kernel_id);
  if (!servers_.contains(server_id)) return NoServer(server_id);
  if (replica_id == 0 || kernel->FindReplica(replica_id) != nullptr) {
    return InvalidArgument("kernel " + Quote(kernel_id) + ": replica id " +
                           std::to_string(replica_id) + " is zero or taken");
  }
  if (kernel->HasReplicaOn(server_id)) {
    return InvalidArgument("kernel " + Quote(kernel_id) + " already has a replica on server " +
                           Quote(server_id));
  }
  kernel->replicas.push_back(
      ReplicaView{std::string(kernel_id), replica_id, std::string(server_id)});
  Subscribe(server_id, kernel->request, true);
  return Status::Ok();
}

Status ClusterState::RemoveReplica(std::string_view kernel_id, uint32_t replica_id) {
  KernelView* kernel = MutableKernel(kernel_id);
  if (kernel == nullptr) return NoKernel(kernel_id);
  auto it = std::find_if(kernel->replicas.begin(), kernel->replicas.end(),
                         [&](const ReplicaView& r) { return r.replica_id == replica_id; });
  if (it == kernel->replicas.end()) {
    return NotFound("kernel " + Quote(kernel_id) + " has no replica " + std::to_string(replica_id));
  }
  Subscribe(it->server_id, kernel->request, false);
  kernel->replicas.erase(it);
  if (kernel->last_executor == replica_id) kernel->last_executor = 0;
  return Status::Ok();
}

Status ClusterState::SetLastExecutor(std::string_view kernel_id, uint32_t replica_id) {
  KernelView* kernel = MutableKernel(kernel_id);
  if (kernel == nullptr) return NoKernel(kernel_id);
  if (replica_id != 0 && kernel->FindReplica(replica_id) == nullptr) {
    return NotFound("kernel " + Quote(kernel_id) + " has no replica " + std::to_string(replica_id));
  }
  kernel->last_executor = replica_id;
  return Status::Ok();
}

const ServerView* ClusterState::FindServer(std::string_view server_id) const {
  auto it = servers_.find(server_id);
  return it == servers_.end() ? nullptr : &it->second;
}

const KernelView* ClusterState::FindKernel(std::string_view kernel_id) const {
  auto it = kernels_.find(kernel_id);
  return it == kernels_.end() ? nullptr : &it->second;
}

ServerView* ClusterState::MutableServer(std::string_view server_id) {
  auto it = servers_.find(server_id);
  return it == servers_.end() ? nullptr : &it->second;
}

KernelView* ClusterState::MutableKernel(std::string_view kernel_id) {
  auto it = kernels_.find(kernel_id);
  return it == kernels_.end() ? nullptr : &it->second;
}

void ClusterState::Subscribe(std::string_view server_id, const Resources& request, bool add) {
  ServerView* server = MutableServer(server_id);
  if (server == nullptr) return;  // an orphan: its server's books are gone
  if (add) {
    server->subscribed += request;
  } else {
    server->subscribed -= request;
    NBOS_CHECK(server->subscribed.IsNonNegative(), "unsubscribed more than was subscribed");
  }
}

Resources ClusterState::TotalSpec() const {
  Resources total;
  for (const auto& [id, s] : servers_) total += s.spec;
  return total;
}

Resources ClusterState::TotalCommitted() const {
  Resources total;
  for (const auto& [id, s] : servers_) total += s.committed;
  return total;
}

int64_t ClusterState::DemandGpus() const {
  int64_t demand = 0;
  for (const auto& [id, k] : kernels_) demand += k.request.gpus;
  return demand;
}

bool SubscriptionFits(const ServerView& server, const Resources& request) {
  return request.FitsWithin(server.spec) &&
         server.subscribed.millicpus + request.millicpus <= server.spec.millicpus &&
         server.subscribed.memory_mb + request.memory_mb <= server.spec.memory_mb;
}

Status CheckRequestFitsSomeServer(const ClusterState& cluster, const Resources& request) {
  if (cluster.servers().empty() || !request.IsNonNegative()) return Status::Ok();
  struct Dimension {
    const char* name;
    int64_t (*get)(const Resources&);
  };
  static constexpr Dimension kDimensions[] = {
      {"GPUs", [](const Resources& r) -> int64_t { return r.gpus; }},
      {"MB of VRAM", [](const Resources& r) { return r.vram_mb; }},
      {"millicpus", [](const Resources& r) { return r.millicpus; }},
      {"MB of memory", [](const Resources& r) { return r.memory_mb; }},
  };
  for (const Dimension& d : kDimensions) {
    const ServerView* largest = nullptr;
    for (const auto& [id, s] : cluster.servers()) {
      if (largest == nullptr || d.get(s.spec) > d.get(largest->spec)) largest = &s;
    }
    if (d.get(request) > d.get(largest->spec)) {
      return InvalidArgument("kernel requests " + std::to_string(d.get(request)) + " " + d.name +
                             " per replica but the largest server, " + Quote(largest->server_id) +
                             ", has " + std::to_string(d.get(largest->spec)));
    }
  }
  return Status::Ok();
}

}  // namespace nbos::sched
