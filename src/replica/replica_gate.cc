#include "replica/replica_gate.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <mutex>  // std::call_once
#include <thread>

#include "common/ids.h"
#include "replica/python_engine.h"
#include "replication/peer_auth.h"
#include "store/blob_refs.h"

namespace nbos::replica {

namespace {
using jupyter::Json;
using namespace std::chrono_literals;

// Outcomes and completions remembered for late or repeated requests.
constexpr size_t kRemembered = 4096;
// A larger cell source or execute reply goes to the blob store, not into the log: libraft 0.15
// took 19 s to commit a 40 MB Done and never committed a 60 MB one (the gateway takes messages up
// to 64 MB).
constexpr size_t kLoggedFieldMaxBytes = 1u << 20;
// A checkpoint also once the journal since the last one holds this much: the Raft snapshot (and
// what a replica that catches up is sent) is the checkpoint plus that journal, and deltas of up
// to 4 MiB each (nbos_state's payload_threshold) would otherwise make it hundreds of MB.
constexpr size_t kCheckpointAfterJournalBytes = 16u << 20;
// A rebuild that failed within this long is tried again before a cell is refused, and while
// idle after kIdleRebuildFirst, then twice as long after each one that failed, up to
// kIdleRebuildMax.
constexpr std::chrono::milliseconds kQuickRebuild{1000};
constexpr std::chrono::milliseconds kIdleRebuildFirst{2000};
constexpr std::chrono::milliseconds kIdleRebuildMax{60000};
constexpr std::chrono::milliseconds kOutcomeLateAfter{5000};
// The outcome of an election a CANCEL decided (ReplicaGate::outcomes_).
constexpr std::string_view kCancelledOutcome = "cancelled";
// How long a standby told to cancel waits for the log to decide: a CANCEL commits within a round
// trip while a majority answers; without one, the answer is "not known" at once.
constexpr std::chrono::milliseconds kCancelDecisionWait{1500};

unsigned RaftTrailing(unsigned snapshot_threshold) {
  return std::min(128u, snapshot_threshold / 2);
}

// The winner an outcome names (0: nobody, also for a cancelled election).
ReplicaId WinnerOf(const Json& outcome) {
  return outcome.is_number_unsigned() ? outcome.get<ReplicaId>() : 0;
}

// A ReplicaGate whose start runs on another thread until the first call needs it.
class BackgroundStartedGate final : public ExecutionGate {
 public:
  explicit BackgroundStartedGate(const ReplicaOptions& options)
      : starting_(
            std::async(std::launch::async, [options] { return ReplicaGate::Start(options); })) {}

  void Attach(PythonEngine* engine) override { Gate().Attach(engine); }
  Result<std::string> SaveCheckpoint() override { return Gate().SaveCheckpoint(); }
  Result<std::vector<std::string>> BlobRefs() override { return Gate().BlobRefs(); }
  Result<Decision> Elect(const jupyter::Message& request) override { return Gate().Elect(request); }
  Status Commit(const Decision& decision, const jupyter::Message& request,
                const std::string& reply_content) override {
    return Gate().Commit(decision, request, reply_content);
  }
  Result<std::string> Follow(const Decision& decision) override { return Gate().Follow(decision); }
  void Pump() override { Gate().Pump(); }
  bool Cancel(const std::string& exec_id, const std::string& reason, bool decide_in_log) override {
    return Gate().Cancel(exec_id, reason, decide_in_log);
  }
  Json ReplyMetadata(const Decision& decision) override { return Gate().ReplyMetadata(decision); }
  std::string Divergence() override { return Gate().Divergence(); }
  Status ChangeMembership(const MembershipChange& change) override {
    return Gate().ChangeMembership(change);
  }
  RaftGroupView RaftGroup() override { return Gate().RaftGroup(); }

 private:
  ReplicaGate& Gate() {
    std::call_once(started_, [this] {
      Result<std::unique_ptr<ReplicaGate>> gate = starting_.get();
      if (!gate.ok()) {
        spdlog::critical("{}", gate.status().ToString());
        spdlog::default_logger()->flush();
        std::_Exit(1);
      }
      gate_ = std::move(*gate);
    });
    return *gate_;
  }

  std::future<Result<std::unique_ptr<ReplicaGate>>> starting_;
  std::once_flag started_;
  std::unique_ptr<ReplicaGate> gate_;  // set once by Gate()
};
}  // namespace

std::unique_ptr<ExecutionGate> ReplicaGate::StartInBackground(const ReplicaOptions& options) {
  return std::make_unique<BackgroundStartedGate>(options);
}

ReplicaGate::ReplicaGate(const ReplicaOptions& options)
    : options_(options),
      ids_(options.replica_id, options.proposal_nonce),
      machine_(options.replicas, this),
      cancel_ids_(options.replica_id, options.proposal_nonce + "-cancel") {}

Result<std::unique_ptr<ReplicaGate>> ReplicaGate::Start(const ReplicaOptions& options) {
  ReplicaOptions with_nonce = options;
  if (with_nonce.proposal_nonce.empty()) with_nonce.proposal_nonce = NewUuid();
  std::unique_ptr<ReplicaGate> gate(new ReplicaGate(with_nonce));
  auto store = store::OpenBlobStore(options.blob_store_url);
  if (!store.ok()) return store.status();
  gate->store_ =
      std::make_unique<store::PrefetchingBlobStore>(std::move(*store), options.prefetch_bytes);
  if (!options.restore_from.empty()) {
    auto checkpoint = gate->store_->Get(options.restore_from);
    if (!checkpoint.ok()) {
      return Unavailable("reading the checkpoint to restore (" + options.restore_from +
                         "): " + checkpoint.status().message());
    }
    MutexLock lock(&gate->machine_mu_);  // uncontended: the log has not started
    if (Status s = gate->machine_.Restore(*checkpoint); !s.ok()) {
      return InvalidArgument("checkpoint " + options.restore_from + ": " + s.message());
    }
    spdlog::info("starting from checkpoint {} ({} bytes)", options.restore_from,
                 checkpoint->size());
  }
  replication::RaftNodeOptions raft;
  raft.id = options.replica_id;
  raft.address = options.raft_address;
  raft.data_dir = options.data_dir;
  raft.bootstrap = options.peers;
  raft.snapshot_threshold = options.snapshot_threshold;
  raft.snapshot_trailing = RaftTrailing(options.snapshot_threshold);
  // Lets bench/replication_bench.py measure followers without the nudge in the same build.
  raft.nudge_followers = std::getenv("NBOS_RAFT_NO_NUDGE") == nullptr;
  ReplicaGate* g = gate.get();
  raft.peer_key = replication::PeerKeyFrom(options.connection_key);
  raft.on_refused_peer = [g](const std::string& why) { g->OnPeerRefused(why); };
  auto node = replication::RaftNode::Start(raft, &gate->locked_);
  if (!node.ok()) return node.status();
  gate->node_ = std::move(*node);
  ProposalRouterOptions router_options;
  router_options.peer_key = raft.peer_key;
  router_options.on_refused = raft.on_refused_peer;
  auto router = ProposalRouter::Start(gate->node_.get(), options.raft_address, router_options);
  if (!router.ok()) return router.status();
  gate->router_ = std::move(*router);
  if (options.blob_hints && options.blob_hint_min_bytes > 0) {
    ProposalRouter* r = gate->router_.get();
    // Short: a hint late by more than a few heartbeats is worth less than the delta behind it.
    gate->announcer_ =
        std::make_unique<BlobAnnouncer>(gate->store_.get(), options.replica_id,
                                        options.blob_hint_min_bytes, [r](std::string entry) {
                                          auto committed = r->Propose(std::move(entry), 2s);
                                          return committed.ok() ? Status::Ok() : committed.status();
                                        });
  }
  return gate;
}

// Something that reaches a replica's ports without the key is another user's process or a
// misconfiguration: worth a warning, but not one per connection attempt (C-Raft retries every
// 10 ms), so the 1st, 2nd, 4th, 8th... are logged, each with the count.
void ReplicaGate::OnPeerRefused(const std::string& why) {
  const uint64_t n = ++peers_refused_;
  if ((n & (n - 1)) == 0) spdlog::warn("{} ({} refused so far)", why, n);
}

ReplicaGate::~ReplicaGate() {
  std::vector<std::future<void>> cancels;
  {
    MutexLock lock(&mu_);
    cancels.swap(cancel_proposals_);
  }
  for (auto& c : cancels) c.wait();  // they propose through router_
  announcer_.reset();                // proposes through router_
  router_.reset();
  if (node_) node_->Close();  // no more listener calls after this
}

void ReplicaGate::LockedMachine::Apply(std::string_view command) {
  MutexLock lock(&gate_->machine_mu_);
  ++gate_->entries_applied_;
  gate_->machine_.Apply(command);
}

std::string ReplicaGate::LockedMachine::Snapshot() {
  MutexLock lock(&gate_->machine_mu_);
  return gate_->machine_.Snapshot();
}

Status ReplicaGate::LockedMachine::Restore(std::string_view snapshot) {
  MutexLock lock(&gate_->machine_mu_);
  return gate_->machine_.Restore(snapshot);
}

uint64_t ReplicaGate::RecentRefEntries() const {
  return options_.snapshot_threshold + RaftTrailing(options_.snapshot_threshold);
}

void ReplicaGate::RememberRefs(std::vector<std::string> keys) {
  const uint64_t applied = entries_applied_.load();
  MutexLock lock(&refs_mu_);
  if (!keys.empty()) recent_refs_.emplace_back(applied, std::move(keys));
  while (!recent_refs_.empty() && recent_refs_.front().first + RecentRefEntries() < applied) {
    recent_refs_.pop_front();
  }
}

Result<std::vector<std::string>> ReplicaGate::BlobRefs() {
  std::set<std::string> keys;
  {
    MutexLock lock(&machine_mu_);
    store::AddBlobKeysIn(machine_.checkpoint(), &keys);
    for (const JournalRecord& r : machine_.journal()) store::AddBlobKeysIn(r.payload, &keys);
  }
  {
    MutexLock lock(&refs_mu_);
    const uint64_t applied = entries_applied_.load();
    for (const auto& [applied_before, entry] : recent_refs_) {
      if (applied_before + RecentRefEntries() >= applied) keys.insert(entry.begin(), entry.end());
    }
  }
  return std::vector<std::string>(keys.begin(), keys.end());
}

// A member behind the log would checkpoint an older state, and the kernel resumed from it would
// lack the cells it had not applied: it first learns the commit index, by committing an entry that
// changes nothing (a blob hint without keys) through the leader, and applies the log up to it.
Result<std::string> ReplicaGate::SaveCheckpoint() {
  auto index = router_->Propose(EncodeKernelEntry({KernelEntry::Type::kBlobHint, "",
                                                   options_.replica_id, Json::object(), ""}),
                                options_.propose_timeout);
  if (!index.ok()) {
    return Unavailable("this replica cannot tell whether it applied every committed cell: " +
                       index.status().message());
  }
  const auto deadline = std::chrono::steady_clock::now() + options_.propose_timeout;
  while (node_->LastApplied() < *index) {
    if (std::chrono::steady_clock::now() > deadline) {
      return Unavailable("this replica did not apply the committed cells in time");
    }
    std::this_thread::sleep_for(5ms);
  }
  std::string state;
  {
    MutexLock lock(&machine_mu_);
    state = machine_.Snapshot();
  }
  return store_->Put(state);
}

void ReplicaGate::Attach(PythonEngine* engine) {
  engine_ = engine;
  store::BlobStore* store =
      announcer_ ? static_cast<store::BlobStore*>(announcer_.get()) : store_.get();
  Status s = engine_->EnableReplication(store, options_.replica_id);
  if (!s.ok()) spdlog::error("replication disabled: {}", s.ToString());
  ProcessEvents();  // whatever the log replayed at start-up
}

void ReplicaGate::Enqueue(Event event) {
  {
    MutexLock lock(&mu_);
    events_.push_back(std::move(event));
  }
  cv_.SignalAll();
}

void ReplicaGate::OnElected(const std::string& exec_id, ReplicaId winner) {
  Enqueue({Event::Kind::kElected, exec_id, winner, {}, {}, {}});
}
void ReplicaGate::OnAllYielded(const std::string& exec_id) {
  Enqueue({Event::Kind::kAllYielded, exec_id, 0, {}, {}, {}});
}
void ReplicaGate::OnCancelled(const std::string& exec_id) {
  Enqueue({Event::Kind::kCancelled, exec_id, 0, {}, {}, {}});
}
void ReplicaGate::OnSuperseded(const std::string& exec_id) {
  Enqueue({Event::Kind::kSuperseded, exec_id, 0, {}, {}, {}});
}
void ReplicaGate::OnDelta(const std::string& exec_id, ReplicaId executor,
                          const std::string& payload) {
  // Start downloading while the delta waits its turn, so applying it (or taking over after a
  // failover) does not wait on the store.
  std::vector<std::string> keys = store::BlobKeysOfContainer(payload);
  if (executor != options_.replica_id && !keys.empty()) {
    spdlog::info("execution {}: prefetching {} blobs", exec_id, keys.size());
    store_->Prefetch(keys);
  }
  RememberRefs(std::move(keys));
  Enqueue({Event::Kind::kDelta, exec_id, executor, payload, {}, {}});
}
void ReplicaGate::OnBlobHint(const std::string& exec_id, ReplicaId executor,
                             const std::vector<std::string>& keys) {
  RememberRefs(keys);
  if (executor == options_.replica_id || keys.empty()) return;
  spdlog::debug("execution {}: prefetching {} hinted blobs", exec_id, keys.size());
  store_->Prefetch(keys);
  hinted_keys_ += keys.size();
  MutexLock lock(&mu_);
  hinted_.emplace_back(dones_logged_, keys);
}
void ReplicaGate::OnSideEffect(const std::string& exec_id, const std::string& statement) {
  Enqueue({Event::Kind::kSideEffect, exec_id, 0, statement, {}, {}});
}
void ReplicaGate::OnDone(const std::string& exec_id, ReplicaId executor, const Json& meta) {
  Enqueue({Event::Kind::kDone, exec_id, executor, {}, meta, {}, ++dones_logged_});
}
void ReplicaGate::OnCheckpoint(uint64_t covers) {
  Enqueue({Event::Kind::kCheckpoint, "", 0, {}, {}, {}, covers});
}
void ReplicaGate::OnRestored(const std::string& checkpoint,
                             const std::vector<JournalRecord>& journal, uint64_t journal_total) {
  Enqueue({Event::Kind::kRestored, "", 0, checkpoint, {}, journal, journal_total});
}

void ReplicaGate::OnDuplicateSkipped(const KernelEntry& entry) {
  spdlog::debug("execution {}: skipped a second commit of proposal {} (type {}, {} skipped)",
                entry.exec_id, entry.id, static_cast<int>(entry.type),
                machine_.duplicates_skipped());
}

void ReplicaGate::Remember(std::map<std::string, Json>* map, std::deque<std::string>* order,
                           const std::string& exec_id, Json value) {
  if (map->insert_or_assign(exec_id, std::move(value)).second) {
    order->push_back(exec_id);
    if (order->size() > kRemembered) {
      map->erase(order->front());
      order->pop_front();
    }
  }
}

void ReplicaGate::Process(Event& e) {
  switch (e.kind) {
    case Event::Kind::kElected:
      Remember(&outcomes_, &outcome_order_, e.exec_id, Json(e.replica));
      return;
    case Event::Kind::kAllYielded:
      Remember(&outcomes_, &outcome_order_, e.exec_id, Json(0));
      return;
    case Event::Kind::kCancelled:
      Remember(&outcomes_, &outcome_order_, e.exec_id, Json(kCancelledOutcome));
      return;
    case Event::Kind::kSuperseded:
      // Its Done will not count: whoever waits for it stops waiting.
      Remember(&done_, &done_order_, e.exec_id, Json{{"superseded", true}});
      return;
    case Event::Kind::kCheckpoint:
      since_checkpoint_ = journal_seen_ - std::min(journal_seen_, e.count);
      return;
    case Event::Kind::kDelta:
    case Event::Kind::kSideEffect:
      ApplyRecord(e);
      return;
    case Event::Kind::kDone:
      FieldsFromStore(&e.meta);  // the executor too: it answers repeated requests from done_
      if (executed_here_.count(e.exec_id) == 0) {
        executed_in_a_row_ = 0;
        if (Status s = engine_->FinishStandby(e.meta); !s.ok()) {
          spdlog::error("execution {}: {}", e.exec_id, s.ToString());
        }
      }
      Remember(&done_, &done_order_, e.exec_id, e.meta);
      DropUnusedHints(e.count);
      // A checkpoint must cover exactly the records this namespace reflects, so it is taken
      // only once the executor's own records have been counted.
      if (e.exec_id == checkpoint_after_) {
        checkpoint_after_.clear();
        MaybeCheckpoint();
      }
      return;
    case Event::Kind::kRestored: {
      std::vector<std::pair<bool, std::string>> records;
      for (const auto& r : e.journal) {
        records.emplace_back(r.type == KernelEntry::Type::kDelta, r.payload);
      }
      executed_here_.clear();
      journal_seen_ = e.count;
      since_checkpoint_ = records.size();
      spdlog::info(
          "restoring the namespace from a snapshot: checkpoint of {} bytes, {} journal "
          "records",
          e.payload.size(), records.size());
      auto unrebuilt = engine_->Restore(e.payload, records);
      last_restore_ = unrebuilt.status();
      behind_why_ = last_restore_.message();
      if (!last_restore_.ok()) {
        spdlog::error("restoring the namespace from a snapshot: {}", last_restore_.ToString());
      }
      NoteUnrebuilt(unrebuilt.ok() ? *unrebuilt : "");
      return;
    }
  }
}

void ReplicaGate::ApplyRecord(const Event& e) {
  // The executor's namespace already holds its own effects; every other replica (and the
  // executor itself after a restart, which starts from an empty namespace) applies them.
  ++journal_seen_;
  ++since_checkpoint_;
  if (executed_here_.count(e.exec_id) > 0) return;
  const auto start = std::chrono::steady_clock::now();
  Status s;
  if (e.kind == Event::Kind::kDelta) {
    auto unrebuilt = engine_->ApplyDelta(e.payload);
    s = unrebuilt.status();
    if (unrebuilt.ok()) NoteUnrebuilt(*unrebuilt);
  } else {
    s = engine_->ApplySideEffects(e.payload);
  }
  if (!s.ok()) {
    spdlog::error("execution {}: {}; this replica rebuilds its namespace", e.exec_id, s.ToString());
    if (behind_why_.empty()) behind_why_ = s.message();
    rebuild_tried_ = false;
  }
  spdlog::debug(
      "execution {}: applied {} in {:.1f} ms", e.exec_id,
      e.kind == Event::Kind::kDelta ? "delta" : "side effects",
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
}

void ReplicaGate::DropUnusedHints(uint64_t dones) {
  std::vector<std::string> unused;
  {
    MutexLock lock(&mu_);
    while (!hinted_.empty() && hinted_.front().first < dones) {
      for (std::string& k : hinted_.front().second) unused.push_back(std::move(k));
      hinted_.pop_front();
    }
  }
  if (!unused.empty()) store_->Forget(unused);
}

void ReplicaGate::ProcessEvents() {
  if (engine_ == nullptr) return;
  for (;;) {
    Event e;
    {
      MutexLock lock(&mu_);
      if (events_.empty()) return;
      e = std::move(events_.front());
      events_.pop_front();
    }
    Process(e);
  }
}

void ReplicaGate::NoteUnrebuilt(const std::string& why) {
  if (why == unrebuilt_why_) return;
  if (!why.empty()) spdlog::error("this replica cannot follow the log: {}", why);
  unrebuilt_why_ = why;
  rebuild_tried_ = false;
}

std::string ReplicaGate::Divergence() {
  if (!behind_why_.empty()) return "it could not apply an earlier cell's effects: " + behind_why_;
  return unrebuilt_why_;
}

void ReplicaGate::Pump() {
  ProcessEvents();
  // Rebuilds from the log after a failure to follow, while idle: at once, then again while the
  // rebuilds fail quickly. A failure that passes (the blob store was unreachable or restarting)
  // heals here, before the gateway replaces the replica (a replacement would need the same
  // store), and a cell routed to this replica is answered at once instead of waiting for a
  // rebuild that fails the same way.
  if (!Divergence().empty() && !rebuild_tried_) {
    idle_rebuild_every_ = kIdleRebuildFirst;
    RebuildFromLog();
  } else if (!Divergence().empty() && last_rebuild_ <= kQuickRebuild &&
             std::chrono::steady_clock::now() - last_rebuild_at_ >=
                 std::max(idle_rebuild_every_, kIdleRebuildFirst)) {
    idle_rebuild_every_ = std::clamp(2 * idle_rebuild_every_, kIdleRebuildFirst, kIdleRebuildMax);
    spdlog::warn("this replica's namespace differs from the log's ({}); rebuilding it",
                 Divergence());
    RebuildFromLog();
  }
  if (want_leadership_) {
    // The executor of the last cell is likely the next one (the scheduler keeps executors
    // sticky): as Raft leader its elections and commits skip the forwarding hop and the wait
    // for the leader's next message. Done while idle, after the reply went out.
    want_leadership_ = false;
    if (Status s = router_->RequestLeadership(options_.replica_id, 500ms); !s.ok()) {
      spdlog::debug("leadership not handed over: {}", s.ToString());
    }
  }
}

template <typename Pred>
bool ReplicaGate::WaitFor(Pred done, const std::string& exec_id,
                          std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    ProcessEvents();
    if (done()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    PythonEngine::Unlocked nogil;
    MutexLock lock(&mu_);
    if (cancelled_.count(exec_id) > 0) return false;
    const auto until = std::min(deadline, std::chrono::steady_clock::now() + 100ms);
    while (events_.empty() && cancelled_.count(exec_id) == 0 && cv_.WaitUntil(&mu_, until)) {
    }
  }
}

std::string ReplicaGate::EncodeWithId(KernelEntry entry) {
  entry.id = ids_.Next();
  return EncodeKernelEntry(entry);
}

Status ReplicaGate::Propose(KernelEntry entry) {
  auto r = router_->Propose(EncodeWithId(std::move(entry)), options_.propose_timeout);
  return r.ok() ? Status::Ok() : r.status();
}

bool ReplicaGate::IsMember(ReplicaId id) {
  if (id == 0) return false;
  for (const replication::Member& m : node_->Members())
    if (m.id == id) return true;
  return false;
}

// The gateway's list of executions it gave up on, which this LEAD cancels if it wins.
Json ReplicaGate::LeadMeta(const Json& nbos) {
  Json meta = Json::object();
  if (nbos.is_object() && nbos.contains("cancels") && nbos["cancels"].is_array())
    meta["cancels"] = nbos["cancels"];
  return meta;
}

Result<ExecutionGate::Decision> ReplicaGate::Elect(const jupyter::Message& request) {
  const Json nbos = request.metadata.value("nbos", Json::object());
  Decision d;
  d.exec_id = nbos.is_object() && nbos.value("exec_id", Json()).is_string()
                  ? nbos["exec_id"].get<std::string>()
                  : request.msg_id();
  bool lead = true;
  ReplicaId target = 0;
  if (nbos.is_object() && nbos.contains("target_replica")) {
    // An operator or the scheduler chose the executor; everyone else steps aside.
    if (nbos["target_replica"].is_number_unsigned()) target = nbos["target_replica"];
    lead = target == options_.replica_id;
  }
  if (target == options_.replica_id && RunsAhead(nbos, d.exec_id)) {
    d.executor = options_.replica_id;
    MutexLock lock(&mu_);
    if (cancelled_.count(d.exec_id) > 0) {
      run_ahead_.reset();
      d.role = Role::kCancelled;
      return d;
    }
    d.role = Role::kExecute;
    started_ = d.exec_id;
    if (announcer_) announcer_->Open(d.exec_id);
    return d;
  }
  // A YIELD decides nothing while a member was targeted: only its LEAD ends the election (or
  // a cancel, if it is gone), so the others wait without adding two entries to every cell's
  // round. A target that is no member gets the YIELDs that fail the election.
  Status s;
  if (lead || !IsMember(target)) {
    KernelEntry proposal{lead ? KernelEntry::Type::kLead : KernelEntry::Type::kYield, d.exec_id,
                         options_.replica_id, lead ? LeadMeta(nbos) : Json::object(), ""};
    s = Propose(std::move(proposal));
  }
  if (s.ok()) s = AwaitOutcome(&d);
  if (!s.ok()) {
    // The chosen executor answers without running the cell, and this request is then done: it
    // never runs it. Any other replica cannot tell whether the executor did.
    if (target != options_.replica_id) return s;
    d.role = Role::kNotRun;
    d.executor = options_.replica_id;
    d.refused = s;
    return d;
  }
  if (d.role == Role::kExecute) {
    // A replica whose namespace lacks the log's state must not run the cell: it answers at once
    // and tells the standbys through the log (Commit).
    if (d.refused = CatchUp(); !d.refused.ok()) return d;
    MutexLock lock(&mu_);
    // Told to cancel before it began: only this replica could run the cell (its LEAD won), and
    // now it never will.
    if (cancelled_.count(d.exec_id) > 0) {
      d.role = Role::kCancelled;
      return d;
    }
    started_ = d.exec_id;
    if (announcer_) announcer_->Open(d.exec_id);
  }
  return d;
}

Status ReplicaGate::AwaitOutcome(Decision* d) {
  const auto outcome_known = [&] { return outcomes_.count(d->exec_id) > 0; };
  // An outcome is normally a round trip away; one that is late says what this member's log
  // holds, for whoever must tell a lagging member from a lost election.
  const auto first_wait = std::min(options_.follow_timeout, kOutcomeLateAfter);
  bool decided = WaitFor(outcome_known, d->exec_id, first_wait);
  if (!decided) {
    LogLateOutcome(d->exec_id);
    decided = WaitFor(outcome_known, d->exec_id, options_.follow_timeout - first_wait);
  }
  bool cancelled_here = false;
  {
    MutexLock lock(&mu_);
    cancelled_here = cancelled_.count(d->exec_id) > 0;
  }
  // Told to stop waiting: the CANCEL proposed with it decides within a round trip while a
  // majority answers; until the log decides, nobody can say whether the cell runs.
  if (!decided && cancelled_here) decided = WaitFor(outcome_known, "", kCancelDecisionWait);
  if (!decided) {
    if (!cancelled_here) {
      return Unavailable("no election outcome for execution " + d->exec_id + " in time");
    }
    d->role = Role::kNotKnown;
    return Status::Ok();
  }
  const Json& outcome = outcomes_.at(d->exec_id);
  d->executor = WinnerOf(outcome);
  d->role = outcome == kCancelledOutcome         ? Role::kCancelled
            : d->executor == 0                   ? Role::kNobody
            : d->executor == options_.replica_id ? Role::kExecute
                                                 : Role::kStandby;
  return Status::Ok();
}

void ReplicaGate::LogLateOutcome(const std::string& exec_id) {
  std::string members;
  for (const replication::Member& m : node_->Members()) members += fmt::format(" {}", m.id);
  uint64_t duplicates = 0, losers = 0;
  {
    MutexLock lock(&machine_mu_);
    duplicates = machine_.duplicates_skipped();
    losers = machine_.losers_skipped();
  }
  spdlog::warn(
      "execution {}: no election outcome after {} ms; applied index {}, leader {}, members{}, "
      "{} duplicate and {} losing entries skipped",
      exec_id, kOutcomeLateAfter.count(), node_->LastApplied(), node_->Leader().id, members,
      duplicates, losers);
}

// Running ahead skips the LEAD's round trip before the cell (decision 0012). It is safe whatever
// happened meanwhile, because the LEAD that follows the cell names the namespace it ran on and
// loses if the log holds other effects by then. The gateway's previous_exec_id (the cell it last
// had answered, with nothing abandoned since) keeps that from happening in the normal course: the
// previous cell ran here, and once its own Done is applied here, no other cell's effects are due.
bool ReplicaGate::RunsAhead(const Json& nbos, const std::string& exec_id) {
  run_ahead_.reset();
  const Json previous = nbos.value("previous_exec_id", Json());
  if (!options_.run_ahead || !previous.is_string() || !Divergence().empty() ||
      executed_here_.count(previous.get<std::string>()) == 0 || outcomes_.count(exec_id) > 0) {
    return false;
  }
  // A follower executor learns that its own last Done committed one message after the leader.
  const std::string& prev = previous.get_ref<const std::string&>();
  if (!WaitFor([&] { return done_.count(prev) > 0; }, exec_id, options_.run_ahead_wait) ||
      outcomes_.count(exec_id) > 0 || !Divergence().empty() || !IsMember(options_.replica_id)) {
    return false;
  }
  run_ahead_ = RunAhead{exec_id, journal_seen_};
  return true;
}

Status ReplicaGate::CatchUp() {
  if (Divergence().empty()) return Status::Ok();
  // Again at a cell even after a failed rebuild, when that took little time: what failed may
  // have passed (the blob store is back), and the answer still comes at once.
  if (!rebuild_tried_ || last_rebuild_ <= kQuickRebuild) {
    spdlog::warn("this replica's namespace differs from the log's ({}); rebuilding it",
                 Divergence());
    RebuildFromLog();
    if (Divergence().empty()) return Status::Ok();
  }
  return Unavailable(fmt::format(
      "replica {} cannot run cells: {}. The cell did not run; nbos replaces this replica (run "
      "the cell again)",
      options_.replica_id, Divergence()));
}

Status ReplicaGate::Commit(const Decision& decision, const jupyter::Message& request,
                           const std::string& reply_content) {
  if (!decision.refused.ok()) return CommitNotRun(decision, reply_content);
  executed_here_.insert(decision.exec_id);
  if (announcer_) announcer_->Close();  // its hints are in the log before the delta
  // Delta, side effects and Done go out together: one round trip to the leader.
  std::vector<std::string> entries;
  const bool ran_ahead = run_ahead_ && run_ahead_->exec_id == decision.exec_id;
  if (ran_ahead) {
    Json meta = LeadMeta(request.metadata.value("nbos", Json::object()));
    meta["ran_on"] = run_ahead_->ran_on;
    entries.push_back(EncodeWithId(
        {KernelEntry::Type::kLead, decision.exec_id, options_.replica_id, std::move(meta), ""}));
  }
  run_ahead_.reset();
  auto delta = engine_->TakeDelta();
  // The delta was made while the cell ran (a store failing then puts its data inline), so this
  // fails only on an engine error. A rebuild of the namespace would most likely fail the same
  // way: this replica keeps the cell's effects instead (they are not in the log, so it is ahead
  // of the others until it is replaced or restarted).
  if (!delta.ok()) return delta.status();
  if (!delta->empty()) {
    entries.push_back(EncodeWithId({KernelEntry::Type::kDelta, decision.exec_id,
                                    options_.replica_id, Json::object(), std::move(*delta)}));
  }
  auto side_effects = engine_->TakeSideEffects();
  if (!side_effects.ok()) return side_effects.status();
  if (!side_effects->empty()) {
    entries.push_back(
        EncodeWithId({KernelEntry::Type::kSideEffect, decision.exec_id, options_.replica_id,
                      Json::object(), std::move(*side_effects)}));
  }
  Json reply = Json::parse(reply_content, nullptr, false);
  const bool silent = request.content.value("silent", false);
  Json meta{{"execution_count", reply.is_object() ? reply.value("execution_count", 0) : 0},
            {"store_history", request.content.value("store_history", !silent)}};
  SetLoggedFields(request.content.value("code", ""), reply_content, reply, &meta);
  entries.push_back(EncodeWithId(
      {KernelEntry::Type::kDone, decision.exec_id, options_.replica_id, std::move(meta), ""}));
  auto committed = router_->ProposeAll(std::move(entries), options_.propose_timeout);
  if (!committed.ok()) {
    // A proposal is at least once: the entries may still commit, so the answer cannot say the
    // effects are lost.
    return ReturnToReplicatedState(
        decision.exec_id,
        {committed.status().code(),
         committed.status().message() +
             "; whether the cell's effects still reach the kernel's log (and then every "
             "replica) is not known: look at the kernel's state before running it again"});
  }
  if (ran_ahead) {
    if (Status s = CheckRanAheadWon(decision.exec_id); !s.ok())
      return ReturnToReplicatedState(decision.exec_id, s);
  }
  // The records are counted when they arrive, and a checkpoint waits for that (see kDone).
  checkpoint_after_ = decision.exec_id;
  if (Status s = CheckCounted(decision.exec_id); !s.ok()) {
    checkpoint_after_.clear();
    return ReturnToReplicatedState(decision.exec_id, s);
  }
  // Only a repeat executor asks: when executors alternate, moving leadership every cell would
  // cost an election each time.
  want_leadership_ = options_.lead_follows_executor && ++executed_in_a_row_ >= 2;
  ProcessEvents();
  return Status::Ok();
}

// A Done without effects: the standbys answer with `reply_content` at once instead of waiting for
// effects that will not come, and nobody's history or execution count moves.
Status ReplicaGate::CommitNotRun(const Decision& decision, const std::string& reply_content) {
  Json meta{{"execution_count", 0}, {"store_history", false}};
  SetLoggedFields("", reply_content, Json::parse(reply_content, nullptr, false), &meta);
  return Propose(
      {KernelEntry::Type::kDone, decision.exec_id, options_.replica_id, std::move(meta), ""});
}

// ProposeAll returns once the leader applied the entries; the leader is usually this replica
// (lead_follows_executor), and a follower learns of the commit with the leader's next message.
// Only then is it known that they count: an executor cut off while the others went on commits
// its effects after later cells', and the log skips them.
Status ReplicaGate::CheckCounted(const std::string& exec_id) {
  if (!WaitFor([&] { return done_.count(exec_id) > 0; }, "", options_.propose_timeout)) {
    return Unavailable(
        "the cell's effects were committed, but whether they count did not reach this replica "
        "in time; whether they are in the kernel's state is not known");
  }
  if (!Superseded(exec_id)) return Status::Ok();
  return Unavailable(
      "a later cell began on the other replicas before they reached the log (this replica was "
      "cut off from them), so they were discarded on every replica and the kernel's state is "
      "as if this cell had not run; whether what it did outside the kernel (files, output) "
      "happened is not known");
}

bool ReplicaGate::Superseded(const std::string& exec_id) const {
  auto it = done_.find(exec_id);
  return it != done_.end() && it->second.value("superseded", false);
}

// The LEAD committed with the cell's effects decides whether they count: a follower learns of
// the commit a message after the leader, which already applied it.
Status ReplicaGate::CheckRanAheadWon(const std::string& exec_id) {
  // Not cancellable: the entries are committed, the outcome is on its way.
  if (!WaitFor([&] { return outcomes_.count(exec_id) > 0; }, "", options_.propose_timeout)) {
    return Unavailable(
        "the cell's effects were committed, but whether they count (its LEAD) "
        "did not reach this replica in time");
  }
  if (WinnerOf(outcomes_.at(exec_id)) == options_.replica_id) return Status::Ok();
  if (outcomes_.at(exec_id) == kCancelledOutcome) {
    return Unavailable(
        "the cell was cancelled through the kernel's log before its LEAD committed (its replica "
        "was thought lost), so its effects were discarded on every replica: it took no effect "
        "(run it again)");
  }
  return Unavailable(
      "another cell's effects reached the log while this cell ran, so this cell's effects were "
      "discarded on every replica (run it again)");
}

// Keeping effects the log may not hold would leave this replica ahead of the others for good,
// since later deltas carry only the names their own cells changed. Going back happens as a
// snapshot restore does: an event at this point of the log (no entry is applied while
// machine_mu_ is held) replaces the namespace with the state the log holds, and clears
// executed_here_. Should the entries commit after all (a proposal is at least once), their delta
// arrives later and is applied like another executor's, unless another cell won the log first.
Status ReplicaGate::ReturnToReplicatedState(const std::string& exec_id, const Status& why) {
  spdlog::warn(
      "execution {}: its effects are not known to be replicated ({}); going back to the "
      "replicated state",
      exec_id, why.message());
  RebuildFromLog();
  if (!last_restore_.ok()) {
    return {why.code(), why.message() +
                            "; going back to the state of the last completed cell "
                            "failed too: " +
                            last_restore_.message()};
  }
  return {why.code(),
          why.message() + "; this replica went back to the state of the last completed cell"};
}

void ReplicaGate::RebuildFromLog() {
  const auto start = std::chrono::steady_clock::now();
  {
    MutexLock lock(&machine_mu_);
    Enqueue({Event::Kind::kRestored,
             "",
             0,
             machine_.checkpoint(),
             {},
             machine_.journal(),
             machine_.journal_total()});
  }
  ProcessEvents();
  rebuild_tried_ = true;
  last_rebuild_at_ = std::chrono::steady_clock::now();
  last_rebuild_ = std::chrono::duration_cast<std::chrono::milliseconds>(last_rebuild_at_ - start);
}

void ReplicaGate::SetLoggedFields(std::string code, const std::string& reply_content,
                                  const Json& reply, Json* done_meta) {
  if (code.size() > kLoggedFieldMaxBytes) {
    auto key = store_->Put(code);
    if (key.ok()) {
      (*done_meta)["code_key"] = *key;
    } else {
      spdlog::warn("this cell's source ({} bytes) is not replicated: {}", code.size(),
                   key.status().ToString());
      code = fmt::format("# nbos: this cell's source ({} bytes) could not be replicated: {}",
                         code.size(), key.status().ToString());
    }
  }
  if (!done_meta->contains("code_key")) (*done_meta)["code"] = std::move(code);
  const bool valid = reply.is_object();
  if (valid && reply_content.size() > kLoggedFieldMaxBytes) {
    auto key = store_->Put(reply_content);
    if (key.ok()) {
      (*done_meta)["reply_key"] = *key;
      return;
    }
    // The other replicas' answers then carry the status and the execution count only.
    spdlog::warn("this cell's reply ({} bytes) is not replicated: {}", reply_content.size(),
                 key.status().ToString());
    (*done_meta)["reply"] = Json{{"status", reply.value("status", "ok")},
                                 {"execution_count", reply.value("execution_count", 0)},
                                 {"user_expressions", Json::object()},
                                 {"payload", Json::array()}};
    return;
  }
  (*done_meta)["reply"] = valid ? reply : Json::object();
}

void ReplicaGate::FieldsFromStore(Json* done_meta) {
  // Every Done passes here: the names are literals, so a Done without keys costs two lookups.
  for (const auto& [field, key_field] : {std::pair{"code", "code_key"}, {"reply", "reply_key"}}) {
    auto key = done_meta->find(key_field);
    if (key == done_meta->end() || !key->is_string()) continue;
    const bool is_reply = std::string_view(field) == "reply";
    auto text = store_->Get(key->get<std::string>());
    if (!text.ok()) {
      spdlog::error("this cell's {} could not be fetched from the blob store: {}", field,
                    text.status().ToString());
      (*done_meta)[field] = is_reply ? Json::object()
                                     : Json(
                                           "# nbos: this cell's source could not be fetched "
                                           "from the blob store: " +
                                           text.status().ToString());
    } else if (is_reply) {
      Json reply = Json::parse(*text, nullptr, false);
      (*done_meta)[field] = reply.is_object() ? std::move(reply) : Json::object();
    } else {
      (*done_meta)[field] = std::move(*text);
    }
  }
}

void ReplicaGate::MaybeCheckpoint() {
  size_t journal_bytes = 0;
  {
    MutexLock lock(&machine_mu_);
    for (const JournalRecord& r : machine_.journal()) journal_bytes += r.payload.size();
  }
  if (since_checkpoint_ < options_.checkpoint_every &&
      journal_bytes < kCheckpointAfterJournalBytes) {
    return;
  }
  auto data = engine_->Checkpoint();
  if (!data.ok()) {
    spdlog::warn("no checkpoint: {}", data.status().ToString());
    return;
  }
  spdlog::info("proposing a checkpoint of {} bytes after {} journal records ({} bytes)",
               data->size(), since_checkpoint_, journal_bytes);
  KernelEntry entry{KernelEntry::Type::kCheckpoint, "", options_.replica_id,
                    Json{{"covers", journal_seen_}}, std::move(*data)};
  // Best effort: a lost checkpoint only means catch-up replays more.
  if (Status s = Propose(std::move(entry)); !s.ok())
    spdlog::warn("checkpoint not committed: {}", s.ToString());
}

Result<std::string> ReplicaGate::Follow(const Decision& decision) {
  if (!WaitFor([&] { return done_.count(decision.exec_id) > 0; }, decision.exec_id,
               options_.follow_timeout)) {
    std::string why;
    {
      MutexLock lock(&mu_);
      auto it = cancel_reasons_.find(decision.exec_id);
      if (it != cancel_reasons_.end()) why = " (" + it->second + ")";
    }
    // The LEAD won: the executor may have run the cell, and its effects may still commit.
    return Unavailable("replica " + std::to_string(decision.executor) +
                       ", chosen to run this cell, did not finish it here" + why +
                       ". Whether the cell ran is not known: if it did, its effects reach every "
                       "replica through the log. Look at the kernel's state before running it "
                       "again");
  }
  if (Superseded(decision.exec_id)) {
    return Unavailable("replica " + std::to_string(decision.executor) +
                       ", chosen to run this cell, had not finished it when a later cell began: "
                       "whatever it did, its effects were discarded on every replica. Whether "
                       "it ran (output, files) is not known; the kernel's state is as if it had "
                       "not");
  }
  return done_.at(decision.exec_id).value("reply", Json::object()).dump();
}

bool ReplicaGate::Cancel(const std::string& exec_id, const std::string& reason,
                         bool decide_in_log) {
  {
    MutexLock lock(&mu_);
    if (exec_id == started_) return false;
    cancelled_.insert(exec_id);
    if (!reason.empty()) {
      if (cancel_reasons_.size() >= 16) cancel_reasons_.erase(cancel_reasons_.begin());
      cancel_reasons_[exec_id] = reason;
    }
    if (decide_in_log && !exec_id.empty()) ProposeCancel(exec_id);
  }
  cv_.SignalAll();
  return true;
}

void ReplicaGate::ProposeCancel(const std::string& exec_id) {
  std::erase_if(cancel_proposals_, [](const std::future<void>& f) {
    return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  });
  KernelEntry entry{KernelEntry::Type::kCancel, exec_id, options_.replica_id, Json::object(), ""};
  entry.id = cancel_ids_.Next();
  cancel_proposals_.push_back(
      std::async(std::launch::async, [router = router_.get(), bytes = EncodeKernelEntry(entry),
                                      exec_id, timeout = options_.propose_timeout] {
        auto committed = router->Propose(bytes, timeout);
        if (!committed.ok()) {
          spdlog::warn("execution {}: the cancel did not reach the log: {}", exec_id,
                       committed.status().ToString());
        }
      }));
}

Json ReplicaGate::ReplyMetadata(const Decision& decision) {
  return Json{
      {"nbos",
       {{"exec_id", decision.exec_id},
        {"replica", options_.replica_id},
        {"executor", decision.executor},
        // The chosen executor's answer is the cell's, also when it could not run it.
        {"role", decision.role == Role::kExecute || decision.role == Role::kNotRun ? "executor"
                                                                                   : "standby"},
        // Whether the executor ran the cell before its LEAD committed (decision 0012).
        {"ran_ahead",
         decision.role == Role::kExecute && run_ahead_ && run_ahead_->exec_id == decision.exec_id},
        // From the process's start to this cell's election: blob keys this replica
        // announced as an executor and was told of as a standby, and blobs it took from
        // the prefetched ones.
        {"blobs",
         {{"announced", announcer_ ? announcer_->keys_announced() : 0},
          {"hinted", hinted_keys_.load()},
          {"prefetch_hits", store_->hits()}}},
        // Raft connections and forwarded requests refused since the process started.
        {"peers_refused", peers_refused_.load()}}}};
}

ExecutionGate::RaftGroupView ReplicaGate::RaftGroup() {
  const replication::RaftNode::GroupView group = node_->Group();
  RaftGroupView view{{}, group.committed, group.leading, group.term};
  for (const replication::Member& m : group.members) view.members.push_back(m.id);
  return view;
}

Status ReplicaGate::ChangeMembership(const MembershipChange& change) {
  // Past the asker's wait, an answer reaches no one, and this replica's control channel stays
  // blocked for the next change asked of it.
  const std::chrono::milliseconds timeout =
      change.timeout.count() > 0 ? std::min(change.timeout, options_.membership_timeout)
                                 : options_.membership_timeout;
  if (change.op == MembershipChange::Op::kAdd) {
    spdlog::info("adding replica {} at {}", change.replica_id, change.raft_address);
    return router_->AddMember({change.replica_id, change.raft_address, replication::Role::kVoter},
                              timeout);
  }
  spdlog::info("removing replica {}", change.replica_id);
  return router_->RemoveMember(change.replica_id, timeout);
}

}  // namespace nbos::replica
