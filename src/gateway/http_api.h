// HttpApi: the gateway's HTTP face. The Jupyter Kernel Gateway REST API (kernelspecs, kernels:
// list, start, get, delete, interrupt, restart) and the kernel WebSocket that
// `jupyter server --gateway-url`, JupyterLab's @jupyterlab/services and `nbos relay` speak;
// `/api/nbos/cluster` (JSON) and `/metrics` (Prometheus text). Operator controls, each answered
// 202 while the work runs (the cluster view shows it): POST /api/nbos/servers/{id}/drain (no new
// replicas there; its replicas are moved off) and POST /api/nbos/kernels/{id}/migrate with an
// optional body {"replica_id": N, "to_server_id": "S"} (the scheduler picks what is not named).
//
// Every request body is checked before use: a body that is not a JSON object, is nested deeper
// than the client limit, or has a field of the wrong type answers 400 with a JSON `message`
// naming the field; unknown kernels and kernelspecs 404; a start no server can take 503. Each
// such refusal counts in nbos_rest_requests_rejected_total. WebSocket frames go to the kernel's
// session unread: it validates them (client_validation.h).
//
// Users (auth/authenticator.h): a kernel belongs to the user who started it. Other users do not
// see it in /api/kernels or /api/nbos/cluster and get 404 for its routes and WebSocket, as if it
// did not exist; admins see and manage every kernel. Draining a server is for admins only (403).
// A start over the user's quota answers 403 naming the quota.
#pragma once

#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "auth/authenticator.h"
#include "gateway/blob_gc.h"
#include "gateway/edge_counters.h"
#include "gateway/kernel_manager.h"
#include "gateway/migrator.h"
#include "gateway/registry.h"
#include "http/server.h"

namespace nbos::gateway {

struct HttpApiOptions {
  auth::GatewayAuthenticator* auth = nullptr;  // required
  std::string kernelspec_name = "nbos";
  std::string display_name;
  // More names the same kernel is served under (the conventional python3, so that notebooks from
  // anywhere, and jupyter_server's own default, start it). A kernel keeps the name it was started
  // under.
  std::vector<std::string> kernelspec_aliases;
  int replicas = 3;
  std::vector<std::string> allowed_env;  // besides KERNEL_*, names a start may pass to replicas
  std::string workspace_root;            // GatewayOptions::workspace_root
  bool workspace_per_user = false;       // users are known: a user who is no admin sees ROOT/<user>
  ClientLimits limits;
  // The blob collector's figures for /metrics; null when it is off.
  std::function<BlobGcStats()> blob_gc_stats;
};

class HttpApi {
 public:
  // Exceptions caught on other threads, summed into /metrics.
  using ExceptionCount = std::function<uint64_t()>;
  HttpApi(HttpApiOptions options, Registry* registry, KernelManager* kernels, Migrator* migrator,
          EdgeCounters* counters, ExceptionCount exceptions);

  // Adds every route and the authenticator to `server` (before it starts).
  void Install(http::Server* server);

  // GET /api/nbos/cluster as `viewer` sees it (their kernels; an admin's: all). Thread-safe.
  jupyter::Json ClusterJson(const http::Identity& viewer) const;

 private:
  void InstallKernelRoutes(http::Server* http);
  void InstallClusterRoutes(http::Server* http);
  // The kernel named by the route's {kernel_id} when the caller may use it.
  std::optional<KernelRecord> VisibleKernel(const http::Request& r) const;
  http::Response PostKernel(const http::Request& r);
  Status AddWorkspace(const jupyter::Json& body, const http::Identity& who,
                      std::map<std::string, std::string>* env) const;
  bool ServesKernelspec(const std::string& name) const;

  http::Response PostMigrate(const http::Request& r);
  http::Response PostDrain(const http::Request& r);
  // The request body as a JSON object (empty: {}), or the 400 answer.
  std::variant<jupyter::Json, http::Response> BodyObject(const http::Request& r);
  http::Response Refuse(int status, const std::string& message);
  http::Response Refuse(const Status& s);
  // The kernelspec model of `name` (the kernel's own name or an alias).
  jupyter::Json KernelspecModel(const std::string& name) const;
  std::string Metrics() const;
  Result<std::shared_ptr<http::WsHandler>> OpenChannels(const http::Request& r,
                                                        std::shared_ptr<http::WsConnection> conn);

  const HttpApiOptions options_;
  Registry* registry_;
  KernelManager* kernels_;
  Migrator* migrator_;
  EdgeCounters* counters_;
  ExceptionCount exceptions_;
};

}  // namespace nbos::gateway
