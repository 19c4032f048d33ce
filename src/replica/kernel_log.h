// The replicated state machine of one distributed kernel (DESIGN.md §3-§4). Its log carries, per
// execution: the LEAD/YIELD proposals of the replicas, the executor's namespace delta, and an
// ExecDone marker; plus side-effect statements and periodic checkpoints of the whole namespace.
// Pure and deterministic: committed entries in, decisions out through a Listener.
//
// Exactly-once: a proposal may be committed more than once (a forwarded proposal whose answer was
// lost is retried, a leader that lost leadership may still have had its entry committed). Every
// entry a replica proposes carries a proposal id (ProposalIds), the same on every retry, and the
// state machine applies an id at most once: it remembers the last kAppliedIdsKept ids it applied.
// Every replica sees the same log (and snapshots carry the window), so every replica skips the
// same entries. Entries without an id (older logs) apply as before.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "common/status.h"
#include "jupyter/message.h"
#include "replication/replicated_log.h"

namespace nbos::replica {

using ReplicaId = replication::ServerId;

struct KernelEntry {
  enum class Type : uint8_t {
    kLead = 1,        // this replica can execute the cell now; with meta.ran_on (see
                      // KernelStateMachine), it already ran it
    kYield = 2,       // it cannot (or another replica was targeted)
    kDelta = 3,       // namespace delta of a finished cell (payload)
    kDone = 4,        // the execution is finished and its effects are all in the log before this
    kCheckpoint = 5,  // a full namespace snapshot (payload) standing for the first
                      // meta.covers journal records
    kSideEffect = 6,  // a statement every replica replays (%cd, os.environ...) (payload)
    kBlobHint = 7,    // blobs the executing cell has stored so far, its delta still to come
                      // (payload: keys, one per line); a hint, never part of the state
    kCancel = 8,      // the execution is not to run: decides its election if no LEAD won first
  };
  Type type = Type::kLead;
  std::string exec_id;  // one attempt at one execution, named by the caller
  ReplicaId replica = 0;
  jupyter::Json meta = jupyter::Json::object();  // small type-specific fields
  std::string payload;
  // Names this proposal across the group and across restarts (see ProposalIds); identical on
  // every retry. Empty: no id (entries of older logs), applied every time it is committed.
  std::string id;

  bool operator==(const KernelEntry&) const = default;
};

std::string EncodeKernelEntry(const KernelEntry& entry);
// Errors: InvalidArgument for bytes that are not an entry of this format.
Result<KernelEntry> DecodeKernelEntry(std::string_view bytes);

// Proposal ids of one proposing process: "<replica>:<nonce>:<seq>". The replica id makes them
// unique within the group, the nonce (random, drawn once per process at the I/O edge) across
// restarts of that replica, the sequence number within the process. Pure: the caller supplies
// the nonce. Not thread-safe.
class ProposalIds {
 public:
  ProposalIds(ReplicaId replica, std::string nonce);
  std::string Next();

 private:
  std::string prefix_;
  uint64_t next_seq_ = 1;
};

// Outcome of one execution's election, identical on every replica because it is derived from the
// log order alone: the first committed LEAD wins; if every replica YIELDs first, it failed; a
// CANCEL committed before any winning LEAD also fails it (`cancelled`), so that "the cell did not
// run" is a decision every replica holds, not one replica's belief: a LEAD after it, and the
// delta, side effects and Done that follow that LEAD, change nothing anywhere.
//
// A LEAD may carry meta.cancels: executions the gateway gave up on before this one (answered
// "not known" or left unreplicated). When the LEAD wins, each of them not yet decided is
// cancelled, as a CANCEL would: none can win after a later cell, which would apply its effects
// out of order.
//
// A LEAD may carry meta.ran_on: the journal_total() of the namespace its replica already ran the
// cell on (an optimistic executor, DESIGN.md §3 as amended by decision 0012). It wins only if the
// log's journal_total() is still that number where the LEAD lands, i.e. no other cell's effects
// were committed in between; otherwise the election fails (`overtaken`) and the cell's delta,
// side effects and Done, which follow it, change nothing anywhere.
struct Election {
  std::optional<ReplicaId> winner;
  bool failed = false;     // all replicas yielded, or an optimistic LEAD was overtaken
  bool overtaken = false;  // failed because an optimistic LEAD's namespace was out of date
  bool cancelled = false;  // failed because a CANCEL committed before any LEAD won
  // Won, but another execution's LEAD won before this one's Done: its effects are skipped.
  bool superseded = false;
  std::vector<ReplicaId> leads;
  std::vector<ReplicaId> yields;
};

// Journal of what changed the namespace since the last checkpoint, for catching up.
struct JournalRecord {
  KernelEntry::Type type;  // kDelta or kSideEffect
  std::string exec_id;
  std::string payload;
  bool operator==(const JournalRecord&) const = default;
};

// Deltas, side effects and Dones of an execution whose election this machine still remembers
// count only if their replica won it (an overtaken optimistic executor's effects are skipped)
// and no other execution's LEAD won after it and before its Done: a winner runs the cell on the
// state the log holds when its LEAD wins, so an earlier execution's effects committed after that
// (its executor was cut off while the others went on) would overwrite the later cells' effects
// with values computed before them.
//
// Execution ids of the gateway's cells read "<kernel>:<epoch>.<sequence>", the epoch drawn anew
// by each gateway session of the kernel. Once a LEAD of a later epoch has won, the earlier
// epochs are retired: a LEAD of a retired epoch loses (its election is cancelled). The session
// that sent that cell is gone, and the one after it went on without it; run now, its effects
// would land after the later cells'. Ids without an epoch are exempt.
class KernelStateMachine final : public replication::StateMachine {
 public:
  // Called on the log's thread, in log order, with the decisions each entry caused.
  class Listener {
   public:
    virtual ~Listener() = default;
    virtual void OnElected(const std::string& exec_id, ReplicaId winner) = 0;
    virtual void OnAllYielded(const std::string& exec_id) = 0;
    // A CANCEL decided the election: nobody runs `exec_id`. A CANCEL after a LEAD won calls
    // nothing (the cell runs, or ran, on the winner).
    virtual void OnCancelled(const std::string& exec_id) = 0;
    // Another execution's LEAD won while `exec_id`'s winner had not logged its Done: whatever
    // of `exec_id` commits from now on is skipped everywhere.
    virtual void OnSuperseded(const std::string& /*exec_id*/) {}
    virtual void OnDelta(const std::string& exec_id, ReplicaId executor,
                         const std::string& payload) = 0;
    virtual void OnSideEffect(const std::string& exec_id, const std::string& statement) = 0;
    virtual void OnDone(const std::string& exec_id, ReplicaId executor,
                        const jupyter::Json& meta) = 0;
    // kBlobHint: `executor`, running `exec_id`, has stored these blobs (valid keys or not: the
    // entry is only a hint). Changes no state, is not journaled and is not in snapshots.
    virtual void OnBlobHint(const std::string& /*exec_id*/, ReplicaId /*executor*/,
                            const std::vector<std::string>& /*keys*/) {}
    // A checkpoint now stands for the first `covers` journal records ever appended.
    virtual void OnCheckpoint(uint64_t covers) = 0;
    // The whole state was replaced (catch-up from a snapshot): rebuild the namespace from the
    // checkpoint, then replay the journal in order. `journal_total` counts every record ever
    // appended, the checkpointed ones included.
    virtual void OnRestored(const std::string& checkpoint,
                            const std::vector<JournalRecord>& journal, uint64_t journal_total) = 0;
    // An entry whose proposal id was already applied was skipped (a retried proposal committed
    // twice). For logging; the state did not change.
    virtual void OnDuplicateSkipped(const KernelEntry& /*entry*/) {}
  };

  // `replicas`: how many YIELDs make an election fail. `listener` may be null (tests).
  KernelStateMachine(size_t replicas, Listener* listener);

  void Apply(std::string_view command) override;
  std::string Snapshot() override;
  Status Restore(std::string_view snapshot) override;

  // Inspection; call from the log's thread (or when it is idle, in tests).
  std::optional<Election> ElectionFor(const std::string& exec_id) const;
  const std::string& checkpoint() const { return checkpoint_; }
  const std::vector<JournalRecord>& journal() const { return journal_; }
  uint64_t executions_done() const { return executions_done_; }
  uint64_t journal_total() const { return journal_total_; }
  uint64_t malformed_entries() const { return malformed_entries_; }
  // Entries skipped because their proposal id had already been applied.
  uint64_t duplicates_skipped() const { return duplicates_skipped_; }
  // Deltas, side effects and Dones skipped because their replica did not win the election or
  // the execution was superseded.
  uint64_t losers_skipped() const { return losers_skipped_; }
  // The window of applied proposal ids, oldest first.
  const std::deque<std::string>& applied_ids() const { return applied_id_order_; }

  // Elections remembered (oldest are forgotten first); late proposals for a forgotten one are
  // ignored, since its outcome was decided long ago.
  static constexpr size_t kElectionsKept = 4096;
  // Proposal ids remembered, oldest forgotten first. A retry commits within seconds of its first
  // copy (ProposalRouter gives up after the caller's timeout), a cell commits about six entries,
  // so this covers the last ~1300 cells, far more than a retry can lag behind.
  static constexpr size_t kAppliedIdsKept = 8192;
  // Retired epochs remembered (one per gateway session that ran a cell of this kernel).
  static constexpr size_t kRetiredEpochsKept = 64;

 private:
  Election& ElectionSlot(const std::string& exec_id);
  // Records `id` as applied; false if it already was (the entry must be skipped).
  bool FirstApplication(const std::string& id);
  void ApplyProposal(const KernelEntry& e);
  // `exec_id`'s LEAD won: the execution that won before it and has no Done yet is superseded.
  void Supersede(const std::string& exec_id);
  // Decides `exec_id`'s election as cancelled unless it is decided already.
  void Cancel(const std::string& exec_id);
  // Whether a delta, side effect or Done of `e.replica` for `e.exec_id` must be skipped.
  bool FromLoser(const KernelEntry& e) const;
  // False if `exec_id`'s epoch is retired; else records it as the current epoch (retiring the
  // one before) when a LEAD of it wins.
  bool EpochMayWin(const std::string& exec_id);

  size_t replicas_;
  Listener* listener_;
  std::map<std::string, Election> elections_;
  std::deque<std::string> election_order_;
  std::string running_;  // the last execution whose LEAD won and whose Done is not applied yet
  std::string current_epoch_;  // of the last LEAD that won with an epoch
  std::deque<std::string> retired_epochs_;
  std::string checkpoint_;
  std::vector<JournalRecord> journal_;
  uint64_t journal_total_ = 0;  // records ever appended; journal_ holds the last ones
  uint64_t executions_done_ = 0;
  uint64_t malformed_entries_ = 0;
  std::unordered_set<std::string> applied_ids_;
  std::deque<std::string> applied_id_order_;  // the same ids, oldest first
  uint64_t duplicates_skipped_ = 0;
  uint64_t losers_skipped_ = 0;
};

}  // namespace nbos::replica
