// KernelRouter: everything the gateway decides about one kernel's messages, as a pure state
// machine in the spirit of etcd-raft's RawNode. Events go in through Apply(now_us, event):
// client frames, replica messages, replica loss and return, planning results, timers; effects
// come out: messages to replicas and clients, plan and grant-release requests, timers, answers to
// probes and control calls. No sockets, threads or clocks: `now_us` (µs since the epoch) is the
// caller's, message ids come from a counter under the kernel's session id, so the same events
// give the same effects (the scenario tests in testdata/router replay them). KernelSession is
// the ZeroMQ/WebSocket shell that carries the effects out.
//
// Rules (the Jupyter kernel a client expects, made of three replicas):
// - Client input is validated first (client_validation.h). A frame that is no Jupyter message
//   closes that client's WebSocket (1007, or 1009 over the size limit); a message with a bad
//   field, a channel or type the gateway does not serve, or a resource request no server can
//   meet is answered by the gateway with an error reply (busy, `error` output, reply, idle for
//   shell requests). Every refusal emits InputRejected with its class, for the metrics.
// - Shell requests are served in arrival order, at most `max_queued_requests` waiting. An
//   execute_request waits for the previous one's reply, then for a plan (PlanWanted ->
//   PlanDone: an executor whose server granted the GPUs); it then goes to every live replica
//   with metadata nbos.{exec_id, target_replica, gpu_ids} and previous_exec_id: the cell
//   answered before it, unless one was abandoned or failed since (decision 0012), and cancels:
//   the newest cells abandoned or left unreplicated, which its winning LEAD cancels in the log
//   if still undecided (none then runs after it). Its grant is
//   released (GrantReleaseWanted) when the reply arrives, the request is failed, or the router
//   closes. A plan that is nullopt is asked again after `replan_interval_ms` (TimerWanted); a plan
//   error fails the request with that error. Other shell requests go to the primary replica (the
//   last executor) at once; comm messages have no reply and are not tracked.
// - Waiting shows: while the head execute_request waits for an executor (a plan of nullopt, held
//   executions, a suspended kernel starting again, a previous gateway's cell still running),
//   every client sees one status line under the request's header (after a busy status the
//   gateway sends for it; the replicas' own busy is then not forwarded): display_data with
//   transient.display_id "nbos-wait-<msg_id>", text "waiting for N GPUs: <why>" ("waiting:
//   <why>" for a cell without GPUs), then update_display_data when the reason changes. When the
//   cell starts, or is answered without running, a clear_output (wait false) removes the line
//   before anything else of the cell. The reply's metadata nbos.waits lists each line shown with
//   how long it stood ({"for", "ms"}).
// - stop_on_error: an execute_reply with status error aborts the execute_requests queued behind
//   it (each answered "aborted" with busy/idle), as ipykernel does.
// - Control requests go to the executing replica, else the primary. An interrupt (client or
//   InterruptRequested) of a cell still waiting for its plan answers that cell with
//   KeyboardInterrupt and releases a plan that arrives later.
// - stdin: input_request goes to the client whose request asked; input_reply back to the
//   replica that asked (the only outstanding prompt when the reply has no parent).
// - Replies and outputs pass through the OutputMerger (one reply, one busy/idle, each output
//   once) and go out under the kernel's one session id; replies to their client, iopub to all.
// - A replica whose execute_reply says it diverged (metadata nbos.diverged: its namespace is not
//   the log's) is left out of executor choice unless a request names it (it then answers at once
//   that it cannot run the cell) and reported (ReplicaDiverged) until it is unlinked or a reply
//   of it no longer says so. An executor's ReplicaOutOfSync answer cancels the cell on the rest.
// - Replica loss: what the lost replica owed is settled by the merger; if it was executing, the
//   standbys get nbos_cancel_request (they answer with the last committed state); with no live
//   replica left the cell is answered with ExecutorLost. A loss during planning re-plans.
// - Unreachable (ReplicaReachable: the gateway's heartbeat went unanswered) is a faster, weaker
//   signal than lost: such a replica is left out of new requests and counts as absent for the
//   majority, but what it owes is not settled, as a slow replica may still answer; except the
//   in-flight cell's executor while a majority still answers: its standbys are told to cancel
//   it through the log and answer (ExecutorLost or CellCancelled), so that a frozen or cut-off
//   executor costs the client about a second, not the server's loss.
// - No live majority of the linked replicas (no replica could commit a cell): an execute_request
//   at the head of the queue is answered at once with ReplicasUnavailable (how many are
//   unreachable, what nbos does about it) instead of waiting; later ones run once a majority is
//   back. Other shell requests still go to a live replica (they commit nothing). When the
//   majority goes while a cell is in flight and its executor is live, the executor is asked to
//   cancel it (nbos_cancel_request); if it had not begun the cell, the cell is answered with
//   ReplicasUnavailable ("did not run"), and a cell it began is left to its replicas. With the
//   executor unreachable the cell is answered at once, saying that whether it ran is not known.
//   Either way the replicas' later messages for it are dropped, and every live replica, and each
//   one that comes back, is told to cancel it (one that has not begun it never will).
// - RecoverExecution (a kernel restored after a gateway restart): the live replicas are asked
//   for the last execute_request they served (nbos_execution_request). While one still runs it,
//   executions wait and the replicas are asked again every 500 ms; once it is done, its
//   execute_reply (and an idle status) under the original request's header goes to every client
//   attached then or later, until the next execution starts: a client that reconnects gets the
//   reply the previous gateway could not forward. A reply finished more than 60 s before the
//   answer was forwarded before that gateway went down, and is dropped. With no answer within
//   10 s (nobody knows), executions go on.
// - Suspended (SuspendChanged; the owner unlinks the replicas): a kernel_info_request is
//   answered from the last kernel_info_reply seen, an interrupt_request with ok; any other shell
//   request waits in the queue and emits ResumeWanted (once per suspension), and the queue moves
//   on when the kernel is no longer suspended and its new replicas are linked.
// - Probes (kernel_info to chosen replicas) and control calls (the migrator's membership
//   requests) are answered with ProbeAnswered / ControlCallAnswered; a call to a replica that is
//   not live, or lost before it answered, or still open at Close, is answered with an error.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "common/status.h"
#include "gateway/client_validation.h"
#include "gateway/output_merger.h"
#include "jupyter/message.h"
#include "jupyter/websocket_codec.h"

namespace nbos::gateway {

using ClientId = uint64_t;

// What the scheduler decided for one execution.
struct ExecutionPlan {
  ReplicaId target_replica = 0;
  std::string server_id;
  std::string grant_id;  // empty when the cell needs no GPUs
  std::vector<int> device_ids;
  bool operator==(const ExecutionPlan&) const = default;
};

struct RouterOptions {
  std::string kernel_id;
  std::string session_id;           // the one session id clients see in headers
  int gpus = 0;                     // per-cell GPUs unless the request's metadata says otherwise
  std::vector<ReplicaId> replicas;  // linked and live at start; the first is the primary
  ClientLimits limits;
  int64_t replan_interval_ms = 20;
  size_t max_queued_requests = 1024;
  // Set per session (random): execution ids must not repeat across gateway restarts, since the
  // replicas' log remembers every id it decided (a reused one would get the old executor).
  std::string execution_epoch;
};

// ---- Events -----------------------------------------------------------------------------------

struct ClientAttached {
  ClientId client = 0;
};
struct ClientDetached {
  ClientId client = 0;
};
// One WebSocket frame as received.
struct ClientFrame {
  ClientId client = 0;
  std::string payload;
  bool binary = false;
};
// A message from a replica's shell, control, stdin or iopub socket (signature already checked).
struct ReplicaMessage {
  ReplicaId replica = 0;
  jupyter::Channel channel = jupyter::Channel::kShell;
  jupyter::Message message;
};
struct ReplicaLost {
  ReplicaId replica = 0;
  std::string why;  // what its server said of its exit, when anything ("out of memory: ...")
};
struct ReplicaBack {
  ReplicaId replica = 0;
};
// A new replica's sockets are connected (migration): it gets every later execution.
struct ReplicaLinked {
  ReplicaId replica = 0;
};
// A replica is dropped (as if lost, then forgotten).
struct ReplicaUnlinked {
  ReplicaId replica = 0;
};
// The answer to PlanWanted with the same plan_id: a plan, nullopt (nobody can execute now), or an
// error that no later attempt can fix.
struct PlanDone {
  uint64_t plan_id = 0;
  Result<std::optional<ExecutionPlan>> plan = std::optional<ExecutionPlan>();
  // With nullopt: what the cell waits for, for the user ("moving replica 2 to host-4 (≈ 0.3 s)").
  std::string wait;
};
struct TimerFired {
  uint64_t timer_id = 0;
};
// The REST interrupt route.
struct InterruptRequested {};
// While held, no new execution starts; other requests flow and an execution in flight goes on.
struct ExecutionsHeld {
  bool held = false;
  std::string why;  // what a waiting cell is told ("moving replica 2 to host-4")
};
// kernel_info_request to each of `replicas`; each answer comes out as ProbeAnswered.
struct ProbeRequested {
  std::vector<ReplicaId> replicas;
};
struct ControlCallRequested {
  uint64_t call_id = 0;
  ReplicaId to = 0;
  std::string msg_type;
  jupyter::Json content = jupyter::Json::object();
};
// The gateway's heartbeat to a replica went unanswered past its timeout, or is answered again.
struct ReplicaReachable {
  ReplicaId replica = 0;
  bool reachable = true;
};
// The session is closing: outstanding calls fail, the grant in flight is released, clients close.
struct RouterClosing {};
// The kernel was restored after a gateway restart (see Rules).
struct RecoverExecution {};
// The kernel's replicas were stopped to save an idle kernel's resources (or it runs again).
struct SuspendChanged {
  bool suspended = false;
};
// Most of the kernel's replicas are gone with their logs (`why`, from the registry): no majority
// can form again, so no replacement can come. Empty: a majority may form again.
struct MajorityLost {
  std::string why;
};

using RouterEvent =
    std::variant<ClientAttached, ClientDetached, ClientFrame, ReplicaMessage, ReplicaLost,
                 ReplicaBack, ReplicaLinked, ReplicaUnlinked, PlanDone, TimerFired,
                 InterruptRequested, ExecutionsHeld, ProbeRequested, ControlCallRequested,
                 RouterClosing, RecoverExecution, SuspendChanged, ReplicaReachable, MajorityLost>;

// ---- Effects ----------------------------------------------------------------------------------

// One message to one or more replicas (an execute_request goes to every live one; the shell
// encodes and signs it once).
struct SendToReplicas {
  std::vector<ReplicaId> replicas;
  jupyter::Channel channel = jupyter::Channel::kShell;
  jupyter::Message message;
};
struct SendToClient {
  ClientId client = 0;
  jupyter::WsMessage message;
};
struct SendToAllClients {
  jupyter::WsMessage message;
};
struct CloseClient {
  ClientId client = 0;
  uint16_t code = 1000;  // 1007 invalid payload, 1009 too big, 1001 kernel gone
  std::string reason;
};
// Choose the executor and commit its GPUs, then answer with PlanDone{plan_id}.
struct PlanWanted {
  uint64_t plan_id = 0;
  std::string exec_id;
  int gpus = 0;
  ReplicaId requested_target = 0;  // metadata nbos.target_replica, 0 if none
  // The replicas that may run the cell: the live ones, less the executor of the previous cell
  // if it could not replicate that cell (it may be behind and would refuse again) and another
  // is live, unless the request names it.
  std::set<ReplicaId> live;
};
struct GrantReleaseWanted {
  ExecutionPlan plan;
};
// Answer with TimerFired{timer_id} after delay_ms; a timer the router no longer waits for is
// ignored when it fires.
struct TimerWanted {
  uint64_t timer_id = 0;
  int64_t delay_ms = 0;
};
// A client asked for shutdown (already answered); the owner deletes or restarts the kernel.
struct ShutdownWanted {
  bool restart = false;
};
struct ProbeAnswered {
  ReplicaId replica = 0;
};
struct ControlCallAnswered {
  uint64_t call_id = 0;
  Result<jupyter::Json> reply = jupyter::Json::object();  // the reply's content
};
// A suspended kernel got a request that needs its replicas: the owner starts them again.
struct ResumeWanted {};
// An execution went to the replicas. `delay_us`: from when it could have started (its arrival,
// or the previous cell's reply if later) to now: what waiting for an executor cost the user.
struct ExecutionStarted {
  std::string exec_id;
  int64_t delay_us = 0;
};
// A replica's execute_reply said its namespace is not the state its log holds (metadata
// nbos.diverged: names it could not rebuild, an entry it could not apply), or, with `why`
// empty, that it follows again. The owner replaces such a replica (self-healing).
struct ReplicaDiverged {
  ReplicaId replica = 0;
  std::string why;
};
// A client input was refused (see client_validation.h for the classes).
struct InputRejected {
  RejectClass reason = RejectClass::kFrame;
  std::string detail;
};

using RouterEffect = std::variant<SendToReplicas, SendToClient, SendToAllClients, CloseClient,
                                  PlanWanted, GrantReleaseWanted, TimerWanted, ShutdownWanted,
                                  ProbeAnswered, ControlCallAnswered, InputRejected, ResumeWanted,
                                  ExecutionStarted, ReplicaDiverged>;

// ---- The router -------------------------------------------------------------------------------

class KernelRouter {
 public:
  explicit KernelRouter(RouterOptions options);

  // The single entry point. Never throws on any input. After RouterClosing every event is
  // ignored, but a PlanDone that carries a grant gets it released.
  std::vector<RouterEffect> Apply(int64_t now_us, RouterEvent event);

  struct Stats {
    uint64_t executions = 0;             // sent to the replicas
    uint64_t waited_for_gpus = 0;        // executions that could not be planned at once
    uint64_t rejected = 0;               // client inputs refused
    uint64_t failed_without_quorum = 0;  // executions answered at once: no live majority
  };
  const Stats& stats() const { return stats_; }
  // "busy" while a shell request is queued or an execution in flight, else "idle".
  const char* execution_state() const;
  int64_t last_activity_us() const { return last_activity_us_; }
  size_t connections() const { return clients_.size(); }
  ReplicaId current_executor() const { return executor_; }
  // An execute_request at the head of the queue waits for an executor (GPUs, a migration, a
  // resume), not for the previous cell.
  bool cell_waiting() const { return !notice_.text.empty(); }
  // The in-flight execution's target; 0 when none.
  ReplicaId executing_replica() const;
  std::set<ReplicaId> live_replicas() const;
  bool closed() const { return closed_; }

 private:
  struct Queued {
    ClientId client = 0;
    jupyter::Channel channel = jupyter::Channel::kShell;
    jupyter::Message request;
    int64_t received_us = 0;
  };
  struct InFlight {
    std::string msg_id;
    std::string exec_id;
    jupyter::Json header;
    ExecutionPlan plan;
    int64_t received_us = 0, planned_us = 0, sent_us = 0;
    bool stop_on_error = true;
    bool cancel_asked = false;                     // CancelForQuorum ran for it
    std::vector<std::string> cancels;              // its nbos.cancels
    jupyter::Json waits = jupyter::Json::array();  // the wait notice's lines and their times
  };
  // The status line of the head execute_request while it waits (see Rules).
  struct WaitNotice {
    std::string msg_id;  // the request it belongs to
    std::string text;    // as shown; "" while nothing is shown
    int64_t since_us = 0;
    jupyter::Json waits = jupyter::Json::array();  // earlier lines: {"for": text, "ms": N}
  };
  // The head execute_request's planning: a PlanWanted or a replan timer outstanding.
  struct Planning {
    uint64_t plan_id = 0;   // outstanding PlanWanted, 0 when none
    uint64_t timer_id = 0;  // outstanding replan timer, 0 when none
    bool logged_wait = false;
  };

  // The cell a previous gateway had in flight (RecoverExecution).
  struct Recovery {
    bool asking = false;   // no answer that settles it yet
    bool running = false;  // the replicas still run it: executions wait
    int64_t since_us = 0;
    uint64_t timer_id = 0;                     // the next ask
    std::map<std::string, ReplicaId> queries;  // nbos_execution_request msg_id -> replica
    std::optional<jupyter::Message> reply;     // for clients attaching until the next execution
  };

  using Effects = std::vector<RouterEffect>;

  void OnFrame(ClientFrame& frame, Effects* out);
  void OnClientMessage(ClientId client, jupyter::WsMessage ws, Effects* out);
  void OnReplicaMessage(ReplicaMessage& m, Effects* out);
  void NoteDivergence(ReplicaId replica, const jupyter::Json& reply_metadata, Effects* out);
  void OnPlanDone(PlanDone& done, Effects* out);
  void OnTimer(const TimerFired& timer, Effects* out);
  void OnInterrupt(Effects* out);
  void OnControlCall(ControlCallRequested& call, Effects* out);
  void OnProbe(const ProbeRequested& probe, Effects* out);
  void OnClosing(Effects* out);
  void AskForLastExecution(Effects* out);
  void OnRecoveryTimer(Effects* out);
  void OnLastExecution(const jupyter::Json& content, Effects* out);
  void DeliverRecovered(ClientId client, Effects* out);
  bool AnsweredWhileSuspended(ClientId client, jupyter::Channel channel, const jupyter::Message& m,
                              Effects* out);
  void SetLive(ReplicaId replica, bool live, Effects* out, const std::string& why = "");
  void Unlink(ReplicaId replica, Effects* out);

  void Pump(Effects* out);
  void ShowWait(const std::string& detail, Effects* out);
  // Records the line shown until now, with how long it stood, into notice_.waits.
  void EndWaitLine();
  // Takes the head request off the queue, clearing its status line; `waits` gets its lines.
  Queued PopHead(Effects* out, jupyter::Json* waits = nullptr);
  void CancelWaitingExecution(Effects* out);
  void FailWithoutQuorum(size_t live, Effects* out);
  void StartExecution(const ExecutionPlan& plan, Effects* out);
  void FinishExecution(jupyter::Message* reply, Effects* out);
  void AbortQueuedExecutions(Effects* out);
  void AnswerWithError(ClientId client, jupyter::Channel channel, const jupyter::Message& request,
                       const std::string& ename, const std::string& evalue, Effects* out,
                       bool with_busy = true);
  void FailInFlight(const std::string& why, Effects* out);
  void SetReachable(ReplicaId replica, bool reachable, Effects* out);
  void CancelForQuorum(Effects* out);
  // The in-flight cell's executor stopped answering while a majority still does: the standbys
  // decide through the log and answer for the cell; `executor`'s later reply is dropped.
  void ExcuseExecutor(ReplicaId executor, Effects* out);
  // Asks the live standbys of the in-flight cell to cancel it through the log ("decide") and
  // answer; `why` says why its executor is given up on.
  void CancelOnStandbys(const std::string& why, Effects* out);
  void OnQuorumCancelReply(const jupyter::Message& reply, Effects* out);
  // `ename` says what the answer promises (docs/decisions/0017-answers-are-promises.md).
  void AbandonInFlight(const std::string& ename, const std::string& why, Effects* out);
  // nbos_cancel_request for `exec_id` to `to`; returns its msg_id.
  std::string SendCancel(ReplicaId to, const std::string& exec_id, Effects* out);
  // Cancels `exec_id` on every live replica but `except`, and on each that comes back later.
  void CancelEverywhere(const std::string& exec_id, ReplicaId except, Effects* out);
  std::string NoQuorumMessage(size_t live) const;
  void Reject(ClientId client, const Rejection& rejection, const jupyter::Message* request,
              jupyter::Channel channel, Effects* out);
  void Route(jupyter::Channel channel, jupyter::Message m, Effects* out);
  void ForwardReply(jupyter::Channel channel, jupyter::Message reply, Effects* out);
  void Deliver(ClientId client, jupyter::Channel channel, jupyter::Message m, Effects* out);
  void Broadcast(jupyter::Channel channel, jupyter::Message m, Effects* out);
  void SendTo(std::vector<ReplicaId> replicas, jupyter::Channel channel, const jupyter::Message& m,
              Effects* out);
  ReplicaId ControlTarget() const;
  bool IsLive(ReplicaId replica) const;
  int CellGpus(const jupyter::Message& request) const;

  RouterOptions options_;
  int64_t now_us_ = 0;
  jupyter::MessageFactory factory_;
  OutputMerger merger_;
  std::map<ReplicaId, bool> replicas_;  // linked replicas and whether each is live
  std::set<ReplicaId> unreachable_;     // linked replicas whose heartbeat goes unanswered
  // The cancel asked of the in-flight cell's executor when the majority went (msg_id), and the
  // cells answered that way or left unreplicated by their executor, whose cancel each replica
  // coming back gets (the newest few).
  std::string quorum_cancel_id_;
  std::deque<std::string> cancelled_exec_ids_;
  std::set<ClientId> clients_;
  std::deque<Queued> shell_queue_;
  std::optional<InFlight> in_flight_;
  Planning planning_;
  Recovery recovery_;
  bool suspended_ = false;
  bool resume_wanted_ = false;                // ResumeWanted emitted in this suspension
  std::optional<jupyter::Json> kernel_info_;  // the last kernel_info_reply's content
  uint64_t next_plan_id_ = 0, next_timer_id_ = 0;
  bool held_ = false;
  std::string held_why_;
  std::string majority_lost_why_;  // MajorityLost
  WaitNotice notice_;
  std::string busy_sent_for_;  // the request whose busy the gateway sent ahead of its status line
  int64_t last_reply_us_ = 0;  // when the last execution's reply went out
  bool abort_after_reply_ = false;  // the reply being forwarded failed a stop_on_error cell
  bool closed_ = false;
  uint64_t sequence_ = 0;                          // executions sent
  std::map<std::string, ClientId> reply_to_;       // request msg_id -> client
  std::map<std::string, ReplicaId> input_asker_;   // input_request msg_id -> replica
  std::map<std::string, ReplicaId> probes_;        // kernel_info probe msg_id -> replica
  std::map<std::string, uint64_t> control_calls_;  // request msg_id -> call id
  std::map<std::string, ReplicaId> control_to_;    // request msg_id -> replica it went to
  // The gateway's own control calls, the last kInternalCallsKept: what replicas send about them
  // (the reply, their busy and idle) is no activity of the kernel's, so that a collector asking
  // every kernel does not keep idle ones from being suspended.
  std::deque<std::string> internal_calls_;
  static constexpr size_t kInternalCallsKept = 64;
  ReplicaId executor_ = 0;
  ReplicaId unreplicated_executor_ = 0;  // answered ReplicationError for the last cell
  // Replicas whose last execute_reply said their namespace is not the log's (nbos.diverged), and
  // why: left out of executor choice until they are replaced or say they follow again.
  std::map<ReplicaId, std::string> diverged_;
  // The last cell answered through its replicas; empty after one that was abandoned or failed.
  std::string previous_exec_id_;
  int64_t last_activity_us_ = 0;
  Stats stats_;
};

// Execution ids: "<kernel>:<sequence>", or "<kernel>:<epoch>.<sequence>" with an epoch.
std::string ExecutionId(const std::string& kernel_id, const std::string& epoch, uint64_t sequence);

}  // namespace nbos::gateway
