// Dashboard: the gateway's pages for people, the history behind their charts and their live
// feed. Routes (Install), authenticated like the rest of the API (a browser passes ?token=T):
//   GET /dashboard                 the cluster, live: servers, kernels, events, charts
//   GET /dashboard/sim             charts and tables of a `nbos sim report` (its results.json)
//   GET /dashboard/static/{file}   the pages' scripts and styles, built in (public: no data)
//   GET /api/nbos/history          {"history": ClusterHistory::Columns(), "interval_ms": N}
//   WS  /api/nbos/live             {"type": "snapshot", "cluster", "history", "interval_ms"} on
//                                  connecting, then each interval {"type": "tick", "cluster",
//                                  "sample"}. "cluster" is /api/nbos/cluster as the viewer sees
//                                  it (events included). Clients' messages are ignored.
// Threads: one sampler thread (Start..Stop) takes a sample of the registry each `interval_ms`
// into the history and sends the ticks; a viewer whose connection has more than
// `max_queued_bytes` unsent skips ticks until it catches up. Handlers run on the server's threads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "common/thread_annotations.h"
#include "gateway/cluster_history.h"
#include "gateway/registry.h"
#include "http/server.h"

namespace nbos::gateway {

struct DashboardOptions {
  int64_t interval_ms = 1000;
  size_t max_queued_bytes = 4u << 20;
};

class Dashboard {
 public:
  using ClusterView = std::function<nlohmann::json(const http::Identity& viewer)>;
  Dashboard(DashboardOptions options, Registry* registry, ClusterView cluster_view);
  ~Dashboard();  // Stop()

  // Before the server starts.
  void Install(http::Server* http);
  void Start();
  void Stop();  // idempotent; ticks stop, open feeds stay until the server closes them

 private:
  struct Viewer {
    std::weak_ptr<http::WsConnection> conn;
    http::Identity who;
  };
  void Run();
  void Tick();
  HistorySample TakeSample(int64_t now_unix_ms);
  Result<std::shared_ptr<http::WsHandler>> OpenFeed(const http::Request& r,
                                                    std::shared_ptr<http::WsConnection> conn);

  const DashboardOptions options_;
  Registry* registry_;
  ClusterView cluster_view_;
  Mutex mu_;
  CondVar cv_;
  bool stopping_ GUARDED_BY(mu_) = false;
  ClusterHistory history_ GUARDED_BY(mu_);
  std::vector<Viewer> viewers_ GUARDED_BY(mu_);
  std::thread sampler_;
};

}  // namespace nbos::gateway
