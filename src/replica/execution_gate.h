// What a replicated kernel adds around execution (DESIGN.md §3): an election before each cell,
// replication of its effects after it, and standbys that follow instead of executing. The
// standalone `nbos kernel` runs without a gate.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "jupyter/message.h"
#include "replica/membership.h"

namespace nbos::replica {

class PythonEngine;

class ExecutionGate {
 public:
  enum class Role {
    kExecute,  // this replica's LEAD committed first: run the cell
    kStandby,  // another replica executes: apply its effects, emit no output
    kNobody,   // every replica yielded: nobody can run the cell now
    // The execution will not run anywhere: a CANCEL reached the kernel's log before any LEAD
    // (or, on the executor, this replica was told to cancel before it began the cell, and only
    // it could have run it). This replica holds the state of the last cell.
    kCancelled,
    // This replica was told to stop waiting (the executor is gone) and the log has not decided
    // yet whether the cell runs: whether it ran is not known; if it did, its effects reach every
    // replica through the log.
    kNotKnown,
    // This replica, the one chosen to run the cell, could not get its election decided in time
    // (no leader, no majority); it has not begun the cell and never will: the cell did not run.
    // `refused` says why.
    kNotRun,
  };
  struct Decision {
    Role role = Role::kNobody;
    std::string exec_id;
    uint64_t executor = 0;
    // kExecute only: why this replica, elected, must not run the cell (its namespace is not the
    // log's). The cell is answered with this error and Commit tells the other replicas.
    Status refused;
  };

  virtual ~ExecutionGate() = default;

  // All methods run on the engine's thread with the GIL held; waits release it.
  // Called once the engine has started, before any request is served.
  virtual void Attach(PythonEngine* engine) = 0;
  // Any thread: stores the replicated state (checkpoint and journal) in the blob store and
  // returns its key, from which a new group can start (ReplicaOptions::restore_from).
  virtual Result<std::string> SaveCheckpoint() {
    return InvalidArgument("this kernel keeps no replicated state");
  }
  // Any thread: every blob key the replicated state refers to (checkpoint and journal), and those
  // of the last deltas and blob hints applied here (ReplicaGate::kRecentRefEntries), which a
  // member that replays its log or catches up from the leader's may still need: what the blob
  // store must keep for this kernel.
  virtual Result<std::vector<std::string>> BlobRefs() {
    return InvalidArgument("this kernel keeps no replicated state");
  }
  // Before an execute_request: returns once the log has decided who executes it.
  virtual Result<Decision> Elect(const jupyter::Message& request) = 0;
  // On the executor, after the cell ran and before its reply: replicates the cell's effects and
  // returns once they are committed and applied here. With `decision.refused`, the cell did not
  // run and `reply_content` (its error) is what the other replicas answer.
  virtual Status Commit(const Decision& decision, const jupyter::Message& request,
                        const std::string& reply_content) = 0;
  // On a standby: waits until the executor's effects are applied here and returns the
  // executor's reply content.
  virtual Result<std::string> Follow(const Decision& decision) = 0;
  // Applies whatever the log delivered meanwhile (catch-up, other executions). Cheap when there
  // is nothing to do; called whenever the replica is otherwise idle.
  virtual void Pump() = 0;
  // Gives up waiting on execution `exec_id` (its executor is gone, or the kernel lost its
  // majority): this replica will not begin the cell. Returns false when this replica already
  // started running it (the cancel then changes nothing). With `decide_in_log`, the replica
  // also proposes a CANCEL to the kernel's log, which decides for every replica whether the cell
  // runs (KernelStateMachine); a standby answers kCancelled only once the log says so, and
  // kNotKnown otherwise. `reason`, when known (the executor ran out of memory), is what a
  // standby's error then says. Thread-safe; does not wait for the log.
  virtual bool Cancel(const std::string& exec_id, const std::string& reason,
                      bool decide_in_log) = 0;
  // Extra execute_reply metadata naming the executor and this replica's role.
  virtual jupyter::Json ReplyMetadata(const Decision& decision) = 0;
  // What keeps this replica's namespace from being the state its log holds ("" when nothing):
  // every execute_reply says so (metadata nbos.diverged), and the gateway replaces the replica.
  virtual std::string Divergence() { return ""; }
  // Applies `change` to the kernel's replica group through its leader and returns once it is
  // committed (for kAdd: once the new replica is a voter, i.e. caught up). Thread-safe and
  // without the GIL: runs on the control thread, not the engine's. Errors: kInvalidArgument
  // (the change makes no sense for this group), kUnavailable (no leader, not done in time).
  virtual Status ChangeMembership(const MembershipChange& change) = 0;
  // The kernel's Raft group as this replica knows it: the ids of the latest configuration it
  // appended, whether that one is committed, whether this replica leads, and the latest term it
  // has seen; no members when it has none. Thread-safe, without the GIL.
  struct RaftGroupView {
    std::vector<uint64_t> members;
    bool committed = false;
    bool leading = false;
    uint64_t term = 0;
  };
  virtual RaftGroupView RaftGroup() { return {}; }
};

}  // namespace nbos::replica
