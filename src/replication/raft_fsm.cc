#include "replication/raft_fsm.h"

#include <cstdint>
#include <cstring>

extern "C" {
#include <raft.h>
}

namespace nbos::replication {

namespace {

StateMachine* MachineOf(struct raft_fsm* fsm) { return static_cast<StateMachine*>(fsm->data); }

constexpr size_t kHeaderBytes = sizeof(uint64_t);
// The length field of a nudge; no command is that long.
constexpr uint64_t kNudgeLength = UINT64_MAX;

int FsmApply(struct raft_fsm* fsm, const struct raft_buffer* buf, void** result) {
  *result = nullptr;
  uint64_t len = 0;
  if (buf->len < kHeaderBytes) return RAFT_MALFORMED;
  std::memcpy(&len, buf->base, kHeaderBytes);
  if (len == kNudgeLength) return 0;
  if (len > buf->len - kHeaderBytes) return RAFT_MALFORMED;
  MachineOf(fsm)->Apply(std::string_view(static_cast<const char*>(buf->base) + kHeaderBytes, len));
  return 0;
}

int FsmSnapshot(struct raft_fsm* fsm, struct raft_buffer* bufs[], unsigned* n_bufs) {
  std::string state = MachineOf(fsm)->Snapshot();
  // Memory handed to C-Raft must come from its allocator: it frees both with raft_free.
  auto* out = static_cast<struct raft_buffer*>(raft_malloc(sizeof(struct raft_buffer)));
  if (out == nullptr) return RAFT_NOMEM;
  out->len = state.size();
  out->base = raft_malloc(state.empty() ? 1 : state.size());
  if (out->base == nullptr) {
    raft_free(out);
    return RAFT_NOMEM;
  }
  if (!state.empty()) std::memcpy(out->base, state.data(), state.size());
  *bufs = out;
  *n_bufs = 1;
  return 0;
}

int FsmRestore(struct raft_fsm* fsm, struct raft_buffer* buf) {
  Status s =
      MachineOf(fsm)->Restore(std::string_view(static_cast<const char*>(buf->base), buf->len));
  if (!s.ok()) return RAFT_CORRUPT;  // the buffer stays ours to keep only on success
  raft_free(buf->base);
  return 0;
}

}  // namespace

bool EncodeEntry(std::string_view command, struct raft_buffer* out) {
  size_t padded = (kHeaderBytes + command.size() + 7) / 8 * 8;
  void* base = raft_calloc(1, padded);
  if (base == nullptr) return false;
  uint64_t len = command.size();
  std::memcpy(base, &len, kHeaderBytes);
  if (!command.empty()) std::memcpy(static_cast<char*>(base) + kHeaderBytes, command.data(), len);
  out->base = base;
  out->len = padded;
  return true;
}

bool EncodeNudge(struct raft_buffer* out) {
  void* base = raft_calloc(1, kHeaderBytes);
  if (base == nullptr) return false;
  std::memcpy(base, &kNudgeLength, kHeaderBytes);
  out->base = base;
  out->len = kHeaderBytes;
  return true;
}

void BindFsm(struct raft_fsm* fsm, StateMachine* machine) {
  *fsm = {};
  fsm->version = 1;
  fsm->data = machine;
  fsm->apply = FsmApply;
  fsm->snapshot = FsmSnapshot;
  fsm->restore = FsmRestore;
}

}  // namespace nbos::replication
