#include "gateway/control_plane.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "control/control.grpc.pb.h"
#include "gateway/raft_group.h"
#include "gateway/replica_ops.h"

namespace nbos::gateway {

void NotifySessions(const std::vector<LivenessChange>& changes) {
  for (const LivenessChange& c : changes) {
    if (c.live) {
      c.session->ReplicaBack(c.replica);
    } else {
      c.session->ReplicaLost(c.replica, c.why);
    }
  }
}

struct ControlPlane::Service final : public control::Gateway::Service {
  explicit Service(ControlPlane* owner) : plane(owner) {}

  grpc::Status Register(grpc::ServerContext*, const control::RegisterRequest* req,
                        control::RegisterReply* reply) override {
    return Guarded("Register", [&] {
      if (req->server_id().empty() || req->daemon_address().empty()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "server_id and daemon_address are required");
      }
      plane->registry_->OnRegister(*req);
      spdlog::info("server {} registered at {} ({} GPUs{})", req->server_id(),
                   req->daemon_address(), req->spec().gpus(),
                   req->gpus_virtual() ? ", virtual" : "");
      reply->set_heartbeat_interval_ms(plane->options_.heartbeat_interval_ms);
      return grpc::Status::OK;
    });
  }

  grpc::Status Heartbeat(grpc::ServerContext*, const control::HeartbeatRequest* req,
                         control::HeartbeatReply* reply) override {
    return Guarded("Heartbeat", [&] {
      auto outcome = plane->registry_->OnHeartbeat(req->status());
      reply->set_known(outcome.known);
      plane->OnHeartbeatOutcome(req->status().server_id(), std::move(outcome));
      return grpc::Status::OK;
    });
  }

  // The edge of gRPC's threads: nothing escapes into the library.
  template <typename F>
  static grpc::Status Guarded(const char* what, F&& f) {
    try {
      return f();
    } catch (const std::exception& e) {
      spdlog::error("control plane: {} failed: {}", what, e.what());
      return {grpc::StatusCode::INTERNAL, e.what()};
    }
  }

  ControlPlane* plane;
};

ControlPlane::ControlPlane(ControlPlaneOptions options, Registry* registry)
    : options_(std::move(options)), registry_(registry) {}

ControlPlane::~ControlPlane() { Stop(); }

Result<std::unique_ptr<ControlPlane>> ControlPlane::Start(ControlPlaneOptions options,
                                                          Registry* registry) {
  std::unique_ptr<ControlPlane> plane(new ControlPlane(std::move(options), registry));
  plane->service_ = std::make_unique<Service>(plane.get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(plane->options_.address,
                           control::ServerCredentials(plane->options_.credential, "gateway",
                                                      plane->options_.refused_calls),
                           &port);
  builder.RegisterService(plane->service_.get());
  plane->server_ = builder.BuildAndStart();
  if (!plane->server_ || port == 0) {
    return Unavailable("cannot listen for daemons on " + plane->options_.address);
  }
  const std::string& address = plane->options_.address;
  plane->address_ = address.substr(0, address.rfind(':')) + ":" + std::to_string(port);
  return plane;
}

void ControlPlane::OnHeartbeatOutcome(const std::string& server_id,
                                      Registry::HeartbeatOutcome outcome) {
  NotifySessions(outcome.changes);
  if (outcome.orphans.empty() || !outcome.client) return;
  std::vector<ReplicaRef> fresh;
  {
    MutexLock lock(&orphans_mu_);
    for (const ReplicaRef& r : outcome.orphans) {
      if (orphans_in_hand_.insert({r.kernel_id, r.replica_id}).second) fresh.push_back(r);
    }
  }
  if (fresh.empty()) return;
  chores_.Post(server_id, [this, client = outcome.client, server_id, orphans = std::move(fresh)] {
    for (const ReplicaRef& r : orphans) {
      if (LeaveGroup(server_id, r)) {
        spdlog::warn(
            "server {} runs replica {} of kernel {}, which the gateway does not know: stopping it",
            server_id, r.replica_id, r.kernel_id);
        StopReplica(*client, r.kernel_id, r.replica_id, server_id);
      }
      MutexLock lock(&orphans_mu_);
      orphans_in_hand_.erase({r.kernel_id, r.replica_id});
    }
  });
}

// A gateway killed while a migration had added a new replica to the kernel's Raft group, and not
// yet recorded it, restarts without it; a migration whose undo could not remove its new replica
// leaves it running. Stopped while still a voter, it would stay in the group, dead, and one more
// fault would leave the kernel without a majority for good: it is stopped only once a live
// replica confirms that it is not (or no longer) a member. Until then it keeps running, a live
// voter, and the next heartbeats try again.
bool ControlPlane::LeaveGroup(const std::string& server_id, const ReplicaRef& orphan) {
  std::optional<KernelRecord> k = registry_->FindKernel(orphan.kernel_id);
  if (!k || !k->session) return true;
  MutexLock op(k->op_mu.get());
  k = registry_->FindKernel(orphan.kernel_id);  // a migration may have recorded it meanwhile
  if (!k || !k->session) return true;
  for (const StoredReplica& r : k->meta.replicas) {
    if (r.replica_id == orphan.replica_id && r.server_id == server_id) return false;
  }
  Status left = RemoveFromRaftGroup(*k, orphan.replica_id, std::chrono::seconds(30));
  if (left.ok()) {
    spdlog::info("kernel {}: replica {} is not a member of the Raft group", orphan.kernel_id,
                 orphan.replica_id);
    return true;
  }
  spdlog::warn(
      "kernel {}: replica {} on {}, which the gateway does not know, keeps running until a live "
      "replica confirms that it left the Raft group: {}",
      orphan.kernel_id, orphan.replica_id, server_id, left.ToString());
  return false;
}

void ControlPlane::CheckServers() {
  NotifySessions(registry_->ExpireServers(std::chrono::milliseconds(options_.server_timeout_ms)));
}

void ControlPlane::Stop() {
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    server_.reset();
  }
  chores_.Stop();
}

}  // namespace nbos::gateway
