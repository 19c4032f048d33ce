#include "gateway/http_api.h"

#include <fmt/format.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "jupyter/json_limits.h"
#include "sched/subscription.h"
#include "workspace/workspace.h"

namespace nbos::gateway {
namespace {

using jupyter::Json;

constexpr char kVersion[] = "0.1.0";

http::Response JsonResponse(int status, const Json& body) {
  http::Response r;
  r.status = status;
  r.body = body.dump(-1, ' ', false, Json::error_handler_t::replace);
  return r;
}

http::Response NoContent() {
  http::Response r;
  r.status = 204;
  r.content_type.clear();
  return r;
}

// live: a group member its daemon runs; lost: its server or process is gone (it is being or will
// be replaced); leaving: a migration moves it; starting: no heartbeat has reported it yet;
// joining (listed separately): the new member a migration adds.
// The replica a migration of `k` is adding while it is not yet a recorded member; 0: none.
ReplicaId JoiningReplica(const KernelRecord& k) {
  if (!k.migration) return 0;
  const ReplicaId id = k.migration->joining_replica;
  const bool member = std::any_of(k.meta.replicas.begin(), k.meta.replicas.end(),
                                  [&](const StoredReplica& r) { return r.replica_id == id; });
  return member ? 0 : id;
}

const char* ReplicaState(const KernelRecord& k, ReplicaId replica) {
  auto live = k.replica_live.find(replica);
  if (live != k.replica_live.end() && !live->second) return "lost";  // also while replaced
  if (k.migration && k.migration->leaving_replica == replica) return "leaving";
  return live == k.replica_live.end() ? "starting" : "live";
}

Json ResourcesJson(const sched::Resources& r) {
  return Json{{"millicpus", r.millicpus},
              {"memory_mb", r.memory_mb},
              {"gpus", r.gpus},
              {"vram_mb", r.vram_mb}};
}

// A kernel clients see: running, or restarting (jupyter server forgets a kernel missing from the
// list as one the gateway culled).
bool Listed(const KernelRecord& k) { return k.session || k.restarting; }

Json KernelModel(const KernelRecord& k) {
  Json m{{"id", k.meta.kernel_id},
         {"name", k.meta.kernelspec},
         {"last_activity", k.meta.created},
         {"execution_state", k.restarting ? "restarting" : "starting"},
         {"connections", 0}};
  if (k.session) {
    m["last_activity"] = k.session->last_activity();
    m["execution_state"] = k.session->execution_state();
    m["connections"] = k.session->connections();
  }
  return m;
}

// One kernel WebSocket: frames go to the session as received; the session validates them and
// answers, closes this connection for frames that cannot be messages, and closes it with 1001
// when the kernel goes away.
class Channels final : public http::WsHandler {
 public:
  Channels(std::shared_ptr<KernelSession> session, const std::shared_ptr<http::WsConnection>& conn)
      : session_(std::move(session)) {
    std::weak_ptr<http::WsConnection> weak = conn;
    client_ = session_->Attach({[weak](const std::string& frame, bool binary) {
                                  auto c = weak.lock();
                                  if (!c) return;
                                  if (binary) {
                                    c->SendBinary(frame);
                                  } else {
                                    c->SendText(frame);
                                  }
                                },
                                [weak](uint16_t code, const std::string& reason) {
                                  if (auto c = weak.lock()) c->Close(code, reason);
                                }});
  }
  void OnText(std::string text) override { session_->Receive(client_, std::move(text), false); }
  void OnBinary(std::string data) override { session_->Receive(client_, std::move(data), true); }
  void OnClose() override { session_->Detach(client_); }

 private:
  std::shared_ptr<KernelSession> session_;
  KernelSession::ClientId client_ = 0;
};

// Kernels by execution state, and their sessions' counters summed.
struct SessionTotals {
  std::map<std::string, int> states{{"idle", 0}, {"busy", 0}, {"starting", 0}};
  uint64_t executions = 0, waited_for_gpus = 0, exceptions_caught = 0;
};

SessionTotals SumSessions(const std::vector<KernelRecord>& kernels) {
  SessionTotals t;
  for (const KernelRecord& k : kernels) {
    if (!k.session) {
      ++t.states["starting"];
      continue;
    }
    const KernelSession::Stats s = k.session->stats();
    ++t.states[k.session->execution_state()];
    t.executions += s.executions;
    t.waited_for_gpus += s.waited_for_gpus;
    t.exceptions_caught += s.exceptions_caught;
  }
  return t;
}

}  // namespace

HttpApi::HttpApi(HttpApiOptions options, Registry* registry, KernelManager* kernels,
                 Migrator* migrator, EdgeCounters* counters, ExceptionCount exceptions)
    : options_(std::move(options)),
      registry_(registry),
      kernels_(kernels),
      migrator_(migrator),
      counters_(counters),
      exceptions_(std::move(exceptions)) {}

http::Response HttpApi::Refuse(int status, const std::string& message) {
  if (status >= 400 && status < 500) ++counters_->rejected_rest_requests;
  return http::ErrorResponse(status, message);
}

http::Response HttpApi::Refuse(const Status& s) {
  int code = http::HttpStatusFor(s);
  if (s.code() == StatusCode::kResourceExhausted || s.code() == StatusCode::kUnavailable) {
    code = 503;
  }
  return Refuse(code, s.message());
}

namespace {

// Kernels of other users are answered as if they did not exist.
bool VisibleTo(const http::Identity& who, const KernelRecord& k) {
  return who.admin || k.meta.owner == who.user;
}

}  // namespace

std::optional<KernelRecord> HttpApi::VisibleKernel(const http::Request& r) const {
  auto k = registry_->FindKernel(r.params.at("kernel_id"));
  if (!k || !VisibleTo(r.identity, *k)) return std::nullopt;
  return k;
}

bool HttpApi::ServesKernelspec(const std::string& name) const {
  return name == options_.kernelspec_name ||
         std::find(options_.kernelspec_aliases.begin(), options_.kernelspec_aliases.end(), name) !=
             options_.kernelspec_aliases.end();
}

Json HttpApi::KernelspecModel(const std::string& name) const {
  // Pickers list display names: an alias says which name it is.
  const std::string display = name == options_.kernelspec_name
                                  ? options_.display_name
                                  : fmt::format("{} as {}", options_.display_name, name);
  Json spec{{"argv", Json::array()}, {"display_name", display},
            {"language", "python"},  {"interrupt_mode", "message"},
            {"env", Json::object()}, {"metadata", {{"nbos", {{"replicas", options_.replicas}}}}}};
  return Json{{"name", name}, {"spec", spec}, {"resources", Json::object()}};
}

void HttpApi::Install(http::Server* http) {
  http->SetAuthenticator([this](const http::Request& r) { return options_.auth->Authenticate(r); });
  http->Route("GET", "/api",
              [](const http::Request&) {
                return JsonResponse(200, Json{{"version", kVersion}, {"server", "nbos"}});
              },
              {.public_route = true});
  InstallKernelRoutes(http);
  InstallClusterRoutes(http);
}

// Jupyter's REST API: kernelspecs and kernels.
void HttpApi::InstallKernelRoutes(http::Server* http) {
  http->Route("GET", "/api/kernelspecs", [this](const http::Request&) {
    Json specs{{options_.kernelspec_name, KernelspecModel(options_.kernelspec_name)}};
    for (const std::string& alias : options_.kernelspec_aliases)
      specs[alias] = KernelspecModel(alias);
    return JsonResponse(200, Json{{"default", options_.kernelspec_name}, {"kernelspecs", specs}});
  });
  http->Route("GET", "/api/kernelspecs/{name}", [this](const http::Request& r) {
    if (!ServesKernelspec(r.params.at("name")))
      return Refuse(404, "no kernelspec named " + r.params.at("name"));
    return JsonResponse(200, KernelspecModel(r.params.at("name")));
  });
  http->Route("GET", "/kernelspecs/{name}/{file}", [this](const http::Request& r) {
    return Refuse(404, "no resource " + r.params.at("file"));
  });
  http->Route("GET", "/api/kernels", [this](const http::Request& r) {
    Json list = Json::array();
    for (const KernelRecord& k : registry_->Kernels())
      if (Listed(k) && VisibleTo(r.identity, k)) list.push_back(KernelModel(k));
    return JsonResponse(200, list);
  });
  http->Route("POST", "/api/kernels", [this](const http::Request& r) { return PostKernel(r); });
  http->Route("GET", "/api/kernels/{kernel_id}", [this](const http::Request& r) {
    auto k = VisibleKernel(r);
    if (!k || !Listed(*k)) return Refuse(404, "no kernel " + r.params.at("kernel_id"));
    return JsonResponse(200, KernelModel(*k));
  });
  http->Route("DELETE", "/api/kernels/{kernel_id}", [this](const http::Request& r) {
    if (!VisibleKernel(r)) return Refuse(404, "no kernel " + r.params.at("kernel_id"));
    Status s = kernels_->Delete(r.params.at("kernel_id"));
    return s.ok() ? NoContent() : Refuse(s);
  });
  http->Route("POST", "/api/kernels/{kernel_id}/interrupt", [this](const http::Request& r) {
    auto k = VisibleKernel(r);
    if (!k || !k->session) return Refuse(404, "no kernel " + r.params.at("kernel_id"));
    k->session->Interrupt();
    return NoContent();
  });
  http->Route("POST", "/api/kernels/{kernel_id}/restart", [this](const http::Request& r) {
    if (!VisibleKernel(r)) return Refuse(404, "no kernel " + r.params.at("kernel_id"));
    auto k = kernels_->Restart(r.params.at("kernel_id"));
    if (!k.ok()) return Refuse(k.status());
    return JsonResponse(200, KernelModel(*k));
  });
}

// The kernels' channels, nbos's own API and metrics.
void HttpApi::InstallClusterRoutes(http::Server* http) {
  http->WebSocket("/api/kernels/{kernel_id}/channels",
                  [this](const http::Request& r, std::shared_ptr<http::WsConnection> conn) {
                    return OpenChannels(r, std::move(conn));
                  },
                  // Only the legacy framing (what jupyter_server's gateway client speaks); a
                  // client offering v1.kernel.websocket.jupyter.org falls back to it.
                  {.subprotocols = {}});
  http->Route("POST", "/api/nbos/kernels/{kernel_id}/migrate",
              [this](const http::Request& r) { return PostMigrate(r); });
  http->Route("POST", "/api/nbos/servers/{server_id}/drain",
              [this](const http::Request& r) { return PostDrain(r); });
  http->Route("GET", "/api/nbos/cluster", [this](const http::Request& r) {
    return JsonResponse(200, ClusterJson(r.identity));
  });
  http->Route("GET", "/metrics", [this](const http::Request&) {
    http::Response resp;
    resp.content_type = "text/plain; version=0.0.4";
    resp.body = Metrics();
    return resp;
  });
}

std::variant<Json, http::Response> HttpApi::BodyObject(const http::Request& r) {
  if (!jupyter::JsonDepthWithin(r.body, options_.limits.max_json_depth)) {
    return Refuse(400, "the request body is nested too deeply");
  }
  Json body = r.body.empty() ? Json::object() : Json::parse(r.body, nullptr, false);
  if (!body.is_object()) return Refuse(400, "the request body must be a JSON object");
  return body;
}

// POST /api/nbos/kernels/{id}/migrate {"replica_id": N, "to_server_id": "S"}, both optional.
http::Response HttpApi::PostMigrate(const http::Request& r) {
  auto parsed = BodyObject(r);
  if (auto* refused = std::get_if<http::Response>(&parsed)) return std::move(*refused);
  const Json& body = std::get<Json>(parsed);
  uint32_t replica_id = 0;
  if (auto it = body.find("replica_id"); it != body.end() && !it->is_null()) {
    if (!it->is_number_unsigned() || it->get<uint64_t>() == 0 || it->get<uint64_t>() > UINT32_MAX) {
      return Refuse(400, "replica_id must be a replica id (a positive integer)");
    }
    replica_id = it->get<uint32_t>();
  }
  std::string to_server_id;
  if (auto it = body.find("to_server_id"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) return Refuse(400, "to_server_id must be a string (a server id)");
    to_server_id = it->get<std::string>();
  }
  const std::string& kernel_id = r.params.at("kernel_id");
  if (!VisibleKernel(r)) return Refuse(404, "no kernel " + kernel_id);
  auto plan = registry_->RequestMove(kernel_id, replica_id, to_server_id);
  if (!plan.ok()) {
    return plan.status().code() == StatusCode::kUnavailable ? Refuse(409, plan.status().message())
                                                            : Refuse(plan.status());
  }
  migrator_->Start(kernel_id, *plan, "asked for by an operator");
  return JsonResponse(202, Json{{"kernel_id", kernel_id},
                                {"replica_id", plan->replica_id},
                                {"from_server_id", plan->from_server_id},
                                {"to_server_id", plan->to_server_id}});
}

// POST /api/nbos/servers/{id}/drain: the monitor moves the server's replicas off.
http::Response HttpApi::PostDrain(const http::Request& r) {
  const std::string& server_id = r.params.at("server_id");
  if (!r.identity.admin) return Refuse(403, "only an admin may drain a server");
  auto held = registry_->DrainServer(server_id);
  if (!held.ok()) return Refuse(held.status());
  return JsonResponse(
      202, Json{{"server_id", server_id}, {"draining", true}, {"replicas_to_move", *held}});
}

// POST /api/kernels {"name": "<kernelspec>", "env": {"KERNEL_GPUS": "1", ...}}; both optional.
http::Response HttpApi::PostKernel(const http::Request& r) {
  auto parsed = BodyObject(r);
  if (auto* refused = std::get_if<http::Response>(&parsed)) return std::move(*refused);
  Json body = std::move(std::get<Json>(parsed));
  std::string name = options_.kernelspec_name;
  if (auto it = body.find("name"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) return Refuse(400, "name must be a string (a kernelspec name)");
    name = it->get<std::string>();
  }
  if (!ServesKernelspec(name)) return Refuse(404, "no kernelspec named " + name);
  std::map<std::string, std::string> env;
  if (auto it = body.find("env"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) return Refuse(400, "env must be an object of strings");
    const std::set<std::string> allowed(options_.allowed_env.begin(), options_.allowed_env.end());
    for (auto& [key, value] : it->items()) {
      // Only KERNEL_* and configured names reach replicas: jupyter_server sends its whole
      // environment through /api/sessions.
      if (key.rfind("KERNEL_", 0) != 0 && !allowed.count(key)) continue;
      if (!value.is_string()) return Refuse(400, "env." + key + " must be a string");
      env[key] = value.get<std::string>();
    }
  }
  if (Status s = AddWorkspace(body, r.identity, &env); !s.ok()) return Refuse(400, s.message());
  auto k = kernels_->Create(name, env, {r.identity.user, r.identity.admin});
  if (!k.ok()) {
    const Status& s = k.status();
    const bool bad = s.code() == StatusCode::kInvalidArgument;
    const bool quota = s.code() == StatusCode::kPermissionDenied;
    http::Response resp = Refuse(bad ? 400 : quota ? 403 : 503, s.message());
    resp.body = Json{{"message", s.message()},
                     {"reason", bad     ? "bad request"
                                : quota ? "quota"
                                        : "unavailable"}}
                    .dump(-1, ' ', false, Json::error_handler_t::replace);
    return resp;
  }
  return JsonResponse(201, KernelModel(*k));
}

// The kernel's workspace (workspace/workspace.h) into the environment its replicas get: which
// directory it sees (set here only: never what a client sent) and where it starts.
Status HttpApi::AddWorkspace(const Json& body, const http::Identity& who,
                             std::map<std::string, std::string>* env) const {
  env->erase(workspace::kVisibleEnv);
  if (options_.workspace_root.empty()) return Status::Ok();
  workspace::WorkspaceRequest request{.root = options_.workspace_root};
  if (options_.workspace_per_user && !who.admin) request.owner = who.user;
  if (auto dir = env->find(workspace::kWorkingDirEnv); dir != env->end()) {
    request.working_dir = dir->second;
  } else if (auto cwd = body.find("cwd"); cwd != body.end() && cwd->is_string()) {
    request.working_dir = cwd->get<std::string>();
  } else if (auto path = body.find("path"); path != body.end() && path->is_string()) {
    request.path = path->get<std::string>();
  }
  auto ws = workspace::Resolve(request);
  if (!ws.ok()) return ws.status();
  (*env)[workspace::kVisibleEnv] = ws->visible;
  (*env)[workspace::kWorkingDirEnv] = ws->working_dir;
  return Status::Ok();
}

Result<std::shared_ptr<http::WsHandler>> HttpApi::OpenChannels(
    const http::Request& r, std::shared_ptr<http::WsConnection> conn) {
  auto k = VisibleKernel(r);
  if (!k || !k->session) return NotFound("no kernel " + r.params.at("kernel_id"));
  return std::shared_ptr<http::WsHandler>(std::make_shared<Channels>(k->session, conn));
}

namespace {

using ReplicaStatuses = std::map<std::pair<std::string, uint32_t>, const control::ReplicaStatus*>;

Json ServerJson(const sched::ServerView& view, const std::optional<ServerRecord>& s) {
  Json warm = Json::object();
  if (s) {
    const control::WarmPool& w = s->status.warm_pool();
    warm = Json{{"ready", w.ready()},       {"starting", w.starting()}, {"target", w.target()},
                {"promoted", w.promoted()}, {"cold", w.cold()},         {"disabled", w.disabled()}};
  }
  return Json{{"server_id", view.server_id},
              {"address", s ? s->client->address() : ""},
              {"alive", s && s->alive},
              {"draining", s && s->draining},
              {"accepting", view.accepting},
              {"gpus_virtual", s && s->gpus_virtual},
              {"spec", ResourcesJson(view.spec)},
              {"subscribed", ResourcesJson(view.subscribed)},
              {"committed", ResourcesJson(view.committed)},
              {"gpus_idle", view.IdleGpus()},
              {"gpus_committed", view.committed.gpus},
              // The daemon's own ledger, as of its last heartbeat (authoritative for grants).
              {"daemon_gpus_committed", s ? s->status.ledger().committed().gpus() : 0},
              {"subscription_ratio", sched::HostSubscriptionRatio(view)},
              {"warm_pool", warm}};
}

// The migration under way, and its new replica listed as joining until the migration records it
// as a member.
Json MigrationJson(const KernelRecord& k, Json* replicas) {
  if (!k.migration) return nullptr;
  const MigrationInProgress& m = *k.migration;
  if (JoiningReplica(k) != 0) {
    replicas->push_back(Json{{"replica_id", m.joining_replica},
                             {"server_id", m.to_server_id},
                             {"pid", 0},
                             {"state", "joining"},
                             {"process_state", "starting"},
                             {"reachable", false},
                             {"restarts", 0},
                             {"role", "standby"}});
  }
  return Json{{"leaving_replica", m.leaving_replica},
              {"joining_replica", m.joining_replica},
              {"to_server_id", m.to_server_id},
              {"reason", m.reason}};
}

Json KernelJson(const KernelRecord& k, const ReplicaStatuses& statuses) {
  const ReplicaId executor = k.session ? k.session->current_executor() : 0;
  Json replicas = Json::array();
  for (const auto& r : k.meta.replicas) {
    auto st = statuses.find({k.meta.kernel_id, r.replica_id});
    const bool known = st != statuses.end();
    replicas.push_back(Json{{"replica_id", r.replica_id},
                            {"server_id", r.server_id},
                            {"pid", known ? st->second->pid() : 0},
                            {"state", ReplicaState(k, r.replica_id)},
                            {"process_state", known ? st->second->state() : "unknown"},
                            {"reachable", k.session && k.session->reachable(r.replica_id)},
                            {"restarts", known ? st->second->restarts() : 0},
                            {"role", r.replica_id == executor ? "executor" : "standby"}});
    // Why its namespace is not the log's (it is replaced and runs no cell meanwhile).
    if (auto d = k.diverged.find(r.replica_id); d != k.diverged.end()) {
      replicas.back()["diverged"] = d->second;
    }
  }
  Json migration = MigrationJson(k, &replicas);
  return Json{{"id", k.meta.kernel_id},
              {"name", k.meta.kernelspec},
              {"owner", k.meta.owner},
              {"resources", ResourcesJson(k.request)},
              {"executor", executor},
              {"execution_state", k.session ? k.session->execution_state() : "starting"},
              {"executing_replica", k.session ? k.session->executing_replica() : 0},
              {"cell_waiting", k.session && k.session->cell_waiting()},
              {"suspended", k.suspended},
              {"replicas", std::move(replicas)},
              {"migration", std::move(migration)}};
}

// What the blob collector holds and frees (blob_gc.h).
void AddBlobGcSeries(const BlobGcStats& s, prometheus::Registry* registry) {
  auto& bytes = prometheus::BuildGauge()
                    .Name("nbos_blob_store_bytes")
                    .Help(
                        "Bytes in the blob store as of the collector's last round: all stored, "
                        "and those live kernels need")
                    .Register(*registry);
  bytes.Add({{"kind", "stored"}}).Set(static_cast<double>(s.bytes_stored));
  bytes.Add({{"kind", "referenced"}}).Set(static_cast<double>(s.bytes_referenced));
  prometheus::BuildGauge()
      .Name("nbos_blob_store_blobs")
      .Help("Blobs in the store as of the collector's last round")
      .Register(*registry)
      .Add({})
      .Set(static_cast<double>(s.blobs_stored));
  prometheus::BuildCounter()
      .Name("nbos_blob_gc_freed_bytes_total")
      .Help("Bytes of blobs the collector deleted")
      .Register(*registry)
      .Add({})
      .Increment(static_cast<double>(s.bytes_freed));
  prometheus::BuildCounter()
      .Name("nbos_blob_gc_deleted_total")
      .Help("Blobs the collector deleted")
      .Register(*registry)
      .Add({})
      .Increment(static_cast<double>(s.blobs_deleted));
  auto& rounds = prometheus::BuildCounter()
                     .Name("nbos_blob_gc_rounds_total")
                     .Help(
                         "Collection rounds: complete, incomplete (a kernel did not answer: "
                         "nothing deleted) and failed (the store could not be listed)")
                     .Register(*registry);
  rounds.Add({{"outcome", "complete"}})
      .Increment(static_cast<double>(s.rounds - s.rounds_incomplete - s.rounds_failed));
  rounds.Add({{"outcome", "incomplete"}}).Increment(static_cast<double>(s.rounds_incomplete));
  rounds.Add({{"outcome", "failed"}}).Increment(static_cast<double>(s.rounds_failed));
}

// What self-healing and scaling show: servers and replicas by state, replacements, servers added
// and removed.
void AddHealingSeries(const RegistrySnapshot& snap, prometheus::Registry* registry) {
  const RegistryCounters& c = snap.counters;
  prometheus::BuildCounter()
      .Name("nbos_replica_replacements_total")
      .Help("Lost replicas replaced by new ones")
      .Register(*registry)
      .Add({})
      .Increment(static_cast<double>(c.replacements_done));
  auto& scaling = prometheus::BuildCounter()
                      .Name("nbos_scaling_servers_total")
                      .Help("Servers added (out) and removed (in) by auto-scaling")
                      .Register(*registry);
  scaling.Add({{"direction", "out"}}).Increment(static_cast<double>(c.scale_outs));
  scaling.Add({{"direction", "in"}}).Increment(static_cast<double>(c.scale_ins));
  auto& suspensions = prometheus::BuildCounter()
                          .Name("nbos_kernel_suspensions_total")
                          .Help("Idle kernels suspended (stopped), and resumed")
                          .Register(*registry);
  suspensions.Add({{"event", "suspended"}}).Increment(static_cast<double>(c.suspensions));
  suspensions.Add({{"event", "resumed"}}).Increment(static_cast<double>(c.resumes));
  auto& servers_gauge = prometheus::BuildGauge()
                            .Name("nbos_servers")
                            .Help("Servers by state (alive, lost, draining, pending)")
                            .Register(*registry);
  auto& replicas_gauge = prometheus::BuildGauge()
                             .Name("nbos_replicas")
                             .Help("Replicas by state (live, lost, starting, leaving, joining)")
                             .Register(*registry);
  std::map<std::string, int> server_states{{"alive", 0}, {"lost", 0}, {"draining", 0}};
  for (const auto& [view, s] : snap.servers) {
    if (s) ++server_states[s->draining ? "draining" : s->alive ? "alive" : "lost"];
  }
  server_states["pending"] = static_cast<int>(snap.pending_servers.size());
  for (const auto& [state, n] : server_states) servers_gauge.Add({{"state", state}}).Set(n);
  std::map<std::string, int> replica_states{
      {"live", 0}, {"lost", 0}, {"starting", 0}, {"leaving", 0}, {"joining", 0}};
  for (const KernelRecord& k : snap.kernels) {
    for (const StoredReplica& r : k.meta.replicas) ++replica_states[ReplicaState(k, r.replica_id)];
    if (JoiningReplica(k) != 0) ++replica_states["joining"];
  }
  for (const auto& [state, n] : replica_states) replicas_gauge.Add({{"state", state}}).Set(n);
}

}  // namespace

namespace {

// The last 50 cluster events the viewer may see: the cluster's own and its kernels' ones (an
// admin's: all).
Json EventsJson(const RegistrySnapshot& snap, const http::Identity& viewer) {
  constexpr size_t kEventsShown = 50;
  std::set<std::string> visible;
  for (const KernelRecord& k : snap.kernels)
    if (VisibleTo(viewer, k)) visible.insert(k.meta.kernel_id);
  Json events = Json::array();
  for (const RegistryCounters::Event& e : snap.counters.events) {
    if (!viewer.admin && !e.kernel_id.empty() && !visible.count(e.kernel_id)) continue;
    events.push_back(Json{{"seq", e.seq},
                          {"at_unix_ms", e.at_unix_ms},
                          {"kind", e.kind},
                          {"kernel_id", e.kernel_id},
                          {"text", e.text}});
  }
  if (events.size() > kEventsShown) events.erase(events.begin(), events.end() - kEventsShown);
  return events;
}

}  // namespace

Json HttpApi::ClusterJson(const http::Identity& viewer) const {
  const RegistrySnapshot snap = registry_->Snapshot();
  Json out{{"servers", Json::array()}, {"kernels", Json::array()}};
  ReplicaStatuses statuses;
  for (const auto& [view, server] : snap.servers) {
    if (!server) continue;
    for (const auto& r : server->status.replicas()) statuses[{r.kernel_id(), r.replica_id()}] = &r;
  }
  for (const auto& [view, s] : snap.servers) out["servers"].push_back(ServerJson(view, s));
  out["cluster_subscription_ratio"] = snap.cluster_ratio;
  out["migrations"] = Json{{"done", snap.counters.migrations_done},
                           {"failed", snap.counters.migrations_failed},
                           {"durations_ms", snap.counters.migration_ms},
                           {"replacements_done", snap.counters.replacements_done},
                           {"replacement_ms", snap.counters.replacement_ms}};
  for (const KernelRecord& k : snap.kernels) {
    if (VisibleTo(viewer, k)) out["kernels"].push_back(KernelJson(k, statuses));
  }
  out["pending_servers"] = snap.pending_servers;
  out["suspensions"] = Json{{"suspended", snap.counters.suspensions},
                            {"resumed", snap.counters.resumes},
                            {"resume_ms", snap.counters.resume_ms},
                            {"suspend_ms", snap.counters.suspend_ms}};
  Json events = Json::array();
  for (const RegistryCounters::ScaleEvent& e : snap.counters.scale_events) {
    events.push_back(Json{
        {"at_ms", e.at_ms}, {"kind", e.kind}, {"server_ids", e.server_ids}, {"reason", e.reason}});
  }
  out["scaling"] = Json{{"scale_outs", snap.counters.scale_outs},
                        {"scale_ins", snap.counters.scale_ins},
                        {"events", std::move(events)}};
  out["events"] = EventsJson(snap, viewer);
  return out;
}

std::string HttpApi::Metrics() const {
  prometheus::Registry registry;
  auto gauge = [&](const char* name, const char* help) -> auto& {
    return prometheus::BuildGauge().Name(name).Help(help).Register(registry);
  };
  auto counter = [&](const char* name, const char* help) -> auto& {
    return prometheus::BuildCounter().Name(name).Help(help).Register(registry);
  };
  auto& gpus =
      gauge("nbos_server_gpus", "GPUs per server by state (spec, committed, idle, subscribed)");
  auto& kernels_gauge = gauge("nbos_kernels", "Kernels by execution state");
  auto& ratio_gauge =
      gauge("nbos_subscription_ratio", "Subscription ratio, per server and for the cluster");
  auto& warm_gauge =
      gauge("nbos_warm_replicas", "Pre-started replica processes per server, ready and target");
  auto& launches = counter("nbos_replica_launches_total",
                           "Replica launches per server, from a warm process or cold");
  auto& grants = counter("nbos_gpu_grants_total", "GPU grant requests by outcome");
  auto& executions = counter("nbos_executions_total",
                             "Executions sent to replicas, and those that waited for GPUs");
  auto& migrations = counter("nbos_migrations_total", "Replica migrations by outcome");
  auto& rejected = counter("nbos_client_messages_rejected_total",
                           "Kernel WebSocket messages refused at the gateway, by reason");
  auto& rejected_rest = counter("nbos_rest_requests_rejected_total",
                                "REST requests answered with a 4xx by the gateway's checks");
  auto& exceptions =
      counter("nbos_gateway_exceptions_total", "Exceptions caught at the edge of a gateway thread");

  const RegistrySnapshot snap = registry_->Snapshot();
  for (const auto& [view, s] : snap.servers) {
    const std::string& id = view.server_id;
    gpus.Add({{"server", id}, {"state", "spec"}}).Set(view.spec.gpus);
    gpus.Add({{"server", id}, {"state", "committed"}}).Set(view.committed.gpus);
    gpus.Add({{"server", id}, {"state", "idle"}}).Set(view.IdleGpus());
    gpus.Add({{"server", id}, {"state", "subscribed"}}).Set(view.subscribed.gpus);
    ratio_gauge.Add({{"server", id}}).Set(sched::HostSubscriptionRatio(view));
    if (!s) continue;
    const control::WarmPool& w = s->status.warm_pool();
    warm_gauge.Add({{"server", id}, {"state", "ready"}}).Set(w.ready());
    warm_gauge.Add({{"server", id}, {"state", "target"}}).Set(w.target());
    launches.Add({{"server", id}, {"from", "warm"}}).Increment(static_cast<double>(w.promoted()));
    launches.Add({{"server", id}, {"from", "cold"}}).Increment(static_cast<double>(w.cold()));
  }
  ratio_gauge.Add({{"server", ""}}).Set(snap.cluster_ratio);
  AddHealingSeries(snap, &registry);
  const RegistryCounters& c = snap.counters;
  grants.Add({{"outcome", "granted"}}).Increment(static_cast<double>(c.grants_made));
  grants.Add({{"outcome", "refused"}}).Increment(static_cast<double>(c.grants_refused));
  migrations.Add({{"outcome", "done"}}).Increment(static_cast<double>(c.migrations_done));
  migrations.Add({{"outcome", "failed"}}).Increment(static_cast<double>(c.migrations_failed));
  const SessionTotals totals = SumSessions(snap.kernels);
  const uint64_t caught = totals.exceptions_caught + (exceptions_ ? exceptions_() : 0);
  for (const auto& [state, n] : totals.states) kernels_gauge.Add({{"state", state}}).Set(n);
  executions.Add({{"kind", "sent"}}).Increment(static_cast<double>(totals.executions));
  executions.Add({{"kind", "waited_for_gpus"}})
      .Increment(static_cast<double>(totals.waited_for_gpus));
  for (RejectClass reason : kAllRejectClasses) {
    rejected.Add({{"reason", RejectClassName(reason)}})
        .Increment(static_cast<double>(counters_->rejected_messages[static_cast<size_t>(reason)]));
  }
  rejected_rest.Add({}).Increment(static_cast<double>(counters_->rejected_rest_requests));
  prometheus::BuildCounter()
      .Name("nbos_control_calls_refused_total")
      .Help("Control-plane (gRPC) calls refused for want of the cluster credential")
      .Register(registry)
      .Add({})
      .Increment(static_cast<double>(counters_->refused_control_calls->load()));
  exceptions.Add({}).Increment(static_cast<double>(caught));
  if (options_.blob_gc_stats) AddBlobGcSeries(options_.blob_gc_stats(), &registry);
  return prometheus::TextSerializer().Serialize(registry.Collect());
}

}  // namespace nbos::gateway
