// `nbos gateway`: the front door and global scheduler (DESIGN.md §2, §3). Serves the Jupyter
// Kernel Gateway REST + WebSocket API that `jupyter server --gateway-url`, JupyterLab's
// @jupyterlab/services and `nbos relay` speak; `/metrics` (Prometheus text); `/api/nbos/cluster`.
// Daemons register with its nbos.control.Gateway gRPC service; it places each kernel's replicas
// on three servers, picks the executor of each cell and asks that server's daemon for GPUs, all
// through the pure `sched` core. Kernel metadata lives in SQLite under the state directory, so a
// restarted gateway serves the same kernels (their replicas keep running under the daemons).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "auth/hub_identity.h"
#include "common/status.h"
#include "control/cluster_credential.h"
#include "sched/resources.h"

namespace nbos::gateway {

class HostProvider;

struct GatewayOptions {
  std::string address = "127.0.0.1";
  uint16_t port = 8888;                         // 0: ephemeral
  std::string control_address = "127.0.0.1:0";  // Gateway gRPC service (daemons register here)
  // TLS and the cluster token between gateway and daemons; null: plaintext (a warning).
  std::shared_ptr<const control::ClusterCredential> credential;
  // Who may call (auth/authenticator.h): the gateway's own token (its holder is an admin), a
  // users file, JupyterHub. One of them is required unless allow_unauthenticated. Clients send
  // `Authorization: token T` or `?token=T`.
  std::string token;
  std::string users_file;
  std::optional<auth::HubOptions> hub;
  bool allow_unauthenticated = false;
  // Per-user quotas for users who are not admins (kernel_manager.h); 0: none.
  int max_kernels_per_user = 0;
  int max_gpus_per_user = 0;
  std::string state_dir;  // required: gateway.db lives here
  std::string kernelspec_name = "nbos";
  std::string display_name = "Python 3 (nbos, replicated)";
  std::vector<std::string> kernelspec_aliases = {"python3"};  // see HttpApiOptions
  int replicas = 3;
  // A kernel's per-replica request when its KERNEL_* variables do not say otherwise.
  sched::Resources default_request{250, 512, 0, 0};
  size_t max_message_bytes = 64u << 20;
  // Besides KERNEL_*, environment names a kernel start request may pass to the replicas.
  std::vector<std::string> allowed_env;
  // The workspace the operator exports (workspace/workspace.h): kernels run in their notebook's
  // directory (KERNEL_WORKING_DIR, the start request's cwd or path), which must lie inside it;
  // with users (users_file, hub) a user who is no admin sees only ROOT/<user>. Every daemon must
  // have the same directory at the same path (nbos daemon --workspace-root). Empty: no
  // workspace; each replica runs in a private directory of its own.
  std::string workspace_root;
  // A daemon that misses heartbeats this long counts as gone: its replicas are lost.
  int heartbeat_interval_ms = 1000;
  int server_timeout_ms = 5000;
  // How long a kernel start waits for every replica to answer kernel_info.
  int kernel_start_timeout_ms = 60000;
  // When set, every scheduling event and decision is appended here as a decision journal
  // (sched/journal.h), which `nbos sim replay` re-derives through the same core.
  std::string decision_journal;
  // > 0: every this many ms the scheduler looks for idle kernels none of whose replica servers
  // can grant the GPUs their last cell used, and moves one replica of each (a bounded few per
  // round, each kernel at most once in 5 minutes) to a server that can, as a live migration
  // between cells (sched/rebalance.h). 0: off; a cell then migrates when it arrives.
  int rebalance_interval_ms = 0;
  // > 0: a kernel idle this long (no request queued or running, no client message, all replicas
  // live) is suspended: checkpointed to the blob store, its replicas stopped; the first request
  // that needs them resumes it (kernel_manager.h). 0: never.
  int64_t idle_suspend_ms = 0;
  // Auto-scaling (host_provider.h): servers are asked for and given back through this provider,
  // between min_hosts and max_hosts servers of gpus_per_host GPUs, decided every
  // scaling_interval_ms (and at once when a cell finds no server with GPUs to take it). Null: a
  // fixed cluster. The provider is told to Shutdown() when the gateway stops.
  std::shared_ptr<HostProvider> host_provider;
  int scaling_interval_ms = 15000;
  int min_hosts = 3;
  int max_hosts = 3;
  int gpus_per_host = 1;
  // Garbage collection of the replicas' blob store (blob_gc.h): every blob_gc_interval_ms, blobs
  // no kernel has needed for blob_gc_grace_ms are deleted. Empty URL: no collection.
  std::string blob_store_url;
  int64_t blob_gc_interval_ms = 600'000;
  int64_t blob_gc_grace_ms = 3'600'000;
};

class Gateway {
 public:
  // Opens the metadata store, restores its kernels, starts the gRPC and HTTP servers.
  // Errors: InvalidArgument for bad options (no token, no state dir), Unavailable when a port
  // cannot be bound or the database cannot be opened.
  static Result<std::unique_ptr<Gateway>> Start(GatewayOptions options);
  ~Gateway();  // Stop()

  uint16_t port() const;
  std::string control_address() const;  // "host:port" of the Gateway gRPC service
  // Re-reads the users file (SIGHUP); on error the users already loaded stay.
  Status ReloadUsers();
  // Stops serving; kernels keep running under their daemons (a restarted gateway finds them).
  void Stop();

  struct Impl;

 private:
  explicit Gateway(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace nbos::gateway
