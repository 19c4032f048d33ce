// One kernel as the gateway serves it: the ZeroMQ/WebSocket shell around its KernelRouter.
//
// Threads. One session thread per kernel owns the router, the ZeroMQ sockets to each replica's
// shell, control, stdin and iopub, the clients' sinks and the router's timers. Every public
// method is thread-safe: it posts an event to the session thread (waking it through an eventfd)
// and, where it returns an answer, waits for the effect that carries it. Planning and grant
// releases are handed to `hooks` and never run on the session thread, so a slow or dead daemon
// holds up no kernel's output; their answers come back as events. The router's decisions are
// documented in kernel_router.h.
//
// Edges. An exception that escapes the router, a hook or a third-party library on the session
// thread is caught there, logged and counted (`exceptions_caught` in Stats); the thread goes on
// with the next event.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "gateway/kernel_router.h"
#include "jupyter/connection_file.h"
#include "jupyter/message.h"

namespace nbos::gateway {

struct ReplicaEndpoint {
  ReplicaId replica_id = 0;
  std::string server_id;
  jupyter::ConnectionInfo connection;
};

// A plan, nullopt (none now: `wait` says for what, for the user), or an error.
using PlanCallback =
    std::function<void(Result<std::optional<ExecutionPlan>> plan, std::string wait)>;

struct KernelSessionHooks {
  // Chooses the executor of `want` and commits its GPUs. Called on the session thread: must hand
  // the work to another thread and return at once; `done` may run on any thread, exactly once.
  // Unset: the requested (else the first live) replica executes, without GPUs.
  std::function<void(const PlanWanted& want, PlanCallback done)> plan;
  // Releases a plan's grant. Called on the session thread (or the one calling Shutdown): must not
  // block.
  std::function<void(const ExecutionPlan&)> release;
  // A client sent shutdown_request (already answered). Must not destroy the session from inside.
  std::function<void(bool restart)> shutdown_requested;
  // A client input was refused (client_validation.h).
  std::function<void(RejectClass reason)> rejected;
  // A suspended kernel got a request that needs its replicas. Must not block.
  std::function<void()> resume_wanted;
  // An execution went to the replicas after `delay_us` waiting for an executor. Must not block.
  std::function<void(int64_t delay_us)> execution_started;
  // A replica cannot follow the kernel's log (`why`), or follows again (`why` empty): the
  // router's ReplicaDiverged. Must not block.
  std::function<void(ReplicaId replica, const std::string& why)> replica_diverged;
};

struct KernelSessionOptions {
  std::string kernel_id;
  std::string session_id;  // the one session id clients see in headers
  int gpus = 0;            // per-cell GPUs unless the request's metadata says otherwise
  // None for a suspended kernel; then `key` signs its messages until replicas are added.
  std::vector<ReplicaEndpoint> replicas;
  std::string key;
  KernelSessionHooks hooks;
  ClientLimits limits;  // client input; max_message_bytes also bounds replica messages
  // Each replica's heartbeat echo is pinged this often; unanswered this long, the replica counts
  // as unreachable for the router (kernel_router.h) until it answers again.
  int64_t heartbeat_interval_ms = 200;
  int64_t heartbeat_timeout_ms = 1200;
};

struct ClientSink {
  // Called on the session thread with each encoded frame for this client; must not block.
  std::function<void(const std::string& frame, bool binary)> deliver;
  // No frame follows: the client sent what cannot be a Jupyter message (1007, 1009), or the
  // kernel is gone (1001: deleted, restarted, gateway stopping).
  std::function<void(uint16_t code, const std::string& reason)> close;
};

class KernelSession {
 public:
  using ClientId = gateway::ClientId;
  static Result<std::unique_ptr<KernelSession>> Start(KernelSessionOptions options);
  ~KernelSession();  // Shutdown()

  // Sends kernel_info_request to every replica and waits until each answered. Errors:
  // Unavailable naming the replicas that did not answer within `timeout`, or the first error
  // `check` returns (polled about once a second, e.g. "a replica exited for good").
  Status AwaitReplicas(std::chrono::milliseconds timeout,
                       const std::function<Status()>& check = nullptr);
  // Probes only `replicas` (see above).
  Status AwaitReplicas(const std::vector<ReplicaId>& replicas, std::chrono::milliseconds timeout,
                       const std::function<Status()>& check = nullptr);
  // Stops the thread, closes every client (1001), releases an outstanding grant, fails open
  // control calls. Idempotent; later calls of the other methods do nothing.
  void Shutdown();

  ClientId Attach(ClientSink sink);
  void Detach(ClientId client);
  // A WebSocket frame from a client, as received; validated on the session thread.
  void Receive(ClientId client, std::string payload, bool binary);
  // interrupt_request on the executor's (or primary's) control channel; a cell still waiting for
  // its executor is answered with KeyboardInterrupt instead.
  void Interrupt();
  // The daemon reported `replica` gone, or back.
  void ReplicaLost(ReplicaId replica, std::string why = "");
  void ReplicaBack(ReplicaId replica);
  // The kernel was restored after a gateway restart: recover the cell the previous gateway had
  // in flight (kernel_router.h, RecoverExecution).
  void RecoverExecution();
  // Suspended: the replicas are (to be) removed; requests that need them wait and call
  // hooks.resume_wanted (kernel_router.h, SuspendChanged). Returns once applied.
  void SetSuspended(bool suspended);
  // Most replicas are gone with their logs (`why`; empty: a majority may form again): every
  // answer without a majority says the kernel cannot come back (kernel_router.h, MajorityLost).
  void SetMajorityLost(std::string why);

  // Migration: links a new replica (it gets every later execution, like the others), or drops
  // one (as if lost, then forgotten). Returns once the session thread applied the change.
  // AddReplica: InvalidArgument for a known replica id, Unavailable when it cannot connect or the
  // session shut down.
  Status AddReplica(const ReplicaEndpoint& replica);
  void RemoveReplica(ReplicaId replica);
  // Sends `msg_type` with `content` on `to`'s control channel and waits for its reply's content.
  // Errors: NotFound (no such live replica), Unavailable (no reply within `timeout`, the replica
  // was lost, or the session shut down).
  Result<jupyter::Json> CallControl(ReplicaId to, const std::string& msg_type,
                                    jupyter::Json content, std::chrono::milliseconds timeout);
  // While held, no new execution starts (other requests flow); an execution in flight goes on.
  // Migration holds executions while the kernel has four linked replicas: an election among
  // four could fail.
  // `why` is what a cell that waits meanwhile is told ("moving replica 2 to host-4").
  void HoldExecutions(bool hold, std::string why = "");

  // What the session thread last published.
  std::string execution_state() const;  // "idle" | "busy"
  std::string last_activity() const;    // ISO 8601 with microseconds and Z
  int64_t last_activity_us() const;     // µs since the epoch
  int connections() const;
  ReplicaId current_executor() const;
  ReplicaId executing_replica() const;  // the in-flight execution's target; 0 when none
  bool cell_waiting() const;            // a cell waits for an executor (KernelRouter)
  // Whether the session would send a cell to `replica` now: linked, not lost and answering its
  // heartbeats (KernelRouter::live_replicas). Can lag the registry's view of the replica by a
  // heartbeat: a replica whose server came back is "live" there before it answers here.
  bool reachable(ReplicaId replica) const;
  struct Stats {
    uint64_t executions = 0;
    uint64_t waited_for_gpus = 0;  // executions that could not be planned at once
    uint64_t rejected = 0;         // client inputs refused
    uint64_t exceptions_caught = 0;
  };
  Stats stats() const;

  struct Impl;

 private:
  explicit KernelSession(std::shared_ptr<Impl> impl);
  Status AwaitSome(const std::vector<ReplicaId>& replicas, std::chrono::milliseconds timeout,
                   const std::function<Status()>& check);
  std::shared_ptr<Impl> impl_;
};

}  // namespace nbos::gateway
