// `nbos replica`: the ExecutionGate of one replica of a distributed kernel. It joins the kernel's
// Raft group (RaftNode + KernelStateMachine), proposes LEAD or YIELD for each execution through
// whichever member leads (ProposalRouter), and keeps the Python namespace identical to the other
// replicas by applying, in log order, the deltas the executors commit.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/thread_annotations.h"
#include "replica/blob_announcer.h"
#include "replica/execution_gate.h"
#include "replica/kernel_log.h"
#include "replica/proposal_router.h"
#include "replication/raft_node.h"
#include "store/blob_store.h"
#include "store/prefetching_blob_store.h"

namespace nbos::replica {

struct ReplicaOptions {
  ReplicaId replica_id = 0;
  std::string raft_address;                // "IPv4:port"; forwarded proposals on port + 1
  std::vector<replication::Member> peers;  // initial voters incl. this one; empty to join later
  std::string data_dir;                    // Raft log and snapshots
  std::string blob_store_url;              // see store::OpenBlobStore
  size_t replicas = 3;                     // YIELDs that make an election fail
  std::chrono::milliseconds propose_timeout{10000};
  // How long a replica waits for an election outcome or for the executor's effects before it
  // answers with an error (the executor may be gone; the gateway retries or cancels first).
  std::chrono::milliseconds follow_timeout{120000};
  // The executor proposes a checkpoint of the whole namespace once this many journal records
  // (deltas, side effects) accumulated since the last one, or 16 MiB of them, so catch-up
  // replays little and the Raft snapshot stays small.
  uint64_t checkpoint_every = 64;
  // Memory for blobs fetched ahead of applying the deltas that need them.
  size_t prefetch_bytes = size_t{2} << 30;
  // With blob_hints, the executor announces each blob of at least blob_hint_min_bytes as soon
  // as it is stored, so that standbys fetch it while the cell's other blobs are written
  // (BlobAnnouncer). Off by default (docs/performance.md, all replicas on one 2-core machine):
  // with a core of their own, standbys were ready 18-36 % sooner at about the same executor's
  // sync on directory stores; sharing the executor's cores they were ready no sooner while the
  // executor's sync, which the user waits for, took 1.2-2.1x as long; with Redis it took
  // 3.1-3.6x as long either way.
  bool blob_hints = false;
  size_t blob_hint_min_bytes = size_t{1} << 20;
  unsigned snapshot_threshold = 1024;  // Raft entries between snapshots
  // After executing a cell, ask to become Raft leader (see ReplicaGate::Pump).
  bool lead_follows_executor = true;
  // A targeted executor that ran the previous cell runs the next one before its LEAD commits,
  // and commits the LEAD with the cell's effects (decision 0012): one round trip less per cell.
  // It first waits at most run_ahead_wait for its previous Done to be applied here, else it
  // takes the LEAD round as before. Off by default: a cell then also starts when no majority is
  // reachable, and is answered only when its commit times out, as run but not replicated.
  bool run_ahead = false;
  std::chrono::milliseconds run_ahead_wait{1000};
  // How long a membership change may take (a new replica's catch-up included).
  std::chrono::milliseconds membership_timeout{90000};
  // Makes this process's proposal ids unique across restarts (see ProposalIds). Empty: Start
  // draws a random one (NewUuid); tests may fix it.
  std::string proposal_nonce;
  // Blob key of a checkpoint (SaveCheckpoint) of a suspended kernel: the state this member starts
  // from, under whatever its own log then applies (a Raft snapshot of its own replaces it). All
  // members of a new group start from the same one.
  std::string restore_from;
  // The kernel's connection key. Raft connections and forwarded requests between this kernel's
  // replicas prove it (replication::PeerKeyFrom); anything else that reaches their ports is
  // refused, counted and logged. Empty: neither is checked.
  std::string connection_key;
};

class ReplicaGate final : public ExecutionGate, private KernelStateMachine::Listener {
 public:
  static Result<std::unique_ptr<ReplicaGate>> Start(const ReplicaOptions& options);
  // Runs Start on a thread of its own and returns at once, so that the Raft node's start (mostly
  // waiting on the disk: C-Raft probes its data directory) overlaps the Python engine's. Each
  // method of the returned gate first waits for that start; if it failed, the process writes
  // why to stderr and exits with status 1 (no cell has run yet: Attach comes first). Call it
  // with SIGINT blocked, as Start: the gate's threads inherit the mask.
  static std::unique_ptr<ExecutionGate> StartInBackground(const ReplicaOptions& options);
  ~ReplicaGate() override;

  void Attach(PythonEngine* engine) override;
  Result<Decision> Elect(const jupyter::Message& request) override;
  Status Commit(const Decision& decision, const jupyter::Message& request,
                const std::string& reply_content) override;
  Result<std::string> Follow(const Decision& decision) override;
  void Pump() override;
  bool Cancel(const std::string& exec_id, const std::string& reason, bool decide_in_log)
      EXCLUDES(mu_) override;
  jupyter::Json ReplyMetadata(const Decision& decision) override;
  // Thread-safe: the replicated state, with every entry committed when it was called, stored in
  // the blob store. Unavailable when the commit index cannot be learnt (no majority) in time.
  Result<std::string> SaveCheckpoint() EXCLUDES(machine_mu_) override;
  Result<std::vector<std::string>> BlobRefs() EXCLUDES(machine_mu_, refs_mu_) override;
  // Adds (AddSpare, then promotion to voter after catch-up) or removes a member through the
  // leader; see ProposalRouter::AddMember and RemoveMember for idempotency and errors. Waits at
  // most ReplicaOptions::membership_timeout.
  Status ChangeMembership(const MembershipChange& change) override;
  RaftGroupView RaftGroup() override;
  // An entry that could not be applied (behind_why_), else names whose values could not be
  // rebuilt here (unrebuilt_why_, from the engine).
  std::string Divergence() override;

 private:
  struct Event {
    enum class Kind {
      kElected,
      kAllYielded,
      kCancelled,
      kSuperseded,
      kDelta,
      kSideEffect,
      kDone,
      kCheckpoint,
      kRestored
    };
    Kind kind;
    std::string exec_id;
    ReplicaId replica = 0;
    std::string payload;
    jupyter::Json meta;
    std::vector<JournalRecord> journal;
    // kCheckpoint: records covered; kRestored: records ever appended; kDone: Dones logged, this
    // one included.
    uint64_t count = 0;
  };

  explicit ReplicaGate(const ReplicaOptions& options);

  // KernelStateMachine::Listener, on the log's thread: queue for the engine's thread.
  void OnElected(const std::string& exec_id, ReplicaId winner) override;
  void OnAllYielded(const std::string& exec_id) override;
  void OnCancelled(const std::string& exec_id) override;
  void OnSuperseded(const std::string& exec_id) override;
  void OnDelta(const std::string& exec_id, ReplicaId executor, const std::string& payload) override;
  void OnSideEffect(const std::string& exec_id, const std::string& statement) override;
  void OnDone(const std::string& exec_id, ReplicaId executor, const jupyter::Json& meta) override;
  void OnBlobHint(const std::string& exec_id, ReplicaId executor,
                  const std::vector<std::string>& keys) override;
  void OnCheckpoint(uint64_t covers) override;
  void OnRestored(const std::string& checkpoint, const std::vector<JournalRecord>& journal,
                  uint64_t journal_total) override;
  // From machine_.Apply, so with machine_mu_ held.
  void OnDuplicateSkipped(const KernelEntry& entry) REQUIRES(machine_mu_) override;
  void Enqueue(Event event) EXCLUDES(mu_);

  // Engine's thread: applies queued events in log order.
  void ProcessEvents() EXCLUDES(mu_);
  void Process(Event& event);
  void ApplyRecord(const Event& event);  // a kDelta or kSideEffect
  // Forgets the prefetched blobs of hints logged before the `dones`-th Done.
  void DropUnusedHints(uint64_t dones) EXCLUDES(mu_);
  // Processes events until `done()` holds, `exec_id` is cancelled, or the timeout passes;
  // releases the GIL while waiting. Returns whether done() holds.
  template <typename Pred>
  bool WaitFor(Pred done, const std::string& exec_id, std::chrono::milliseconds timeout)
      EXCLUDES(mu_);
  // Encodes `entry` with the next proposal id; every retry of it re-sends the same bytes.
  std::string EncodeWithId(KernelEntry entry);
  // A LEAD's meta for a request's nbos metadata: its `cancels` (KernelStateMachine).
  static jupyter::Json LeadMeta(const jupyter::Json& nbos);
  Status Propose(KernelEntry entry);
  // After this replica proposed (or skipped) its LEAD or YIELD: waits for the log's outcome of
  // d->exec_id and sets d->executor and d->role from it (kNotKnown: told to cancel, and the log
  // did not decide in time). Unavailable when no outcome came within follow_timeout.
  Status AwaitOutcome(Decision* d);
  void LogLateOutcome(const std::string& exec_id) EXCLUDES(machine_mu_);
  // Proposes a CANCEL of `exec_id` on a thread of its own (see cancel_proposals_).
  void ProposeCancel(const std::string& exec_id) REQUIRES(mu_);
  // Whether `id` is in the Raft configuration this member knows (any role).
  bool IsMember(ReplicaId id);
  // Whether this replica, the request's target, runs execution `exec_id` before its LEAD
  // commits; sets run_ahead_ if so. `nbos` is the request's metadata.nbos.
  bool RunsAhead(const jupyter::Json& nbos, const std::string& exec_id);
  // After a ran-ahead cell's entries committed: Ok if its LEAD won, Aborted if it was overtaken.
  Status CheckRanAheadWon(const std::string& exec_id);
  // After this executor's Done committed: Ok once it is applied here, Unavailable if the log
  // superseded the execution first (see KernelStateMachine), Unavailable if that is not known
  // in time.
  Status CheckCounted(const std::string& exec_id);
  bool Superseded(const std::string& exec_id) const;
  void MaybeCheckpoint() EXCLUDES(machine_mu_);
  // After a cell whose effects could not be replicated (`why`): makes this namespace the
  // replicated state again (engine's thread). Returns `why`, saying whether that worked.
  Status ReturnToReplicatedState(const std::string& exec_id, const Status& why);
  // Rebuilds the namespace from the checkpoint and journal the log holds, at this point of the
  // log (engine's thread); last_restore_ says how it went.
  void RebuildFromLog() EXCLUDES(machine_mu_, mu_);
  // Before this replica runs a cell: if its namespace differs from the log's (Divergence), it
  // rebuilds it first, unless a rebuild that took long failed since (the answer must come at
  // once). Unavailable, saying why, when it still differs: a cell must not run on a namespace
  // that lacks an earlier cell's effects.
  Status CatchUp();
  void NoteUnrebuilt(const std::string& why);
  Status CommitNotRun(const Decision& decision, const std::string& reply_content);
  // A Done's "code" (the cell's source, for the other replicas' input history) and "reply" (the
  // execute reply their answers repeat; its user_expressions can be any size): over 1 MiB each
  // goes to the blob store and the Done keeps its key ("code_key", "reply_key").
  // FieldsFromStore puts them back.
  void SetLoggedFields(std::string code, const std::string& reply_content,
                       const jupyter::Json& reply, jupyter::Json* done_meta);
  void FieldsFromStore(jupyter::Json* done_meta);
  void Remember(std::map<std::string, jupyter::Json>* map, std::deque<std::string>* order,
                const std::string& exec_id, jupyter::Json value);

  ReplicaOptions options_;
  ProposalIds ids_;  // used by the engine's thread only
  std::unique_ptr<store::PrefetchingBlobStore> store_;
  // The log drives machine_ through `locked_`, so that SaveCheckpoint, from another thread,
  // reads a state between two entries.
  class LockedMachine final : public replication::StateMachine {
   public:
    explicit LockedMachine(ReplicaGate* gate) : gate_(gate) {}
    void Apply(std::string_view command) override;
    std::string Snapshot() override;
    Status Restore(std::string_view snapshot) override;

   private:
    ReplicaGate* gate_;
  };
  Mutex machine_mu_;  // taken before mu_, never after
  KernelStateMachine machine_ GUARDED_BY(machine_mu_);
  LockedMachine locked_{this};
  std::unique_ptr<replication::RaftNode> node_;
  std::unique_ptr<ProposalRouter> router_;
  // The store the engine writes through (in front of store_); null when hints are off.
  std::unique_ptr<BlobAnnouncer> announcer_;

  Mutex mu_;
  CondVar cv_;  // signalled when an event is queued or an execution cancelled
  std::deque<Event> events_ GUARDED_BY(mu_);
  std::set<std::string> cancelled_ GUARDED_BY(mu_);
  // CANCEL proposals of the control thread, each on a thread of its own (the log may take up to
  // propose_timeout to take one); the destructor waits for them before the router goes.
  ProposalIds cancel_ids_ GUARDED_BY(mu_);
  std::vector<std::future<void>> cancel_proposals_ GUARDED_BY(mu_);
  std::map<std::string, std::string> cancel_reasons_ GUARDED_BY(mu_);  // exec id -> why
  std::string started_ GUARDED_BY(mu_);  // the last execution begun here
  // Keys other executors hinted, prefetched for deltas to come, each with the number of Dones
  // the log had applied before the hint. Processing the n-th Done drops what the deltas before
  // it did not take (hints of an executor that failed, blobs this replica already had).
  std::deque<std::pair<uint64_t, std::vector<std::string>>> hinted_ GUARDED_BY(mu_);
  uint64_t dones_logged_ = 0;  // log's thread only
  std::atomic<uint64_t> hinted_keys_{0};
  // Raft connections and forwarded requests refused for not proving the kernel's key.
  std::atomic<uint64_t> peers_refused_{0};
  // The keys of the deltas and blob hints among the last RecentRefEntries() log entries applied
  // here, with the count of entries applied before each: a member that replays its log from its
  // last Raft snapshot, or a lagging one that the leader sends what it keeps after its own, may
  // still apply them after the journal dropped them, so BlobRefs names them too.
  Mutex refs_mu_;
  std::deque<std::pair<uint64_t, std::vector<std::string>>> recent_refs_ GUARDED_BY(refs_mu_);
  std::atomic<uint64_t> entries_applied_{0};
  void RememberRefs(std::vector<std::string> keys) EXCLUDES(refs_mu_);
  // Raft keeps snapshot_threshold entries between snapshots and snapshot_trailing behind one.
  uint64_t RecentRefEntries() const;
  void OnPeerRefused(const std::string& why);

  // Engine's thread only.
  PythonEngine* engine_ = nullptr;
  // exec_id -> winner (0: nobody), or "cancelled" (a CANCEL decided the election).
  std::map<std::string, jupyter::Json> outcomes_;
  std::deque<std::string> outcome_order_;
  std::map<std::string, jupyter::Json> done_;  // exec_id -> kDone meta
  std::deque<std::string> done_order_;
  std::set<std::string> executed_here_;  // by this process: its namespace already has the effects
  uint64_t journal_seen_ = 0;            // journal records this namespace reflects
  uint64_t since_checkpoint_ = 0;        // of those, after the last checkpoint
  bool want_leadership_ = false;         // executed cells here; ask for Raft leadership
  uint64_t executed_in_a_row_ = 0;       // cells executed here since another replica executed
  std::string checkpoint_after_;         // executed here, Done not yet applied here
  Status last_restore_;                  // of the last kRestored event
  // Why the namespace lacks effects the log holds (an entry it could not apply, a failed
  // rebuild); empty while it has them all.
  std::string behind_why_;
  std::string unrebuilt_why_;  // the engine's account of names it could not rebuild
  bool rebuild_tried_ = true;  // since the namespace last started to differ from the log's
  std::chrono::milliseconds last_rebuild_{0};                // how long the last rebuild took
  std::chrono::steady_clock::time_point last_rebuild_at_{};  // when it ended
  // Between rebuilds while idle (Pump): doubles after each that failed, from kIdleRebuildFirst.
  std::chrono::milliseconds idle_rebuild_every_{0};
  // The execution running ahead of its LEAD, and the journal records its namespace reflected.
  struct RunAhead {
    std::string exec_id;
    uint64_t ran_on = 0;
  };
  std::optional<RunAhead> run_ahead_;
};

}  // namespace nbos::replica
