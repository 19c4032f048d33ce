// Suspension of idle kernels (kernel_manager.h). The session stays with its clients throughout:
// while suspended it answers kernel_info itself and holds other requests (kernel_router.h), so an
// open notebook does not wake its kernel, and a cell wakes it without the client reconnecting.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <thread>

#include "gateway/kernel_manager.h"
#include "gateway/replica_ops.h"
#include "jupyter/connection_file.h"

namespace nbos::gateway {

namespace {
constexpr std::chrono::milliseconds kCheckpointTimeout{120000};
constexpr std::chrono::milliseconds kResumeRetryPause{2000};
}  // namespace

void KernelManager::SuspendIdle(std::chrono::milliseconds idle) {
  for (const std::string& id : registry_->IdleKernels(idle)) {
    chores_.Post(id, [this, id] {
      if (Status s = Suspend(id); !s.ok())
        spdlog::info("kernel {} not suspended: {}", id, s.message());
    });
  }
}

Status KernelManager::Suspend(const std::string& kernel_id) {
  std::optional<KernelRecord> found = registry_->FindKernel(kernel_id);
  if (!found) return NotFound("no kernel " + kernel_id);
  MutexLock op(found->op_mu.get());
  std::optional<KernelRecord> k = registry_->FindKernel(kernel_id);
  if (!k || !k->session || k->suspended || !k->in_cluster || k->migrating) {
    return Unavailable("kernel " + kernel_id + " is not running steadily");
  }
  const auto started = SteadyClock::now();
  std::shared_ptr<KernelSession> session = k->session;
  session->HoldExecutions(true, "the idle kernel is being suspended; it starts again next");
  if (session->executing_replica() != 0 || session->execution_state() != "idle") {
    session->HoldExecutions(false);
    return Unavailable("kernel " + kernel_id + " is busy");
  }
  ReplicaId from = session->current_executor();
  if (from == 0) from = k->meta.replicas.front().replica_id;
  auto reply = session->CallControl(from, "nbos_checkpoint_request", jupyter::Json::object(),
                                    kCheckpointTimeout);
  if (!reply.ok() || reply->value("status", "") != "ok" || !(*reply)["key"].is_string()) {
    session->HoldExecutions(false);
    return Unavailable(
        "checkpointing replica " + std::to_string(from) + ": " +
        (reply.ok() ? reply->value("evalue", reply->dump()) : reply.status().message()));
  }
  const std::string key = (*reply)["key"];
  // Recorded before anything stops (no cell runs meanwhile: executions are held): a gateway that
  // goes down from here on restores the kernel suspended on this checkpoint, stops the replicas
  // it had not stopped yet as orphans, and numbers the next ones after theirs. A database that
  // cannot be written leaves the kernel running.
  StoredKernel suspending = k->meta;
  suspending.checkpoint = key;
  suspending.resuming = true;  // its replicas are on their way out (UndoCutOffResume)
  if (Status s = store_->Put(suspending); !s.ok()) {
    session->HoldExecutions(false);
    return s;
  }
  spdlog::info("kernel {}: suspending on checkpoint {}", kernel_id, key);
  // From here requests wait for a resume instead of going to replicas that are stopping.
  session->SetSuspended(true);
  for (const StoredReplica& r : k->meta.replicas) session->RemoveReplica(r.replica_id);
  session->HoldExecutions(false);
  StopReplicas(k->meta);
  const int64_t took_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - started).count();
  if (std::optional<StoredKernel> meta = registry_->MarkSuspended(kernel_id, key, took_ms)) {
    if (Status s = store_->Put(*meta); !s.ok()) {
      spdlog::warn(
          "kernel {}: recording the suspension (a restarted gateway finds it suspended "
          "all the same): {}",
          kernel_id, s.ToString());
    }
  }
  spdlog::info("kernel {} suspended after being idle: checkpoint {}, {} ms", kernel_id, key,
               took_ms);
  return Status::Ok();
}

Status KernelManager::Resume(const std::string& kernel_id, SteadyClock::time_point since) {
  std::optional<KernelRecord> found = registry_->FindKernel(kernel_id);
  if (!found) return NotFound("no kernel " + kernel_id);
  MutexLock op(found->op_mu.get());
  // From now, not from `since`: a resume queued behind another one's attempts still gets the
  // whole timeout for its first.
  const SteadyClock::time_point deadline = SteadyClock::now() + options_.kernel_start_timeout;
  Status s;
  for (bool placed = true; placed;) {
    std::optional<KernelRecord> k = registry_->FindKernel(kernel_id);
    if (!k || !k->suspended || !k->session) return Status::Ok();  // resumed (or deleted) meanwhile
    s = ResumeOnce(kernel_id, deadline, &placed);
    if (s.ok()) break;
    // A launch that failed right after servers came back (a daemon not answering yet, a replica
    // that could not start) may well succeed on the next try, on the same or other servers: the
    // cells keep waiting. Without servers for the kernel they are answered now.
    if (!placed || SteadyClock::now() + kResumeRetryPause >= deadline) break;
    spdlog::warn("kernel {}: resuming failed, trying again: {}", kernel_id, s.ToString());
    std::this_thread::sleep_for(kResumeRetryPause);
  }
  std::optional<KernelRecord> k = registry_->FindKernel(kernel_id);
  if (!k || !k->session) return s;
  if (!s.ok()) {
    spdlog::error("kernel {} did not resume: {}", kernel_id, s.ToString());
    // The waiting cells are answered (no replicas: ReplicasUnavailable) and the next request
    // tries again, not before a pause (this kernel's next Resume runs after this one returns):
    // requests that cannot be answered without replicas (kernel_info before any was seen) stay
    // queued and would wake the kernel at once.
    k->session->SetSuspended(false);
    k->session->SetSuspended(true);
    std::this_thread::sleep_for(kResumeRetryPause);
    return s;
  }
  const int64_t took_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - since).count();
  registry_->MarkResumed(kernel_id, took_ms);
  k->session->SetSuspended(false);
  spdlog::info("kernel {} resumed from checkpoint {} in {} ms", kernel_id, k->meta.checkpoint,
               took_ms);
  return Status::Ok();
}

// One attempt: three replicas placed, launched from the checkpoint and linked. A failed attempt
// leaves nothing behind (replicas unlinked and stopped, placement undone); `placed` tells whether
// servers were found for it.
Status KernelManager::ResumeOnce(const std::string& kernel_id, SteadyClock::time_point deadline,
                                 bool* placed) {
  auto servers = registry_->PlaceForResume(kernel_id, options_.replicas);
  *placed = servers.ok();
  Status s = servers.ok() ? LaunchReplicas(kernel_id, *servers) : servers.status();
  if (s.ok()) s = LinkResumedReplicas(kernel_id, deadline);
  if (s.ok()) s = RecordResumed(kernel_id);
  if (s.ok()) return s;
  if (std::optional<KernelRecord> failed = registry_->FindKernel(kernel_id); failed) {
    for (const StoredReplica& r : failed->meta.replicas) {
      if (failed->session) failed->session->RemoveReplica(r.replica_id);
    }
    StopReplicas(failed->meta);
  }
  registry_->UndoResume(kernel_id);
  // LinkResumedReplicas stored the attempt's replicas: a gateway restarted now must find the
  // kernel suspended on its checkpoint, not on three replicas that are gone.
  if (std::optional<KernelRecord> undone = registry_->FindKernel(kernel_id); undone && *placed) {
    if (Status put = store_->Put(undone->meta); !put.ok()) {
      spdlog::warn("kernel {}: recording the undone resume: {}", kernel_id, put.ToString());
    }
  }
  return s;
}

// The launched replicas join the kernel's session, which waits until each answers, or one of
// them exits for good, or `deadline` passes.
Status KernelManager::LinkResumedReplicas(const std::string& kernel_id,
                                          SteadyClock::time_point deadline) {
  const SteadyClock::time_point linked = SteadyClock::now();
  std::optional<KernelRecord> k = registry_->FindKernel(kernel_id);
  if (!k) return NotFound("kernel " + kernel_id + " was deleted while it resumed");
  StoredKernel resuming = k->meta;
  resuming.resuming = true;
  if (Status s = store_->Put(resuming); !s.ok()) return s;
  spdlog::info("kernel {}: waiting for its resumed replicas", kernel_id);
  std::vector<ReplicaId> ids;
  for (const StoredReplica& r : k->meta.replicas) {
    auto conn = jupyter::ParseConnectionInfo(r.connection_json);
    if (!conn.ok()) return conn.status();
    if (Status s = k->session->AddReplica({r.replica_id, r.server_id, *conn}); !s.ok()) return s;
    ids.push_back(r.replica_id);
  }
  const auto left =
      std::max(std::chrono::milliseconds(1000),
               std::chrono::duration_cast<std::chrono::milliseconds>(deadline - linked));
  return k->session->AwaitReplicas(ids, left, [this, meta = k->meta, linked] {
    return registry_->CheckReplicasNotGivenUp(meta, linked);
  });
}

// Until this is stored, a gateway restarted would take the kernel for suspended (the attempt cut
// off): its cells from now on must not be lost that way, so a failure here fails the attempt.
Status KernelManager::RecordResumed(const std::string& kernel_id) {
  std::optional<KernelRecord> k = registry_->FindKernel(kernel_id);
  if (!k) return NotFound("kernel " + kernel_id + " was deleted while it resumed");
  return store_->Put(k->meta);
}

}  // namespace nbos::gateway
