// Registry: the gateway's tables, and the only owner of them: registered servers (their daemon
// clients and last heartbeats), kernels (metadata, resources, session, replica liveness,
// migration bookkeeping) and the scheduling core that decides over both. One mutex guards all
// of it (checked by -Wthread-safety). Callers get copies (KernelRecord, ServerRecord, Snapshot)
// and change a kernel only through UpdateKernel or the named operations, so no thread ever reads
// a table while another rewrites it. No RPC, disk or socket work happens under the lock.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/thread_annotations.h"
#include "control/control.pb.h"
#include "daemon/daemon_client.h"
#include "gateway/kernel_session.h"
#include "gateway/metadata_store.h"
#include "sched/scheduler.h"

namespace nbos::gateway {

using SteadyClock = std::chrono::steady_clock;

// A migration under way, for the cluster view: the replica it replaces and the one it adds.
struct MigrationInProgress {
  uint32_t leaving_replica = 0;
  uint32_t joining_replica = 0;  // 0 until the migration has its id
  std::string to_server_id;
  std::string reason;  // "replacing a lost replica", "a cell needs GPUs", ...
};

struct KernelRecord {
  StoredKernel meta;
  sched::Resources request;
  std::shared_ptr<KernelSession> session;  // null while the kernel starts or restarts
  // A restart is under way: the kernel stays listed (execution_state "restarting") while it has
  // no session, since clients such as jupyter server take a kernel missing from the list for
  // one the gateway culled.
  bool restarting = false;
  // Serialises restart, delete and migration of this kernel; never held with the registry's.
  std::shared_ptr<Mutex> op_mu = std::make_shared<Mutex>();
  bool in_cluster = false;  // part of the scheduler's view (all its servers registered)
  std::map<ReplicaId, bool> replica_live;
  bool migrating = false;  // a migration is queued or running
  // Why a majority of the replicas cannot form again ("" while it may): told to the session.
  std::string majority_lost;
  std::optional<MigrationInProgress> migration;  // set while one runs
  // When the gateway first saw each replica lost (for the time to replace it).
  std::map<ReplicaId, SteadyClock::time_point> lost_since;
  std::string move_wait_logged;  // why a replica that must move waits, as last logged
  SteadyClock::time_point migration_retry_after{};
  uint32_t last_replica_id = 0;  // replica ids are never reused within a kernel
  // Idle too long: checkpointed (meta.checkpoint), replicas stopped, out of the scheduler's view.
  bool suspended = false;
  // Replicas whose namespace is not the state their log holds, and why (the session's
  // ReplicaDiverged); PlanMoves replaces them, the next one no earlier than
  // divergence_retry_after.
  std::map<ReplicaId, std::string> diverged;
  SteadyClock::time_point divergence_retry_after{};
  // Replicas a migration takes out of the Raft group before its replacement joins: lost for
  // good, whatever their servers report, until replaced. Recorded before the removal is asked,
  // so one may still be a member; `left_confirmed` holds those a live member confirmed gone
  // (this gateway's own knowledge: not recorded).
  std::set<ReplicaId> left_group;
  std::set<ReplicaId> left_confirmed;
  std::chrono::milliseconds divergence_backoff{0};
  // When PlanRevivals last asked for each replica's restart.
  std::map<ReplicaId, SteadyClock::time_point> revived_at;
  // When PlanGroupChecks last had the kernel's Raft group asked for (CheckGroup), whether that
  // check runs, and whether one is due before the next migration: a migration that failed may
  // have failed on a record that drifted from the group (a member that is none), and would
  // fail the same way again.
  SteadyClock::time_point group_checked_at{};
  bool group_check_running = false;
  bool group_check_due = false;
};

struct ServerRecord {
  std::string server_id;
  std::shared_ptr<daemon::DaemonClient> client;
  bool gpus_virtual = false;
  bool alive = true;
  bool draining = false;   // takes no new replicas; its replicas are moved off
  bool releasing = false;  // draining for scale-in: removed once empty
  SteadyClock::time_point release_started{};
  SteadyClock::time_point last_seen;
  control::ServerStatus status;
  // Replicas this daemon runs that belong to no kernel, as of the last heartbeat; stopped when
  // the next heartbeat still reports them.
  std::set<std::pair<std::string, uint32_t>> orphans_seen;
  // Replicas of kernels placed on this server that its last heartbeat did not report, and those
  // two heartbeats in a row did not (`forgotten`): the daemon no longer runs them (it restarted,
  // and a restarted daemon forgets its replicas and their logs), so they are replaced.
  std::set<std::pair<std::string, uint32_t>> missing_seen;
  std::set<std::pair<std::string, uint32_t>> forgotten;
};

// A replica's liveness as its daemon reports it, for the kernel's session.
struct LivenessChange {
  std::shared_ptr<KernelSession> session;
  ReplicaId replica = 0;
  bool live = false;
  std::string why;  // a lost replica's exit reason from its server, when it gave one
};

struct ReplicaRef {
  std::string kernel_id;
  uint32_t replica_id = 0;
};

// Who may execute a cell, in order, with their daemons.
struct ExecutorCandidates {
  struct Candidate {
    ReplicaId replica = 0;
    std::string server_id;
    std::shared_ptr<daemon::DaemonClient> client;
  };
  std::vector<Candidate> candidates;
  // Set when no candidate's server can grant the GPUs and a migration should start now (the
  // kernel was marked migrating; the caller must hand the plan to the migrator).
  std::optional<sched::MigrationPlan> migration;
  // With no candidate: what the cell waits for, said to its user ("moving replica 2 to host-4
  // (≈ 0.3 s)", "a new server (host-5) is starting").
  std::string wait;
};

struct RegistryCounters {
  uint64_t grants_made = 0, grants_refused = 0, kernels_started = 0;
  uint64_t migrations_done = 0, migrations_failed = 0;
  std::vector<int64_t> migration_ms;  // the last 100 migrations' durations
  uint64_t replacements_done = 0;
  uint64_t scale_outs = 0, scale_ins = 0;  // servers asked for, servers removed
  // The last 50 scaling events, oldest first.
  struct ScaleEvent {
    int64_t at_ms = 0;  // the scheduler's clock
    std::string kind;   // "out" (servers asked for) or "in" (a server removed)
    std::vector<std::string> server_ids;
    std::string reason;
  };
  std::vector<ScaleEvent> scale_events;
  // What happened in the cluster, for people watching it (the dashboard): the last 200, oldest
  // first, numbered from 1 in order.
  struct Event {
    uint64_t seq = 0;
    int64_t at_unix_ms = 0;
    std::string kind;       // "migration", "scale-out", "scale-in", "server-lost", "suspend", ...
    std::string kernel_id;  // "" for the cluster's own events
    std::string text;
  };
  std::vector<Event> events;
  // The last 100 replacements of lost replicas: from the loss seen to the new replica answering.
  std::vector<int64_t> replacement_ms;
  uint64_t suspensions = 0, resumes = 0;
  // The last 100 resumes: from the request that woke the kernel to its replicas answering; the
  // last 100 suspensions: from the decision to the replicas stopped.
  std::vector<int64_t> resume_ms, suspend_ms;
};

// The scheduler's plan to move a replica that must move (the kernel is marked migrating).
struct MovePlan {
  std::string kernel_id;
  sched::MigrationPlan plan;
  std::string reason;  // "replacing a lost replica", "draining server host-2"
};

// A replica its daemon gave up restarting (it kept dying past the restart budget) that its
// kernel needs for a majority: launched again where it is, from its own Raft log.
struct Revival {
  StoredKernel meta;
  ReplicaId replica_id = 0;
  std::string server_id;
  std::shared_ptr<daemon::DaemonClient> client;
};

// A replica recorded as leaving its kernel's Raft group, its removal not confirmed, that its
// server runs: `kernel` (a copy) is asked whether it is still a member.
// Everything the cluster view and the metrics show, copied at one moment.
struct RegistrySnapshot {
  std::vector<std::pair<sched::ServerView, std::optional<ServerRecord>>> servers;
  std::vector<KernelRecord> kernels;
  double cluster_ratio = 0;
  RegistryCounters counters;
  std::vector<std::string> pending_servers;  // asked of the host provider, not registered yet
};

class Registry {
 public:
  // `journal`, when set, sees every scheduling event (the decision journal); it must outlive the
  // registry.
  explicit Registry(sched::SchedulerOptions options, sched::SchedulerObserver* journal = nullptr);

  // ---- servers ----
  void OnRegister(const control::RegisterRequest& request) EXCLUDES(mu_);
  // How the clients of servers registering from now on call their daemons (TLS, token).
  void SetDaemonClientOptions(daemon::DaemonClientOptions options) EXCLUDES(mu_);
  struct HeartbeatOutcome {
    bool known = false;  // false: the daemon must register first
    std::vector<LivenessChange> changes;
    std::vector<ReplicaRef> orphans;  // to stop: seen in two heartbeats, owned by no kernel
    std::shared_ptr<daemon::DaemonClient> client;
  };
  HeartbeatOutcome OnHeartbeat(const control::ServerStatus& status) EXCLUDES(mu_);
  // Servers silent for longer than `timeout` stop counting: their replicas are lost. So are the
  // replicas of recorded kernels on servers that have not registered `timeout` after this
  // registry was made (lost while the gateway was down).
  std::vector<LivenessChange> ExpireServers(std::chrono::milliseconds timeout) EXCLUDES(mu_);
  std::shared_ptr<daemon::DaemonClient> Client(const std::string& server_id) const EXCLUDES(mu_);
  // Client, waiting up to `timeout` for the server to register: right after a gateway restart
  // the daemons come back with their next heartbeat.
  std::shared_ptr<daemon::DaemonClient> AwaitClient(const std::string& server_id,
                                                    std::chrono::milliseconds timeout) const
      EXCLUDES(mu_);
  // Unavailable when a daemon reports, in a heartbeat newer than `since`, that a replica of
  // `meta` exited and will not be restarted.
  Status CheckReplicasNotGivenUp(const StoredKernel& meta, SteadyClock::time_point since) const
      EXCLUDES(mu_);

  // ---- kernels ----
  // Places a new kernel's `replicas` replicas through the scheduler and records the kernel with
  // its (not yet launched) replicas, so concurrent starts see them. Returns the servers, in
  // replica id order. Errors: InvalidArgument (a request no server could ever meet),
  // ResourceExhausted (no servers can take it now).
  Result<std::vector<std::string>> PlaceKernel(KernelRecord kernel, int replicas) EXCLUDES(mu_);
  // A kernel from the database; it joins the scheduler's view once its servers registered.
  void RestoreKernel(KernelRecord kernel) EXCLUDES(mu_);
  std::optional<KernelRecord> FindKernel(const std::string& kernel_id) const EXCLUDES(mu_);
  std::vector<KernelRecord> Kernels() const EXCLUDES(mu_);
  // Runs `change` on the kernel's record under the lock (it must not call the registry). False
  // when there is no such kernel.
  bool UpdateKernel(const std::string& kernel_id, const std::function<void(KernelRecord&)>& change)
      EXCLUDES(mu_);
  // Forgets the kernel (and its scheduling state); returns its last record, nullopt when there was
  // none.
  std::optional<KernelRecord> RemoveKernel(const std::string& kernel_id) EXCLUDES(mu_);
  void CountKernelStarted() EXCLUDES(mu_);

  // ---- suspension of idle kernels ----
  // Kernels with a session, all replicas live, no migration, idle (no request queued or running)
  // and no activity for `idle`.
  std::vector<std::string> IdleKernels(std::chrono::milliseconds idle) const EXCLUDES(mu_);
  // The kernel's replicas are stopped and its state is `checkpoint`: it leaves the scheduler's
  // view and lists no replicas. Returns its record to store.
  std::optional<StoredKernel> MarkSuspended(const std::string& kernel_id,
                                            const std::string& checkpoint, int64_t took_ms)
      EXCLUDES(mu_);
  // Places a suspended kernel's replicas again (new replica ids) and puts it back in the
  // scheduler's view; errors as PlaceKernel's. UndoResume takes that back (the launch failed).
  Result<std::vector<std::string>> PlaceForResume(const std::string& kernel_id, int replicas)
      EXCLUDES(mu_);
  void UndoResume(const std::string& kernel_id) EXCLUDES(mu_);
  void MarkResumed(const std::string& kernel_id, int64_t took_ms) EXCLUDES(mu_);

  // ---- executions ----
  // The scheduler's choice of executor for one execution of `kernel_id` among `live` replicas,
  // with the daemons to ask for GPUs. NotFound: the kernel is not in the scheduler's view (its
  // servers have not registered yet); InvalidArgument: more GPUs than the largest server has
  // (no later attempt can succeed); other errors are the scheduler's (the caller waits).
  Result<ExecutorCandidates> RequestExecutor(const std::string& kernel_id,
                                             const std::string& exec_id, int gpus,
                                             ReplicaId requested, const std::set<ReplicaId>& live)
      EXCLUDES(mu_);
  void OnGrantCommitted(const std::string& kernel_id, const std::string& exec_id, ReplicaId replica,
                        const std::string& server_id, int gpus) EXCLUDES(mu_);
  void OnGrantRefused() EXCLUDES(mu_);
  void OnGrantReleased(const std::string& kernel_id, ReplicaId replica,
                       const std::string& server_id, int gpus) EXCLUDES(mu_);
  // A scheduler tick: its rebalance plans whose kernels could be marked migrating, and its
  // scaling decision when one was evaluated.
  struct TickOutcome {
    std::vector<sched::RebalancePlan> rebalance;
    std::optional<sched::ScalingDecision> scaling;
  };
  TickOutcome Tick() EXCLUDES(mu_);

  // ---- scaling ----
  // Whether some cell, replacement or start found no server able to take it since the last call
  // (the scheduler said scale_out_needed); clears the flag. `reason` gets the last such reason.
  bool TakeScaleOutWanted(std::string* reason) EXCLUDES(mu_);
  // Servers asked of the host provider: pending until they register. A scale-out (not the
  // cluster's first servers) is counted and listed among the scaling events.
  void NoteScaleOut(const std::vector<std::string>& server_ids, const std::string& reason,
                    bool scale_out = true) EXCLUDES(mu_);
  // Scale-in of one server: it drains (PlanMoves moves its replicas off) and is reported
  // by EmptiedServers once it holds nothing. False: unknown, lost, or already on its way out.
  bool BeginRelease(const std::string& server_id, const std::string& reason) EXCLUDES(mu_);
  // Releasing servers that hold no replica, no migration target and no committed GPUs (in the
  // scheduler's view and in their daemon's ledger). A release that could not empty its server
  // within `give_up` ends: the server accepts replicas again.
  std::vector<std::string> EmptiedServers(std::chrono::milliseconds give_up) EXCLUDES(mu_);
  // Forgets a removed server (the scheduler's ServerLeft).
  void RemoveServer(const std::string& server_id, const std::string& reason) EXCLUDES(mu_);
  // Kernels with a replica that must move and a live majority, not migrating and not backing
  // off: each is marked migrating and gets the scheduler's plan to move that replica. A replica
  // must move when it is lost (its server missed its heartbeats, or its daemon reports it exited
  // for good) or its server drains. A kernel without a live majority, or whose plan has no
  // target, waits (its next try backs off for `retry`).
  std::vector<MovePlan> PlanMoves(std::chrono::milliseconds retry) EXCLUDES(mu_);
  // Kernels without a live majority whose replicas on live servers were given up by their
  // daemons (exited with an error past the restart budget: killed or crashed too often): no
  // replacement can join without a majority, and the given-up replica's log is still on its
  // server, so it is launched again, each no more often than `every`. Without this a burst of
  // kills that spends two replicas' budgets leaves the kernel stopped for good.
  std::vector<Revival> PlanRevivals(std::chrono::milliseconds every) EXCLUDES(mu_);
  // Kernels whose record of their Raft group is to be checked against the group: those a failed
  // migration left due, those without a live majority once `suspect_every` passed since their
  // last check, any other after `every`; not while migrating, only with a live replica to ask.
  // The gateway's record drifts from the group when a membership change committed after the
  // gateway stopped waiting (or was killed), or never committed after it was recorded. The
  // caller asks the live replicas (AskRaftGroup), corrects the record (KeepMember, NoteGone),
  // then calls GroupChecked; PlanMoves leaves the kernel alone meanwhile.
  std::vector<KernelRecord> PlanGroupChecks(std::chrono::milliseconds suspect_every,
                                            std::chrono::milliseconds every) EXCLUDES(mu_);
  void GroupChecked(const std::string& kernel_id) EXCLUDES(mu_);
  // The kernel's proven Raft group lists `replica_id` (recorded as leaving): it counts as a
  // member again (live once its server reports it running). Returns the kernel's record to
  // store, or nothing when the kernel is gone, migrating, or no longer records it as leaving.
  std::optional<StoredKernel> KeepMember(const std::string& kernel_id, ReplicaId replica_id)
      EXCLUDES(mu_);
  // The kernel's proven Raft group does not list `replica_id`: it left for good. It is recorded
  // as leaving with its removal confirmed and stops counting live, so PlanMoves replaces it.
  // Returns the kernel's record to store, or nothing when the kernel is gone, migrating, or
  // already knew.
  std::optional<StoredKernel> NoteGone(const std::string& kernel_id, ReplicaId replica_id)
      EXCLUDES(mu_);
  // The kernel's session says `replica` cannot follow its log (`why`), or, with `why` empty,
  // follows again. PlanMoves replaces such a replica like a lost one, each replacement of one
  // kernel's diverged replicas waiting twice as long as the one before (2 s up to 5 minutes;
  // back to 2 s after 10 quiet minutes): a failure every new replica meets (a value that cannot
  // be rebuilt anywhere but on its executor) must not replace replicas without end, and one that
  // passes must still be healed. A replica that newly diverged is left kDivergenceGrace to
  // rebuild itself first: most such failures pass (the blob store was restarting), the replica
  // retries on its own, and its replacement would need the same store. The cluster view shows
  // it.
  void NoteDivergence(const std::string& kernel_id, uint32_t replica_id, const std::string& why)
      EXCLUDES(mu_);
  static constexpr std::chrono::milliseconds kDivergenceGrace{10000};
  static constexpr std::chrono::milliseconds kDivergenceBackoffFirst{2000};
  static constexpr std::chrono::milliseconds kDivergenceBackoffMax{300000};
  static constexpr std::chrono::minutes kDivergenceQuiet{10};
  // An operator's move of one kernel's replica (MoveRequested: replica and target optional).
  // Marks the kernel migrating. Errors: NotFound (kernel, replica, server), InvalidArgument (a
  // target that cannot take it), Unavailable (a migration of this kernel is under way, the
  // kernel is not schedulable yet, or no server can take the replica).
  Result<sched::MigrationPlan> RequestMove(const std::string& kernel_id, uint32_t replica_id,
                                           const std::string& to_server_id) EXCLUDES(mu_);
  // The server takes no new replicas, and PlanMoves moves its replicas off. Returns how
  // many replicas it holds. NotFound: no such server.
  Result<size_t> DrainServer(const std::string& server_id) EXCLUDES(mu_);

  // ---- migration ----
  // Marks the kernel migrating unless it already is or a failed migration backs off. False:
  // leave it.
  bool BeginMigration(const std::string& kernel_id) EXCLUDES(mu_);
  bool ServerAlive(const std::string& server_id) const EXCLUDES(mu_);
  // Adds to RegistryCounters::events (stamped with the wall clock).
  void NoteEvent(std::string kind, std::string kernel_id, std::string text) EXCLUDES(mu_);
  // Delays of executions that went to replicas (KernelRouter's ExecutionStarted), kept until
  // taken: the dashboard's sampler takes them once a second. At most 10,000 are kept.
  void RecordExecutionDelay(double delay_ms) EXCLUDES(mu_);
  std::vector<double> TakeExecutionDelays() EXCLUDES(mu_);
  // Clears the mark; a failure is counted and backs off for `backoff`.
  void EndMigration(const std::string& kernel_id, const Status& outcome,
                    std::chrono::milliseconds backoff) EXCLUDES(mu_);
  // A migration that took `took` replaced replica `old_id` by `replacement`: the kernel's
  // metadata, liveness, the scheduler's view and the migration counters change together.
  // Returns the metadata to store.
  std::optional<StoredKernel> ReplaceReplica(const std::string& kernel_id, uint32_t old_id,
                                             const StoredReplica& replacement,
                                             std::chrono::milliseconds took) EXCLUDES(mu_);

  RegistrySnapshot Snapshot() const EXCLUDES(mu_);

 private:
  int64_t NowMs() const;
  Status AddToCluster(KernelRecord& kernel) REQUIRES(mu_);
  void JoinRestoredKernels() REQUIRES(mu_);
  Result<std::vector<std::string>> PlaceLocked(KernelRecord& kernel, int replicas) REQUIRES(mu_);
  std::vector<ReplicaRef> FindOrphans(ServerRecord& server) REQUIRES(mu_);
  // Updates server.missing_seen and server.forgotten from its last status.
  void FindForgotten(ServerRecord& server) REQUIRES(mu_);
  // Tells the kernel's session whether a majority of its replicas is gone for good.
  void NoteMajorityLost(KernelRecord& kernel) REQUIRES(mu_);
  // The replicas on servers that never registered (ExpireServers).
  void ExpireUnregistered(SteadyClock::time_point now, std::vector<LivenessChange>* lost)
      REQUIRES(mu_);
  void OrphanOnUnregistered(const std::set<std::string>& silent) REQUIRES(mu_);
  std::shared_ptr<daemon::DaemonClient> ClientLocked(const std::string& server_id) const
      REQUIRES(mu_);
  // The first of the kernel's replicas that must move (lost, on a draining server, or diverged
  // and past its backoff); 0 when none must. `reason` says why.
  ReplicaId ReplicaToMove(const KernelRecord& kernel, std::string* reason) const REQUIRES(mu_);
  std::set<std::string, std::less<>> WarmServers() const REQUIRES(mu_);
  static void LogMoveWait(KernelRecord& kernel, std::string why);

  const SteadyClock::time_point started_ = SteadyClock::now();
  mutable Mutex mu_;
  daemon::DaemonClientOptions client_options_ GUARDED_BY(mu_);
  sched::Scheduler scheduler_ GUARDED_BY(mu_);
  std::map<std::string, ServerRecord> servers_ GUARDED_BY(mu_);
  const SteadyClock::time_point made_ = SteadyClock::now();
  std::map<std::string, KernelRecord> kernels_ GUARDED_BY(mu_);
  RegistryCounters counters_ GUARDED_BY(mu_);
  uint64_t events_noted_ GUARDED_BY(mu_) = 0;
  std::vector<double> execution_delays_ms_ GUARDED_BY(mu_);
  std::set<std::string> logged_migration_ GUARDED_BY(mu_);  // exec ids whose wait was logged
  void WantScaleOut(const std::string& reason) REQUIRES(mu_);
  void NoteEventLocked(std::string kind, std::string kernel_id, std::string text) REQUIRES(mu_);
  // What a cell of `k` that no replica's server can run waits for (ExecutorCandidates::wait);
  // `starting`: the migration this request starts, if any.
  std::string WaitReasonLocked(const KernelRecord* k,
                               const std::optional<sched::MigrationPlan>& starting) const
      REQUIRES(mu_);
  void RecordScaleEvent(std::string kind, std::vector<std::string> ids, std::string reason)
      REQUIRES(mu_);
  bool scale_out_wanted_ GUARDED_BY(mu_) = false;
  std::set<std::string> pending_servers_ GUARDED_BY(mu_);
  // When each pending server was asked for, and how long the last ones took to register.
  std::map<std::string, SteadyClock::time_point> pending_since_ GUARDED_BY(mu_);
  std::vector<int64_t> server_start_ms_ GUARDED_BY(mu_);
  SteadyClock::time_point last_registration_ GUARDED_BY(mu_){};
  std::string scale_out_reason_ GUARDED_BY(mu_);
};

}  // namespace nbos::gateway
