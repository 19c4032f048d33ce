// ClusterState: the gateway's (or the simulator's) view of servers and distributed kernels, the
// single input of every scheduling decision in this folder. Pure data with checked mutations: no
// I/O, no clock. Iteration order is by id, so decisions derived from it are deterministic.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "sched/resources.h"

namespace nbos::sched {

// R: replicas per distributed kernel; also the divisor of the host subscription ratio.
inline constexpr int32_t kReplicasPerKernel = 3;

struct ServerView {
  std::string server_id;
  Resources spec;        // what the server has
  Resources subscribed;  // sum of the requests of the replicas placed here (derived, see below)
  Resources committed;   // bound to executing replicas right now; <= spec
  // false: draining or being released; it gets no new replicas and no new GPU grants.
  bool accepting = true;

  Resources Idle() const { return spec - committed; }
  int32_t IdleGpus() const { return spec.gpus - committed.gpus; }
};

struct ReplicaView {
  std::string kernel_id;
  uint32_t replica_id = 0;  // >= 1; 0 means "none" wherever a replica id is optional
  std::string server_id;
};

struct KernelView {
  std::string kernel_id;
  Resources request;  // per replica
  std::vector<ReplicaView> replicas;
  uint32_t last_executor = 0;  // replica id of the previous cell's executor, 0 if none

  const ReplicaView* FindReplica(uint32_t replica_id) const;
  bool HasReplicaOn(std::string_view server_id) const;
};

// Invariants kept by every mutation:
//  - server.subscribed == sum of kernel.request over the replicas whose server_id is that server;
//  - a kernel has at most one replica per server, and replica ids are unique and >= 1.
// A replica may name a server that is not (or no longer) in the view: an orphan after a server
// failure. Executor choice skips orphans and migration moves them first.
class ClusterState {
 public:
  using ServerMap = std::map<std::string, ServerView, std::less<>>;
  using KernelMap = std::map<std::string, KernelView, std::less<>>;

  // InvalidArgument: empty id, duplicate id, negative spec, committed not within spec, or a
  // non-zero `subscribed` (it is derived: recomputed from the kernels already naming this id).
  Status AddServer(ServerView server);
  // Replaces spec, committed and accepting (a daemon's report); subscribed stays derived.
  // NotFound / InvalidArgument as for AddServer.
  Status UpdateServer(const ServerView& server);
  // Replicas on the removed server become orphans. NotFound if absent.
  Status RemoveServer(std::string_view server_id);
  Status SetAccepting(std::string_view server_id, bool accepting);

  // Mirror of a daemon's grant / release. Commit: ResourceExhausted if committed would exceed
  // spec. Release: InvalidArgument if more than is committed.
  Status Commit(std::string_view server_id, const Resources& resources);
  Status Release(std::string_view server_id, const Resources& resources);

  // Adds a kernel with its replicas (possibly none yet). A replica with an empty kernel_id gets
  // the kernel's. InvalidArgument: empty/duplicate id, negative request, bad replica ids, two
  // replicas on one server, a replica on an unknown server, last_executor not a replica.
  Status AddKernel(KernelView kernel);
  Status RemoveKernel(std::string_view kernel_id);
  // For migration: add the new replica, later remove the old one.
  Status AddReplica(std::string_view kernel_id, uint32_t replica_id, std::string_view server_id);
  // Clears last_executor if it was this replica.
  Status RemoveReplica(std::string_view kernel_id, uint32_t replica_id);
  Status SetLastExecutor(std::string_view kernel_id, uint32_t replica_id);

  const ServerView* FindServer(std::string_view server_id) const;
  const KernelView* FindKernel(std::string_view kernel_id) const;
  const ServerMap& servers() const { return servers_; }
  const KernelMap& kernels() const { return kernels_; }

  Resources TotalSpec() const;
  Resources TotalCommitted() const;
  // GPUs asked for by all kernels, counted once per kernel (not per replica): the cluster's demand.
  int64_t DemandGpus() const;

 private:
  ServerView* MutableServer(std::string_view server_id);
  KernelView* MutableKernel(std::string_view kernel_id);
  void Subscribe(std::string_view server_id, const Resources& request, bool add);

  ServerMap servers_;
  KernelMap kernels_;
};

// The replica's CPU and memory fit the server's spec on top of what is already subscribed there,
// and one replica's request fits the spec in every dimension (GPUs and VRAM are oversubscribed
// across replicas, but one executor must fit the server).
bool SubscriptionFits(const ServerView& server, const Resources& request);

// InvalidArgument naming the largest server when `request` exceeds every server's spec in some
// dimension (it could never run); Ok otherwise, and Ok when there are no servers at all.
Status CheckRequestFitsSomeServer(const ClusterState& cluster, const Resources& request);

}  // namespace nbos::sched
