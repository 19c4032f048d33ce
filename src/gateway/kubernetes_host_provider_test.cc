#include "gateway/kubernetes_host_provider.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <deque>
#include <fstream>

#include "http/server.h"

namespace nbos::gateway {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// True when every field of `want` is in `got` with the same value (objects compared field by
// field, the rest exactly).
bool Contains(const Json& got, const Json& want) {
  if (!want.is_object()) return got == want;
  if (!got.is_object()) return false;
  for (auto& [key, value] : want.items())
    if (!got.contains(key) || !Contains(got[key], value)) return false;
  return true;
}

// Answers each call with the next recorded exchange, after checking that the call is the one
// recorded. With nothing left, or `down`, the API server is unreachable.
class ReplayApi final : public KubeApi {
 public:
  explicit ReplayApi(std::deque<Json>* exchanges, bool* down)
      : exchanges_(exchanges), down_(down) {}
  Result<Response> Call(const std::string& method, const std::string& path,
                        const Json& body) override {
    if (*down_ || exchanges_->empty()) return Unavailable("cannot reach the Kubernetes API");
    const Json e = exchanges_->front();
    exchanges_->pop_front();
    const Json& want = e["request"];
    EXPECT_EQ(method, want["method"].get<std::string>());
    EXPECT_EQ(path, want["path"].get<std::string>());
    if (want.contains("body")) {
      EXPECT_TRUE(Contains(body, want["body"])) << body.dump() << "\nlacks " << want["body"];
    }
    return Response{e["response"]["status"].get<long>(), e["response"]["body"]};
  }

 private:
  std::deque<Json>* exchanges_;
  bool* down_;
};

Json PodTemplate() {
  return Json::parse(R"json({
    "kind": "Pod",
    "metadata": {"labels": {"team": "ml"}},
    "spec": {"containers": [{"name": "daemon", "image": "registry.example/nbos:1",
                             "args": ["daemon", "--server-id=$(POD_NAME)"],
                             "resources": {"limits": {"nvidia.com/gpu": 1}}}]}})json");
}

class KubernetesHostProviderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ifstream in(std::string(NBOS_KUBERNETES_TESTDATA) + "/scale.json");
    const Json recorded = Json::parse(in);
    for (const Json& e : recorded["exchanges"]) exchanges_.push_back(e);
  }
  Result<std::unique_ptr<KubernetesHostProvider>> Create(Json pod_template = PodTemplate()) {
    KubernetesHostOptions o;
    o.namespace_name = "gpu";
    o.pod_template = std::move(pod_template);
    o.max_hosts = 6;
    o.relist_interval = std::chrono::milliseconds(0);
    return KubernetesHostProvider::Create(o, std::make_unique<ReplayApi>(&exchanges_, &down_));
  }

  std::deque<Json> exchanges_;
  bool down_ = false;
};

TEST_F(KubernetesHostProviderTest, GrowsAndShrinksThePoolOfDaemonPods) {
  auto p = Create();
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  // Adopted the running Pod; the one being deleted is not a server.
  EXPECT_EQ((*p)->Count(), 1);
  EXPECT_TRUE((*p)->Owns("nbos-daemon-1"));
  EXPECT_TRUE((*p)->Pending().empty());

  // Two more: nbos-daemon-3 is still taken by the Pod being deleted, so -2 and -4.
  auto added = (*p)->AddServers(2);
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  EXPECT_THAT(*added, ElementsAre("nbos-daemon-2", "nbos-daemon-4"));
  EXPECT_THAT((*p)->Pending(), ElementsAre("nbos-daemon-2", "nbos-daemon-4"));

  // A quota stops the next one: the API server's reason comes back.
  auto refused = (*p)->AddServers(1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(refused.status().message(), HasSubstr("exceeded quota: gpu-quota"));

  (*p)->OnRegistered("nbos-daemon-2");
  EXPECT_THAT((*p)->Pending(), ElementsAre("nbos-daemon-4"));
  EXPECT_EQ((*p)->RemoveServer("somewhere-else").code(), StatusCode::kNotFound);
  EXPECT_TRUE((*p)->RemoveServer("nbos-daemon-2").ok());
  EXPECT_FALSE((*p)->Owns("nbos-daemon-2"));

  // The re-list forgets the Pod that finished deleting; -4 waits for a node (Unschedulable).
  (*p)->Poll();
  EXPECT_FALSE((*p)->Owns("nbos-daemon-3"));
  EXPECT_EQ((*p)->Count(), 2);
  EXPECT_THAT((*p)->Pending(), ElementsAre("nbos-daemon-4"));
  // Deleted already by someone else: nothing left to do.
  EXPECT_TRUE((*p)->RemoveServer("nbos-daemon-4").ok());
  EXPECT_TRUE(exchanges_.empty()) << exchanges_.size() << " exchanges were not made";

  // The API server goes away: a clear error, and nothing forgotten.
  down_ = true;
  auto unreachable = (*p)->AddServers(1);
  ASSERT_FALSE(unreachable.ok());
  EXPECT_EQ(unreachable.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ((*p)->Count(), 1);
  (*p)->Poll();  // logged, not fatal
  EXPECT_TRUE((*p)->Owns("nbos-daemon-1"));
}

TEST_F(KubernetesHostProviderTest, ATemplateThatIsNotAPodIsRefusedBeforeAnyCall) {
  for (const char* bad : {R"([])", R"({"kind": "Deployment", "spec": {}})", R"({"kind": "Pod"})"}) {
    auto p = Create(Json::parse(bad));
    ASSERT_FALSE(p.ok()) << bad;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(exchanges_.size(), 8u);
}

// The libcurl transport against a real HTTP server: the service account's token as a bearer
// token (read per call), JSON both ways, and a body that is not JSON read as null.
TEST(KubeApiTest, SpeaksJsonWithTheServiceAccountsToken) {
  http::Server server;
  std::string seen_auth, seen_body;
  server.Route("POST", "/api/v1/namespaces/{ns}/pods", [&](const http::Request& r) {
    seen_auth = r.Header("authorization");
    seen_body = r.body;
    return http::Response{201, "application/json", R"({"kind":"Pod"})", {}};
  });
  server.Route("GET", "/api/v1/namespaces/{ns}/pods", [&](const http::Request&) {
    return http::Response{403, "text/plain", "forbidden", {}};
  });
  ASSERT_TRUE(server.Start({}).ok());
  const std::string token_file = testing::TempDir() + "/kube-token";
  std::ofstream(token_file) << "abc123\n";
  auto api = ConnectKubeApi({.base_url = "http://127.0.0.1:" + std::to_string(server.port()),
                             .token_file = token_file,
                             .ca_file = ""});
  ASSERT_TRUE(api.ok()) << api.status().ToString();
  auto created = (*api)->Call("POST", "/api/v1/namespaces/gpu/pods", Json{{"kind", "Pod"}});
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  EXPECT_EQ(created->status, 201);
  EXPECT_EQ(created->body["kind"], "Pod");
  EXPECT_EQ(seen_auth, "Bearer abc123");
  EXPECT_EQ(Json::parse(seen_body), (Json{{"kind", "Pod"}}));
  auto refused = (*api)->Call("GET", "/api/v1/namespaces/gpu/pods", nullptr);
  ASSERT_TRUE(refused.ok());
  EXPECT_EQ(refused->status, 403);
  EXPECT_TRUE(refused->body.is_null());
  const uint16_t port = server.port();
  server.Stop();
  auto gone = ConnectKubeApi({.base_url = "http://127.0.0.1:" + std::to_string(port)});
  auto down = (*gone)->Call("GET", "/api/v1/namespaces/gpu/pods", nullptr);
  ASSERT_FALSE(down.ok());
  EXPECT_EQ(down.status().code(), StatusCode::kUnavailable);
  std::remove(token_file.c_str());
}

TEST(KubeApiTest, OutsideAPodWithoutAnUrlIsAClearError) {
  ::unsetenv("KUBERNETES_SERVICE_HOST");
  auto api = ConnectKubeApi({});
  ASSERT_FALSE(api.ok());
  EXPECT_THAT(api.status().message(), HasSubstr("KUBERNETES_SERVICE_HOST"));
}

}  // namespace
}  // namespace nbos::gateway
