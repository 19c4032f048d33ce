#include "auth/hub_identity.h"

#include <curl/curl.h>

#include <mutex>
#include <nlohmann/json.hpp>

namespace nbos::auth {
namespace {

size_t Append(char* data, size_t size, size_t count, void* out) {
  static_cast<std::string*>(out)->append(data, size * count);
  return size * count;
}

}  // namespace

HubTransport CurlHubTransport(const HubOptions& options) {
  static std::once_flag init;
  std::call_once(init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  return [options](const std::string& url, std::string_view token) -> Result<HubReply> {
    CURL* curl = curl_easy_init();
    if (curl == nullptr) return Unavailable("jupyterhub: cannot create a libcurl handle");
    HubReply reply;
    const std::string authorization = "Authorization: token " + std::string(token);
    curl_slist* headers = curl_slist_append(nullptr, "Accept: application/json");
    headers = curl_slist_append(headers, authorization.c_str());
    curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
    if (!options.ca_file.empty()) curl_easy_setopt(curl, CURLOPT_CAINFO, options.ca_file.c_str());
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, static_cast<long>(options.timeout.count()));
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, Append);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &reply.body);
    const CURLcode rc = curl_easy_perform(curl);
    curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &reply.status);
    curl_slist_free_all(headers);
    curl_easy_cleanup(curl);
    if (rc != CURLE_OK) {
      return Unavailable("cannot reach JupyterHub at " + url + ": " + curl_easy_strerror(rc));
    }
    return reply;
  };
}

Result<std::optional<http::Identity>> ParseHubReply(const HubReply& reply) {
  if (reply.status == 401 || reply.status == 403 || reply.status == 404) {
    return std::optional<http::Identity>();
  }
  if (reply.status != 200) {
    return Unavailable("JupyterHub answered HTTP " + std::to_string(reply.status) +
                       " when asked whose a token is");
  }
  const nlohmann::json model = nlohmann::json::parse(reply.body, nullptr, false);
  if (!model.is_object() || !model.contains("name") || !model["name"].is_string()) {
    return Unavailable("JupyterHub's answer about a token is not a user model");
  }
  // A service's token identifies the service ("kind": "service"), not a user who owns kernels.
  if (model.value("kind", "user") != "user") return std::optional<http::Identity>();
  const auto admin = model.find("admin");
  return std::optional<http::Identity>(http::Identity{
      model["name"].get<std::string>(), admin != model.end() && admin->is_boolean() && *admin});
}

namespace {

HubOptions WithoutTrailingSlash(HubOptions options) {
  while (!options.api_url.empty() && options.api_url.back() == '/') options.api_url.pop_back();
  return options;
}

}  // namespace

HubIdentity::HubIdentity(HubOptions options, HubTransport transport)
    : options_(WithoutTrailingSlash(std::move(options))), transport_(std::move(transport)) {}

Result<std::optional<http::Identity>> HubIdentity::Lookup(std::string_view token, int64_t now_ms) {
  const TokenDigest digest = Sha256(token);
  {
    MutexLock lock(&mu_);
    auto it = cache_.find(digest);
    if (it != cache_.end() && it->second.expires_ms > now_ms) return it->second.identity;
  }
  // Asked without the lock: one slow Hub answer must not hold up tokens already cached.
  auto reply = transport_(options_.api_url + "/user", token);
  if (!reply.ok()) return reply.status();
  auto identity = ParseHubReply(*reply);
  if (!identity.ok()) return identity.status();
  MutexLock lock(&mu_);
  Remember(digest, *identity, now_ms);
  return identity;
}

void HubIdentity::Remember(const TokenDigest& digest, std::optional<http::Identity> identity,
                           int64_t now_ms) {
  if (cache_.size() >= options_.max_cached_tokens) {
    std::erase_if(cache_, [&](const auto& entry) { return entry.second.expires_ms <= now_ms; });
    // Still full of live entries: start again rather than grow without bound.
    if (cache_.size() >= options_.max_cached_tokens) cache_.clear();
  }
  const int64_t ttl_ms = identity ? options_.cache_ms : options_.refused_cache_ms;
  cache_[digest] = Entry{std::move(identity), now_ms + ttl_ms};
}

}  // namespace nbos::auth
