// ControlPlane: the gateway's side of the daemons. Serves the nbos.control.Gateway gRPC service
// (Register, Heartbeat), keeps the registry's servers current, tells kernel sessions when a
// replica is lost or back, expires servers whose heartbeats stop, and stops replicas that no
// kernel owns (seen in two heartbeats in a row). Stopping orphans runs on the chores queue, off
// the gRPC threads. An exception from a handler is caught there and answered with INTERNAL.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "common/status.h"
#include "common/thread_annotations.h"
#include "common/work_queue.h"
#include "control/cluster_credential.h"
#include "gateway/registry.h"

namespace grpc {
class Server;
}

namespace nbos::gateway {

struct ControlPlaneOptions {
  std::string address = "127.0.0.1:0";  // "host:port" to listen on; port 0: ephemeral
  int heartbeat_interval_ms = 1000;
  int server_timeout_ms = 5000;  // missed heartbeats this long: the server is gone
  // TLS and the cluster token (control/cluster_credential.h); null: plaintext. Calls refused for
  // want of it count in `refused_calls`.
  std::shared_ptr<const control::ClusterCredential> credential;
  std::shared_ptr<std::atomic<uint64_t>> refused_calls;
};

class ControlPlane {
 public:
  // Errors: Unavailable when the address cannot be bound.
  static Result<std::unique_ptr<ControlPlane>> Start(ControlPlaneOptions options,
                                                     Registry* registry);
  ~ControlPlane();

  std::string address() const { return address_; }  // the bound "host:port"
  // Expires servers that missed their heartbeats; called periodically by the gateway.
  void CheckServers();
  void Stop();

  struct Service;

 private:
  ControlPlane(ControlPlaneOptions options, Registry* registry);
  void OnHeartbeatOutcome(const std::string& server_id, Registry::HeartbeatOutcome outcome);
  // Removes `orphan` (on `server_id`) from its kernel's Raft group through a live replica, if the
  // kernel is known and still does not list it. True: it may be stopped (its kernel is gone, or a
  // live replica confirmed that it is not a member); false: it must keep running (the kernel
  // lists it now, or no replica could confirm). Blocks on the kernel's operation lock and on
  // membership changes.
  bool LeaveGroup(const std::string& server_id, const ReplicaRef& orphan);

  const ControlPlaneOptions options_;
  Registry* registry_;
  std::string address_;
  Mutex orphans_mu_;
  // Orphans posted to `chores_` and not yet handled: one in hand is not posted again.
  std::set<std::pair<std::string, uint32_t>> orphans_in_hand_ GUARDED_BY(orphans_mu_);
  KeyedWorkQueue chores_{1, "control-chores"};
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
};

// Tells each session of the change (ReplicaLost / ReplicaBack).
void NotifySessions(const std::vector<LivenessChange>& changes);

}  // namespace nbos::gateway
