// A HostProvider on Kubernetes: each server is a daemon Pod the provider creates from a template
// (a GPU request on a GPU node pool). A Pod that no node can take stays Pending, and the cluster
// autoscaler adds a node for it; a Pod the gateway gives back is deleted, and the autoscaler
// removes the node once it is empty. The provider speaks to the API server through KubeApi, so
// its decisions can be checked against recorded API exchanges (see the test).
//
// Pods. Named `<name_prefix><n>` (the lowest n not in use), labelled
// app.kubernetes.io/name=nbos and app.kubernetes.io/component=daemon plus the template's labels;
// the template's container learns its server id from its own name (downward API: POD_NAME, and
// `--server-id=$(POD_NAME)` in its args). At start the provider adopts the labelled Pods already
// there (a restarted gateway keeps its servers); a Pod that disappears (its node was reclaimed) is
// forgotten at the next re-list (every `relist_interval`).
//
// Errors: AddServers is Unavailable with the API server's message when it created no Pod (e.g.
// RBAC forbids it, a quota is exhausted); RemoveServer is NotFound for a server it does not own,
// Unavailable when the API call fails.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "gateway/host_provider.h"

namespace nbos::gateway {

// The Kubernetes API as the provider uses it: one JSON request, one JSON answer.
class KubeApi {
 public:
  struct Response {
    long status = 0;
    nlohmann::json body;  // null when the body is not JSON
  };
  virtual ~KubeApi() = default;
  // `path` starts with /api/; `body` is sent as JSON unless null. Unavailable when the API server
  // cannot be reached.
  virtual Result<Response> Call(const std::string& method, const std::string& path,
                                const nlohmann::json& body) = 0;
};

// The API server seen from a Pod: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, the
// service account's CA and token (the token is read on every call: projected tokens rotate).
struct KubeApiOptions {
  std::string base_url;  // empty: from the environment, as above
  std::string token_file = "/var/run/secrets/kubernetes.io/serviceaccount/token";
  std::string ca_file = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";
  std::chrono::milliseconds timeout{10000};
};
Result<std::unique_ptr<KubeApi>> ConnectKubeApi(KubeApiOptions options);

struct KubernetesHostOptions {
  std::string namespace_name;   // where the daemon Pods live
  nlohmann::json pod_template;  // a Pod object (metadata.labels, spec); name and labels are set
  std::string name_prefix = "nbos-daemon-";
  int max_hosts = 8;
  std::chrono::milliseconds relist_interval{30000};
};

class KubernetesHostProvider : public HostProvider {
 public:
  // Lists (adopts) the existing daemon Pods. InvalidArgument for a template that is not a Pod
  // with a spec; Unavailable when the list fails.
  static Result<std::unique_ptr<KubernetesHostProvider>> Create(KubernetesHostOptions options,
                                                                std::unique_ptr<KubeApi> api);

  Result<std::vector<std::string>> AddServers(int count) override;
  Status RemoveServer(const std::string& server_id) override;
  std::vector<std::string> Pending() const override;
  int Count() const override { return static_cast<int>(pods_.size()); }
  bool Owns(const std::string& server_id) const override { return pods_.count(server_id) > 0; }
  void OnRegistered(const std::string& server_id) override { pending_.erase(server_id); }
  void Poll() override;

 private:
  KubernetesHostProvider(KubernetesHostOptions options, std::unique_ptr<KubeApi> api);
  Status List();
  std::string PodsPath() const;
  std::string NextName() const;
  nlohmann::json PodFor(const std::string& name) const;

  const KubernetesHostOptions options_;
  std::unique_ptr<KubeApi> api_;
  std::set<std::string> pods_;     // daemon Pods it created or adopted
  std::set<std::string> pending_;  // created, not registered yet
  std::chrono::steady_clock::time_point listed_;
};

}  // namespace nbos::gateway
