// The resource ledger of one GPU server (DESIGN.md §5): what the server has (spec), what the
// replicas placed on it asked for (subscribed), and which GPUs are bound to executions now
// (committed). Pure bookkeeping: no I/O, no clock, no randomness (grant ids are passed in).
//
// Invariants (checked in every build by NBOS_CHECK and by ledger_test's randomized test):
//  - a device id belongs to at most one grant at a time;
//  - every grant belongs to a subscribed replica;
//  - at most one grant per (kernel id, exec id).
#pragma once

#include <compare>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"

namespace nbos::daemon {

// Integer resources, as control.proto's Resources.
struct ResourceVector {
  int64_t millicpus = 0;
  int64_t memory_mb = 0;
  int32_t gpus = 0;
  int64_t vram_mb = 0;

  ResourceVector& operator+=(const ResourceVector& o);
  ResourceVector& operator-=(const ResourceVector& o);
  bool operator==(const ResourceVector&) const = default;
};

// One replica of one kernel on this server.
struct ReplicaKey {
  std::string kernel_id;
  uint32_t replica_id = 0;

  auto operator<=>(const ReplicaKey&) const = default;
  std::string ToString() const;  // "KERNEL/ID"
};

// A physical or virtual GPU of this server.
struct GpuDevice {
  int id = 0;           // NVML index, or 0..N-1 for virtual GPUs
  int64_t vram_mb = 0;  // memory of this device
};

struct GpuGrant {
  std::string grant_id;
  ReplicaKey replica;
  std::string exec_id;
  std::vector<int> device_ids;  // ascending
  int64_t vram_mb = 0;          // what the execution asked for
};

struct GrantDecision {
  bool granted = false;
  GpuGrant grant;         // when granted
  std::string reason;     // when refused: a sentence for logs and for the gateway
  bool repeated = false;  // granted earlier for the same exec id; nothing changed
};

class Ledger {
 public:
  // `devices` must have distinct ids; spec.gpus and spec.vram_mb are derived from them (the
  // values in `spec` for those two fields are ignored).
  Ledger(ResourceVector spec, std::vector<GpuDevice> devices);

  // Records a placed replica's per-replica request. Servers are oversubscribed by design, so
  // subscriptions are not refused for exceeding the spec in total; a single replica asking more
  // GPUs than the server has (it could never execute here) or negative amounts are refused with
  // InvalidArgument. Subscribing an already subscribed replica replaces its request.
  Status Subscribe(const ReplicaKey& replica, const ResourceVector& request);

  // Forgets a replica and releases all its grants; returns the released grant ids. Unknown
  // replicas are a no-op.
  std::vector<std::string> Unsubscribe(const ReplicaKey& replica);

  bool IsSubscribed(const ReplicaKey& replica) const;

  // Commits `gpus` devices (lowest free ids first) to one execution of a subscribed replica.
  // Idempotent: an (kernel, exec_id) that already holds a grant for the same replica gets that
  // grant back with repeated = true. Refused (granted = false, with a reason) when the replica is
  // not subscribed, when fewer than `gpus` devices are idle, when `vram_mb` exceeds what the
  // chosen devices have, when the exec id is held by another replica, or on negative amounts.
  // `gpus` = 0 grants no device (a CPU-only execution) but still records the grant.
  // `grant_id` must be unique across the ledger's life (the caller passes a UUID).
  GrantDecision Grant(const ReplicaKey& replica, const std::string& exec_id, int gpus,
                      int64_t vram_mb, const std::string& grant_id);

  // Frees one grant's devices. False when the grant is unknown (already released).
  bool Release(const std::string& grant_id);

  // Frees every grant of one replica (its process stopped or died); returns their ids.
  std::vector<std::string> ReleaseAll(const ReplicaKey& replica);

  const ResourceVector& spec() const { return spec_; }
  ResourceVector subscribed() const;
  // GPUs and VRAM of all grants, plus millicpus and memory of the replicas holding a grant.
  ResourceVector committed() const;
  std::vector<int> idle_device_ids() const;  // ascending
  std::vector<GpuGrant> grants() const;      // by grant id
  std::optional<GpuGrant> FindGrant(const std::string& grant_id) const;
  size_t replica_count() const { return subscriptions_.size(); }

 private:
  void CheckInvariants() const;

  ResourceVector spec_;
  std::map<int, GpuDevice> devices_;                                    // by id
  std::map<int, std::string> holder_;                                   // device id -> grant id
  std::map<ReplicaKey, ResourceVector> subscriptions_;                  // placed replicas
  std::map<std::string, GpuGrant> grants_;                              // by grant id
  std::map<std::pair<std::string, std::string>, std::string> by_exec_;  // (kernel, exec) -> grant
};

}  // namespace nbos::daemon
