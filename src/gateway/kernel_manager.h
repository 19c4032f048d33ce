// KernelManager: a kernel's life as the gateway drives it: start (placement, replicas prepared and
// launched on three servers, metadata stored, the session started, every replica answering),
// restart, delete, restore after a gateway restart. Operations on one kernel are serialised by
// its operation lock; a failed start leaves nothing behind (replicas stopped, metadata removed,
// scheduler state undone).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>

#include "common/status.h"
#include "common/work_queue.h"
#include "gateway/edge_counters.h"
#include "gateway/metadata_store.h"
#include "gateway/planner.h"
#include "gateway/registry.h"

namespace nbos::gateway {

struct KernelManagerOptions {
  int replicas = 3;
  sched::Resources default_request;
  ClientLimits limits;
  std::chrono::milliseconds server_timeout{5000};  // how long to wait for a server to register
  std::chrono::milliseconds kernel_start_timeout{60000};
  // Per-user limits, for users who are not admins (0: none): kernels at once, and GPUs their
  // kernels subscribe at once (KERNEL_GPUS summed; what a user's cells can hold at one time).
  int max_kernels_per_user = 0;
  int max_gpus_per_user = 0;
};

// Who starts a kernel: it becomes the kernel's owner; admins are not held to user quotas.
struct KernelStarter {
  std::string user;
  bool admin = false;
};

// Per-replica resources from a kernel start request's environment: KERNEL_GPUS (whole GPUs),
// KERNEL_CPUS (cores, fractions allowed, or millicpus with an "m" suffix), KERNEL_MEMORY (MB, or
// with a K/M/G/Ki/Mi/Gi suffix), KERNEL_VRAM (MB). Errors: InvalidArgument naming the variable.
Result<sched::Resources> ResourcesFromEnv(const std::map<std::string, std::string>& env,
                                          const sched::Resources& defaults);

class KernelManager {
 public:
  KernelManager(KernelManagerOptions options, Registry* registry, MetadataStore* store,
                Planner* planner, EdgeCounters* counters);
  ~KernelManager();

  // Starts a kernel of `kernelspec` whose replicas get `env`, owned by `starter`. Errors:
  // InvalidArgument (a bad KERNEL_* value, a request no server could ever meet), PermissionDenied
  // (over the user's quota), ResourceExhausted / Unavailable (no servers now, a replica that did
  // not start).
  Result<KernelRecord> Create(const std::string& kernelspec,
                              const std::map<std::string, std::string>& env,
                              const KernelStarter& starter = {});
  // Removes the kernel from the database, then stops its replicas. NotFound for an unknown
  // kernel; Unavailable, the kernel untouched, when the database cannot be written.
  Status Delete(const std::string& kernel_id);
  Result<KernelRecord> Restart(const std::string& kernel_id);
  // Kernels of the database, with their sessions (their replicas kept running).
  Status Restore();
  // The gateway stops: sessions end (clients 1001), kernels keep running under their daemons.
  void Stop();

  // Suspension of idle kernels (kernel_suspension.cc). SuspendIdle queues a suspension of each
  // kernel idle for `idle` (Registry::IdleKernels). Suspend: the replicated state is checkpointed
  // to the blob store, the replicas are stopped and leave the scheduler's view (their resources
  // are free), the session stays with its clients. Resume (on the first request that needs the
  // replicas, or a restart): three new replicas start from the checkpoint, the session links
  // them and the waiting requests go on. A placed attempt that fails (a daemon that does not
  // answer, a replica that cannot start) is undone and tried again, with a new placement, until
  // kernel_start_timeout after the resume began; the waiting cells are answered
  // (ReplicasUnavailable) only then, or at once when no servers can take the kernel. Errors:
  // Unavailable (busy, no reply, no servers).
  void SuspendIdle(std::chrono::milliseconds idle);
  Status Suspend(const std::string& kernel_id);
  Status Resume(const std::string& kernel_id, SteadyClock::time_point since);

 private:
  Result<std::shared_ptr<KernelSession>> StartSession(const KernelRecord& k);
  Status LaunchReplicas(const std::string& kernel_id, const std::vector<std::string>& server_ids);
  void StopReplicas(const StoredKernel& meta);
  Status AwaitReplicas(const KernelRecord& k);
  void OnShutdownRequested(const std::string& kernel_id, bool restart);
  Status ResumeOnce(const std::string& kernel_id, SteadyClock::time_point deadline, bool* placed);
  Status LinkResumedReplicas(const std::string& kernel_id, SteadyClock::time_point deadline);
  Status RecordResumed(const std::string& kernel_id);
  ReplicaId UndoCutOffResume(StoredKernel& meta);
  Status RecordMarked(const KernelRecord& k, bool StoredKernel::*mark, bool on);
  void ForgetCutOffStart(const StoredKernel& meta);
  void RestartCutOffRestart(const std::string& kernel_id);
  Status CheckQuota(const KernelStarter& starter, const sched::Resources& request) const;

  const KernelManagerOptions options_;
  Registry* registry_;
  MetadataStore* store_;
  Planner* planner_;
  EdgeCounters* counters_;
  // Held from a start's quota check until its kernel is in the registry, so that two starts of
  // one user cannot both pass the check.
  Mutex quota_mu_;
  // Restarts and deletes that clients ask for with shutdown_request, off their session threads.
  KeyedWorkQueue chores_{2, "kernel-chores"};
};

}  // namespace nbos::gateway
