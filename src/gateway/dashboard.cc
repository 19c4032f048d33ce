#include "gateway/dashboard.h"

#include <spdlog/spdlog.h>

#include <chrono>

#include "web/assets.h"

namespace nbos::gateway {

using Json = nlohmann::json;

namespace {

int64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

http::Response AssetResponse(const std::string& name) {
  auto asset = web::FindAsset(name);
  if (!asset) return http::ErrorResponse(404, "no dashboard file " + name);
  http::Response r;
  r.content_type = std::string(asset->content_type);
  r.body = std::string(asset->body);
  // The files change only with the binary; pages ask again on every load.
  r.headers.emplace_back("Cache-Control", name.ends_with(".html") ? "no-store" : "max-age=300");
  return r;
}

// The feed ignores what viewers send.
class FeedHandler : public http::WsHandler {};

}  // namespace

Dashboard::Dashboard(DashboardOptions options, Registry* registry, ClusterView cluster_view)
    : options_(options), registry_(registry), cluster_view_(std::move(cluster_view)) {}

Dashboard::~Dashboard() { Stop(); }

void Dashboard::Install(http::Server* http) {
  http->Route("GET", "/dashboard",
              [](const http::Request&) { return AssetResponse("index.html"); });
  http->Route("GET", "/dashboard/sim",
              [](const http::Request&) { return AssetResponse("sim.html"); });
  http->Route("GET", "/dashboard/static/{file}",
              [](const http::Request& r) { return AssetResponse(r.params.at("file")); },
              {.public_route = true});
  http->Route("GET", "/dashboard/static/vendor/{file}",
              [](const http::Request& r) { return AssetResponse("vendor/" + r.params.at("file")); },
              {.public_route = true});
  http->Route("GET", "/api/nbos/history", [this](const http::Request&) {
    Json body;
    {
      MutexLock lock(&mu_);
      body = Json{{"history", history_.Columns()}, {"interval_ms", options_.interval_ms}};
    }
    http::Response r;
    r.body = body.dump();
    return r;
  });
  http->WebSocket("/api/nbos/live",
                  [this](const http::Request& r, std::shared_ptr<http::WsConnection> conn) {
                    return OpenFeed(r, std::move(conn));
                  },
                  {.subprotocols = {}});
}

Result<std::shared_ptr<http::WsHandler>> Dashboard::OpenFeed(
    const http::Request& r, std::shared_ptr<http::WsConnection> conn) {
  Json hello{{"type", "snapshot"},
             {"cluster", cluster_view_(r.identity)},
             {"interval_ms", options_.interval_ms}};
  MutexLock lock(&mu_);
  hello["history"] = history_.Columns();
  conn->SendText(hello.dump());
  viewers_.push_back({conn, r.identity});
  return std::shared_ptr<http::WsHandler>(std::make_shared<FeedHandler>());
}

void Dashboard::Start() {
  sampler_ = std::thread([this] { Run(); });
}

void Dashboard::Stop() {
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    cv_.SignalAll();
  }
  if (sampler_.joinable()) sampler_.join();
}

HistorySample Dashboard::TakeSample(int64_t now_unix_ms) {
  const RegistrySnapshot snap = registry_->Snapshot();
  HistorySample s{.at_unix_ms = now_unix_ms};
  for (const auto& [view, server] : snap.servers) {
    if (!server || !server->alive) continue;
    s.gpus_provisioned += view.spec.gpus;
    s.gpus_committed += view.committed.gpus;
    s.gpus_subscribed += view.subscribed.gpus;
  }
  for (const KernelRecord& k : snap.kernels) {
    ++s.kernels;
    if (k.session && k.session->cell_waiting()) ++s.cells_waiting;
  }
  return s;
}

void Dashboard::Run() {
  while (true) {
    {
      MutexLock lock(&mu_);
      if (!stopping_) cv_.WaitFor(&mu_, std::chrono::milliseconds(options_.interval_ms));
      if (stopping_) return;
    }
    Tick();
  }
}

// One sample into the history, then the viewers' updates. A viewer's cluster view reads the
// registry, so it is built outside the dashboard's lock.
void Dashboard::Tick() {
  const int64_t now = UnixMs();
  const HistorySample taken = TakeSample(now);
  const std::vector<double> delays = registry_->TakeExecutionDelays();
  std::vector<Viewer> viewers;
  Json sample;
  {
    MutexLock lock(&mu_);
    history_.RecordDelays(now, delays);
    sample = ClusterHistory::SampleJson(history_.Add(taken));
    std::erase_if(viewers_, [](const Viewer& v) {
      auto c = v.conn.lock();
      return !c || c->closed();
    });
    viewers = viewers_;
  }
  for (const Viewer& v : viewers) {
    auto conn = v.conn.lock();
    if (!conn || conn->queued_bytes() > options_.max_queued_bytes) continue;
    try {
      conn->SendText(
          Json{{"type", "tick"}, {"cluster", cluster_view_(v.who)}, {"sample", sample}}.dump());
    } catch (const std::exception& e) {
      spdlog::warn("dashboard feed to {}: {}", conn->remote(), e.what());
    }
  }
}

}  // namespace nbos::gateway
