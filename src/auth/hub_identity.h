// JupyterHub as the judge of tokens (`nbos gateway --auth jupyterhub`). A token a client presents
// is a Hub API token: a user's own, or the one the Hub gives each single-user server
// (JUPYTERHUB_API_TOKEN), which that server sends on as `--GatewayClient.auth_token`. The Hub's
// `GET {api_url}/user`, called with that token, says whose it is and whether the user is a Hub
// admin (every token may identify its owner). Tokens belonging to Hub services, not users, are
// refused.
//
// Answers are cached by the token's SHA-256 (the token itself is not kept): a user for
// `cache_ms`, a refused token for `refused_cache_ms`, so a client retrying a bad token does not
// load the Hub. A Hub that cannot be reached or answers 5xx is not cached: the call fails with
// Unavailable and the next one asks again.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "auth/users.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "http/server.h"

namespace nbos::auth {

struct HubOptions {
  std::string api_url;  // e.g. http://127.0.0.1:8081/hub/api (JUPYTERHUB_API_URL)
  int64_t cache_ms = 60'000;
  int64_t refused_cache_ms = 5'000;
  size_t max_cached_tokens = 10'000;
  std::chrono::milliseconds timeout{5'000};
  std::string ca_file;  // for an https Hub with a private CA; empty: the system's
};

// The Hub's answer for one token: HTTP status and body. Errors: the Hub could not be reached.
struct HubReply {
  long status = 0;
  std::string body;
};
using HubTransport =
    std::function<Result<HubReply>(const std::string& url, std::string_view token)>;

// libcurl, with the options' timeout and CA.
HubTransport CurlHubTransport(const HubOptions& options);

// Reads a reply of GET /user: the user, nullopt for a token the Hub refuses (401/403/404, or a
// service's token), Unavailable for 5xx or a body that is not a user model.
Result<std::optional<http::Identity>> ParseHubReply(const HubReply& reply);

// Thread-safe.
class HubIdentity {
 public:
  HubIdentity(HubOptions options, HubTransport transport);

  // The token's owner; nullopt: the Hub does not know it. `now_ms` is a monotonic clock.
  Result<std::optional<http::Identity>> Lookup(std::string_view token, int64_t now_ms);

 private:
  struct Entry {
    std::optional<http::Identity> identity;
    int64_t expires_ms = 0;
  };
  void Remember(const TokenDigest& digest, std::optional<http::Identity> identity, int64_t now_ms)
      REQUIRES(mu_);

  const HubOptions options_;
  const HubTransport transport_;
  Mutex mu_;
  std::map<TokenDigest, Entry> cache_ GUARDED_BY(mu_);
};

}  // namespace nbos::auth
