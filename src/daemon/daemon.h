// `nbos daemon`: the local scheduler of one GPU server (DESIGN.md §2, §5, §6). It owns the
// server's resources and ledger, prepares, launches, watches and stops replica processes, and
// grants GPUs to executions. It serves the nbos.control.Daemon gRPC service and keeps itself
// registered with the gateway's nbos.control.Gateway service (Register, then Heartbeat every
// heartbeat_interval_ms; it registers again when a heartbeat fails or the gateway does not know
// it).
//
// Replica directories live under STATE_DIR/replicas/KERNEL-REPLICA (see supervisor.h).
//
// The public operations below are the same the gRPC service serves, callable in-process; all
// are thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>  // std::once_flag
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "common/thread_annotations.h"
#include "control/cluster_credential.h"
#include "control/control.pb.h"
#include "daemon/gpu_inventory.h"
#include "daemon/ledger.h"
#include "daemon/ports.h"
#include "daemon/supervisor.h"
#include "workspace/workspace.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace nbos::daemon {

struct DaemonOptions {
  std::string server_id;                       // empty: the host name
  std::string listen_address = "127.0.0.1:0";  // Daemon gRPC service; port 0 = ephemeral
  std::string gateway_address;                 // Gateway gRPC service; empty = do not register
  std::string state_dir;                       // required; created if missing
  std::string nbos_binary;                     // `nbos` to run replicas with; required
  std::string blob_store_url;                  // default for launches; empty: dir://STATE/blobs
  GpuSource gpu_source = GpuSource::kAuto;     // NVML when present, else virtual GPUs
  int virtual_gpus = 0;                        // --gpus N
  int64_t vram_mb_per_gpu = 16384;             // VRAM of each virtual GPU
  int64_t millicpus = 0;                       // 0: online CPUs × 1000
  int64_t memory_mb = 0;                       // 0: physical memory
  std::string advertise_ip = "127.0.0.1";      // replicas bind and are reached here (IPv4)
  PortRange replica_ports;                     // what replicas bind (see ports.h)
  int warm_pool_size = 0;                      // pre-started replica processes (see Supervisor)
  std::vector<std::string> warm_preload;       // Python modules they import ahead
  std::string replica_log_level = "info";      // --log-level of replicas
  // Where replicas keep their Raft logs: "auto" (the default) puts them in RAM, in
  // /dev/shm/nbos-raft-<hash of the state directory>, when /dev/shm is a tmpfs of at least
  // 1 GiB, else in each replica's directory; "state" always in each replica's directory; a path
  // puts them in PATH/nbos-raft-<hash>. This daemon owns that directory: it empties it at start
  // and removes it at shutdown; while it runs it holds a lock there, so that the next daemon
  // started on the machine removes the directory of one that died. A log in RAM is safe because
  // nbos never replays one after its host restarts (docs/decisions/0011).
  std::string raft_log_dir = "auto";
  // Replica restarts (see SupervisorOptions).
  int max_restarts = 5;
  std::chrono::milliseconds restart_window{std::chrono::minutes(5)};
  std::chrono::milliseconds restart_delay{std::chrono::milliseconds(300)};
  std::chrono::milliseconds stop_grace{std::chrono::seconds(5)};
  // Gateway calls: deadline of each, pause between failed registrations, and the heartbeat
  // interval used until the gateway's RegisterReply names one.
  std::chrono::milliseconds gateway_rpc_timeout{std::chrono::seconds(3)};
  std::chrono::milliseconds register_retry{std::chrono::seconds(1)};
  std::chrono::milliseconds default_heartbeat_interval{std::chrono::seconds(2)};
  // TLS and the cluster token for the Daemon service and the calls to the gateway
  // (control/cluster_credential.h); null: plaintext, open to any caller.
  std::shared_ptr<const control::ClusterCredential> credential;
  // Replica sandboxes (sandbox.h, supervisor.h): "auto" sandboxes where bubblewrap works and warns
  // where it does not, "on" refuses to start without, "off" runs replicas as the daemon runs.
  std::string sandbox = "auto";
  std::string bwrap = "bwrap";
  // Paths replicas must not see besides the state directory (files or directories): the
  // gateway's state, the credential file, a cluster directory holding other servers'.
  std::vector<std::string> sandbox_hide;
  // Directories every replica may write (a team's scratch space); created when missing. Their
  // permissions decide which kernels' user ids can write there.
  std::vector<std::string> sandbox_share;
  // The workspace root the gateway exports (workspace/workspace.h), mounted here at the same
  // path as on every server (a shared filesystem across machines). A launch whose environment
  // names a workspace (NBOS_WORKSPACE, KERNEL_WORKING_DIR) is checked against it and its replica
  // runs there; such a launch fails without one. Empty: none.
  std::string workspace_root;
};

class Daemon {
 public:
  // Discovers GPUs, creates STATE_DIR, starts the gRPC server and (when gateway_address is set)
  // the registration loop. Errors: InvalidArgument for missing options, Unavailable when the
  // listen address cannot be bound, Internal when the state directory cannot be created.
  static Result<std::unique_ptr<Daemon>> Start(const DaemonOptions& options);

  ~Daemon();  // Shutdown()
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // "host:port" of the Daemon service, as registered with the gateway (a wildcard listen host
  // is replaced by advertise_ip).
  std::string address() const { return address_; }
  const std::string& server_id() const { return options_.server_id; }
  bool gpus_virtual() const { return gpus_.is_virtual; }
  // Whether the last Register or Heartbeat succeeded with known = true.
  bool registered() const EXCLUDES(reg_mu_);

  // Blocks until Shutdown() has finished (from another thread).
  void Wait() EXCLUDES(reg_mu_);
  // Stops registering, stops the gRPC server (in-flight calls get a short grace), and stops
  // every replica process (SIGTERM, then SIGKILL), keeping their directories so a restarted
  // cluster can find them. Idempotent. Not from a gRPC handler or a signal handler.
  void Shutdown() EXCLUDES(reg_mu_, mu_);

  // The Daemon service's operations (control.proto). Errors: InvalidArgument for malformed
  // requests (kernel ids must be [A-Za-z0-9._-]+, replica ids positive), NotFound for unknown
  // replicas, ResourceExhausted when no ports are left, Internal for spawn and disk failures.
  //
  // PrepareReplica is idempotent: a replica already prepared gets its connection back.
  // A fresh preparation wipes a stale directory of the same replica left by an earlier daemon.
  Result<control::PrepareReplicaReply> PrepareReplica(const control::PrepareReplicaRequest& req)
      EXCLUDES(mu_);
  // Peers must include this replica at its prepared Raft address, or be empty (join an
  // existing group). A running replica is not started twice.
  Result<control::LaunchReplicaReply> LaunchReplica(const control::LaunchReplicaRequest& req);
  // The workspace a launch's environment names, checked on this server (workspace.h); nullopt
  // when it names none.
  Result<std::optional<workspace::KernelWorkspace>> LaunchWorkspace(
      const std::map<std::string, std::string>& env, const std::string& blob_store) const;
  // Stops the process, releases its grants, subscription and ports; removes the directory
  // unless keep_data.
  Status StopReplica(const control::StopReplicaRequest& req) EXCLUDES(mu_, reg_mu_);
  // Refusals are replies (granted = false, reason), not errors.
  control::GrantReply Grant(const control::GrantRequest& req) EXCLUDES(mu_);
  control::ReleaseReply Release(const control::ReleaseRequest& req) EXCLUDES(mu_);
  control::ServerStatus GetStatus() const EXCLUDES(mu_);

 private:
  class Service;

  explicit Daemon(DaemonOptions options, GpuInventory gpus);
  // RegistrationLoop's link to the gateway (defined in daemon.cc).
  struct GatewayLink;
  void RegistrationLoop() EXCLUDES(reg_mu_, mu_);
  // One Register or Heartbeat call over `link`; returns how long to wait before the next call.
  std::chrono::milliseconds RegisterOnce(GatewayLink& link) EXCLUDES(reg_mu_, mu_);
  std::chrono::milliseconds HeartbeatOnce(GatewayLink& link) EXCLUDES(reg_mu_, mu_);
  // The Supervisor's exit callback, called without its lock.
  void OnReplicaExit(const ReplicaKey& key, int exit_code, bool restarting) EXCLUDES(mu_, reg_mu_);
  void NudgeHeartbeat() EXCLUDES(reg_mu_);

  DaemonOptions options_;
  const GpuInventory gpus_;
  std::string address_;
  std::string replicas_dir_;
  std::string raft_log_root_;  // "" when Raft logs live in the replicas' directories
  int raft_log_lock_fd_ = -1;  // holds raft_log_root_/.lock's flock while the daemon runs

  mutable Mutex mu_;  // taken before the Supervisor's own lock, never after
  Ledger ledger_ GUARDED_BY(mu_);
  std::map<ReplicaKey, std::vector<int>> ports_ GUARDED_BY(mu_);  // handed to each replica
  PortAllocator port_allocator_;
  std::unique_ptr<Supervisor> supervisor_;

  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  // Calls refused for want of the cluster credential (logged with the count).
  std::shared_ptr<std::atomic<uint64_t>> refused_calls_ =
      std::make_shared<std::atomic<uint64_t>>(0);

  // Registration loop and shutdown.
  mutable Mutex reg_mu_;
  CondVar reg_cv_;
  bool stopping_ GUARDED_BY(reg_mu_) = false;
  bool heartbeat_now_ GUARDED_BY(reg_mu_) = false;
  bool registered_ GUARDED_BY(reg_mu_) = false;
  bool shut_down_ GUARDED_BY(reg_mu_) = false;  // Shutdown() finished
  std::thread registration_;
  std::once_flag shutdown_once_;
};

}  // namespace nbos::daemon
