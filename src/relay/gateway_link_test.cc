#include "relay/gateway_link.h"

#include <gtest/gtest.h>

#include <atomic>
#include <deque>
#include <set>
#include <thread>

#include "common/thread_annotations.h"
#include "http/server.h"

namespace nbos::relay {
namespace {

using jupyter::Channel;
using jupyter::Json;
using jupyter::WsMessage;
using namespace std::chrono_literals;

// A gateway with one kernel "k1" whose channels echo every message back on iopub.
class FakeGateway {
 public:
  FakeGateway() {
    server_.SetAuthenticator([](const http::Request& r) -> Result<http::Identity> {
      if (r.Header("authorization") == "token good") return http::Identity{"u", false};
      return Unauthenticated("bad token");
    });
    server_.Route("POST", "/api/kernels", [this](const http::Request& r) {
      MutexLock lock(&mu_);
      posted_ = Json::parse(r.body, nullptr, false);
      http::Response res;
      res.status = 201;
      res.body = Json{{"id", "k1"}, {"name", "nbos"}}.dump();
      return res;
    });
    server_.Route("DELETE", "/api/kernels/{id}", [this](const http::Request& r) {
      MutexLock lock(&mu_);
      deleted_.insert(r.params.at("id"));
      http::Response res;
      res.status = 204;
      res.content_type.clear();
      return res;
    });
    server_.Route("POST", "/api/kernels/{id}/interrupt", [this](const http::Request&) {
      ++interrupts_;
      http::Response res;
      res.status = 204;
      res.content_type.clear();
      return res;
    });
    server_.WebSocket("/api/kernels/{id}/channels",
                      [this](const http::Request& r, std::shared_ptr<http::WsConnection> conn)
                          -> Result<std::shared_ptr<http::WsHandler>> {
                        if (r.params.at("id") != "k1" || gone_) return NotFound("no kernel");
                        if (refuse_) return Unavailable("not now");
                        {
                          MutexLock lock(&mu_);
                          conn_ = conn;
                          ++opened_;
                        }
                        return std::shared_ptr<http::WsHandler>(std::make_shared<Echo>(conn));
                      });
    EXPECT_TRUE(server_.Start({}).ok());
    url_ = "http://127.0.0.1:" + std::to_string(server_.port()) + "/";
  }

  // Drops the current WebSocket as a network failure would.
  void DropConnection() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (conn_) conn_->Close(1011, "dropped");
  }

  class Echo final : public http::WsHandler {
   public:
    explicit Echo(std::shared_ptr<http::WsConnection> conn) : conn_(std::move(conn)) {}
    void OnText(std::string text) override {
      auto m = jupyter::DecodeWs(text, false);
      if (!m.ok()) return;
      m->channel = Channel::kIopub;
      conn_->SendText(jupyter::EncodeWsText(*m));
    }

   private:
    std::shared_ptr<http::WsConnection> conn_;
  };

  http::Server server_;
  std::string url_;
  Mutex mu_;
  Json posted_ GUARDED_BY(mu_);
  std::set<std::string> deleted_ GUARDED_BY(mu_);
  std::shared_ptr<http::WsConnection> conn_ GUARDED_BY(mu_);
  int opened_ GUARDED_BY(mu_) = 0;
  std::atomic<int> interrupts_{0};
  std::atomic<bool> gone_{false};
  std::atomic<bool> refuse_{false};  // WebSocket upgrades fail with 500 while set
};

class Inbox {
 public:
  void Push(WsMessage m) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    messages_.push_back(std::move(m));
    cv_.SignalAll();
  }
  void Gone(const Status& s) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    gone_ = s;
    cv_.SignalAll();
  }
  std::optional<WsMessage> Pop() EXCLUDES(mu_) {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    MutexLock lock(&mu_);
    while (messages_.empty() && cv_.WaitUntil(&mu_, deadline)) {
    }
    if (messages_.empty()) return std::nullopt;
    WsMessage m = std::move(messages_.front());
    messages_.pop_front();
    return m;
  }
  std::optional<Status> WaitGone() EXCLUDES(mu_) {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    MutexLock lock(&mu_);
    while (!gone_.has_value() && cv_.WaitUntil(&mu_, deadline)) {
    }
    return gone_;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::deque<WsMessage> messages_ GUARDED_BY(mu_);
  std::optional<Status> gone_ GUARDED_BY(mu_);
};

WsMessage Msg(const std::string& id) {
  WsMessage m;
  m.channel = Channel::kShell;
  m.message.header = Json{{"msg_id", id}, {"msg_type", "kernel_info_request"}};
  return m;
}

GatewayOptions Options(const FakeGateway& g, std::string token = "good") {
  GatewayOptions o;
  o.url = g.url_;
  o.token = std::move(token);
  o.env = {{"KERNEL_GPUS", "1"}};
  o.backoff_initial = 20ms;
  o.backoff_max = 100ms;
  o.reconnect_for = 2s;
  return o;
}

TEST(KernelEnvTest, TakesOnlyKernelVariables) {
  const char* vars[] = {"KERNEL_GPUS=2", "HOME=/root", "KERNEL_X=a=b", "KERNEL_", nullptr};
  auto env = KernelEnvFrom(const_cast<char**>(vars));
  EXPECT_EQ(env, (std::map<std::string, std::string>{{"KERNEL_GPUS", "2"}, {"KERNEL_X", "a=b"}}));
}

TEST(GatewayLinkTest, StartsSendsReceivesAndDeletes) {
  FakeGateway g;
  Inbox inbox;
  auto link = GatewayLink::Start(
      Options(g), [&](WsMessage m) { inbox.Push(std::move(m)); },
      [&](const Status& s) { inbox.Gone(s); });
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  EXPECT_EQ((*link)->kernel_id(), "k1");
  {
    MutexLock lock(&g.mu_);
    EXPECT_EQ(g.posted_["name"], "nbos");
    EXPECT_EQ(g.posted_["env"]["KERNEL_GPUS"], "1");
  }
  (*link)->Send(Msg("m1"));
  auto m = inbox.Pop();
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->channel, Channel::kIopub);
  EXPECT_EQ(m->message.msg_id(), "m1");

  EXPECT_TRUE((*link)->Interrupt().ok());
  EXPECT_EQ(g.interrupts_.load(), 1);
  (*link)->Stop();
  EXPECT_TRUE((*link)->Delete(5s).ok());
  MutexLock lock(&g.mu_);
  EXPECT_TRUE(g.deleted_.count("k1"));
}

TEST(GatewayLinkTest, ReconnectsAfterADropAndKeepsOrder) {
  FakeGateway g;
  Inbox inbox;
  auto link = GatewayLink::Start(
      Options(g), [&](WsMessage m) { inbox.Push(std::move(m)); },
      [&](const Status& s) { inbox.Gone(s); });
  ASSERT_TRUE(link.ok());
  // A message in flight while the connection drops may be lost (the WebSocket has no acks);
  // what is sent after the drop is noticed is queued and delivered in order.
  g.refuse_ = true;
  g.DropConnection();
  std::this_thread::sleep_for(200ms);
  for (int i = 0; i < 20; ++i) (*link)->Send(Msg("m" + std::to_string(i)));
  g.refuse_ = false;
  for (int i = 0; i < 20; ++i) {
    auto m = inbox.Pop();
    ASSERT_TRUE(m.has_value()) << "message " << i;
    EXPECT_EQ(m->message.msg_id(), "m" + std::to_string(i));
  }
  MutexLock lock(&g.mu_);
  EXPECT_GE(g.opened_, 2);
}

TEST(GatewayLinkTest, AKernelTheGatewayLostIsGone) {
  FakeGateway g;
  Inbox inbox;
  auto link = GatewayLink::Start(
      Options(g), [&](WsMessage m) { inbox.Push(std::move(m)); },
      [&](const Status& s) { inbox.Gone(s); });
  ASSERT_TRUE(link.ok());
  g.gone_ = true;
  g.DropConnection();
  auto gone = inbox.WaitGone();
  ASSERT_TRUE(gone.has_value());
  EXPECT_EQ(gone->code(), StatusCode::kNotFound);
}

TEST(GatewayLinkTest, RefusedTokenAndUnreachableGateway) {
  FakeGateway g;
  auto link = GatewayLink::Start(
      Options(g, "bad"), [](WsMessage) {}, [](const Status&) {});
  ASSERT_FALSE(link.ok());
  EXPECT_EQ(link.status().code(), StatusCode::kUnauthenticated);
  EXPECT_NE(link.status().message().find("HTTP 403"), std::string::npos);
  EXPECT_NE(link.status().message().find("token"), std::string::npos);

  GatewayOptions o = Options(g);
  g.server_.Stop();
  o.start_timeout = 2s;
  link = GatewayLink::Start(
      o, [](WsMessage) {}, [](const Status&) {});
  ASSERT_FALSE(link.ok());
  EXPECT_EQ(link.status().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace nbos::relay
