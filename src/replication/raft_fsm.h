// Binds a StateMachine to C-Raft's FSM contract. Shared by RaftNode (libuv I/O) and the
// deterministic tests on C-Raft's in-memory fixture, so both exercise the same adapter.
#pragma once

#include "replication/replicated_log.h"

struct raft_fsm;
struct raft_buffer;

namespace nbos::replication {

// Fills `fsm` (version 1 contract: the library frees snapshot buffers, restore frees its input)
// so that it forwards to `machine`, which must outlive it.
void BindFsm(struct raft_fsm* fsm, StateMachine* machine);

// Log entry for `command` in a buffer from raft_malloc (ownership passes with raft_apply). Entries
// carry their length and are padded to a multiple of 8 bytes: C-Raft 0.15 reads past the end of
// received entries whose size is not (a heap overflow seen under ASan when a restarted member
// catches up). Returns false when out of memory.
bool EncodeEntry(std::string_view command, struct raft_buffer* out);

// A log entry the state machine never sees (the adapter skips it). A leader appends one after a
// batch commits so that its next AppendEntries, which carries the new commit index, goes out at
// once: C-Raft 0.15 otherwise tells followers about a commit only with the next heartbeat.
bool EncodeNudge(struct raft_buffer* out);

}  // namespace nbos::replication
