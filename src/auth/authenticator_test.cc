#include "auth/authenticator.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>

#include "http/server.h"

namespace nbos::auth {
namespace {

http::Request WithHeader(const std::string& authorization) {
  http::Request r;
  r.headers["authorization"] = authorization;
  return r;
}

http::Request WithQuery(const std::string& token) {
  http::Request r;
  r.query["token"] = token;
  return r;
}

class UsersFile {
 public:
  UsersFile() : path_("/tmp/nbos-users-" + std::to_string(getpid()) + ".json") {}
  ~UsersFile() { std::remove(path_.c_str()); }
  void Write(const std::string& json) { std::ofstream(path_) << json; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(AuthenticatorTest, TheGatewayTokenIsAnAdminAndEveryFormOfItIsAccepted) {
  auto auth = GatewayAuthenticator::Create({.token = "gateway-token-0123"});
  ASSERT_TRUE(auth.ok());
  for (const http::Request& r :
       {WithHeader("token gateway-token-0123"), WithHeader("Bearer gateway-token-0123"),
        WithQuery("gateway-token-0123")}) {
    auto who = (*auth)->Authenticate(r);
    ASSERT_TRUE(who.ok());
    EXPECT_EQ(who->user, "admin");
    EXPECT_TRUE(who->admin);
  }
  auto none = (*auth)->Authenticate(http::Request());
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("requires a token"), std::string::npos);
  auto wrong = (*auth)->Authenticate(WithHeader("token gateway-token-0124"));
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(wrong.status().message(), "invalid token");
}

TEST(AuthenticatorTest, UsersFromTheFileAndReloadKeepsTheOldUsersOnABadFile) {
  UsersFile file;
  file.Write(R"({"users": [{"name": "alice", "token": "alice-token-0123456789"}]})");
  auto auth =
      GatewayAuthenticator::Create({.token = "gateway-token-0123", .users_file = file.path()});
  ASSERT_TRUE(auth.ok()) << auth.status().message();
  auto alice = (*auth)->Authenticate(WithHeader("token alice-token-0123456789"));
  ASSERT_TRUE(alice.ok());
  EXPECT_EQ(alice->user, "alice");
  EXPECT_FALSE(alice->admin);

  file.Write(R"({"users": [{"name": "bob", "token": "bob-token-0123456789ab", "admin": true}]})");
  ASSERT_TRUE((*auth)->ReloadUsers().ok());
  EXPECT_FALSE((*auth)->Authenticate(WithHeader("token alice-token-0123456789")).ok());
  auto bob = (*auth)->Authenticate(WithHeader("token bob-token-0123456789ab"));
  ASSERT_TRUE(bob.ok());
  EXPECT_TRUE(bob->admin);

  file.Write("{broken");
  Status s = (*auth)->ReloadUsers();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find(file.path()), std::string::npos);
  EXPECT_TRUE((*auth)->Authenticate(WithHeader("token bob-token-0123456789ab")).ok());
  EXPECT_EQ((*auth)->users(), 1u);
}

TEST(AuthenticatorTest, AnUnreadableUsersFileIsAnError) {
  auto auth = GatewayAuthenticator::Create({.users_file = "/nonexistent/users.json"});
  ASSERT_FALSE(auth.ok());
  EXPECT_EQ(auth.status().code(), StatusCode::kInvalidArgument);
}

TEST(AuthenticatorTest, WithoutAnyCredentialEveryCallerIsAnUnnamedAdmin) {
  auto auth = GatewayAuthenticator::Create({});
  ASSERT_TRUE(auth.ok());
  auto who = (*auth)->Authenticate(http::Request());
  ASSERT_TRUE(who.ok());
  EXPECT_EQ(who->user, "");
  EXPECT_TRUE(who->admin);
}

// The Hub is asked over HTTP (libcurl) at GET {api_url}/user with the client's token.
TEST(AuthenticatorTest, JupyterHubUsersThroughARealHttpHub) {
  http::Server hub;
  hub.Route("GET", "/hub/api/user", [](const http::Request& r) {
    http::Response res;
    if (r.Header("authorization") == "token hub-alice") {
      res.body = R"({"kind":"user","name":"alice","admin":false,"groups":[]})";
    } else if (r.Header("authorization") == "token hub-root") {
      res.body = R"({"kind":"user","name":"root","admin":true})";
    } else {
      res.status = 403;
      res.body = R"({"status":403,"message":"Forbidden"})";
    }
    return res;
  });
  ASSERT_TRUE(hub.Start({}).ok());
  const std::string api = "http://127.0.0.1:" + std::to_string(hub.port()) + "/hub/api";
  auto auth = GatewayAuthenticator::Create(
      {.token = "gateway-token-0123", .hub = HubOptions{.api_url = api}});
  ASSERT_TRUE(auth.ok());
  auto alice = (*auth)->Authenticate(WithHeader("token hub-alice"));
  ASSERT_TRUE(alice.ok()) << alice.status().message();
  EXPECT_EQ(alice->user, "alice");
  EXPECT_FALSE(alice->admin);
  auto root = (*auth)->Authenticate(WithQuery("hub-root"));
  ASSERT_TRUE(root.ok());
  EXPECT_TRUE(root->admin);
  auto wrong = (*auth)->Authenticate(WithHeader("token hub-nobody"));
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kUnauthenticated);
  // The gateway's own token still works beside the Hub.
  EXPECT_TRUE((*auth)->Authenticate(WithHeader("token gateway-token-0123")).ok());
  hub.Stop();
  // A Hub that is gone: known tokens answer from the cache, new ones are Unavailable.
  EXPECT_TRUE((*auth)->Authenticate(WithHeader("token hub-alice")).ok());
  auto unknown = (*auth)->Authenticate(WithHeader("token hub-new"));
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(unknown.status().message().find("cannot reach JupyterHub"), std::string::npos);
}

TEST(AuthenticatorTest, AHubWithoutAnApiUrlIsAnError) {
  auto auth = GatewayAuthenticator::Create({.hub = HubOptions{}});
  ASSERT_FALSE(auth.ok());
  EXPECT_NE(auth.status().message().find("JUPYTERHUB_API_URL"), std::string::npos);
}

}  // namespace
}  // namespace nbos::auth
