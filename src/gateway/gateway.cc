#include "gateway/gateway.h"

#include <grpcpp/grpcpp.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "common/hex.h"
#include "common/ids.h"
#include "control/control.grpc.pb.h"
#include "daemon/daemon_client.h"
#include "gateway/kernel_session.h"
#include "gateway/metadata_store.h"
#include "http/server.h"
#include "jupyter/connection_file.h"
#include "jupyter/websocket_codec.h"
#include "sched/cluster.h"
#include "sched/executor.h"
#include "sched/journal.h"
#include "sched/placement.h"
#include "sched/scheduler.h"
#include "sched/subscription.h"

namespace nbos::gateway {
namespace {

using jupyter::Json;
using SteadyClock = std::chrono::steady_clock;

// A migration step (Raft membership change, the new replica's first answer) that takes longer
// than this failed; a failed migration is not retried for the backoff.
constexpr std::chrono::milliseconds kMembershipTimeout{60000};
constexpr std::chrono::seconds kMigrationBackoff{10};

constexpr char kVersion[] = "0.1.0";

sched::Resources FromProto(const control::Resources& r) {
  return {r.millicpus(), r.memory_mb(), r.gpus(), r.vram_mb()};
}
control::Resources ToProto(const sched::Resources& r) {
  control::Resources p;
  p.set_millicpus(r.millicpus);
  p.set_memory_mb(r.memory_mb);
  p.set_gpus(r.gpus);
  p.set_vram_mb(r.vram_mb);
  return p;
}
Json ResourcesJson(const sched::Resources& r) {
  return Json{{"millicpus", r.millicpus},
              {"memory_mb", r.memory_mb},
              {"gpus", r.gpus},
              {"vram_mb", r.vram_mb}};
}
sched::Resources ResourcesFromJson(const Json& j, const sched::Resources& defaults) {
  if (!j.is_object()) return defaults;
  return {j.value("millicpus", defaults.millicpus), j.value("memory_mb", defaults.memory_mb),
          j.value("gpus", defaults.gpus), j.value("vram_mb", defaults.vram_mb)};
}

http::Response JsonResponse(int status, const Json& body) {
  http::Response r;
  r.status = status;
  r.body = body.dump();
  return r;
}
http::Response Error(int status, const std::string& message, const std::string& reason = "") {
  Json body{{"message", message}};
  if (!reason.empty()) body["reason"] = reason;
  return JsonResponse(status, body);
}
http::Response Error(const Status& s) {
  int code = http::HttpStatusFor(s);
  if (s.code() == StatusCode::kResourceExhausted) code = 503;
  if (s.code() == StatusCode::kUnavailable) code = 503;
  return Error(code, s.message());
}

std::string NewKey() { return NewUuid(); }

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

struct Gateway::Impl {
  explicit Impl(GatewayOptions o) : options(std::move(o)) {}

  struct Server {
    std::string server_id;
    std::unique_ptr<daemon::DaemonClient> client;
    bool gpus_virtual = false;
    SteadyClock::time_point last_seen;
    control::ServerStatus status;
    bool alive = true;
    // Replicas this daemon runs that belong to no kernel of the gateway, as of the last
    // heartbeat; stopped when the next heartbeat still reports them.
    std::set<std::pair<std::string, uint32_t>> orphans_seen;
  };
  struct Kernel {
    StoredKernel meta;
    sched::Resources request;
    std::shared_ptr<KernelSession> session;
    std::mutex op_mu;  // serialises restart, delete and migration
    bool in_cluster = false;
    std::map<uint32_t, bool> replica_live;
    // Guarded by the gateway's mu: a migration is queued or running; none starts before
    // migration_retry_after (a failed one backs off); replica ids a migration may use.
    bool migrating = false;
    SteadyClock::time_point migration_retry_after{};
    uint32_t last_replica_id = 0;
  };

  GatewayOptions options;
  std::unique_ptr<MetadataStore> store;
  http::Server http;
  std::unique_ptr<grpc::Server> control_server;
  std::unique_ptr<control::Gateway::Service> control_service;
  std::string control_address;

  mutable std::mutex mu;
  // Every scheduling decision goes through this core, the one `nbos sim` drives. The gateway
  // has no host provider, so it does not auto-scale; placements sample SR_c first.
  sched::Scheduler scheduler{SchedulerOptionsForGateway(options)};  // guarded by mu
  const sched::ClusterState& cluster = scheduler.cluster();         // guarded by mu
  std::ofstream journal_file;                                       // guarded by mu
  std::unique_ptr<sched::JournalWriter> journal;                    // guarded by mu
  const SteadyClock::time_point started = SteadyClock::now();
  std::set<std::string> logged_migration;  // guarded by mu: exec ids whose wait was logged
  std::map<std::string, std::unique_ptr<Server>> servers;             // guarded by mu
  std::map<std::string, std::shared_ptr<Kernel>> kernels;             // guarded by mu
  uint64_t grants_made = 0, grants_refused = 0, kernels_started = 0;  // guarded by mu
  uint64_t migrations_done = 0, migrations_failed = 0;                // guarded by mu
  std::deque<int64_t> migration_ms;  // guarded by mu: the last 100 migrations' durations

  std::thread monitor;
  std::mutex monitor_mu;
  std::condition_variable monitor_cv;
  bool stopping = false;                     // guarded by monitor_mu
  std::deque<std::function<void()>> chores;  // guarded by monitor_mu: run on the monitor thread
  // Migrations run one at a time on their own thread: each takes seconds of waiting on
  // daemons and Raft, which must not hold up the monitor's chores and server checks.
  std::thread migrator;
  std::deque<std::function<void()>> migrations;  // guarded by monitor_mu
  SteadyClock::time_point next_rebalance;        // monitor thread only

  static sched::SchedulerOptions SchedulerOptionsForGateway(const GatewayOptions& options) {
    sched::SchedulerOptions o;
    o.auto_scaling = false;
    o.rebalance.enabled = options.rebalance_interval_ms > 0;
    return o;
  }

  // The scheduler's clock: ms since the gateway started (mu held, so it never goes backwards
  // from one event to the next).
  int64_t NowMs() const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - started)
        .count();
  }

  // ---------- kernels ----------
  Json Model(const Kernel& k) const {
    Json m{{"id", k.meta.kernel_id},
           {"name", k.meta.kernelspec},
           {"last_activity", k.meta.created},
           {"execution_state", "starting"},
           {"connections", 0}};
    if (k.session) {
      m["last_activity"] = k.session->last_activity();
      m["execution_state"] = k.session->execution_state();
      m["connections"] = k.session->connections();
    }
    return m;
  }

  std::shared_ptr<Kernel> FindKernel(const std::string& id) const {
    std::lock_guard lock(mu);
    auto it = kernels.find(id);
    return it == kernels.end() ? nullptr : it->second;
  }

  daemon::DaemonClient* ClientFor(const std::string& server_id) {
    auto it = servers.find(server_id);
    return it == servers.end() ? nullptr : it->second->client.get();
  }

  // ClientFor, waiting up to server_timeout_ms for the server to register: right after a gateway
  // restart the daemons come back with their next heartbeat. Call without mu held.
  daemon::DaemonClient* AwaitClient(const std::string& server_id) {
    const auto deadline = SteadyClock::now() + std::chrono::milliseconds(options.server_timeout_ms);
    while (true) {
      {
        std::lock_guard lock(mu);
        if (daemon::DaemonClient* c = ClientFor(server_id)) return c;
      }
      if (SteadyClock::now() >= deadline) return nullptr;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  // Plans one execution on the session's thread: executor choice by the sched core, then GPUs
  // from the chosen replica's daemon, trying the next candidate when a daemon refuses.
  std::optional<ExecutionPlan> Plan(const std::string& kernel_id, const std::string& exec_id,
                                    int gpus, ReplicaId requested,
                                    const std::set<ReplicaId>& live) {
    std::vector<std::pair<ReplicaId, std::string>> candidates;
    std::vector<daemon::DaemonClient*> clients;
    {
      std::lock_guard lock(mu);
      const sched::KernelView* view = cluster.FindKernel(kernel_id);
      if (view == nullptr) {
        // Its servers have not registered (yet): no grants possible, but a GPU-less cell can run.
        if (gpus > 0 || live.empty()) return std::nullopt;
        return ExecutionPlan{
            requested && live.count(requested) ? requested : *live.begin(), "", "", {}};
      }
      sched::ExecutorRequested request;
      request.kernel_id = kernel_id;
      request.gpus = gpus;
      for (const auto& r : view->replicas)
        if (!live.count(r.replica_id)) request.excluded_replicas.insert(r.replica_id);
      if (requested) request.target_replica = requested;
      for (const auto& [id, s] : servers)
        if (s->alive && s->status.warm_pool().ready() > 0) request.warm_servers.insert(id);
      auto decision = scheduler.RequestExecutor(NowMs(), std::move(request));
      if (!decision.ok()) {
        spdlog::warn("kernel {}: no executor: {}", kernel_id, decision.status().ToString());
        return std::nullopt;
      }
      const sched::ExecutorChoice& choice = decision->choice;
      if (!choice.note.empty()) spdlog::info("kernel {}: {}", kernel_id, choice.note);
      if (decision->migration) {
        const sched::MigrationPlan& m = *decision->migration;
        if (!logged_migration.count(exec_id)) {
          logged_migration.insert(exec_id);
          spdlog::info(
              "kernel {}: no replica's server has {} idle GPU(s); migration plan: "
              "replica {} from {} to {}{}",
              kernel_id, gpus, m.replica_id, m.from_server_id,
              m.to_server_id.empty() ? "(none)" : m.to_server_id,
              m.scale_out_needed ? " (scale-out needed: " + m.reason + ")" : "");
        }
        MaybeStartMigration(kernel_id, m);
      }
      for (uint32_t id : choice.candidates) {
        const sched::ReplicaView* r = view->FindReplica(id);
        if (r == nullptr) continue;
        candidates.emplace_back(id, r->server_id);
        clients.push_back(ClientFor(r->server_id));
      }
    }
    for (size_t i = 0; i < candidates.size(); ++i) {
      const auto& [replica, server_id] = candidates[i];
      ExecutionPlan plan{replica, server_id, "", {}};
      if (gpus > 0) {
        if (clients[i] == nullptr) continue;
        control::GrantRequest req;
        req.set_kernel_id(kernel_id);
        req.set_replica_id(replica);
        req.set_exec_id(exec_id);
        req.set_gpus(gpus);
        auto granted = clients[i]->Grant(req);
        if (!granted.ok() || !granted->granted()) {
          std::lock_guard lock(mu);
          ++grants_refused;
          continue;
        }
        plan.grant_id = granted->grant_id();
        plan.device_ids.assign(granted->device_ids().begin(), granted->device_ids().end());
      }
      std::lock_guard lock(mu);
      if (gpus > 0) ++grants_made;
      logged_migration.erase(exec_id);
      if (Status s = scheduler.OnGrantCommitted(
              NowMs(), {kernel_id, replica, server_id, sched::Resources{0, 0, gpus, 0}});
          !s.ok()) {
        spdlog::warn("kernel {}: recording grant: {}", kernel_id, s.ToString());
      }
      return plan;
    }
    return std::nullopt;
  }

  void Release(const std::string& kernel_id, const ExecutionPlan& plan) {
    daemon::DaemonClient* client;
    {
      std::lock_guard lock(mu);
      client = ClientFor(plan.server_id);
      (void)scheduler.OnGrantReleased(
          NowMs(), {kernel_id, plan.target_replica, plan.server_id,
                    sched::Resources{0, 0, static_cast<int32_t>(plan.device_ids.size()), 0}});
    }
    if (client == nullptr) return;
    auto released = client->Release(plan.grant_id);
    if (!released.ok()) {
      spdlog::warn("releasing grant {} on {}: {}", plan.grant_id, plan.server_id,
                   released.status().ToString());
    }
  }

  Result<std::shared_ptr<KernelSession>> StartSession(const std::shared_ptr<Kernel>& k) {
    KernelSessionOptions o;
    o.kernel_id = k->meta.kernel_id;
    o.session_id = k->meta.session_id;
    o.gpus = k->request.gpus;
    o.max_message_bytes = options.max_message_bytes;
    for (const StoredReplica& r : k->meta.replicas) {
      auto conn = jupyter::ParseConnectionInfo(r.connection_json);
      if (!conn.ok()) return conn.status();
      o.replicas.push_back({r.replica_id, r.server_id, *conn});
    }
    const std::string kernel_id = k->meta.kernel_id;
    o.hooks.plan = [this, kernel_id](const std::string& exec_id, int gpus, ReplicaId requested,
                                     const std::set<ReplicaId>& live) {
      return Plan(kernel_id, exec_id, gpus, requested, live);
    };
    o.hooks.release = [this, kernel_id](const ExecutionPlan& plan) { Release(kernel_id, plan); };
    o.hooks.shutdown_requested = [this, kernel_id](bool restart) {
      Chore([this, kernel_id, restart] {
        Status s = restart ? RestartKernel(kernel_id).status() : DeleteKernel(kernel_id);
        if (!s.ok()) spdlog::warn("kernel {}: {}", kernel_id, s.ToString());
      });
    };
    auto session = KernelSession::Start(std::move(o));
    if (!session.ok()) return session.status();
    return std::shared_ptr<KernelSession>(std::move(*session));
  }

  // Prepares and launches one replica per server; fills `k->meta.replicas`.
  // Asks `client` (server `server_id`) to prepare replica `replica_id` of `k`: its directory,
  // ports and connection file.
  Result<StoredReplica> PrepareReplica(const Kernel& k, daemon::DaemonClient* client,
                                       const std::string& server_id, uint32_t replica_id) {
    control::PrepareReplicaRequest req;
    req.set_kernel_id(k.meta.kernel_id);
    req.set_replica_id(replica_id);
    *req.mutable_resources() = ToProto(k.request);
    req.set_key(k.meta.key);
    auto prepared = client->PrepareReplica(req);
    if (!prepared.ok()) {
      return Status(prepared.status().code(), "preparing replica " + std::to_string(replica_id) +
                                                  " on " + server_id + ": " +
                                                  prepared.status().message());
    }
    jupyter::ConnectionInfo conn;
    const control::ConnectionInfo& c = prepared->connection();
    conn.ip = c.ip();
    conn.transport = c.transport().empty() ? "tcp" : c.transport();
    conn.shell_port = c.shell_port();
    conn.iopub_port = c.iopub_port();
    conn.stdin_port = c.stdin_port();
    conn.control_port = c.control_port();
    conn.hb_port = c.hb_port();
    conn.key = c.key().empty() ? k.meta.key : c.key();
    conn.signature_scheme = c.signature_scheme().empty() ? "hmac-sha256" : c.signature_scheme();
    conn.kernel_name = k.meta.kernelspec;
    return StoredReplica{replica_id, server_id, prepared->raft_address(),
                         jupyter::ConnectionInfoToJson(conn)};
  }

  // Replicas get the kernel's start environment (meta.env) and KERNEL_ID.
  Status LaunchReplicas(Kernel* k, const std::vector<std::string>& server_ids) {
    std::vector<std::pair<daemon::DaemonClient*, std::string>> targets;
    for (const std::string& id : server_ids) {
      daemon::DaemonClient* c = AwaitClient(id);
      if (c == nullptr) return Unavailable("server " + id + " is not registered");
      targets.emplace_back(c, id);
    }
    k->meta.replicas.clear();
    std::vector<control::Peer> peers;
    uint32_t replica_id = 0;
    for (auto& [client, server_id] : targets) {
      ++replica_id;
      auto prepared = PrepareReplica(*k, client, server_id, replica_id);
      if (!prepared.ok()) return prepared.status();
      k->meta.replicas.push_back(*prepared);
      control::Peer peer;
      peer.set_replica_id(replica_id);
      peer.set_raft_address(prepared->raft_address);
      peers.push_back(peer);
    }
    {
      std::lock_guard lock(mu);
      k->last_replica_id = std::max(k->last_replica_id, replica_id);
    }
    for (size_t i = 0; i < targets.size(); ++i) {
      control::LaunchReplicaRequest req;
      req.set_kernel_id(k->meta.kernel_id);
      req.set_replica_id(static_cast<uint32_t>(i + 1));
      for (const auto& p : peers) *req.add_peers() = p;
      for (const auto& [name, value] : k->meta.env) (*req.mutable_env())[name] = value;
      (*req.mutable_env())["KERNEL_ID"] = k->meta.kernel_id;
      auto launched = targets[i].first->LaunchReplica(req);
      if (!launched.ok()) {
        return Status(launched.status().code(), "launching replica " + std::to_string(i + 1) +
                                                    " on " + targets[i].second + ": " +
                                                    launched.status().message());
      }
    }
    return Status::Ok();
  }

  void StopReplicas(const StoredKernel& meta) {
    for (const StoredReplica& r : meta.replicas) {
      daemon::DaemonClient* client = AwaitClient(r.server_id);
      if (client == nullptr) {
        // The daemon's heartbeats report it once the server registers; OnHeartbeat stops it.
        spdlog::warn("kernel {}: replica {} on unregistered server {} is stopped when it returns",
                     meta.kernel_id, r.replica_id, r.server_id);
        continue;
      }
      control::StopReplicaRequest req;
      req.set_kernel_id(meta.kernel_id);
      req.set_replica_id(r.replica_id);
      req.set_keep_data(false);
      if (Status s = client->StopReplica(req); !s.ok()) {
        spdlog::warn("kernel {}: stopping replica {} on {}: {}", meta.kernel_id, r.replica_id,
                     r.server_id, s.ToString());
      }
    }
  }

  Status AddToCluster(Kernel& k) {
    sched::KernelView view;
    view.kernel_id = k.meta.kernel_id;
    view.request = k.request;
    for (const StoredReplica& r : k.meta.replicas)
      view.replicas.push_back({k.meta.kernel_id, r.replica_id, r.server_id});
    Status s = scheduler.OnKernelPlaced(NowMs(), std::move(view));
    k.in_cluster = s.ok();
    return s;
  }

  Result<std::shared_ptr<Kernel>> CreateKernel(const std::string& name,
                                               const std::map<std::string, std::string>& env) {
    auto request = ResourcesFromEnv(env, options.default_request);
    if (!request.ok()) return request.status();
    auto k = std::make_shared<Kernel>();
    k->request = *request;
    k->meta.kernel_id = NewUuid();
    k->meta.kernelspec = name;
    k->meta.key = NewKey();
    k->meta.session_id = NewUuid();
    k->meta.resources = ResourcesJson(k->request);
    k->meta.created = NowIsoUtc();
    k->meta.env = env;
    std::vector<std::string> server_ids;
    {
      std::lock_guard lock(mu);
      if (Status s = sched::CheckRequestFitsSomeServer(cluster, k->request); !s.ok()) return s;
      (void)scheduler.OnTick(NowMs());  // SR_c sampled with the demand of this moment
      sched::PlacementRequested po;
      po.kernel_id = k->meta.kernel_id;
      po.request = k->request;
      po.replicas = options.replicas;
      // `nbos up` has no host provider to scale out with: place anyway and say so.
      po.can_scale_out = false;
      auto placement = scheduler.RequestPlacement(NowMs(), std::move(po));
      if (!placement.ok()) return placement.status();
      if (placement->server_ids.empty()) {
        return ResourceExhausted("no " + std::to_string(options.replicas) +
                                 " servers can host this kernel: " + placement->reason);
      }
      if (placement->ratio_ignored) {
        spdlog::warn("kernel {} placed above the subscription ratio: {}", k->meta.kernel_id,
                     placement->reason);
      }
      server_ids = placement->server_ids;
      // Subscribe now so concurrent starts see these replicas.
      for (size_t i = 0; i < server_ids.size(); ++i) {
        k->meta.replicas.push_back({static_cast<uint32_t>(i + 1), server_ids[i], "", ""});
      }
      if (Status s = AddToCluster(*k); !s.ok()) return s;
      kernels[k->meta.kernel_id] = k;
    }
    std::lock_guard op(k->op_mu);
    Status s = LaunchReplicas(k.get(), server_ids);
    if (s.ok()) s = store->Put(k->meta);
    if (s.ok()) {
      auto session = StartSession(k);
      if (session.ok()) {
        k->session = *session;
      } else {
        s = session.status();
      }
    }
    if (s.ok()) s = AwaitReplicas(*k);
    if (!s.ok()) {
      spdlog::error("kernel {} did not start: {}", k->meta.kernel_id, s.ToString());
      if (k->session) k->session->Shutdown();
      k->session.reset();
      StopReplicas(k->meta);
      (void)store->Remove(k->meta.kernel_id);
      std::lock_guard lock(mu);
      (void)scheduler.OnKernelRemoved(NowMs(), k->meta.kernel_id);
      kernels.erase(k->meta.kernel_id);
      return s;
    }
    {
      std::lock_guard lock(mu);
      ++kernels_started;
    }
    spdlog::info("kernel {} started: replicas on {}", k->meta.kernel_id,
                 fmt::format("{}", fmt::join(server_ids, ", ")));
    return k;
  }

  // Waits until every replica answers kernel_info, so the first request of a client does not
  // race the replicas' start-up.
  Status AwaitReplicas(Kernel& k) {
    return k.session->AwaitReplicas(
        std::chrono::milliseconds(options.kernel_start_timeout_ms),
        [&, since = SteadyClock::now()] { return ReplicasNotGivenUp(k.meta, since); });
  }

  // Unavailable when a daemon reports, in a heartbeat newer than `since`, that one of the
  // kernel's replicas exited and is not restarted (its restart budget is spent): waiting for it
  // longer is pointless.
  Status ReplicasNotGivenUp(const StoredKernel& meta, SteadyClock::time_point since) {
    std::lock_guard lock(mu);
    for (const StoredReplica& r : meta.replicas) {
      auto it = servers.find(r.server_id);
      if (it == servers.end() || it->second->last_seen <= since) continue;
      for (const auto& st : it->second->status.replicas()) {
        if (st.kernel_id() == meta.kernel_id && st.replica_id() == r.replica_id &&
            st.state() == "exited") {
          return Unavailable(fmt::format(
              "replica {} of kernel {} on server {} exited (code {}) and will not be restarted; "
              "its replica.log on that server says why",
              r.replica_id, meta.kernel_id, r.server_id, st.exit_code()));
        }
      }
    }
    return Status::Ok();
  }

  // ---------- migration (DESIGN §5) ----------
  // Queues the core's migration plan for a cell that no replica's server can give GPUs to, unless
  // one is queued or running for this kernel, or a failed one is backing off. mu held.
  void MaybeStartMigration(const std::string& kernel_id, const sched::MigrationPlan& plan) {
    if (plan.scale_out_needed || plan.to_server_id.empty()) return;  // no host provider yet
    auto it = kernels.find(kernel_id);
    if (it == kernels.end()) return;
    Kernel& k = *it->second;
    if (k.migrating || SteadyClock::now() < k.migration_retry_after) return;
    k.migrating = true;
    {
      std::lock_guard lock(monitor_mu);
      migrations.push_back([this, kernel_id, plan] { RunMigration(kernel_id, plan); });
    }
    monitor_cv.notify_all();
  }

  void RunMigration(const std::string& kernel_id, const sched::MigrationPlan& plan) {
    std::shared_ptr<Kernel> k = FindKernel(kernel_id);
    if (!k) return;
    const auto migration_started = SteadyClock::now();
    Result<uint32_t> moved = Migrate(*k, plan);
    std::lock_guard lock(mu);
    k->migrating = false;
    if (!moved.ok()) {
      k->migration_retry_after = SteadyClock::now() + kMigrationBackoff;
      ++migrations_failed;
      spdlog::error("kernel {}: migrating replica {} from {} to {} failed: {}", kernel_id,
                    plan.replica_id, plan.from_server_id, plan.to_server_id,
                    moved.status().ToString());
      return;
    }
    ++migrations_done;
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() -
                                                                          migration_started);
    migration_ms.push_back(ms.count());
    if (migration_ms.size() > 100) migration_ms.pop_front();
    spdlog::info("kernel {}: replica {} on {} migrated to replica {} on {} in {} ms", kernel_id,
                 plan.replica_id, plan.from_server_id, *moved, plan.to_server_id, ms.count());
  }

  // Adds a replica on the target server to the kernel's Raft group, waits until it caught up
  // and answers, then removes and stops the old one. Returns the new replica's id. On failure
  // the kernel keeps its old replicas (a new one that was started is stopped again).
  Result<uint32_t> Migrate(Kernel& k, const sched::MigrationPlan& plan) {
    std::lock_guard op(k.op_mu);
    std::shared_ptr<KernelSession> session = k.session;
    if (!session) return Unavailable("the kernel has no session");
    daemon::DaemonClient* to_client;
    daemon::DaemonClient* from_client;
    uint32_t new_id = 0;
    ReplicaId via = 0;
    {
      std::lock_guard lock(mu);
      to_client = ClientFor(plan.to_server_id);
      from_client = ClientFor(plan.from_server_id);
      new_id = ++k.last_replica_id;
      // A live member other than the one leaving takes the membership requests.
      for (const StoredReplica& r : k.meta.replicas) {
        auto live = k.replica_live.find(r.replica_id);
        if (r.replica_id != plan.replica_id && (live == k.replica_live.end() || live->second)) {
          via = r.replica_id;
          break;
        }
      }
    }
    if (to_client == nullptr) return Unavailable("server " + plan.to_server_id + " is gone");
    if (via == 0) return Unavailable("no live replica to change the Raft group through");
    // Per-step times for the log: where a slow migration spends its time.
    std::string steps;
    auto step_start = SteadyClock::now();
    auto step = [&](const char* name) {
      const auto now = SteadyClock::now();
      steps += fmt::format(
          " {} {} ms", name,
          std::chrono::duration_cast<std::chrono::milliseconds>(now - step_start).count());
      step_start = now;
    };
    auto prepared = PrepareReplica(k, to_client, plan.to_server_id, new_id);
    if (!prepared.ok()) return prepared.status();
    control::LaunchReplicaRequest launch;
    launch.set_kernel_id(k.meta.kernel_id);
    launch.set_replica_id(new_id);  // no peers: it joins the running group
    for (const auto& [name, value] : k.meta.env) (*launch.mutable_env())[name] = value;
    (*launch.mutable_env())["KERNEL_ID"] = k.meta.kernel_id;
    bool member = false, linked = false;
    auto undo = [&](Status why) -> Status {
      if (member) {
        (void)session->CallControl(via, "nbos_membership_request",
                                   Json{{"op", "remove"}, {"replica_id", new_id}},
                                   kMembershipTimeout);
      }
      if (linked) session->RemoveReplica(new_id);
      control::StopReplicaRequest stop;
      stop.set_kernel_id(k.meta.kernel_id);
      stop.set_replica_id(new_id);
      stop.set_keep_data(false);
      (void)to_client->StopReplica(stop);
      return why;
    };
    if (auto launched = to_client->LaunchReplica(launch); !launched.ok()) {
      return undo(launched.status());
    }
    step("launch");
    auto added = MembershipChange(
        *session, via,
        Json{{"op", "add"}, {"replica_id", new_id}, {"raft_address", prepared->raft_address}});
    if (!added.ok()) return undo(added);
    member = true;
    step("join");
    auto conn = jupyter::ParseConnectionInfo(prepared->connection_json);
    if (!conn.ok()) return undo(conn.status());
    // No execution may start while four replicas are linked (their election could fail), and
    // none may be running when the fourth is linked.
    session->HoldExecutions(true);
    struct Unhold {
      KernelSession* s;
      ~Unhold() { s->HoldExecutions(false); }
    } unhold{session.get()};
    const auto drain_deadline = SteadyClock::now() + kMembershipTimeout;
    while (ReplicaId busy = session->executing_replica()) {
      if (busy == plan.replica_id) {
        // A cell got GPUs on the leaving replica meanwhile: it no longer needs to move.
        return undo(Unavailable("replica " + std::to_string(plan.replica_id) +
                                " started executing; migration abandoned"));
      }
      if (SteadyClock::now() > drain_deadline) {
        return undo(Unavailable("an execution did not finish; migration abandoned"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (Status s = session->AddReplica({new_id, plan.to_server_id, *conn}); !s.ok()) {
      return undo(s);
    }
    linked = true;
    if (Status s = session->AwaitReplicas({new_id}, kMembershipTimeout); !s.ok()) return undo(s);
    step("answer");
    if (Status s = MembershipChange(*session, via,
                                    Json{{"op", "remove"}, {"replica_id", plan.replica_id}});
        !s.ok()) {
      return undo(s);
    }
    session->RemoveReplica(plan.replica_id);
    step("leave");
    spdlog::info("kernel {}: migration steps:{}", k.meta.kernel_id, steps);
    if (from_client != nullptr) {
      control::StopReplicaRequest stop;
      stop.set_kernel_id(k.meta.kernel_id);
      stop.set_replica_id(plan.replica_id);
      stop.set_keep_data(false);
      if (Status s = from_client->StopReplica(stop); !s.ok()) {
        spdlog::warn("kernel {}: stopping the migrated replica {} on {}: {}", k.meta.kernel_id,
                     plan.replica_id, plan.from_server_id, s.ToString());
      }
    }
    {
      std::lock_guard lock(mu);
      std::erase_if(k.meta.replicas,
                    [&](const StoredReplica& r) { return r.replica_id == plan.replica_id; });
      k.meta.replicas.push_back(*prepared);
      k.replica_live.erase(plan.replica_id);
      k.replica_live[new_id] = true;
      (void)scheduler.OnReplicaAdded(NowMs(), k.meta.kernel_id, new_id, plan.to_server_id);
      (void)scheduler.OnReplicaRemoved(NowMs(), k.meta.kernel_id, plan.replica_id);
    }
    if (Status s = store->Put(k.meta); !s.ok()) {
      spdlog::error("kernel {}: recording the migration: {}", k.meta.kernel_id, s.ToString());
    }
    return new_id;
  }

  // One nbos_membership_request through replica `via`; its error reply as a Status.
  Status MembershipChange(KernelSession& session, ReplicaId via, Json request) {
    const std::string what = request.dump();
    auto reply =
        session.CallControl(via, "nbos_membership_request", std::move(request), kMembershipTimeout);
    if (!reply.ok()) return reply.status();
    if (reply->value("status", "") != "ok") {
      return Unavailable("membership change " + what +
                         " refused: " + reply->value("evalue", reply->dump()));
    }
    return Status::Ok();
  }

  void Migrator() {
    std::unique_lock lock(monitor_mu);
    while (!stopping) {
      monitor_cv.wait(lock, [&] { return stopping || !migrations.empty(); });
      if (stopping) break;
      auto f = std::move(migrations.front());
      migrations.pop_front();
      lock.unlock();
      f();
      lock.lock();
    }
  }

  Status DeleteKernel(const std::string& id) {
    std::shared_ptr<Kernel> k = FindKernel(id);
    if (!k) return NotFound("no kernel " + id);
    std::lock_guard op(k->op_mu);
    {
      std::lock_guard lock(mu);
      if (!kernels.erase(id)) return NotFound("no kernel " + id);
    }
    if (k->session)
      k->session->Shutdown();  // releases outstanding grants, closes client websockets
    k->session.reset();
    StopReplicas(k->meta);
    (void)store->Remove(id);
    std::lock_guard lock(mu);
    (void)scheduler.OnKernelRemoved(NowMs(), id);
    spdlog::info("kernel {} deleted", id);
    return Status::Ok();
  }

  Result<std::shared_ptr<Kernel>> RestartKernel(const std::string& id) {
    std::shared_ptr<Kernel> k = FindKernel(id);
    if (!k) return NotFound("no kernel " + id);
    std::lock_guard op(k->op_mu);
    std::vector<std::string> server_ids;
    for (const StoredReplica& r : k->meta.replicas) server_ids.push_back(r.server_id);
    if (k->session) k->session->Shutdown();
    k->session.reset();
    StopReplicas(k->meta);
    k->meta.key = NewKey();
    k->meta.session_id = NewUuid();
    Status s = LaunchReplicas(k.get(), server_ids);
    if (s.ok()) s = store->Put(k->meta);
    if (s.ok()) {
      auto session = StartSession(k);
      if (!session.ok()) return session.status();
      k->session = *session;
      s = AwaitReplicas(*k);
    }
    if (!s.ok()) return s;
    spdlog::info("kernel {} restarted", id);
    return k;
  }

  // ---------- servers ----------
  void OnRegister(const control::RegisterRequest& req) {
    std::vector<std::shared_ptr<Kernel>> restored;
    {
      std::lock_guard lock(mu);
      auto& s = servers[req.server_id()];
      if (!s) s = std::make_unique<Server>();
      s->server_id = req.server_id();
      if (!s->client || s->client->address() != req.daemon_address())
        s->client = std::make_unique<daemon::DaemonClient>(req.daemon_address());
      s->gpus_virtual = req.gpus_virtual();
      s->last_seen = SteadyClock::now();
      s->alive = true;
      sched::ServerView view;
      view.server_id = req.server_id();
      view.spec = FromProto(req.spec());
      if (const sched::ServerView* existing = cluster.FindServer(req.server_id())) {
        view.committed = existing->committed;
        (void)scheduler.OnServerUpdated(NowMs(), view);
      } else if (Status st = scheduler.OnServerJoined(NowMs(), view); !st.ok()) {
        spdlog::error("registering server {}: {}", req.server_id(), st.ToString());
      }
      // Kernels restored from the database join the scheduler's view once all their servers
      // are back.
      for (auto& [id, k] : kernels) {
        if (k->in_cluster) continue;
        bool all = true;
        for (const auto& r : k->meta.replicas) all = all && cluster.FindServer(r.server_id);
        if (all && !AddToCluster(*k).ok()) spdlog::warn("kernel {} not schedulable", id);
      }
    }
    spdlog::info("server {} registered at {} ({} GPUs{})", req.server_id(), req.daemon_address(),
                 req.spec().gpus(), req.gpus_virtual() ? ", virtual" : "");
  }

  bool OnHeartbeat(const control::ServerStatus& status) {
    std::vector<std::pair<std::shared_ptr<KernelSession>, std::pair<uint32_t, bool>>> changes;
    std::vector<std::pair<std::string, uint32_t>> to_stop;
    daemon::DaemonClient* client = nullptr;
    {
      std::lock_guard lock(mu);
      auto it = servers.find(status.server_id());
      if (it == servers.end()) return false;
      Server& s = *it->second;
      s.last_seen = SteadyClock::now();
      s.status = status;
      s.alive = true;
      client = s.client.get();
      to_stop = FindOrphans(s);
      std::set<std::pair<std::string, uint32_t>> running;
      for (const auto& r : status.replicas())
        if (r.state() == "running") running.insert({r.kernel_id(), r.replica_id()});
      for (auto& [id, k] : kernels) {
        for (const auto& r : k->meta.replicas) {
          if (r.server_id != s.server_id) continue;
          const bool live = running.count({id, r.replica_id}) > 0;
          auto [pos, inserted] = k->replica_live.emplace(r.replica_id, live);
          if (!inserted && pos->second == live) continue;
          pos->second = live;
          if (k->session) changes.push_back({k->session, {r.replica_id, live}});
        }
      }
    }
    for (auto& [session, change] : changes) {
      if (change.second) {
        session->ReplicaBack(change.first);
      } else {
        session->ReplicaLost(change.first);
      }
    }
    if (!to_stop.empty()) {
      Chore([client, server_id = status.server_id(), to_stop] {
        for (const auto& [kernel_id, replica_id] : to_stop) {
          spdlog::warn(
              "server {} runs replica {} of kernel {}, which the gateway does not know: "
              "stopping it",
              server_id, replica_id, kernel_id);
          control::StopReplicaRequest req;
          req.set_kernel_id(kernel_id);
          req.set_replica_id(replica_id);
          req.set_keep_data(false);
          if (Status st = client->StopReplica(req); !st.ok()) {
            spdlog::warn("stopping replica {} of kernel {} on {}: {}", replica_id, kernel_id,
                         server_id, st.ToString());
          }
        }
      });
    }
    return true;
  }

  // Replicas the server reports that no kernel of the gateway has (a kernel deleted or restarted
  // while its server was unregistered, or one the database lost), seen in two heartbeats in a
  // row. Kernels with a restart, delete or migration under way are left alone: their replica
  // lists are changing. Call with mu held.
  std::vector<std::pair<std::string, uint32_t>> FindOrphans(Server& s) {
    std::set<std::pair<std::string, uint32_t>> seen;
    std::vector<std::pair<std::string, uint32_t>> orphans;
    for (const auto& r : s.status.replicas()) {
      if (r.state() == "stopped") continue;
      auto k = kernels.find(r.kernel_id());
      if (k != kernels.end()) {
        std::unique_lock op(k->second->op_mu, std::try_to_lock);
        if (!op.owns_lock()) continue;
        const auto& replicas = k->second->meta.replicas;
        if (std::any_of(replicas.begin(), replicas.end(), [&](const StoredReplica& m) {
              return m.replica_id == r.replica_id() && m.server_id == s.server_id;
            })) {
          continue;
        }
      }
      const std::pair<std::string, uint32_t> id{r.kernel_id(), r.replica_id()};
      seen.insert(id);
      if (s.orphans_seen.count(id)) orphans.push_back(id);
    }
    s.orphans_seen = std::move(seen);
    return orphans;
  }

  // Servers that stopped sending heartbeats: their replicas count as lost.
  void CheckServers() {
    std::vector<std::pair<std::shared_ptr<KernelSession>, uint32_t>> lost;
    {
      std::lock_guard lock(mu);
      const auto now = SteadyClock::now();
      for (auto& [id, s] : servers) {
        if (!s->alive || now - s->last_seen < std::chrono::milliseconds(options.server_timeout_ms))
          continue;
        s->alive = false;
        (void)scheduler.OnServerAccepting(NowMs(), id, false);
        spdlog::warn("server {} missed its heartbeats; its replicas count as lost", id);
        for (auto& [kid, k] : kernels) {
          for (const auto& r : k->meta.replicas) {
            if (r.server_id != id) continue;
            k->replica_live[r.replica_id] = false;
            if (k->session) lost.push_back({k->session, r.replica_id});
          }
        }
      }
    }
    for (auto& [session, r] : lost) session->ReplicaLost(r);
  }

  void Chore(std::function<void()> f) {
    {
      std::lock_guard lock(monitor_mu);
      chores.push_back(std::move(f));
    }
    monitor_cv.notify_all();
  }

  void Monitor() {
    std::unique_lock lock(monitor_mu);
    while (!stopping) {
      monitor_cv.wait_for(lock, std::chrono::milliseconds(500),
                          [&] { return stopping || !chores.empty(); });
      while (!chores.empty() && !stopping) {
        auto f = std::move(chores.front());
        chores.pop_front();
        lock.unlock();
        f();
        lock.lock();
      }
      lock.unlock();
      CheckServers();
      MaybeRebalance();
      lock.lock();
    }
  }

  // With rebalance_interval_ms: a scheduler tick, whose rebalance plans become migrations.
  void MaybeRebalance() {
    if (options.rebalance_interval_ms <= 0) return;
    const auto now = SteadyClock::now();
    if (now < next_rebalance) return;
    next_rebalance = now + std::chrono::milliseconds(options.rebalance_interval_ms);
    std::lock_guard lock(mu);
    const sched::TickDecision tick = scheduler.OnTick(NowMs());
    for (const sched::RebalancePlan& r : tick.rebalance) {
      spdlog::info("kernel {}: moving idle replica {} from {} to {} ({})", r.kernel_id,
                   r.plan.replica_id, r.plan.from_server_id, r.plan.to_server_id, r.plan.reason);
      MaybeStartMigration(r.kernel_id, r.plan);
    }
  }

  // ---------- HTTP ----------
  Json KernelspecModel() const {
    Json spec{{"argv", Json::array()}, {"display_name", options.display_name},
              {"language", "python"},  {"interrupt_mode", "message"},
              {"env", Json::object()}, {"metadata", {{"nbos", {{"replicas", options.replicas}}}}}};
    return Json{{"name", options.kernelspec_name}, {"spec", spec}, {"resources", Json::object()}};
  }

  Status Authenticate(const http::Request& req) const {
    if (options.token.empty()) return Status::Ok();
    const std::string& header = req.Header("authorization");
    for (const char* scheme : {"token ", "Token ", "Bearer ", "bearer "}) {
      const size_t n = std::strlen(scheme);
      if (header.size() > n && header.compare(0, n, scheme) == 0 &&
          header.substr(n) == options.token)
        return Status::Ok();
    }
    auto q = req.query.find("token");
    if (q != req.query.end() && q->second == options.token) return Status::Ok();
    return Unauthenticated(header.empty() && q == req.query.end()
                               ? "this gateway requires a token (Authorization: token T)"
                               : "invalid token");
  }

  void Routes() {
    http.SetAuthenticator([this](const http::Request& r) { return Authenticate(r); });
    http.Route("GET", "/api",
               [](const http::Request&) {
                 return JsonResponse(200, Json{{"version", kVersion}, {"server", "nbos"}});
               },
               {.public_route = true});
    http.Route("GET", "/api/kernelspecs", [this](const http::Request&) {
      return JsonResponse(200,
                          Json{{"default", options.kernelspec_name},
                               {"kernelspecs", {{options.kernelspec_name, KernelspecModel()}}}});
    });
    http.Route("GET", "/api/kernelspecs/{name}", [this](const http::Request& r) {
      if (r.params.at("name") != options.kernelspec_name)
        return Error(404, "no kernelspec named " + r.params.at("name"));
      return JsonResponse(200, KernelspecModel());
    });
    http.Route("GET", "/kernelspecs/{name}/{file}", [](const http::Request& r) {
      return Error(404, "no resource " + r.params.at("file"));
    });
    http.Route("GET", "/api/kernels", [this](const http::Request&) {
      Json list = Json::array();
      std::vector<std::shared_ptr<Kernel>> all;
      {
        std::lock_guard lock(mu);
        for (auto& [id, k] : kernels) all.push_back(k);
      }
      for (auto& k : all)
        if (k->session) list.push_back(Model(*k));
      return JsonResponse(200, list);
    });
    http.Route("POST", "/api/kernels", [this](const http::Request& r) { return PostKernel(r); });
    http.Route("GET", "/api/kernels/{kernel_id}", [this](const http::Request& r) {
      auto k = FindKernel(r.params.at("kernel_id"));
      if (!k || !k->session) return Error(404, "no kernel " + r.params.at("kernel_id"));
      return JsonResponse(200, Model(*k));
    });
    http.Route("DELETE", "/api/kernels/{kernel_id}", [this](const http::Request& r) {
      Status s = DeleteKernel(r.params.at("kernel_id"));
      if (!s.ok()) return Error(s);
      http::Response resp;
      resp.status = 204;
      resp.content_type.clear();
      return resp;
    });
    http.Route("POST", "/api/kernels/{kernel_id}/interrupt", [this](const http::Request& r) {
      auto k = FindKernel(r.params.at("kernel_id"));
      if (!k || !k->session) return Error(404, "no kernel " + r.params.at("kernel_id"));
      k->session->Interrupt();
      http::Response resp;
      resp.status = 204;
      resp.content_type.clear();
      return resp;
    });
    http.Route("POST", "/api/kernels/{kernel_id}/restart", [this](const http::Request& r) {
      auto k = RestartKernel(r.params.at("kernel_id"));
      if (!k.ok()) return Error(k.status());
      return JsonResponse(200, Model(**k));
    });
    http.WebSocket("/api/kernels/{kernel_id}/channels",
                   [this](const http::Request& r, std::shared_ptr<http::WsConnection> conn) {
                     return OpenChannels(r, std::move(conn));
                   },
                   // Only the legacy framing (what jupyter_server's gateway client speaks); a
                   // client offering v1.kernel.websocket.jupyter.org falls back to it.
                   {.subprotocols = {}});
    http.Route("GET", "/api/nbos/cluster",
               [this](const http::Request&) { return JsonResponse(200, ClusterJson()); });
    http.Route("GET", "/metrics", [this](const http::Request&) {
      http::Response resp;
      resp.content_type = "text/plain; version=0.0.4";
      resp.body = Metrics();
      return resp;
    });
  }

  http::Response PostKernel(const http::Request& r) {
    Json body = r.body.empty() ? Json::object() : Json::parse(r.body, nullptr, false);
    if (!body.is_object()) return Error(400, "the request body must be a JSON object");
    const std::string name = body.value("name", options.kernelspec_name);
    if (name != options.kernelspec_name) return Error(404, "no kernelspec named " + name);
    std::map<std::string, std::string> env;
    if (body.contains("env")) {
      if (!body["env"].is_object()) return Error(400, "env must be an object of strings");
      const std::set<std::string> allowed(options.allowed_env.begin(), options.allowed_env.end());
      for (auto& [key, value] : body["env"].items()) {
        // Only KERNEL_* and configured names reach replicas: jupyter_server sends its whole
        // environment through /api/sessions.
        if (key.rfind("KERNEL_", 0) != 0 && !allowed.count(key)) continue;
        if (!value.is_string()) return Error(400, "env." + key + " must be a string");
        env[key] = value.get<std::string>();
      }
    }
    auto k = CreateKernel(name, env);
    if (!k.ok()) {
      const Status& s = k.status();
      int code = s.code() == StatusCode::kInvalidArgument ? 400 : 503;
      return Error(code, s.message(),
                   s.code() == StatusCode::kInvalidArgument ? "bad request" : "unavailable");
    }
    return JsonResponse(201, Model(**k));
  }

  class Channels final : public http::WsHandler {
   public:
    Channels(std::shared_ptr<KernelSession> session, std::shared_ptr<http::WsConnection> conn,
             size_t max_bytes)
        : session_(std::move(session)), conn_(std::move(conn)), max_bytes_(max_bytes) {
      std::weak_ptr<http::WsConnection> weak = conn_;
      client_ = session_->Attach({[weak](const jupyter::WsMessage& m) {
                                    auto c = weak.lock();
                                    if (!c) return;
                                    bool binary = false;
                                    std::string frame = jupyter::EncodeWs(m, &binary);
                                    if (binary) {
                                      c->SendBinary(std::move(frame));
                                    } else {
                                      c->SendText(std::move(frame));
                                    }
                                  },
                                  [weak] {
                                    if (auto c = weak.lock()) c->Close(1001, "kernel gone");
                                  }});
    }
    void OnText(std::string text) override { Receive(text, false); }
    void OnBinary(std::string data) override { Receive(data, true); }
    void OnClose() override { session_->Detach(client_); }

   private:
    void Receive(const std::string& payload, bool binary) {
      auto m = jupyter::DecodeWs(payload, binary, {.max_message_bytes = max_bytes_});
      Status s = m.ok() ? session_->Send(client_, std::move(*m)) : m.status();
      if (!s.ok()) {
        // A client that sends what cannot be a Jupyter message is broken; tell it why.
        spdlog::warn("closing a kernel websocket from {}: {}", conn_->remote(), s.ToString());
        conn_->Close(s.code() == StatusCode::kResourceExhausted ? 1009 : 1007,
                     s.message().substr(0, 120));
      }
    }
    std::shared_ptr<KernelSession> session_;
    std::shared_ptr<http::WsConnection> conn_;
    size_t max_bytes_;
    KernelSession::ClientId client_ = 0;
  };

  Result<std::shared_ptr<http::WsHandler>> OpenChannels(const http::Request& r,
                                                        std::shared_ptr<http::WsConnection> conn) {
    auto k = FindKernel(r.params.at("kernel_id"));
    if (!k || !k->session) return NotFound("no kernel " + r.params.at("kernel_id"));
    return std::shared_ptr<http::WsHandler>(
        std::make_shared<Channels>(k->session, std::move(conn), options.max_message_bytes));
  }

  Json ClusterJson() const {
    std::lock_guard lock(mu);
    Json out{{"servers", Json::array()}, {"kernels", Json::array()}};
    std::map<std::pair<std::string, uint32_t>, const control::ReplicaStatus*> replica_status;
    for (const auto& [id, s] : servers) {
      for (const auto& r : s->status.replicas())
        replica_status[{r.kernel_id(), r.replica_id()}] = &r;
    }
    for (const auto& [id, view] : cluster.servers()) {
      auto s = servers.find(id);
      Json warm = Json::object();
      if (s != servers.end()) {
        const control::WarmPool& w = s->second->status.warm_pool();
        warm = Json{{"ready", w.ready()},   {"starting", w.starting()},
                    {"target", w.target()}, {"promoted", w.promoted()},
                    {"cold", w.cold()},     {"disabled", w.disabled()}};
      }
      out["servers"].push_back(
          Json{{"server_id", id},
               {"address", s != servers.end() ? s->second->client->address() : ""},
               {"alive", s != servers.end() && s->second->alive},
               {"gpus_virtual", s != servers.end() && s->second->gpus_virtual},
               {"spec", ResourcesJson(view.spec)},
               {"subscribed", ResourcesJson(view.subscribed)},
               {"committed", ResourcesJson(view.committed)},
               {"gpus_idle", view.IdleGpus()},
               {"gpus_committed", view.committed.gpus},
               // The daemon's own ledger, as of its last heartbeat (authoritative for grants).
               {"daemon_gpus_committed",
                s != servers.end() ? s->second->status.ledger().committed().gpus() : 0},
               {"subscription_ratio", sched::HostSubscriptionRatio(view)},
               {"warm_pool", warm}});
    }
    out["cluster_subscription_ratio"] = scheduler.ratio().value();
    out["migrations"] = Json{
        {"done", migrations_done}, {"failed", migrations_failed}, {"durations_ms", migration_ms}};
    for (const auto& [id, k] : kernels) {
      const ReplicaId executor = k->session ? k->session->current_executor() : 0;
      Json replicas = Json::array();
      for (const auto& r : k->meta.replicas) {
        auto st = replica_status.find({id, r.replica_id});
        replicas.push_back(
            Json{{"replica_id", r.replica_id},
                 {"server_id", r.server_id},
                 {"pid", st != replica_status.end() ? st->second->pid() : 0},
                 {"state", st != replica_status.end() ? st->second->state() : "unknown"},
                 {"restarts", st != replica_status.end() ? st->second->restarts() : 0},
                 {"role", r.replica_id == executor ? "executor" : "standby"}});
      }
      out["kernels"].push_back(
          Json{{"id", id},
               {"name", k->meta.kernelspec},
               {"resources", ResourcesJson(k->request)},
               {"executor", executor},
               {"execution_state", k->session ? k->session->execution_state() : "starting"},
               {"replicas", replicas}});
    }
    return out;
  }

  std::string Metrics() const {
    prometheus::Registry registry;
    auto& gpus = prometheus::BuildGauge()
                     .Name("nbos_server_gpus")
                     .Help("GPUs per server by state (spec, committed, idle, subscribed)")
                     .Register(registry);
    auto& kernels_gauge = prometheus::BuildGauge()
                              .Name("nbos_kernels")
                              .Help("Kernels by execution state")
                              .Register(registry);
    auto& ratio_gauge = prometheus::BuildGauge()
                            .Name("nbos_subscription_ratio")
                            .Help("Subscription ratio, per server and for the cluster")
                            .Register(registry);
    auto& warm_gauge = prometheus::BuildGauge()
                           .Name("nbos_warm_replicas")
                           .Help("Pre-started replica processes per server, ready and target")
                           .Register(registry);
    auto& launches = prometheus::BuildCounter()
                         .Name("nbos_replica_launches_total")
                         .Help("Replica launches per server, from a warm process or cold")
                         .Register(registry);
    auto& grants = prometheus::BuildCounter()
                       .Name("nbos_gpu_grants_total")
                       .Help("GPU grant requests by outcome")
                       .Register(registry);
    auto& executions = prometheus::BuildCounter()
                           .Name("nbos_executions_total")
                           .Help("Executions sent to replicas, and those that waited for GPUs")
                           .Register(registry);
    auto& migrations_counter = prometheus::BuildCounter()
                                   .Name("nbos_migrations_total")
                                   .Help("Replica migrations by outcome")
                                   .Register(registry);
    std::vector<std::shared_ptr<KernelSession>> sessions;
    {
      std::lock_guard lock(mu);
      migrations_counter.Add({{"outcome", "done"}}).Increment(static_cast<double>(migrations_done));
      migrations_counter.Add({{"outcome", "failed"}})
          .Increment(static_cast<double>(migrations_failed));
      for (const auto& [id, view] : cluster.servers()) {
        gpus.Add({{"server", id}, {"state", "spec"}}).Set(view.spec.gpus);
        gpus.Add({{"server", id}, {"state", "committed"}}).Set(view.committed.gpus);
        gpus.Add({{"server", id}, {"state", "idle"}}).Set(view.IdleGpus());
        gpus.Add({{"server", id}, {"state", "subscribed"}}).Set(view.subscribed.gpus);
        ratio_gauge.Add({{"server", id}}).Set(sched::HostSubscriptionRatio(view));
        if (auto s = servers.find(id); s != servers.end()) {
          const control::WarmPool& w = s->second->status.warm_pool();
          warm_gauge.Add({{"server", id}, {"state", "ready"}}).Set(w.ready());
          warm_gauge.Add({{"server", id}, {"state", "target"}}).Set(w.target());
          launches.Add({{"server", id}, {"from", "warm"}})
              .Increment(static_cast<double>(w.promoted()));
          launches.Add({{"server", id}, {"from", "cold"}}).Increment(static_cast<double>(w.cold()));
        }
      }
      ratio_gauge.Add({{"server", ""}}).Set(scheduler.ratio().value());
      grants.Add({{"outcome", "granted"}}).Increment(static_cast<double>(grants_made));
      grants.Add({{"outcome", "refused"}}).Increment(static_cast<double>(grants_refused));
      for (const auto& [id, k] : kernels)
        if (k->session) sessions.push_back(k->session);
    }
    std::map<std::string, int> states{{"idle", 0}, {"busy", 0}, {"starting", 0}};
    uint64_t executed = 0, waited = 0;
    for (const auto& s : sessions) {
      ++states[s->execution_state()];
      executed += s->stats().executions;
      waited += s->stats().waited_for_gpus;
    }
    for (const auto& [state, n] : states) kernels_gauge.Add({{"state", state}}).Set(n);
    executions.Add({{"kind", "sent"}}).Increment(static_cast<double>(executed));
    executions.Add({{"kind", "waited_for_gpus"}}).Increment(static_cast<double>(waited));
    return prometheus::TextSerializer().Serialize(registry.Collect());
  }

  Status RestoreKernels() {
    auto stored = store->List();
    if (!stored.ok()) return stored.status();
    for (StoredKernel& meta : *stored) {
      auto k = std::make_shared<Kernel>();
      k->request = ResourcesFromJson(meta.resources, options.default_request);
      k->meta = std::move(meta);
      for (const StoredReplica& r : k->meta.replicas)
        k->last_replica_id = std::max(k->last_replica_id, r.replica_id);
      auto session = StartSession(k);
      if (!session.ok()) {
        spdlog::error("kernel {} could not be restored: {}", k->meta.kernel_id,
                      session.status().ToString());
        continue;
      }
      k->session = *session;
      std::lock_guard lock(mu);
      kernels[k->meta.kernel_id] = k;
    }
    if (!stored->empty()) spdlog::info("restored {} kernel(s) from the database", stored->size());
    return Status::Ok();
  }
};

namespace {

class ControlService final : public control::Gateway::Service {
 public:
  explicit ControlService(Gateway::Impl* impl) : impl_(impl) {}
  grpc::Status Register(grpc::ServerContext*, const control::RegisterRequest* req,
                        control::RegisterReply* reply) override {
    if (req->server_id().empty() || req->daemon_address().empty())
      return {grpc::StatusCode::INVALID_ARGUMENT, "server_id and daemon_address are required"};
    impl_->OnRegister(*req);
    reply->set_heartbeat_interval_ms(impl_->options.heartbeat_interval_ms);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const control::HeartbeatRequest* req,
                         control::HeartbeatReply* reply) override {
    reply->set_known(impl_->OnHeartbeat(req->status()));
    return grpc::Status::OK;
  }

 private:
  Gateway::Impl* impl_;
};

}  // namespace

Result<std::unique_ptr<Gateway>> Gateway::Start(GatewayOptions options) {
  if (options.state_dir.empty()) return InvalidArgument("the gateway needs a state directory");
  if (options.token.empty() && !options.allow_unauthenticated)
    return InvalidArgument("the gateway needs a token (or explicitly allow unauthenticated use)");
  std::error_code ec;
  std::filesystem::create_directories(options.state_dir, ec);
  if (ec) return Unavailable("creating " + options.state_dir + ": " + ec.message());
  auto impl = std::make_unique<Impl>(std::move(options));
  if (!impl->options.decision_journal.empty()) {
    // One journal per gateway run: it starts from an empty core, as its replay does.
    impl->journal_file.open(impl->options.decision_journal, std::ios::trunc);
    if (!impl->journal_file) {
      return Unavailable("cannot write the decision journal " + impl->options.decision_journal);
    }
    impl->journal_file << std::unitbuf;  // a record is on disk as soon as it is decided
    impl->journal =
        std::make_unique<sched::JournalWriter>(impl->journal_file, impl->scheduler.options());
    impl->scheduler.set_observer(impl->journal.get());
  }
  auto store = MetadataStore::Open(impl->options.state_dir + "/gateway.db");
  if (!store.ok()) return store.status();
  impl->store = std::move(*store);
  if (Status s = impl->RestoreKernels(); !s.ok()) return s;

  impl->control_service = std::make_unique<ControlService>(impl.get());
  grpc::ServerBuilder builder;
  int control_port = 0;
  builder.AddListeningPort(impl->options.control_address, grpc::InsecureServerCredentials(),
                           &control_port);
  builder.RegisterService(impl->control_service.get());
  impl->control_server = builder.BuildAndStart();
  if (!impl->control_server || control_port == 0)
    return Unavailable("cannot listen for daemons on " + impl->options.control_address);
  const std::string host =
      impl->options.control_address.substr(0, impl->options.control_address.rfind(':'));
  impl->control_address = host + ":" + std::to_string(control_port);

  impl->Routes();
  http::ServerOptions ho;
  ho.address = impl->options.address;
  ho.port = impl->options.port;
  ho.max_body_bytes = impl->options.max_message_bytes;
  ho.max_ws_message_bytes = impl->options.max_message_bytes;
  ho.handler_threads = 8;
  if (Status s = impl->http.Start(ho); !s.ok()) return s;
  Impl* raw = impl.get();
  impl->monitor = std::thread([raw] { raw->Monitor(); });
  impl->migrator = std::thread([raw] { raw->Migrator(); });
  return std::unique_ptr<Gateway>(new Gateway(std::move(impl)));
}

Gateway::Gateway(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Gateway::~Gateway() { Stop(); }

uint16_t Gateway::port() const { return impl_->http.port(); }
std::string Gateway::control_address() const { return impl_->control_address; }

void Gateway::Stop() {
  {
    std::lock_guard lock(impl_->monitor_mu);
    if (impl_->stopping) return;
    impl_->stopping = true;
  }
  impl_->monitor_cv.notify_all();
  if (impl_->monitor.joinable()) impl_->monitor.join();
  if (impl_->migrator.joinable()) impl_->migrator.join();
  impl_->http.Stop();
  if (impl_->control_server)
    impl_->control_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  std::vector<std::shared_ptr<KernelSession>> sessions;
  {
    std::lock_guard lock(impl_->mu);
    for (auto& [id, k] : impl_->kernels)
      if (k->session) sessions.push_back(k->session);
  }
  for (auto& s : sessions) s->Shutdown();
}

}  // namespace nbos::gateway
