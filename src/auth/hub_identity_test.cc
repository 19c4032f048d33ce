#include "auth/hub_identity.h"

#include <gtest/gtest.h>

#include <atomic>
#include <nlohmann/json.hpp>

namespace nbos::auth {
namespace {

// A Hub that knows "alice-token" (alice) and "ops-token" (an admin), and a service token.
struct FakeHub {
  std::atomic<int> calls{0};
  bool down = false;
  std::string last_url;

  HubTransport Transport() {
    return [this](const std::string& url, std::string_view token) -> Result<HubReply> {
      ++calls;
      last_url = url;
      if (down) return Unavailable("connection refused");
      if (token == "alice-token") return HubReply{200, R"({"kind":"user","name":"alice"})"};
      if (token == "ops-token") {
        return HubReply{200, R"({"kind":"user","name":"ops","admin":true})"};
      }
      if (token == "service-token") return HubReply{200, R"({"kind":"service","name":"x"})"};
      if (token == "broken-token") return HubReply{502, "bad gateway"};
      return HubReply{403, R"({"status":403})"};
    };
  }
};

TEST(HubIdentityTest, AsksTheHubOnceAndCachesTheAnswer) {
  FakeHub hub;
  HubIdentity identity({.api_url = "http://hub/hub/api/"}, hub.Transport());
  auto alice = identity.Lookup("alice-token", 1000);
  ASSERT_TRUE(alice.ok());
  ASSERT_TRUE(*alice);
  EXPECT_EQ((*alice)->user, "alice");
  EXPECT_FALSE((*alice)->admin);
  EXPECT_EQ(hub.last_url, "http://hub/hub/api/user");
  EXPECT_TRUE(identity.Lookup("alice-token", 30'000).ok());
  EXPECT_EQ(hub.calls, 1);
  // Past the cache time the Hub is asked again (a token may have been revoked).
  EXPECT_TRUE(identity.Lookup("alice-token", 61'001).ok());
  EXPECT_EQ(hub.calls, 2);
  auto ops = identity.Lookup("ops-token", 1000);
  ASSERT_TRUE(ops.ok() && *ops);
  EXPECT_TRUE((*ops)->admin);
}

TEST(HubIdentityTest, RefusedTokensAreCachedBriefly) {
  FakeHub hub;
  HubIdentity identity({.api_url = "http://hub/hub/api", .refused_cache_ms = 5000},
                       hub.Transport());
  for (int64_t now : {0, 1000, 4999}) {
    auto r = identity.Lookup("wrong-token", now);
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(*r);
  }
  EXPECT_EQ(hub.calls, 1);
  EXPECT_FALSE(*identity.Lookup("wrong-token", 5000));
  EXPECT_EQ(hub.calls, 2);
  // A service's token is not a user's.
  EXPECT_FALSE(*identity.Lookup("service-token", 0));
}

TEST(HubIdentityTest, AHubThatCannotAnswerIsUnavailableAndNotCached) {
  FakeHub hub;
  HubIdentity identity({.api_url = "http://hub/hub/api"}, hub.Transport());
  hub.down = true;
  auto r = identity.Lookup("alice-token", 0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  hub.down = false;
  auto broken = identity.Lookup("broken-token", 0);
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.status().message().find("HTTP 502"), std::string::npos);
  auto alice = identity.Lookup("alice-token", 1);
  ASSERT_TRUE(alice.ok() && *alice);
  EXPECT_EQ(hub.calls, 3);
}

TEST(HubIdentityTest, TheCacheStaysBounded) {
  FakeHub hub;
  HubIdentity identity({.api_url = "http://hub/hub/api", .max_cached_tokens = 4}, hub.Transport());
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(identity.Lookup("t" + std::to_string(i), i).ok());
  EXPECT_EQ(hub.calls, 100);
  ASSERT_TRUE(identity.Lookup("alice-token", 200).ok());
  ASSERT_TRUE(identity.Lookup("alice-token", 201).ok());
  EXPECT_EQ(hub.calls, 101);
}

TEST(HubIdentityTest, RepliesThatAreNotUserModelsAreUnavailable) {
  EXPECT_FALSE(ParseHubReply({200, "[]"}).ok());
  EXPECT_FALSE(ParseHubReply({200, R"({"name": 7})"}).ok());
  EXPECT_FALSE(ParseHubReply({500, ""}).ok());
  auto refused = ParseHubReply({401, ""});
  ASSERT_TRUE(refused.ok());
  EXPECT_FALSE(*refused);
}

}  // namespace
}  // namespace nbos::auth
