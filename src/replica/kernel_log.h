// The replicated state machine of one distributed kernel (DESIGN.md §3-§4). Its log carries, per
// execution: the LEAD/YIELD proposals of the replicas, the executor's namespace delta, and an
// ExecDone marker; plus side-effect statements and periodic checkpoints of the whole namespace.
// Pure and deterministic: committed entries in, decisions out through a Listener.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "jupyter/message.h"
#include "replication/replicated_log.h"

namespace nbos::replica {

using ReplicaId = replication::ServerId;

struct KernelEntry {
  enum class Type : uint8_t {
    kLead = 1,        // this replica can execute the cell now
    kYield = 2,       // it cannot (or another replica was targeted)
    kDelta = 3,       // namespace delta of a finished cell (payload)
    kDone = 4,        // the execution is finished and its effects are all in the log before this
    kCheckpoint = 5,  // a full namespace snapshot (payload) standing for the first
                      // meta.covers journal records
    kSideEffect = 6,  // a statement every replica replays (%cd, os.environ...) (payload)
  };
  Type type = Type::kLead;
  std::string exec_id;  // one attempt at one execution, named by the caller
  ReplicaId replica = 0;
  jupyter::Json meta = jupyter::Json::object();  // small type-specific fields
  std::string payload;

  bool operator==(const KernelEntry&) const = default;
};

std::string EncodeKernelEntry(const KernelEntry& entry);
// Errors: InvalidArgument for bytes that are not an entry of this format.
Result<KernelEntry> DecodeKernelEntry(std::string_view bytes);

// Outcome of one execution's election, identical on every replica because it is derived from the
// log order alone: the first committed LEAD wins; if every replica YIELDs first, it failed.
struct Election {
  std::optional<ReplicaId> winner;
  bool failed = false;  // all replicas yielded
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

class KernelStateMachine final : public replication::StateMachine {
 public:
  // Called on the log's thread, in log order, with the decisions each entry caused.
  class Listener {
   public:
    virtual ~Listener() = default;
    virtual void OnElected(const std::string& exec_id, ReplicaId winner) = 0;
    virtual void OnAllYielded(const std::string& exec_id) = 0;
    virtual void OnDelta(const std::string& exec_id, ReplicaId executor,
                         const std::string& payload) = 0;
    virtual void OnSideEffect(const std::string& exec_id, const std::string& statement) = 0;
    virtual void OnDone(const std::string& exec_id, ReplicaId executor,
                        const jupyter::Json& meta) = 0;
    // A checkpoint now stands for the first `covers` journal records ever appended.
    virtual void OnCheckpoint(uint64_t covers) = 0;
    // The whole state was replaced (catch-up from a snapshot): rebuild the namespace from the
    // checkpoint, then replay the journal in order. `journal_total` counts every record ever
    // appended, the checkpointed ones included.
    virtual void OnRestored(const std::string& checkpoint,
                            const std::vector<JournalRecord>& journal, uint64_t journal_total) = 0;
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

  // Elections remembered (oldest are forgotten first); late proposals for a forgotten one are
  // ignored, since its outcome was decided long ago.
  static constexpr size_t kElectionsKept = 4096;

 private:
  Election& ElectionSlot(const std::string& exec_id);

  size_t replicas_;
  Listener* listener_;
  std::map<std::string, Election> elections_;
  std::deque<std::string> election_order_;
  std::string checkpoint_;
  std::vector<JournalRecord> journal_;
  uint64_t journal_total_ = 0;  // records ever appended; journal_ holds the last ones
  uint64_t executions_done_ = 0;
  uint64_t malformed_entries_ = 0;
};

}  // namespace nbos::replica
