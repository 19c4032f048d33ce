// One kernel as the gateway serves it: ZeroMQ links to each replica's shell, control, stdin and
// iopub sockets; the clients attached to it (WebSocket connections, relays); and the order in
// which requests reach the replicas. Runs one thread per kernel; every public method is
// thread-safe.
//
// Shell requests are served in arrival order. An execute_request waits until the previous one is
// answered and until `plan` finds a replica that may execute now (GPUs granted); it then goes to
// every live replica tagged with the execution id, the target replica and the device ids, and
// its grant is released when the answer arrives. Other requests go to the primary replica (the
// last executor). Replies go back to the client that sent the request, iopub to every client,
// all under the kernel's one session id (OutputMerger removes the replicas' duplicates).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "gateway/output_merger.h"
#include "jupyter/connection_file.h"
#include "jupyter/message.h"
#include "jupyter/websocket_codec.h"

namespace nbos::gateway {

struct ReplicaEndpoint {
  ReplicaId replica_id = 0;
  std::string server_id;
  jupyter::ConnectionInfo connection;
};

// What the scheduler decided for one execution.
struct ExecutionPlan {
  ReplicaId target_replica = 0;
  std::string server_id;
  std::string grant_id;  // empty when the cell needs no GPUs
  std::vector<int> device_ids;
};

struct KernelSessionHooks {
  // Chooses the executor and commits its GPUs. `gpus` is the kernel's request or the cell's
  // override. nullopt: no replica can be granted now; the request waits and is planned again.
  // `requested_target` is the request's nbos.target_replica (operators, tests), 0 if none.
  std::function<std::optional<ExecutionPlan>(const std::string& exec_id, int gpus,
                                             ReplicaId requested_target,
                                             const std::set<ReplicaId>& live_replicas)>
      plan;
  std::function<void(const ExecutionPlan&)> release;
  // A client sent shutdown_request on control; the session already answered it. Called on the
  // session thread: must not destroy the session from inside.
  std::function<void(bool restart)> shutdown_requested;
  // Every state change (busy/idle, last activity), for the kernel model and metrics.
  std::function<void()> changed;
};

struct KernelSessionOptions {
  std::string kernel_id;
  std::string session_id;  // the one session id clients see in headers
  int gpus = 0;            // per-cell GPUs unless the request's metadata says otherwise
  std::vector<ReplicaEndpoint> replicas;
  KernelSessionHooks hooks;
  size_t max_message_bytes = 64u << 20;
};

struct ClientSink {
  // Called on the session thread with each message for this client; must not block for long.
  std::function<void(const jupyter::WsMessage&)> deliver;
  // The kernel is gone (deleted, restarted, gateway stopping); no message follows.
  std::function<void()> closed;
};

class KernelSession {
 public:
  using ClientId = uint64_t;
  static Result<std::unique_ptr<KernelSession>> Start(KernelSessionOptions options);
  ~KernelSession();  // Shutdown()

  // Sends kernel_info_request to every replica and waits until each answered. Errors:
  // Unavailable naming the replicas that did not answer within `timeout`, or the first error
  // `check` returns (polled about once a second, e.g. "a replica exited for good").
  Status AwaitReplicas(std::chrono::milliseconds timeout,
                       const std::function<Status()>& check = nullptr);
  // Stops the thread, tells every client the kernel is gone, releases an outstanding grant.
  // Idempotent; later calls of the other methods do nothing.
  void Shutdown();

  ClientId Attach(ClientSink sink);
  void Detach(ClientId client);
  // A message from a client. Errors: InvalidArgument when the message cannot be a request.
  Status Send(ClientId client, jupyter::WsMessage message);
  // interrupt_request on the executor's (or primary's) control channel.
  void Interrupt();
  // The daemon reported `replica` gone, or back.
  void ReplicaLost(ReplicaId replica);
  void ReplicaBack(ReplicaId replica);

  // Migration: links a new replica (it gets every later execution, like the others), or drops
  // one (as if lost, then forgotten). Returns once the session thread applied the change.
  // AddReplica: InvalidArgument for a known replica id, Unavailable when it cannot connect.
  Status AddReplica(const ReplicaEndpoint& replica);
  void RemoveReplica(ReplicaId replica);
  // Sends `msg_type` with `content` on `to`'s control channel and waits for its reply's content.
  // Errors: NotFound (no such live replica), Unavailable (no reply within `timeout`, or the
  // session shut down).
  Result<jupyter::Json> CallControl(ReplicaId to, const std::string& msg_type,
                                    jupyter::Json content, std::chrono::milliseconds timeout);
  // While held, no new execution starts (others requests flow); an execution in flight goes on.
  // Migration holds executions while the kernel has four linked replicas: an election among
  // four could fail.
  void HoldExecutions(bool hold);
  // Probes only `replicas` (see AwaitReplicas).
  Status AwaitReplicas(const std::vector<ReplicaId>& replicas, std::chrono::milliseconds timeout);

  std::string execution_state() const;  // "idle" | "busy" | "starting"
  std::string last_activity() const;    // ISO 8601 with microseconds and Z
  int connections() const;
  ReplicaId current_executor() const;
  ReplicaId executing_replica() const;  // the in-flight execution's target; 0 when none
  struct Stats {
    uint64_t executions = 0;
    uint64_t waited_for_gpus = 0;  // executions that could not be planned at once
  };
  Stats stats() const;

 private:
  struct Impl;
  explicit KernelSession(std::unique_ptr<Impl> impl);
  Status AwaitSome(const std::vector<ReplicaId>& replicas, std::chrono::milliseconds timeout,
                   const std::function<Status()>& check);
  // Runs a link change on the session thread and waits for it (Unavailable after shutdown).
  Status ChangeLinks(std::optional<ReplicaEndpoint> add, ReplicaId remove);
  std::unique_ptr<Impl> impl_;
};

// Execution ids: "<kernel>:<sequence>".
std::string ExecutionId(const std::string& kernel_id, uint64_t sequence);

}  // namespace nbos::gateway
