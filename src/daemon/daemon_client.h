// The gateway's handle on one daemon: the nbos.control.Daemon service behind Result-returning
// calls with deadlines, so callers never touch generated stubs or grpc::Status.
//
// Errors: Unavailable when the daemon cannot be reached or the deadline passed (retry or pick
// another server), otherwise what the daemon answered (InvalidArgument, NotFound,
// ResourceExhausted, Internal). A refused grant is not an error: GrantReply.granted is false and
// GrantReply.reason says why. Thread-safe; calls from many threads share one channel.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "common/status.h"
#include "control/cluster_credential.h"
#include "control/control.pb.h"

namespace nbos::daemon {

struct DaemonClientOptions {
  std::chrono::milliseconds timeout{std::chrono::seconds(5)};  // Prepare, Grant, Release, Status
  // TLS and the cluster token (control/cluster_credential.h); null: plaintext.
  std::shared_ptr<const control::ClusterCredential> credential;
  std::chrono::milliseconds launch_timeout{std::chrono::seconds(15)};
  // StopReplica waits out the daemon's grace period (SIGTERM, then SIGKILL).
  std::chrono::milliseconds stop_timeout{std::chrono::seconds(30)};
};

class DaemonClient {
 public:
  // Does not connect yet: the channel connects on the first call and reconnects as needed.
  explicit DaemonClient(std::string address, DaemonClientOptions options = {});
  ~DaemonClient();
  DaemonClient(const DaemonClient&) = delete;
  DaemonClient& operator=(const DaemonClient&) = delete;

  const std::string& address() const { return address_; }

  Result<control::PrepareReplicaReply> PrepareReplica(const control::PrepareReplicaRequest& req);
  Result<control::LaunchReplicaReply> LaunchReplica(const control::LaunchReplicaRequest& req);
  Status StopReplica(const control::StopReplicaRequest& req);
  Result<control::GrantReply> Grant(const control::GrantRequest& req);
  // Whether the grant existed (false: already released).
  Result<bool> Release(const std::string& grant_id);
  Result<control::ServerStatus> GetStatus();

 private:
  struct Impl;
  std::string address_;
  DaemonClientOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nbos::daemon
