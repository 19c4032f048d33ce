// How the gateway knows who calls it: every authenticated request carries an http::Identity (a
// user name, and whether that user is an admin who sees and manages every user's kernels).
//
// A client presents a token as `Authorization: token T` (or `Bearer T`) or as `?token=T`. It is
// checked against, in this order:
//  - the gateway's own token (`--token`): the caller is the admin `token_user`;
//  - the users file (`--users FILE`, users.h), re-read by ReloadUsers (the gateway calls it on
//    SIGHUP); a file that no longer parses keeps the users already loaded;
//  - JupyterHub (`--auth jupyterhub`, hub_identity.h).
// Tokens are compared through their SHA-256 digests in constant time. With none of the three
// configured every caller is an unnamed admin (a development gateway).
//
// Refusals: Unauthenticated (no token, or one nobody knows), Unavailable (the Hub cannot be
// asked now). Thread-safe.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "auth/hub_identity.h"
#include "auth/users.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "http/server.h"

namespace nbos::auth {

struct AuthOptions {
  std::string token;
  std::string token_user = "admin";
  std::string users_file;
  std::optional<HubOptions> hub;
};

// The token a request carries, or "" when none.
std::string RequestToken(const http::Request& req);

class GatewayAuthenticator {
 public:
  // Errors: InvalidArgument for a users file that cannot be read or parsed, or a Hub without an
  // API URL. `hub_transport` null: libcurl.
  static Result<std::unique_ptr<GatewayAuthenticator>> Create(AuthOptions options,
                                                              HubTransport hub_transport = nullptr);

  Result<http::Identity> Authenticate(const http::Request& req);
  // Re-reads the users file (nothing to do without one). On error the old users stay.
  Status ReloadUsers();
  size_t users() const;

 private:
  explicit GatewayAuthenticator(AuthOptions options);

  const AuthOptions options_;
  const std::optional<TokenDigest> token_sha256_;
  std::unique_ptr<HubIdentity> hub_;
  mutable Mutex mu_;
  std::vector<User> users_ GUARDED_BY(mu_);
};

}  // namespace nbos::auth
