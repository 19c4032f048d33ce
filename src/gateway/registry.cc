#include "gateway/registry.h"

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <thread>

#include "gateway/replica_ops.h"

namespace nbos::gateway {
namespace {

constexpr size_t kMigrationsRemembered = 100;

size_t LiveReplicas(const KernelRecord& k) {
  size_t live = 0;
  for (const auto& [replica, is_live] : k.replica_live) live += is_live ? 1 : 0;
  return live;
}

// The voters of the kernel's Raft group as far as the gateway knows: its replicas but those
// whose removal committed.
size_t Voters(const KernelRecord& k) {
  return std::count_if(k.meta.replicas.begin(), k.meta.replicas.end(), [&](const StoredReplica& r) {
    return !k.left_confirmed.count(r.replica_id);
  });
}

bool HasLiveMajority(const KernelRecord& k) { return 2 * LiveReplicas(k) > Voters(k); }

// What `status` last said of replica `replica_id` of `kernel_id`, if it exited; else null.
const control::ReplicaStatus* ExitedReplica(const control::ServerStatus& status,
                                            const std::string& kernel_id, uint32_t replica_id) {
  for (const auto& st : status.replicas()) {
    if (st.kernel_id() == kernel_id && st.replica_id() == replica_id && st.state() == "exited") {
      return &st;
    }
  }
  return nullptr;
}

}  // namespace

Registry::Registry(sched::SchedulerOptions options, sched::SchedulerObserver* journal)
    : scheduler_(std::move(options)) {
  MutexLock lock(&mu_);
  scheduler_.set_observer(journal);
}

// The scheduler's clock: ms since the registry was made. Read under mu_, so it never goes
// backwards from one event to the next.
int64_t Registry::NowMs() const {
  return std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - started_)
      .count();
}

// ---- servers ----------------------------------------------------------------------------------

void Registry::SetDaemonClientOptions(daemon::DaemonClientOptions options) {
  MutexLock lock(&mu_);
  client_options_ = std::move(options);
}

void Registry::OnRegister(const control::RegisterRequest& req) {
  MutexLock lock(&mu_);
  pending_servers_.erase(req.server_id());
  last_registration_ = SteadyClock::now();
  if (auto asked = pending_since_.find(req.server_id()); asked != pending_since_.end()) {
    server_start_ms_.push_back(
        std::chrono::duration_cast<std::chrono::milliseconds>(last_registration_ - asked->second)
            .count());
    if (server_start_ms_.size() > kMigrationsRemembered)
      server_start_ms_.erase(server_start_ms_.begin());
    pending_since_.erase(asked);
  }
  ServerRecord& s = servers_[req.server_id()];
  s.server_id = req.server_id();
  if (!s.client || s.client->address() != req.daemon_address())
    s.client = std::make_shared<daemon::DaemonClient>(req.daemon_address(), client_options_);
  s.gpus_virtual = req.gpus_virtual();
  s.last_seen = SteadyClock::now();
  s.alive = true;
  sched::ServerView view;
  view.server_id = req.server_id();
  view.spec = FromProto(req.spec());
  view.accepting = !s.draining;
  if (const sched::ServerView* existing = scheduler_.cluster().FindServer(req.server_id())) {
    view.committed = existing->committed;
    if (Status st = scheduler_.OnServerUpdated(NowMs(), view); !st.ok()) {
      spdlog::error("updating server {}: {}", req.server_id(), st.ToString());
    }
  } else if (Status st = scheduler_.OnServerJoined(NowMs(), view); !st.ok()) {
    spdlog::error("registering server {}: {}", req.server_id(), st.ToString());
  }
  JoinRestoredKernels();
}

// Kernels restored from the database join the scheduler's view once it knows all their servers:
// registered again, or given up on (ExpireUnregistered).
void Registry::JoinRestoredKernels() {
  for (auto& [id, k] : kernels_) {
    if (k.in_cluster || k.suspended) continue;
    bool all = true;
    for (const auto& r : k.meta.replicas)
      all = all && scheduler_.cluster().FindServer(r.server_id) != nullptr;
    if (all && !AddToCluster(k).ok()) spdlog::warn("kernel {} not schedulable", id);
  }
}

Registry::HeartbeatOutcome Registry::OnHeartbeat(const control::ServerStatus& status) {
  HeartbeatOutcome out;
  MutexLock lock(&mu_);
  auto it = servers_.find(status.server_id());
  if (it == servers_.end()) return out;
  out.known = true;
  ServerRecord& s = it->second;
  s.last_seen = SteadyClock::now();
  s.status = status;
  if (!s.alive) {
    spdlog::warn("server {} answers again", s.server_id);
    if (Status st = scheduler_.OnServerAccepting(NowMs(), s.server_id, !s.draining); !st.ok()) {
      spdlog::warn("server {}: {}", s.server_id, st.ToString());
    }
  }
  s.alive = true;
  out.client = s.client;
  out.orphans = FindOrphans(s);
  FindForgotten(s);
  std::set<std::pair<std::string, uint32_t>> running;
  std::map<std::pair<std::string, uint32_t>, std::string> reasons;
  for (const auto& r : status.replicas()) {
    if (r.state() == "running") running.insert({r.kernel_id(), r.replica_id()});
    if (!r.exit_reason().empty()) reasons[{r.kernel_id(), r.replica_id()}] = r.exit_reason();
  }
  for (auto& [id, k] : kernels_) {
    for (const auto& r : k.meta.replicas) {
      if (r.server_id != s.server_id) continue;
      const bool live =
          running.count({id, r.replica_id}) > 0 && k.left_group.count(r.replica_id) == 0;
      auto [pos, inserted] = k.replica_live.emplace(r.replica_id, live);
      if (!inserted && pos->second == live) continue;
      pos->second = live;
      auto why = reasons.find({id, r.replica_id});
      if (k.session) {
        out.changes.push_back(
            {k.session, r.replica_id, live, why == reasons.end() ? "" : why->second});
      }
    }
  }
  return out;
}

// Replicas the server reports that no kernel of the gateway has (a kernel deleted or restarted
// while its server was unregistered, or one the database lost), seen in two heartbeats in a row.
// Kernels with a restart, delete or migration under way are left alone: their replica lists are
// changing.
std::vector<ReplicaRef> Registry::FindOrphans(ServerRecord& s) {
  std::set<std::pair<std::string, uint32_t>> seen;
  std::vector<ReplicaRef> orphans;
  for (const auto& r : s.status.replicas()) {
    if (r.state() == "stopped") continue;
    auto k = kernels_.find(r.kernel_id());
    if (k != kernels_.end()) {
      // An id a server reports is never given to another replica of the kernel (a gateway
      // restarted mid-migration did not record the one it had given).
      k->second.last_replica_id = std::max(k->second.last_replica_id, r.replica_id());
      if (!k->second.op_mu->TryLock()) continue;
      k->second.op_mu->Unlock();
      const auto& replicas = k->second.meta.replicas;
      if (std::any_of(replicas.begin(), replicas.end(), [&](const StoredReplica& m) {
            return m.replica_id == r.replica_id() && m.server_id == s.server_id;
          })) {
        continue;
      }
    }
    const std::pair<std::string, uint32_t> id{r.kernel_id(), r.replica_id()};
    seen.insert(id);
    if (s.orphans_seen.count(id)) orphans.push_back({id.first, id.second});
  }
  s.orphans_seen = std::move(seen);
  return orphans;
}

// Kernels with an operation under way (start, restart, migration, resume) are left alone: their
// replicas may not be launched yet. Two heartbeats in a row rule out one taken just before a
// launch.
void Registry::FindForgotten(ServerRecord& s) {
  std::set<std::pair<std::string, uint32_t>> reported;
  for (const auto& r : s.status.replicas()) reported.insert({r.kernel_id(), r.replica_id()});
  std::set<std::pair<std::string, uint32_t>> missing;
  std::set<std::pair<std::string, uint32_t>> forgotten;
  for (auto& [id, k] : kernels_) {
    if (!k.in_cluster || k.suspended || k.migrating || !k.op_mu->TryLock()) continue;
    k.op_mu->Unlock();
    for (const StoredReplica& r : k.meta.replicas) {
      const std::pair<std::string, uint32_t> key{id, r.replica_id};
      if (r.server_id != s.server_id || reported.count(key)) continue;
      missing.insert(key);
      if (s.missing_seen.count(key)) forgotten.insert(key);
    }
  }
  for (const auto& key : forgotten) {
    if (!s.forgotten.count(key)) {
      spdlog::warn("server {} no longer runs replica {} of kernel {} (its daemon restarted?)",
                   s.server_id, key.second, key.first);
    }
  }
  s.missing_seen = std::move(missing);
  s.forgotten = std::move(forgotten);
}

std::vector<LivenessChange> Registry::ExpireServers(std::chrono::milliseconds timeout) {
  std::vector<LivenessChange> lost;
  MutexLock lock(&mu_);
  const auto now = SteadyClock::now();
  for (auto& [id, s] : servers_) {
    if (!s.alive || now - s.last_seen < timeout) continue;
    s.alive = false;
    if (Status st = scheduler_.OnServerAccepting(NowMs(), id, false); !st.ok()) {
      spdlog::warn("server {}: {}", id, st.ToString());
    }
    spdlog::warn("server {} missed its heartbeats; its replicas count as lost", id);
    NoteEventLocked("server-lost", "", id + " missed its heartbeats; its replicas count as lost");
    for (auto& [kid, k] : kernels_) {
      for (const auto& r : k.meta.replicas) {
        if (r.server_id != id) continue;
        k.replica_live[r.replica_id] = false;
        k.lost_since.emplace(r.replica_id, now);
        if (k.session) lost.push_back({k.session, r.replica_id, false});
      }
    }
  }
  if (now - made_ >= timeout) ExpireUnregistered(now, &lost);
  return lost;
}

// A gateway restarted while a server was down (or after it was lost) hears nothing from it: its
// replicas, listed as starting, would be waited for for ever instead of replaced.
void Registry::ExpireUnregistered(SteadyClock::time_point now, std::vector<LivenessChange>* lost) {
  std::set<std::string> silent;
  for (auto& [kid, k] : kernels_) {
    for (const auto& r : k.meta.replicas) {
      if (servers_.count(r.server_id) || k.replica_live.count(r.replica_id)) continue;
      k.replica_live[r.replica_id] = false;
      k.lost_since.emplace(r.replica_id, now);
      if (k.session) lost->push_back({k.session, r.replica_id, false});
      silent.insert(r.server_id);
    }
  }
  for (const std::string& id : silent) {
    spdlog::warn(
        "server {} has not registered since the gateway started; its replicas count as "
        "lost",
        id);
    NoteEventLocked("server-lost", "", id + " has not registered since the gateway started");
  }
  OrphanOnUnregistered(silent);
}

// Its kernels join the scheduler's view with their replicas there orphaned, as a server that left
// would leave them: the scheduler moves orphans first, and counts them again should the server
// register after all. It knows a kernel only with each replica's server, so the server joins
// (with no resources, taking nothing) and leaves around the kernels' joining.
void Registry::OrphanOnUnregistered(const std::set<std::string>& silent) {
  std::vector<std::string> joined;
  for (const std::string& id : silent) {
    if (scheduler_.cluster().FindServer(id) != nullptr) continue;
    sched::ServerView unknown;
    unknown.server_id = id;
    unknown.accepting = false;
    if (Status st = scheduler_.OnServerJoined(NowMs(), unknown); st.ok()) joined.push_back(id);
  }
  JoinRestoredKernels();
  for (const std::string& id : joined) {
    if (Status st = scheduler_.OnServerLeft(NowMs(), id); !st.ok()) {
      spdlog::error("server {}: {}", id, st.ToString());
    }
  }
}

std::shared_ptr<daemon::DaemonClient> Registry::ClientLocked(const std::string& server_id) const {
  auto it = servers_.find(server_id);
  return it == servers_.end() ? nullptr : it->second.client;
}

std::shared_ptr<daemon::DaemonClient> Registry::Client(const std::string& server_id) const {
  MutexLock lock(&mu_);
  return ClientLocked(server_id);
}

std::shared_ptr<daemon::DaemonClient> Registry::AwaitClient(
    const std::string& server_id, std::chrono::milliseconds timeout) const {
  const auto deadline = SteadyClock::now() + timeout;
  for (;;) {
    if (auto c = Client(server_id)) return c;
    if (SteadyClock::now() >= deadline) return nullptr;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

Status Registry::CheckReplicasNotGivenUp(const StoredKernel& meta,
                                         SteadyClock::time_point since) const {
  MutexLock lock(&mu_);
  for (const StoredReplica& r : meta.replicas) {
    auto it = servers_.find(r.server_id);
    if (it == servers_.end() || it->second.last_seen <= since) continue;
    if (const auto* st = ExitedReplica(it->second.status, meta.kernel_id, r.replica_id)) {
      return Unavailable(fmt::format(
          "replica {} of kernel {} on server {} exited (code {}) and will not be restarted; "
          "its replica.log on that server says why",
          r.replica_id, meta.kernel_id, r.server_id, st->exit_code()));
    }
  }
  return Status::Ok();
}

// ---- kernels ----------------------------------------------------------------------------------

Status Registry::AddToCluster(KernelRecord& k) {
  sched::KernelView view;
  view.kernel_id = k.meta.kernel_id;
  view.request = k.request;
  for (const StoredReplica& r : k.meta.replicas)
    view.replicas.push_back({k.meta.kernel_id, r.replica_id, r.server_id});
  Status s = scheduler_.OnKernelPlaced(NowMs(), std::move(view));
  k.in_cluster = s.ok();
  return s;
}

Result<std::vector<std::string>> Registry::PlaceKernel(KernelRecord k, int replicas) {
  MutexLock lock(&mu_);
  k.last_replica_id = 0;
  auto servers = PlaceLocked(k, replicas);
  if (!servers.ok()) return servers;
  const std::string id = k.meta.kernel_id;
  kernels_[id] = std::move(k);
  return servers;
}

// Places `k`'s replicas (ids after k.last_replica_id) and adds it to the scheduler's view.
Result<std::vector<std::string>> Registry::PlaceLocked(KernelRecord& k, int replicas) {
  if (Status s = sched::CheckRequestFitsSomeServer(scheduler_.cluster(), k.request); !s.ok()) {
    return s;
  }
  (void)scheduler_.OnTick(NowMs());  // SR_c sampled with the demand of this moment
  sched::PlacementRequested po;
  po.kernel_id = k.meta.kernel_id;
  po.request = k.request;
  po.replicas = replicas;
  // There is no host provider to scale out with: place anyway and say so.
  po.can_scale_out = false;
  auto placement = scheduler_.RequestPlacement(NowMs(), std::move(po));
  if (!placement.ok()) return placement.status();
  if (placement->server_ids.empty()) {
    return ResourceExhausted("no " + std::to_string(replicas) +
                             " servers can host this kernel: " + placement->reason);
  }
  if (placement->ratio_ignored) {
    spdlog::warn("kernel {} placed above the subscription ratio: {}", k.meta.kernel_id,
                 placement->reason);
  }
  k.meta.replicas.clear();
  for (const std::string& server_id : placement->server_ids) {
    k.meta.replicas.push_back({++k.last_replica_id, server_id, "", ""});
  }
  if (Status s = AddToCluster(k); !s.ok()) return s;
  return placement->server_ids;
}

std::vector<std::string> Registry::IdleKernels(std::chrono::milliseconds idle) const {
  std::vector<std::pair<std::string, std::shared_ptr<KernelSession>>> candidates;
  {
    MutexLock lock(&mu_);
    for (const auto& [id, k] : kernels_) {
      if (!k.session || k.suspended || !k.in_cluster || k.migrating) continue;
      bool all_live = k.replica_live.size() == k.meta.replicas.size();
      for (const auto& [replica, live] : k.replica_live) all_live = all_live && live;
      if (all_live) candidates.emplace_back(id, k.session);
    }
  }
  // The sessions are asked outside the lock: their threads may be calling into the registry.
  const int64_t now_us = std::chrono::duration_cast<std::chrono::microseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  std::vector<std::string> out;
  for (const auto& [id, session] : candidates) {
    if (session->execution_state() == "idle" &&
        now_us - session->last_activity_us() >=
            std::chrono::duration_cast<std::chrono::microseconds>(idle).count()) {
      out.push_back(id);
    }
  }
  return out;
}

std::optional<StoredKernel> Registry::MarkSuspended(const std::string& kernel_id,
                                                    const std::string& checkpoint,
                                                    int64_t took_ms) {
  MutexLock lock(&mu_);
  auto it = kernels_.find(kernel_id);
  if (it == kernels_.end()) return std::nullopt;
  KernelRecord& k = it->second;
  if (k.in_cluster) {
    if (Status s = scheduler_.OnKernelRemoved(NowMs(), kernel_id); !s.ok()) {
      spdlog::warn("kernel {}: leaving the scheduler's view: {}", kernel_id, s.ToString());
    }
  }
  k.in_cluster = false;
  k.suspended = true;
  k.meta.checkpoint = checkpoint;
  k.meta.replicas.clear();
  k.replica_live.clear();
  k.lost_since.clear();
  ++counters_.suspensions;
  NoteEventLocked("suspend", kernel_id, fmt::format("suspended while idle ({} ms)", took_ms));
  counters_.suspend_ms.push_back(took_ms);
  if (counters_.suspend_ms.size() > 100) counters_.suspend_ms.erase(counters_.suspend_ms.begin());
  return k.meta;
}

Result<std::vector<std::string>> Registry::PlaceForResume(const std::string& kernel_id,
                                                          int replicas) {
  MutexLock lock(&mu_);
  auto it = kernels_.find(kernel_id);
  if (it == kernels_.end()) return NotFound("no kernel " + kernel_id);
  return PlaceLocked(it->second, replicas);
}

void Registry::UndoResume(const std::string& kernel_id) {
  MutexLock lock(&mu_);
  auto it = kernels_.find(kernel_id);
  if (it == kernels_.end()) return;
  if (it->second.in_cluster) (void)scheduler_.OnKernelRemoved(NowMs(), kernel_id);
  it->second.in_cluster = false;
  it->second.meta.replicas.clear();
  it->second.replica_live.clear();
}

void Registry::MarkResumed(const std::string& kernel_id, int64_t took_ms) {
  MutexLock lock(&mu_);
  auto it = kernels_.find(kernel_id);
  if (it == kernels_.end()) return;
  it->second.suspended = false;
  ++counters_.resumes;
  NoteEventLocked("resume", kernel_id, fmt::format("resumed in {} ms", took_ms));
  counters_.resume_ms.push_back(took_ms);
  if (counters_.resume_ms.size() > 100) counters_.resume_ms.erase(counters_.resume_ms.begin());
}

void Registry::RestoreKernel(KernelRecord k) {
  for (const StoredReplica& r : k.meta.replicas)
    k.last_replica_id = std::max(k.last_replica_id, r.replica_id);
  MutexLock lock(&mu_);
  const std::string id = k.meta.kernel_id;
  kernels_[id] = std::move(k);
}

std::optional<KernelRecord> Registry::FindKernel(const std::string& kernel_id) const {
  MutexLock lock(&mu_);
  auto it = kernels_.find(kernel_id);
  if (it == kernels_.end()) return std::nullopt;
  return it->second;
}

std::vector<KernelRecord> Registry::Kernels() const {
  MutexLock lock(&mu_);
  std::vector<KernelRecord> all;
  all.reserve(kernels_.size());
  for (const auto& [id, k] : kernels_) all.push_back(k);
  return all;
}

bool Registry::UpdateKernel(const std::string& kernel_id,
                            const std::function<void(KernelRecord&)>& change) {
  MutexLock lock(&mu_);
  auto it = kernels_.find(kernel_id);
  if (it == kernels_.end()) return false;
  change(it->second);
  return true;
}

std::optional<KernelRecord> Registry::RemoveKernel(const std::string& kernel_id) {
  MutexLock lock(&mu_);
  auto it = kernels_.find(kernel_id);
  if (it == kernels_.end()) return std::nullopt;
  KernelRecord removed = std::move(it->second);
  kernels_.erase(it);
  if (scheduler_.cluster().FindKernel(kernel_id) != nullptr) {
    if (Status s = scheduler_.OnKernelRemoved(NowMs(), kernel_id); !s.ok()) {
      spdlog::warn("kernel {}: {}", kernel_id, s.ToString());
    }
  }
  return removed;
}

void Registry::CountKernelStarted() {
  MutexLock lock(&mu_);
  ++counters_.kernels_started;
}

// ---- executions -------------------------------------------------------------------------------

Result<ExecutorCandidates> Registry::RequestExecutor(const std::string& kernel_id,
                                                     const std::string& exec_id, int gpus,
                                                     ReplicaId requested,
                                                     const std::set<ReplicaId>& live) {
  MutexLock lock(&mu_);
  const sched::KernelView* view = scheduler_.cluster().FindKernel(kernel_id);
  if (view == nullptr) return NotFound("kernel " + kernel_id + " is not in the scheduler's view");
  int32_t largest = 0;
  for (const auto& [id, server] : scheduler_.cluster().servers())
    largest = std::max(largest, server.spec.gpus);
  if (gpus > largest) {
    return InvalidArgument(
        fmt::format("this cell asks for {} GPU(s); the largest server has {}", gpus, largest));
  }
  sched::ExecutorRequested request;
  request.kernel_id = kernel_id;
  request.gpus = gpus;
  for (const auto& r : view->replicas)
    if (!live.count(r.replica_id)) request.excluded_replicas.insert(r.replica_id);
  if (requested) request.target_replica = requested;
  request.warm_servers = WarmServers();
  auto decision = scheduler_.RequestExecutor(NowMs(), std::move(request));
  if (!decision.ok()) return decision.status();
  view = scheduler_.cluster().FindKernel(kernel_id);  // the event may have changed the view
  ExecutorCandidates out;
  const sched::ExecutorChoice& choice = decision->choice;
  if (!choice.note.empty()) spdlog::info("kernel {}: {}", kernel_id, choice.note);
  for (uint32_t id : choice.candidates) {
    const sched::ReplicaView* r = view == nullptr ? nullptr : view->FindReplica(id);
    if (r == nullptr) continue;
    out.candidates.push_back({id, r->server_id, ClientLocked(r->server_id)});
  }
  if (decision->migration) {
    const sched::MigrationPlan& m = *decision->migration;
    if (logged_migration_.insert(exec_id).second) {
      spdlog::info(
          "kernel {}: no replica's server has {} idle GPU(s); migration plan: replica {} from {} "
          "to {}{}",
          kernel_id, gpus, m.replica_id, m.from_server_id,
          m.to_server_id.empty() ? "(none)" : m.to_server_id,
          m.scale_out_needed ? " (scale-out needed: " + m.reason + ")" : "");
    }
    auto k = kernels_.find(kernel_id);
    if (m.scale_out_needed) WantScaleOut("a cell needs GPUs no server has free: " + m.reason);
    // A plan without a target waits for GPUs to free up or a server to be added.
    if (!m.scale_out_needed && !m.to_server_id.empty() && k != kernels_.end() &&
        !k->second.migrating && SteadyClock::now() >= k->second.migration_retry_after) {
      k->second.migrating = true;
      out.migration = m;
    }
    out.wait = WaitReasonLocked(k == kernels_.end() ? nullptr : &k->second, out.migration);
  }
  return out;
}

namespace {

// "(≈ 0.3 s)" from the median of past durations; "" with none.
std::string EstimateFrom(std::vector<int64_t> durations_ms) {
  if (durations_ms.empty()) return "";
  std::nth_element(durations_ms.begin(), durations_ms.begin() + durations_ms.size() / 2,
                   durations_ms.end());
  const double s = static_cast<double>(durations_ms[durations_ms.size() / 2]) / 1000.0;
  return s < 10 ? fmt::format(" (≈ {:.1f} s)", s) : fmt::format(" (≈ {:.0f} s)", s);
}

}  // namespace

std::string Registry::WaitReasonLocked(const KernelRecord* k,
                                       const std::optional<sched::MigrationPlan>& starting) const {
  const std::string eta = EstimateFrom(counters_.migration_ms);
  if (starting) {
    return fmt::format("moving replica {} to {}{}", starting->replica_id, starting->to_server_id,
                       eta);
  }
  if (k != nullptr && k->migration) {
    return fmt::format("moving replica {} to {}{}", k->migration->leaving_replica,
                       k->migration->to_server_id, eta);
  }
  if (k != nullptr && k->migrating) return "moving a replica to a server with free GPUs" + eta;
  if (!pending_servers_.empty()) {
    return fmt::format("a new server ({}) is starting{}", fmt::join(pending_servers_, ", "),
                       EstimateFrom(server_start_ms_));
  }
  return "every server's GPUs are in use by other cells";
}

void Registry::OnGrantCommitted(const std::string& kernel_id, const std::string& exec_id,
                                ReplicaId replica, const std::string& server_id, int gpus) {
  MutexLock lock(&mu_);
  if (gpus > 0) ++counters_.grants_made;
  logged_migration_.erase(exec_id);
  if (Status s = scheduler_.OnGrantCommitted(
          NowMs(), {kernel_id, replica, server_id, sched::Resources{0, 0, gpus, 0}});
      !s.ok()) {
    spdlog::warn("kernel {}: recording grant: {}", kernel_id, s.ToString());
  }
}

void Registry::OnGrantRefused() {
  MutexLock lock(&mu_);
  ++counters_.grants_refused;
}

void Registry::OnGrantReleased(const std::string& kernel_id, ReplicaId replica,
                               const std::string& server_id, int gpus) {
  MutexLock lock(&mu_);
  if (Status s = scheduler_.OnGrantReleased(
          NowMs(), {kernel_id, replica, server_id, sched::Resources{0, 0, gpus, 0}});
      !s.ok()) {
    spdlog::warn("kernel {}: recording release: {}", kernel_id, s.ToString());
  }
}

Registry::TickOutcome Registry::Tick() {
  MutexLock lock(&mu_);
  TickOutcome out;
  sched::TickDecision tick = scheduler_.OnTick(NowMs());
  if (tick.scaling_evaluated) out.scaling = tick.scaling;
  for (sched::RebalancePlan& r : tick.rebalance) {
    auto k = kernels_.find(r.kernel_id);
    if (k == kernels_.end() || k->second.migrating ||
        SteadyClock::now() < k->second.migration_retry_after) {
      continue;
    }
    k->second.migrating = true;
    out.rebalance.push_back(std::move(r));
  }
  return out;
}

// ---- scaling ----------------------------------------------------------------------------------

// A server on its way, or one that registered a moment ago, is what a waiting cell needs: it finds
// it at its next plan (every few ms), so a want from before then asks for nothing more.
void Registry::WantScaleOut(const std::string& reason) {
  constexpr auto kRegistrationSettle = std::chrono::seconds(2);
  if (!pending_servers_.empty() || SteadyClock::now() - last_registration_ < kRegistrationSettle) {
    return;
  }
  scale_out_wanted_ = true;
  scale_out_reason_ = reason;
}

bool Registry::TakeScaleOutWanted(std::string* reason) {
  MutexLock lock(&mu_);
  const bool wanted = scale_out_wanted_;
  scale_out_wanted_ = false;
  *reason = scale_out_reason_;
  return wanted;
}

void Registry::NoteEvent(std::string kind, std::string kernel_id, std::string text) {
  MutexLock lock(&mu_);
  NoteEventLocked(std::move(kind), std::move(kernel_id), std::move(text));
}

void Registry::NoteEventLocked(std::string kind, std::string kernel_id, std::string text) {
  constexpr size_t kEventsRemembered = 200;
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  counters_.events.push_back(
      {++events_noted_, now_ms, std::move(kind), std::move(kernel_id), std::move(text)});
  if (counters_.events.size() > kEventsRemembered) counters_.events.erase(counters_.events.begin());
}

void Registry::RecordExecutionDelay(double delay_ms) {
  constexpr size_t kDelaysKept = 10'000;
  MutexLock lock(&mu_);
  if (execution_delays_ms_.size() < kDelaysKept) execution_delays_ms_.push_back(delay_ms);
}

std::vector<double> Registry::TakeExecutionDelays() {
  MutexLock lock(&mu_);
  return std::exchange(execution_delays_ms_, {});
}

void Registry::RecordScaleEvent(std::string kind, std::vector<std::string> ids,
                                std::string reason) {
  constexpr size_t kScaleEventsRemembered = 50;
  NoteEventLocked(kind == "out" ? "scale-out" : "scale-in", "",
                  fmt::format("{} {}: {}", kind == "out" ? "adding" : "removing",
                              fmt::join(ids, ", "), reason));
  counters_.scale_events.push_back({NowMs(), std::move(kind), std::move(ids), std::move(reason)});
  if (counters_.scale_events.size() > kScaleEventsRemembered)
    counters_.scale_events.erase(counters_.scale_events.begin());
}

void Registry::NoteScaleOut(const std::vector<std::string>& server_ids, const std::string& reason,
                            bool scale_out) {
  MutexLock lock(&mu_);
  for (const std::string& id : server_ids)
    if (!servers_.count(id) && pending_servers_.insert(id).second)
      pending_since_[id] = SteadyClock::now();
  if (!scale_out) return;
  counters_.scale_outs += server_ids.size();
  RecordScaleEvent("out", server_ids, reason);
}

bool Registry::BeginRelease(const std::string& server_id, const std::string& reason) {
  MutexLock lock(&mu_);
  auto s = servers_.find(server_id);
  if (s == servers_.end() || !s->second.alive || s->second.draining) return false;
  s->second.draining = s->second.releasing = true;
  s->second.release_started = SteadyClock::now();
  if (Status st = scheduler_.OnServerAccepting(NowMs(), server_id, false); !st.ok()) {
    spdlog::warn("server {}: {}", server_id, st.ToString());
  }
  spdlog::info("server {}: released for scale-in ({}); moving its replicas off", server_id, reason);
  return true;
}

std::vector<std::string> Registry::EmptiedServers(std::chrono::milliseconds give_up) {
  MutexLock lock(&mu_);
  std::set<std::string> busy;
  for (const auto& [id, k] : kernels_) {
    for (const StoredReplica& r : k.meta.replicas) busy.insert(r.server_id);
    if (k.migration) busy.insert(k.migration->to_server_id);
  }
  std::vector<std::string> emptied;
  const auto now = SteadyClock::now();
  for (auto& [id, s] : servers_) {
    if (!s.releasing) continue;
    const sched::ServerView* view = scheduler_.cluster().FindServer(id);
    const bool idle =
        view != nullptr && view->committed.gpus == 0 && s.status.ledger().committed().gpus() == 0;
    if (!busy.count(id) && idle) {
      emptied.push_back(id);
    } else if (now - s.release_started > give_up) {
      spdlog::warn("server {}: could not be emptied for scale-in; it accepts replicas again", id);
      s.draining = s.releasing = false;
      if (Status st = scheduler_.OnServerAccepting(NowMs(), id, true); !st.ok()) {
        spdlog::warn("server {}: {}", id, st.ToString());
      }
    }
  }
  return emptied;
}

void Registry::RemoveServer(const std::string& server_id, const std::string& reason) {
  MutexLock lock(&mu_);
  servers_.erase(server_id);
  if (Status st = scheduler_.OnServerLeft(NowMs(), server_id); !st.ok()) {
    spdlog::warn("server {}: {}", server_id, st.ToString());
  }
  ++counters_.scale_ins;
  RecordScaleEvent("in", {server_id}, reason);
}

// ---- migration --------------------------------------------------------------------------------

std::set<std::string, std::less<>> Registry::WarmServers() const {
  std::set<std::string, std::less<>> warm;
  for (const auto& [id, s] : servers_)
    if (s.alive && s.status.warm_pool().ready() > 0) warm.insert(id);
  return warm;
}

ReplicaId Registry::ReplicaToMove(const KernelRecord& k, std::string* reason) const {
  if (!k.left_group.empty()) {
    *reason = fmt::format("replacing replica {}, which left the Raft group", *k.left_group.begin());
    return *k.left_group.begin();
  }
  for (const StoredReplica& r : k.meta.replicas) {
    auto server = servers_.find(r.server_id);
    if (server == servers_.end()) {
      // Not registered since the gateway started: lost once ExpireUnregistered said so.
      auto live = k.replica_live.find(r.replica_id);
      if (live == k.replica_live.end() || live->second) continue;
      *reason = fmt::format(
          "replacing replica {}, whose server {} has not registered since the "
          "gateway started",
          r.replica_id, r.server_id);
      return r.replica_id;
    }
    *reason = "replacing a lost replica";
    if (!server->second.alive) return r.replica_id;
    if (server->second.forgotten.count({k.meta.kernel_id, r.replica_id})) {
      *reason = fmt::format("replacing replica {}, which server {} no longer runs", r.replica_id,
                            r.server_id);
      return r.replica_id;
    }
    if (ExitedReplica(server->second.status, k.meta.kernel_id, r.replica_id)) return r.replica_id;
    *reason = "draining server " + r.server_id;
    if (server->second.draining) return r.replica_id;
  }
  for (const auto& [replica, why] : k.diverged) {
    auto live = k.replica_live.find(replica);
    if (live == k.replica_live.end() || !live->second ||
        SteadyClock::now() < k.divergence_retry_after) {
      continue;
    }
    *reason = fmt::format("replacing replica {}, which cannot follow its log ({})", replica, why);
    return replica;
  }
  reason->clear();
  return 0;
}

void Registry::NoteDivergence(const std::string& kernel_id, uint32_t replica_id,
                              const std::string& why) {
  MutexLock lock(&mu_);
  auto k = kernels_.find(kernel_id);
  if (k == kernels_.end()) return;
  if (why.empty()) {
    if (k->second.diverged.erase(replica_id) > 0) {
      spdlog::info("kernel {}: replica {} follows its log again", kernel_id, replica_id);
    }
    return;
  }
  if (!k->second.diverged.count(replica_id)) {
    k->second.divergence_retry_after =
        std::max(k->second.divergence_retry_after, SteadyClock::now() + kDivergenceGrace);
  }
  k->second.diverged[replica_id] = why;
  spdlog::warn("kernel {}: replica {} cannot follow its log: {}", kernel_id, replica_id, why);
  NoteEventLocked("replica-diverged", kernel_id,
                  fmt::format("replica {} cannot follow its log: {}", replica_id, why));
}

// Logged when the reason a kernel waits changes, not every retry.
void Registry::LogMoveWait(KernelRecord& k, std::string why) {
  if (why == k.move_wait_logged) return;
  spdlog::warn("kernel {}: {}", k.meta.kernel_id, why);
  k.move_wait_logged = std::move(why);
}

std::vector<MovePlan> Registry::PlanMoves(std::chrono::milliseconds retry) {
  MutexLock lock(&mu_);
  std::vector<MovePlan> plans;
  const auto now = SteadyClock::now();
  for (auto& [id, k] : kernels_) {
    if (!k.in_cluster || !k.session || k.migrating || now < k.migration_retry_after ||
        k.group_check_due || k.group_check_running) {
      continue;
    }
    std::string reason;
    const ReplicaId lost = ReplicaToMove(k, &reason);
    if (lost == 0) {
      NoteMajorityLost(k);
      k.lost_since.clear();  // replicas seen lost came back
      k.move_wait_logged.clear();
      continue;
    }
    if (!k.replica_live.count(lost) || !k.replica_live.at(lost)) k.lost_since.emplace(lost, now);
    NoteMajorityLost(k);
    if (!HasLiveMajority(k)) {
      k.migration_retry_after = now + retry;
      LogMoveWait(k, fmt::format("{} of {} voters live; waiting for a majority to replace one",
                                 LiveReplicas(k), Voters(k)));
      continue;
    }
    auto plan = scheduler_.RequestMove(NowMs(), {id, lost, "", WarmServers()});
    if (!plan.ok() || plan->scale_out_needed || plan->to_server_id.empty()) {
      if (plan.ok() && plan->scale_out_needed) {
        WantScaleOut("no server can take a replica that must move: " + plan->reason);
      }
      k.migration_retry_after = now + retry;
      LogMoveWait(k, fmt::format("no server can take a replacement for replica {}: {}", lost,
                                 plan.ok() ? plan->reason : plan.status().ToString()));
      continue;
    }
    k.migrating = true;
    if (k.diverged.count(lost)) {
      const bool quiet = now - k.divergence_retry_after > kDivergenceQuiet;
      k.divergence_backoff = quiet ? kDivergenceBackoffFirst
                                   : std::min(2 * k.divergence_backoff, kDivergenceBackoffMax);
      k.divergence_retry_after = now + k.divergence_backoff;
    }
    plans.push_back({id, std::move(plan).value(), std::move(reason)});
  }
  return plans;
}

std::vector<Revival> Registry::PlanRevivals(std::chrono::milliseconds every) {
  MutexLock lock(&mu_);
  std::vector<Revival> revivals;
  const auto now = SteadyClock::now();
  for (auto& [id, k] : kernels_) {
    if (!k.session || k.suspended || k.migrating) continue;
    if (HasLiveMajority(k)) continue;
    for (const StoredReplica& r : k.meta.replicas) {
      auto server = servers_.find(r.server_id);
      if (server == servers_.end() || !server->second.alive || k.left_group.count(r.replica_id) ||
          (k.revived_at.count(r.replica_id) && now - k.revived_at[r.replica_id] < every)) {
        continue;
      }
      const auto* st = ExitedReplica(server->second.status, id, r.replica_id);
      if (st != nullptr && st->exit_code() != 0) {
        k.revived_at[r.replica_id] = now;
        revivals.push_back({k.meta, r.replica_id, r.server_id, server->second.client});
      }
    }
  }
  return revivals;
}

std::vector<KernelRecord> Registry::PlanGroupChecks(std::chrono::milliseconds suspect_every,
                                                    std::chrono::milliseconds every) {
  MutexLock lock(&mu_);
  std::vector<KernelRecord> checks;
  const auto now = SteadyClock::now();
  for (auto& [id, k] : kernels_) {
    if (!k.session || k.suspended || k.migrating || k.group_check_running || LiveReplicas(k) == 0) {
      continue;
    }
    const auto since = now - k.group_checked_at;
    if (!k.group_check_due && since < every && (since < suspect_every || HasLiveMajority(k))) {
      continue;
    }
    k.group_check_running = true;
    k.group_checked_at = now;
    checks.push_back(k);
  }
  return checks;
}

void Registry::GroupChecked(const std::string& kernel_id) {
  MutexLock lock(&mu_);
  auto it = kernels_.find(kernel_id);
  if (it == kernels_.end()) return;
  it->second.group_check_running = false;
  it->second.group_check_due = false;
}

std::optional<StoredKernel> Registry::KeepMember(const std::string& kernel_id,
                                                 ReplicaId replica_id) {
  MutexLock lock(&mu_);
  auto it = kernels_.find(kernel_id);
  if (it == kernels_.end()) return std::nullopt;
  KernelRecord& k = it->second;
  if (k.migrating || !k.left_group.count(replica_id) || k.left_confirmed.count(replica_id)) {
    return std::nullopt;
  }
  k.left_group.erase(replica_id);
  k.replica_live.erase(replica_id);  // the next heartbeat of its server tells the session
  for (StoredReplica& r : k.meta.replicas) {
    if (r.replica_id == replica_id) r.left_group = false;
  }
  NoteEventLocked("member-kept", kernel_id,
                  fmt::format("replica {} is still a member of the Raft group", replica_id));
  return k.meta;
}

std::optional<StoredKernel> Registry::NoteGone(const std::string& kernel_id, ReplicaId replica_id) {
  MutexLock lock(&mu_);
  auto it = kernels_.find(kernel_id);
  if (it == kernels_.end() || it->second.migrating || it->second.left_confirmed.count(replica_id)) {
    return std::nullopt;
  }
  KernelRecord& k = it->second;
  bool known = false;
  for (StoredReplica& r : k.meta.replicas) {
    if (r.replica_id != replica_id) continue;
    r.left_group = true;
    known = true;
  }
  if (!known) return std::nullopt;
  k.left_group.insert(replica_id);
  k.left_confirmed.insert(replica_id);
  k.replica_live[replica_id] = false;
  NoteEventLocked("member-gone", kernel_id,
                  fmt::format("replica {} is no longer a member of the Raft group", replica_id));
  return k.meta;
}

// A replica its server no longer runs is gone with its log (a restarted daemon forgets both);
// one on a lost server may come back. A replica known to have left is no voter any more. When
// the gone ones leave no majority of the voters, none can form again.
void Registry::NoteMajorityLost(KernelRecord& k) {
  size_t voters = 0, gone = 0;
  for (const StoredReplica& r : k.meta.replicas) {
    if (k.left_confirmed.count(r.replica_id)) continue;
    ++voters;
    auto server = servers_.find(r.server_id);
    if (server != servers_.end() &&
        server->second.forgotten.count({k.meta.kernel_id, r.replica_id}))
      ++gone;
  }
  const std::string why =
      voters > 0 && 2 * (voters - gone) <= voters
          ? fmt::format(
                "{} of the {} members of this kernel's Raft group {} gone with their logs (their "
                "servers restarted without them)",
                gone, voters, gone == 1 ? "is" : "are")
          : "";
  if (why == k.majority_lost) return;
  k.majority_lost = why;
  if (!why.empty()) {
    spdlog::error("kernel {}: {}; it cannot run cells again", k.meta.kernel_id, why);
    NoteEventLocked("majority-lost", k.meta.kernel_id, why);
  }
  k.session->SetMajorityLost(why);
}

Result<sched::MigrationPlan> Registry::RequestMove(const std::string& kernel_id,
                                                   uint32_t replica_id,
                                                   const std::string& to_server_id) {
  MutexLock lock(&mu_);
  auto k = kernels_.find(kernel_id);
  if (k == kernels_.end() || !k->second.session) return NotFound("no kernel " + kernel_id);
  if (!k->second.in_cluster) {
    return Unavailable("kernel " + kernel_id + " waits for its servers to register");
  }
  if (k->second.migrating) {
    return Unavailable("a migration of kernel " + kernel_id + " is already under way");
  }
  auto plan = scheduler_.RequestMove(NowMs(), {kernel_id, replica_id, to_server_id, WarmServers()});
  if (!plan.ok()) return plan.status();
  if (plan->scale_out_needed || plan->to_server_id.empty()) {
    return Unavailable("no server can take a replica of kernel " + kernel_id + ": " + plan->reason);
  }
  k->second.migrating = true;
  return plan;
}

Result<size_t> Registry::DrainServer(const std::string& server_id) {
  MutexLock lock(&mu_);
  auto s = servers_.find(server_id);
  if (s == servers_.end()) return NotFound("no server " + server_id);
  if (!s->second.draining) spdlog::warn("server {} drains: its replicas are moved off", server_id);
  s->second.draining = true;
  if (Status st = scheduler_.OnServerAccepting(NowMs(), server_id, false); !st.ok()) {
    spdlog::warn("server {}: {}", server_id, st.ToString());
  }
  size_t held = 0;
  for (const auto& [id, k] : kernels_) {
    for (const StoredReplica& r : k.meta.replicas) held += r.server_id == server_id ? 1 : 0;
  }
  return held;
}

bool Registry::ServerAlive(const std::string& server_id) const {
  MutexLock lock(&mu_);
  auto s = servers_.find(server_id);
  return s != servers_.end() && s->second.alive;
}

bool Registry::BeginMigration(const std::string& kernel_id) {
  MutexLock lock(&mu_);
  auto k = kernels_.find(kernel_id);
  if (k == kernels_.end() || k->second.migrating ||
      SteadyClock::now() < k->second.migration_retry_after) {
    return false;
  }
  k->second.migrating = true;
  return true;
}

void Registry::EndMigration(const std::string& kernel_id, const Status& outcome,
                            std::chrono::milliseconds backoff) {
  MutexLock lock(&mu_);
  auto k = kernels_.find(kernel_id);
  if (k != kernels_.end()) {
    k->second.migrating = false;
    k->second.migration.reset();
    if (!outcome.ok()) {
      k->second.migration_retry_after = SteadyClock::now() + backoff;
      k->second.group_check_due = true;
    }
  }
  if (!outcome.ok()) ++counters_.migrations_failed;
}

std::optional<StoredKernel> Registry::ReplaceReplica(const std::string& kernel_id, uint32_t old_id,
                                                     const StoredReplica& replacement,
                                                     std::chrono::milliseconds took) {
  MutexLock lock(&mu_);
  ++counters_.migrations_done;
  counters_.migration_ms.push_back(took.count());
  if (counters_.migration_ms.size() > kMigrationsRemembered)
    counters_.migration_ms.erase(counters_.migration_ms.begin());
  auto it = kernels_.find(kernel_id);
  if (it == kernels_.end()) return std::nullopt;
  KernelRecord& k = it->second;
  if (auto lost = k.lost_since.find(old_id); lost != k.lost_since.end()) {
    ++counters_.replacements_done;
    counters_.replacement_ms.push_back(
        std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - lost->second)
            .count());
    if (counters_.replacement_ms.size() > kMigrationsRemembered)
      counters_.replacement_ms.erase(counters_.replacement_ms.begin());
    k.lost_since.erase(lost);
  }
  std::erase_if(k.meta.replicas, [&](const StoredReplica& r) { return r.replica_id == old_id; });
  k.meta.replicas.push_back(replacement);
  k.replica_live.erase(old_id);
  k.left_group.erase(old_id);
  k.left_confirmed.erase(old_id);
  k.replica_live[replacement.replica_id] = true;
  k.diverged.erase(old_id);
  if (Status s = scheduler_.OnReplicaAdded(NowMs(), kernel_id, replacement.replica_id,
                                           replacement.server_id);
      !s.ok()) {
    spdlog::warn("kernel {}: recording replica {}: {}", kernel_id, replacement.replica_id,
                 s.ToString());
  }
  if (Status s = scheduler_.OnReplicaRemoved(NowMs(), kernel_id, old_id); !s.ok()) {
    spdlog::warn("kernel {}: forgetting replica {}: {}", kernel_id, old_id, s.ToString());
  }
  return k.meta;
}

RegistrySnapshot Registry::Snapshot() const {
  MutexLock lock(&mu_);
  RegistrySnapshot out;
  for (const auto& [id, view] : scheduler_.cluster().servers()) {
    auto s = servers_.find(id);
    out.servers.emplace_back(
        view, s == servers_.end() ? std::nullopt : std::optional<ServerRecord>(s->second));
  }
  for (const auto& [id, k] : kernels_) out.kernels.push_back(k);
  out.cluster_ratio = scheduler_.ratio().value();
  out.counters = counters_;
  out.pending_servers.assign(pending_servers_.begin(), pending_servers_.end());
  return out;
}

}  // namespace nbos::gateway
