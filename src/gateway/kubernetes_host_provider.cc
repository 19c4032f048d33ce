#include "gateway/kubernetes_host_provider.h"

#include <curl/curl.h>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>

namespace nbos::gateway {
namespace {

using Json = nlohmann::json;

constexpr char kComponentSelector[] =
    "app.kubernetes.io%2Fname%3Dnbos%2Capp.kubernetes.io%2Fcomponent%3Ddaemon";

// The API server's reason, from a Status object when it sent one.
std::string Reason(const KubeApi::Response& r) {
  if (r.body.is_object() && r.body.contains("message") && r.body["message"].is_string())
    return r.body["message"].get<std::string>();
  return "HTTP " + std::to_string(r.status);
}

size_t Append(char* data, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(data, size * n);
  return size * n;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::string s = text.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

class CurlKubeApi final : public KubeApi {
 public:
  explicit CurlKubeApi(KubeApiOptions options) : options_(std::move(options)) {}

  Result<Response> Call(const std::string& method, const std::string& path,
                        const Json& body) override {
    CURL* curl = curl_easy_init();
    if (curl == nullptr) return Unavailable("kubernetes: cannot create a libcurl handle");
    const std::string url = options_.base_url + path;
    const std::string payload = body.is_null() ? "" : body.dump();
    const std::string token = ReadFile(options_.token_file);
    std::string answer;
    curl_slist* headers = curl_slist_append(nullptr, "Accept: application/json");
    headers = curl_slist_append(headers, "Content-Type: application/json");
    if (!token.empty())
      headers = curl_slist_append(headers, ("Authorization: Bearer " + token).c_str());
    curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, method.c_str());
    if (!body.is_null()) {
      curl_easy_setopt(curl, CURLOPT_POSTFIELDS, payload.c_str());
      curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(payload.size()));
    }
    if (!options_.ca_file.empty()) curl_easy_setopt(curl, CURLOPT_CAINFO, options_.ca_file.c_str());
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, static_cast<long>(options_.timeout.count()));
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, Append);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &answer);
    const CURLcode rc = curl_easy_perform(curl);
    Response r;
    curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &r.status);
    curl_slist_free_all(headers);
    curl_easy_cleanup(curl);
    if (rc != CURLE_OK) {
      return Unavailable("cannot reach the Kubernetes API at " + options_.base_url + ": " +
                         curl_easy_strerror(rc));
    }
    r.body = Json::parse(answer, nullptr, false);
    if (r.body.is_discarded()) r.body = nullptr;
    return r;
  }

 private:
  const KubeApiOptions options_;
};

}  // namespace

Result<std::unique_ptr<KubeApi>> ConnectKubeApi(KubeApiOptions options) {
  static std::once_flag init;
  std::call_once(init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  if (options.base_url.empty()) {
    const char* host = std::getenv("KUBERNETES_SERVICE_HOST");
    const char* port = std::getenv("KUBERNETES_SERVICE_PORT");
    if (host == nullptr || port == nullptr) {
      return InvalidArgument(
          "not in a Kubernetes Pod (KUBERNETES_SERVICE_HOST/PORT unset) and no API URL given");
    }
    const std::string h = host;
    options.base_url =
        "https://" + (h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + port;
  }
  return std::unique_ptr<KubeApi>(new CurlKubeApi(std::move(options)));
}

KubernetesHostProvider::KubernetesHostProvider(KubernetesHostOptions options,
                                               std::unique_ptr<KubeApi> api)
    : options_(std::move(options)), api_(std::move(api)) {}

Result<std::unique_ptr<KubernetesHostProvider>> KubernetesHostProvider::Create(
    KubernetesHostOptions options, std::unique_ptr<KubeApi> api) {
  const Json& t = options.pod_template;
  if (!t.is_object() || t.value("kind", "") != "Pod" || !t.contains("spec") ||
      !t["spec"].is_object()) {
    return InvalidArgument("the daemon Pod template must be a Pod object with a spec");
  }
  if (options.namespace_name.empty()) return InvalidArgument("no Kubernetes namespace given");
  std::unique_ptr<KubernetesHostProvider> p(
      new KubernetesHostProvider(std::move(options), std::move(api)));
  if (Status s = p->List(); !s.ok()) return s;
  return p;
}

std::string KubernetesHostProvider::PodsPath() const {
  return "/api/v1/namespaces/" + options_.namespace_name + "/pods";
}

// Adopts the daemon Pods there are; forgets the ones gone. A Pod not Running yet is pending
// unless it registered already.
Status KubernetesHostProvider::List() {
  auto r = api_->Call("GET", PodsPath() + "?labelSelector=" + kComponentSelector, nullptr);
  if (!r.ok()) return r.status();
  if (r->status != 200 || !r->body.is_object() || !r->body["items"].is_array())
    return Unavailable("listing daemon Pods: " + Reason(*r));
  std::set<std::string> seen;
  for (const Json& pod : r->body["items"]) {
    if (!pod.is_object()) continue;
    const Json meta = pod.value("metadata", Json::object());
    const Json status = pod.value("status", Json::object());
    const Json name = meta.is_object() ? meta.value("name", Json()) : Json();
    // A Pod being deleted is on its way out (its name is still taken: see AddServers).
    if (!name.is_string() || (meta.is_object() && meta.contains("deletionTimestamp"))) continue;
    seen.insert(name.get<std::string>());
    const bool running = status.is_object() && status.value("phase", Json()) == "Running";
    if (!pods_.count(name.get<std::string>()) && !running) pending_.insert(name.get<std::string>());
  }
  for (const std::string& gone : pods_)
    if (!seen.count(gone)) spdlog::warn("kubernetes hosts: daemon Pod {} is gone", gone);
  std::erase_if(pending_, [&](const std::string& n) { return !seen.count(n); });
  pods_ = std::move(seen);
  listed_ = std::chrono::steady_clock::now();
  return Status::Ok();
}

std::string KubernetesHostProvider::NextName() const {
  for (int n = 1;; ++n) {
    std::string name = options_.name_prefix + std::to_string(n);
    if (!pods_.count(name)) return name;
  }
}

Json KubernetesHostProvider::PodFor(const std::string& name) const {
  Json pod = options_.pod_template;
  pod["apiVersion"] = "v1";
  pod["metadata"]["name"] = name;
  pod["metadata"]["namespace"] = options_.namespace_name;
  pod["metadata"]["labels"]["app.kubernetes.io/name"] = "nbos";
  pod["metadata"]["labels"]["app.kubernetes.io/component"] = "daemon";
  return pod;
}

Result<std::vector<std::string>> KubernetesHostProvider::AddServers(int count) {
  std::vector<std::string> added;
  std::string last_error;
  for (int i = 0; i < count && Count() < options_.max_hosts; ++i) {
    const std::string name = NextName();
    auto r = api_->Call("POST", PodsPath(), PodFor(name));
    if (!r.ok()) return added.empty() ? Result<std::vector<std::string>>(r.status()) : added;
    if (r->status == 409) {  // someone else's Pod by that name: take it as ours, try the next
      pods_.insert(name);
      --i;
      continue;
    }
    if (r->status != 201 && r->status != 200) {
      last_error = Reason(*r);
      break;
    }
    pods_.insert(name);
    pending_.insert(name);
    added.push_back(name);
    spdlog::info("kubernetes hosts: created daemon Pod {}", name);
  }
  if (added.empty() && !last_error.empty())
    return Unavailable("creating a daemon Pod: " + last_error);
  return added;
}

Status KubernetesHostProvider::RemoveServer(const std::string& server_id) {
  if (!pods_.count(server_id)) return NotFound("no daemon Pod " + server_id + " of this gateway");
  auto r = api_->Call("DELETE", PodsPath() + "/" + server_id, nullptr);
  if (!r.ok()) return r.status();
  if (r->status != 200 && r->status != 202 && r->status != 404)
    return Unavailable("deleting daemon Pod " + server_id + ": " + Reason(*r));
  pods_.erase(server_id);
  pending_.erase(server_id);
  spdlog::info("kubernetes hosts: deleted daemon Pod {}", server_id);
  return Status::Ok();
}

std::vector<std::string> KubernetesHostProvider::Pending() const {
  return {pending_.begin(), pending_.end()};
}

void KubernetesHostProvider::Poll() {
  if (std::chrono::steady_clock::now() - listed_ < options_.relist_interval) return;
  if (Status s = List(); !s.ok()) spdlog::warn("kubernetes hosts: {}", s.ToString());
}

}  // namespace nbos::gateway
