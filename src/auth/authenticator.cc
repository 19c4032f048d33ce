#include "auth/authenticator.h"

#include <openssl/crypto.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstring>

namespace nbos::auth {
namespace {

int64_t MonotonicMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::string RequestToken(const http::Request& req) {
  const std::string& header = req.Header("authorization");
  for (const char* scheme : {"token ", "Token ", "Bearer ", "bearer "}) {
    const size_t n = std::strlen(scheme);
    if (header.size() > n && header.compare(0, n, scheme) == 0) return header.substr(n);
  }
  auto q = req.query.find("token");
  return q == req.query.end() ? std::string() : q->second;
}

GatewayAuthenticator::GatewayAuthenticator(AuthOptions options)
    : options_(std::move(options)),
      token_sha256_(options_.token.empty() ? std::nullopt
                                           : std::optional<TokenDigest>(Sha256(options_.token))) {}

Result<std::unique_ptr<GatewayAuthenticator>> GatewayAuthenticator::Create(
    AuthOptions options, HubTransport hub_transport) {
  std::unique_ptr<GatewayAuthenticator> auth(new GatewayAuthenticator(std::move(options)));
  if (const auto& hub = auth->options_.hub) {
    if (hub->api_url.empty()) {
      return InvalidArgument("--auth jupyterhub needs the Hub's API URL (JUPYTERHUB_API_URL)");
    }
    auth->hub_ = std::make_unique<HubIdentity>(
        *hub, hub_transport ? std::move(hub_transport) : CurlHubTransport(*hub));
  }
  if (Status s = auth->ReloadUsers(); !s.ok()) return s;
  return auth;
}

Status GatewayAuthenticator::ReloadUsers() {
  if (options_.users_file.empty()) return Status::Ok();
  auto users = ReadUsersFile(options_.users_file);
  if (!users.ok()) return users.status();
  MutexLock lock(&mu_);
  users_ = std::move(*users);
  return Status::Ok();
}

size_t GatewayAuthenticator::users() const {
  MutexLock lock(&mu_);
  return users_.size();
}

Result<http::Identity> GatewayAuthenticator::Authenticate(const http::Request& req) {
  if (!token_sha256_ && options_.users_file.empty() && !hub_) return http::Identity{"", true};
  const std::string token = RequestToken(req);
  if (token.empty())
    return Unauthenticated("this gateway requires a token (Authorization: token T)");
  const TokenDigest digest = Sha256(token);
  if (token_sha256_ && CRYPTO_memcmp(token_sha256_->data(), digest.data(), digest.size()) == 0) {
    return http::Identity{options_.token_user, true};
  }
  {
    MutexLock lock(&mu_);
    if (auto user = FindUser(users_, digest)) return *user;
  }
  if (hub_) {
    auto user = hub_->Lookup(token, MonotonicMs());
    if (!user.ok()) return user.status();
    if (*user) return **user;
  }
  return Unauthenticated("invalid token");
}

}  // namespace nbos::auth
