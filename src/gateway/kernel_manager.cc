#include "gateway/kernel_manager.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <future>
#include <utility>

#include "common/ids.h"
#include "gateway/replica_ops.h"
#include "jupyter/connection_file.h"

namespace nbos::gateway {
namespace {

using jupyter::Json;

Json ResourcesJson(const sched::Resources& r) {
  return Json{{"millicpus", r.millicpus},
              {"memory_mb", r.memory_mb},
              {"gpus", r.gpus},
              {"vram_mb", r.vram_mb}};
}

// A stored kernel's resources; a field that is missing or not a number keeps the default.
sched::Resources ResourcesFromJson(const Json& j, const sched::Resources& defaults) {
  auto field = [&](const char* key, int64_t fallback) {
    if (!j.is_object()) return fallback;
    auto it = j.find(key);
    return it != j.end() && it->is_number_integer() ? it->get<int64_t>() : fallback;
  };
  return {field("millicpus", defaults.millicpus), field("memory_mb", defaults.memory_mb),
          static_cast<int32_t>(field("gpus", defaults.gpus)), field("vram_mb", defaults.vram_mb)};
}

bool ParseDouble(const std::string& text, double* out) {
  try {
    size_t used = 0;
    *out = std::stod(text, &used);
    return used == text.size() && std::isfinite(*out) && *out >= 0;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

Result<sched::Resources> ResourcesFromEnv(const std::map<std::string, std::string>& env,
                                          const sched::Resources& defaults) {
  sched::Resources r = defaults;
  auto get = [&](const char* name) -> const std::string* {
    auto it = env.find(name);
    return it == env.end() || it->second.empty() ? nullptr : &it->second;
  };
  if (const std::string* v = get("KERNEL_GPUS")) {
    double gpus;
    if (!ParseDouble(*v, &gpus) || gpus != std::floor(gpus) || gpus > 1024) {
      return InvalidArgument("KERNEL_GPUS must be a whole number of GPUs, not '" + *v + "'");
    }
    r.gpus = static_cast<int32_t>(gpus);
  }
  if (const std::string* v = get("KERNEL_CPUS")) {
    double cpus;
    const bool milli = v->back() == 'm';
    if (!ParseDouble(milli ? v->substr(0, v->size() - 1) : *v, &cpus) || cpus > 1e6) {
      return InvalidArgument(
          "KERNEL_CPUS must be cores (e.g. 2 or 0.5) or millicpus (500m), not '" + *v + "'");
    }
    r.millicpus = static_cast<int64_t>(milli ? cpus : cpus * 1000);
  }
  for (const char* name : {"KERNEL_MEMORY", "KERNEL_VRAM"}) {
    const std::string* v = get(name);
    if (v == nullptr) continue;
    static const std::vector<std::pair<std::string, double>> kUnits = {
        {"Ki", 1.0 / 1024}, {"Mi", 1}, {"Gi", 1024}, {"Ti", 1024 * 1024},
        {"K", 1.0 / 1000},  {"M", 1},  {"G", 1000},  {"T", 1000 * 1000},
        {"KB", 1.0 / 1000}, {"MB", 1}, {"GB", 1000}, {"", 1}};
    double mb = -1;
    for (const auto& [suffix, factor] : kUnits) {
      if (v->size() <= suffix.size() ||
          v->compare(v->size() - suffix.size(), suffix.size(), suffix) != 0)
        continue;
      double number;
      if (ParseDouble(v->substr(0, v->size() - suffix.size()), &number)) {
        mb = number * factor;
        break;
      }
    }
    if (mb < 0 || mb > 1e12) {
      return InvalidArgument(std::string(name) +
                             " must be megabytes, optionally with a unit (512, 4Gi), not '" + *v +
                             "'");
    }
    (std::string(name) == "KERNEL_MEMORY" ? r.memory_mb : r.vram_mb) =
        static_cast<int64_t>(std::ceil(mb));
  }
  return r;
}

KernelManager::KernelManager(KernelManagerOptions options, Registry* registry, MetadataStore* store,
                             Planner* planner, EdgeCounters* counters)
    : options_(std::move(options)),
      registry_(registry),
      store_(store),
      planner_(planner),
      counters_(counters) {}

KernelManager::~KernelManager() { chores_.Stop(); }

Result<std::shared_ptr<KernelSession>> KernelManager::StartSession(const KernelRecord& k) {
  KernelSessionOptions o;
  o.kernel_id = k.meta.kernel_id;
  o.session_id = k.meta.session_id;
  o.gpus = k.request.gpus;
  o.limits = options_.limits;
  for (const StoredReplica& r : k.meta.replicas) {
    auto conn = jupyter::ParseConnectionInfo(r.connection_json);
    if (!conn.ok()) return conn.status();
    o.replicas.push_back({r.replica_id, r.server_id, *conn});
  }
  o.key = k.meta.key;
  const std::string kernel_id = k.meta.kernel_id;
  o.hooks.resume_wanted = [this, kernel_id] {
    chores_.Post(kernel_id, [this, kernel_id, since = SteadyClock::now()] {
      (void)Resume(kernel_id, since);  // logged there
    });
  };
  o.hooks.plan = [this, kernel_id](const PlanWanted& want, PlanCallback done) {
    planner_->Plan(kernel_id, want, std::move(done));
  };
  o.hooks.release = [this, kernel_id](const ExecutionPlan& plan) {
    planner_->Release(kernel_id, plan);
  };
  o.hooks.shutdown_requested = [this, kernel_id](bool restart) {
    chores_.Post(kernel_id,
                 [this, kernel_id, restart] { OnShutdownRequested(kernel_id, restart); });
  };
  o.hooks.rejected = [this](RejectClass reason) { counters_->Rejected(reason); };
  o.hooks.execution_started = [this](int64_t delay_us) {
    registry_->RecordExecutionDelay(static_cast<double>(delay_us) / 1000.0);
  };
  o.hooks.replica_diverged = [this, kernel_id](ReplicaId replica, const std::string& why) {
    registry_->NoteDivergence(kernel_id, replica, why);
  };
  auto session = KernelSession::Start(std::move(o));
  if (!session.ok()) return session.status();
  return std::shared_ptr<KernelSession>(std::move(*session));
}

void KernelManager::OnShutdownRequested(const std::string& kernel_id, bool restart) {
  Status s = restart ? Restart(kernel_id).status() : Delete(kernel_id);
  if (!s.ok()) spdlog::warn("kernel {}: {}", kernel_id, s.ToString());
}

// Prepares one replica per server (in `replicas`' order and ids), records them, then launches
// each with the whole group as its peers. Replicas get the kernel's start environment.
Status KernelManager::LaunchReplicas(const std::string& kernel_id,
                                     const std::vector<std::string>& server_ids) {
  std::optional<KernelRecord> k = registry_->FindKernel(kernel_id);
  if (!k) return NotFound("no kernel " + kernel_id);
  std::vector<std::shared_ptr<daemon::DaemonClient>> clients;
  for (const std::string& id : server_ids) {
    auto c = registry_->AwaitClient(id, options_.server_timeout);
    if (!c) return Unavailable("server " + id + " is not registered");
    clients.push_back(std::move(c));
  }
  // The daemons are asked at once, one call per replica in each round: a start waits for the
  // slowest daemon instead of the sum of them.
  std::vector<std::future<Result<StoredReplica>>> preparing;
  for (size_t i = 0; i < server_ids.size(); ++i) {
    const uint32_t replica_id = k->meta.replicas.size() == server_ids.size()
                                    ? k->meta.replicas[i].replica_id
                                    : static_cast<uint32_t>(i + 1);
    preparing.push_back(std::async(std::launch::async, [&, i, replica_id] {
      return PrepareReplica(*clients[i], k->meta, k->request, server_ids[i], replica_id);
    }));
  }
  std::vector<StoredReplica> prepared;
  std::vector<control::Peer> peers;
  Status failed;
  for (auto& f : preparing) {
    auto replica = f.get();
    if (!replica.ok()) {
      if (failed.ok()) failed = replica.status();
      continue;
    }
    control::Peer peer;
    peer.set_replica_id(replica->replica_id);
    peer.set_raft_address(replica->raft_address);
    peers.push_back(peer);
    prepared.push_back(std::move(*replica));
  }
  if (!failed.ok()) return failed;
  registry_->UpdateKernel(kernel_id, [&](KernelRecord& r) { r.meta.replicas = prepared; });
  k->meta.replicas = prepared;
  std::vector<std::future<Status>> launching;
  for (size_t i = 0; i < prepared.size(); ++i) {
    launching.push_back(std::async(std::launch::async, [&, i]() -> Status {
      auto launched =
          clients[i]->LaunchReplica(LaunchRequest(k->meta, prepared[i].replica_id, peers));
      if (launched.ok()) return Status::Ok();
      return Status(launched.status().code(),
                    fmt::format("launching replica {} on {}: {}", prepared[i].replica_id,
                                server_ids[i], launched.status().message()));
    }));
  }
  for (auto& f : launching) {
    Status s = f.get();
    if (failed.ok()) failed = s;
  }
  return failed;
}

void KernelManager::StopReplicas(const StoredKernel& meta) {
  for (const StoredReplica& r : meta.replicas) {
    auto client = registry_->AwaitClient(r.server_id, options_.server_timeout);
    if (!client) {
      // The daemon's heartbeats report it once the server registers; it is stopped as an orphan.
      spdlog::warn("kernel {}: replica {} on unregistered server {} is stopped when it returns",
                   meta.kernel_id, r.replica_id, r.server_id);
      continue;
    }
    StopReplica(*client, meta.kernel_id, r.replica_id, r.server_id);
  }
}

// Waits until every replica answers kernel_info, so the first request of a client does not race
// the replicas' start-up.
Status KernelManager::AwaitReplicas(const KernelRecord& k) {
  return k.session->AwaitReplicas(options_.kernel_start_timeout,
                                  [this, meta = k.meta, since = SteadyClock::now()] {
                                    return registry_->CheckReplicasNotGivenUp(meta, since);
                                  });
}

Status KernelManager::CheckQuota(const KernelStarter& starter,
                                 const sched::Resources& request) const {
  if (starter.admin) return Status::Ok();
  int kernels = 0, gpus = 0;
  for (const KernelRecord& k : registry_->Kernels()) {
    if (k.meta.owner != starter.user) continue;
    ++kernels;
    gpus += k.request.gpus;
  }
  const int max_kernels = options_.max_kernels_per_user, max_gpus = options_.max_gpus_per_user;
  if (max_kernels > 0 && kernels + 1 > max_kernels) {
    return PermissionDenied(fmt::format("quota: {} has {} of {} kernels; shut one down first",
                                        starter.user, kernels, max_kernels));
  }
  if (max_gpus > 0 && gpus + request.gpus > max_gpus) {
    return PermissionDenied(
        fmt::format("quota: {}'s kernels hold {} of {} GPUs, and this one asks for {} more",
                    starter.user, gpus, max_gpus, request.gpus));
  }
  return Status::Ok();
}

Result<KernelRecord> KernelManager::Create(const std::string& kernelspec,
                                           const std::map<std::string, std::string>& env,
                                           const KernelStarter& starter) {
  auto request = ResourcesFromEnv(env, options_.default_request);
  if (!request.ok()) return request.status();
  KernelRecord k;
  k.request = *request;
  k.meta.kernel_id = NewUuid();
  k.meta.kernelspec = kernelspec;
  k.meta.key = NewUuid();
  k.meta.session_id = NewUuid();
  k.meta.resources = ResourcesJson(k.request);
  k.meta.created = NowIsoUtc();
  k.meta.env = env;
  k.meta.owner = starter.user;
  const std::string id = k.meta.kernel_id;
  const std::shared_ptr<Mutex> op_mu = k.op_mu;
  MutexLock op(op_mu.get());
  MutexLock quota(&quota_mu_);
  if (Status s = CheckQuota(starter, *request); !s.ok()) return s;
  auto server_ids = registry_->PlaceKernel(std::move(k), options_.replicas);
  quota.Unlock();
  if (!server_ids.ok()) return server_ids.status();
  Status s = LaunchReplicas(id, *server_ids);
  // Nobody else removes it: deletes and restarts wait for the operation lock held here.
  std::optional<KernelRecord> started = registry_->FindKernel(id);
  NBOS_CHECK(started.has_value(), "a starting kernel left the registry");
  if (s.ok()) s = RecordMarked(*started, &StoredKernel::starting, true);
  if (s.ok()) {
    auto session = StartSession(*started);
    if (session.ok()) {
      started->session = *session;
      registry_->UpdateKernel(id, [&](KernelRecord& r) { r.session = *session; });
      spdlog::info("kernel {}: waiting for its replicas", id);
      s = AwaitReplicas(*started);
    } else {
      s = session.status();
    }
  }
  if (s.ok()) s = RecordMarked(*started, &StoredKernel::starting, false);
  if (!s.ok()) {
    spdlog::error("kernel {} did not start: {}", id, s.ToString());
    if (started->session) started->session->Shutdown();
    StopReplicas(started->meta);
    if (Status removed = store_->Remove(id); !removed.ok()) {
      spdlog::warn("kernel {}: removing it from the database: {}", id, removed.ToString());
    }
    (void)registry_->RemoveKernel(id);
    return s;
  }
  registry_->CountKernelStarted();
  spdlog::info("kernel {} started: replicas on {}", id, fmt::join(*server_ids, ", "));
  return *started;
}

Status KernelManager::Delete(const std::string& kernel_id) {
  std::optional<KernelRecord> found = registry_->FindKernel(kernel_id);
  if (!found) return NotFound("no kernel " + kernel_id);
  MutexLock op(found->op_mu.get());
  // Out of the database before anything stops: a gateway that goes down from here on neither
  // restores the kernel on replicas it stopped nor loses track of the others, which it stops as
  // orphans. A database that cannot be written leaves the kernel as it was.
  if (Status s = store_->Remove(kernel_id); !s.ok()) return s;
  // Taken under the operation lock: a migration may have changed the replicas meanwhile.
  std::optional<KernelRecord> k = registry_->RemoveKernel(kernel_id);
  if (!k) return NotFound("no kernel " + kernel_id);
  spdlog::info("kernel {}: deleting; it is out of the database", kernel_id);
  if (k->session) k->session->Shutdown();  // releases outstanding grants, closes client sockets
  StopReplicas(k->meta);
  spdlog::info("kernel {} deleted", kernel_id);
  return Status::Ok();
}

Result<KernelRecord> KernelManager::Restart(const std::string& kernel_id) {
  std::optional<KernelRecord> found = registry_->FindKernel(kernel_id);
  if (!found) return NotFound("no kernel " + kernel_id);
  MutexLock op(found->op_mu.get());
  std::optional<KernelRecord> k = registry_->FindKernel(kernel_id);
  if (!k) return NotFound("no kernel " + kernel_id);
  // Recorded before anything is stopped: a gateway that goes down from here on restarts the
  // kernel again when it comes back, instead of restoring it on stopped replicas.
  if (Status s = RecordMarked(*k, &StoredKernel::restarting, true); !s.ok()) return s;
  // Listed as restarting from here until the restart ends, however it ends.
  registry_->UpdateKernel(kernel_id, [](KernelRecord& r) { r.restarting = true; });
  struct Unmark {
    Registry* registry;
    const std::string& id;
    ~Unmark() {
      registry->UpdateKernel(id, [](KernelRecord& r) { r.restarting = false; });
    }
  } unmark{registry_, kernel_id};
  std::vector<std::string> server_ids;
  for (const StoredReplica& r : k->meta.replicas) server_ids.push_back(r.server_id);
  if (k->session) k->session->Shutdown();
  StopReplicas(k->meta);
  spdlog::info("kernel {}: restarting; its replicas are stopped", kernel_id);
  if (k->suspended) {
    // A restart discards the namespace, so the checkpoint too; the replicas are placed anew.
    auto placed = registry_->PlaceForResume(kernel_id, options_.replicas);
    if (!placed.ok()) return placed.status();
    server_ids = *placed;
  }
  // The same replica ids on the same servers (the scheduler's view keeps them), a new key and
  // session: clients see a new kernel process, as after any restart.
  registry_->UpdateKernel(kernel_id, [](KernelRecord& r) {
    r.session.reset();
    r.meta.key = NewUuid();
    r.meta.session_id = NewUuid();
    r.meta.checkpoint.clear();
    r.suspended = false;
    r.replica_live.clear();
  });
  Status s = LaunchReplicas(kernel_id, server_ids);
  std::optional<KernelRecord> restarted = registry_->FindKernel(kernel_id);
  if (!restarted) return NotFound("kernel " + kernel_id + " was deleted while it restarted");
  if (s.ok()) s = RecordMarked(*restarted, &StoredKernel::restarting, true);
  if (!s.ok()) return s;
  auto session = StartSession(*restarted);
  if (!session.ok()) return session.status();
  restarted->session = *session;
  registry_->UpdateKernel(kernel_id, [&](KernelRecord& r) { r.session = *session; });
  if (Status awaited = AwaitReplicas(*restarted); !awaited.ok()) return awaited;
  if (Status recorded = RecordMarked(*restarted, &StoredKernel::restarting, false);
      !recorded.ok()) {
    return recorded;
  }
  spdlog::info("kernel {} restarted", kernel_id);
  return *restarted;
}

// A resume or suspension the last gateway did not see through: a resume's replicas may never have
// started, a suspension's may still run, and no cell has run on them since the checkpoint (the
// kernel's state). The kernel is suspended; its next request resumes it anew, and the recorded
// replicas, now unknown, are stopped as orphans once their daemons report them. Returns their
// highest replica id: the next attempt's ids come after it, so that none is taken for an orphan
// still running.
ReplicaId KernelManager::UndoCutOffResume(StoredKernel& meta) {
  spdlog::warn(
      "kernel {}: its suspension or resume was cut off by a gateway restart; it stays "
      "suspended",
      meta.kernel_id);
  ReplicaId highest = 0;
  for (const StoredReplica& r : meta.replicas) highest = std::max(highest, r.replica_id);
  meta.replicas.clear();
  meta.resuming = false;
  if (Status s = store_->Put(meta); !s.ok()) {
    spdlog::warn("kernel {}: recording the undone resume: {}", meta.kernel_id, s.ToString());
  }
  return highest;
}

// The registry's record keeps its marks false, so that no later write of it marks a kernel as
// one whose start or restart was cut off.
Status KernelManager::RecordMarked(const KernelRecord& k, bool StoredKernel::*mark, bool on) {
  StoredKernel meta = k.meta;
  meta.*mark = on;
  return store_->Put(meta);
}

// A start the last gateway did not see through: its client had no 201, so the kernel is
// forgotten; its replicas, now unknown, are stopped as orphans once their daemons report them.
void KernelManager::ForgetCutOffStart(const StoredKernel& meta) {
  spdlog::warn("kernel {}: its start was cut off by a gateway restart; it is forgotten",
               meta.kernel_id);
  if (Status s = store_->Remove(meta.kernel_id); !s.ok()) {
    spdlog::warn("kernel {}: removing it from the database: {}", meta.kernel_id, s.ToString());
  }
}

// A restart the last gateway did not see through: the recorded replicas may be stopped, or
// replaced by ones started with a key that was never recorded. The kernel is restored and
// restarted again, which stops whatever runs under its replica ids and starts new replicas. The
// mark stays in the database until that restart has finished.
void KernelManager::RestartCutOffRestart(const std::string& kernel_id) {
  spdlog::warn("kernel {}: its restart was cut off by a gateway restart; it is restarted again",
               kernel_id);
  chores_.Post(kernel_id, [this, kernel_id] { OnShutdownRequested(kernel_id, true); });
}

Status KernelManager::Restore() {
  auto stored = store_->List();
  if (!stored.ok()) return stored.status();
  std::erase_if(*stored, [this](const StoredKernel& meta) {
    if (meta.starting) ForgetCutOffStart(meta);
    return meta.starting;
  });
  std::vector<std::string> cut_off_restarts;
  for (StoredKernel& meta : *stored) {
    KernelRecord k;
    k.request = ResourcesFromJson(meta.resources, options_.default_request);
    k.meta = std::move(meta);
    for (const StoredReplica& r : k.meta.replicas) {
      if (r.left_group) k.left_group.insert(r.replica_id);
    }
    if (k.meta.resuming) k.last_replica_id = UndoCutOffResume(k.meta);
    const bool restart = std::exchange(k.meta.restarting, false);
    auto session = StartSession(k);
    if (!session.ok()) {
      spdlog::error("kernel {} could not be restored: {}", k.meta.kernel_id,
                    session.status().ToString());
      continue;
    }
    k.session = *session;
    if (k.meta.replicas.empty() && !k.meta.checkpoint.empty()) {
      k.suspended = true;  // resumes on its first request
      k.session->SetSuspended(true);
    } else {
      k.session->RecoverExecution();
    }
    if (restart) cut_off_restarts.push_back(k.meta.kernel_id);
    registry_->RestoreKernel(std::move(k));
  }
  if (!stored->empty()) spdlog::info("restored {} kernel(s) from the database", stored->size());
  for (const std::string& id : cut_off_restarts) RestartCutOffRestart(id);
  return Status::Ok();
}

void KernelManager::Stop() {
  chores_.Stop();
  for (const KernelRecord& k : registry_->Kernels())
    if (k.session) k.session->Shutdown();
}

}  // namespace nbos::gateway
