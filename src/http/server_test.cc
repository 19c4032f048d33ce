#include "http/server.h"

#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/websocket.hpp>
#include <chrono>
#include <future>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/thread_annotations.h"

namespace nbos::http {
namespace {

namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
namespace websocket = boost::beast::websocket;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using json = nlohmann::json;
using namespace std::chrono_literals;

std::string Str(beast::string_view s) { return std::string(s.data(), s.size()); }

struct HttpResult {
  int status = 0;
  std::string body;
  bhttp::fields headers;

  json Json() const { return json::parse(body); }
  std::string Header(bhttp::field f) const { return Str(headers[f]); }
  std::string Header(const std::string& name) const { return Str(headers[name]); }
};

// One client connection; successive calls reuse it (keep-alive).
class HttpClient {
 public:
  explicit HttpClient(uint16_t port) : socket_(ioc_) {
    socket_.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
  }

  HttpResult Call(const std::string& method, const std::string& target, std::string body = "",
                  const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    bhttp::request<bhttp::string_body> req;
    req.method_string(method);
    req.target(target);
    req.version(11);
    req.set(bhttp::field::host, "127.0.0.1");
    for (const auto& [name, value] : headers) req.set(name, value);
    req.body() = std::move(body);
    req.prepare_payload();
    bhttp::write(socket_, req);
    bhttp::response<bhttp::string_body> res;
    bhttp::read(socket_, buffer_, res);
    HttpResult out;
    out.status = static_cast<int>(res.result_int());
    out.body = res.body();
    out.headers = res.base();
    return out;
  }

  // Reads until the server closes the connection; true if it did.
  bool ServerClosed() {
    beast::error_code ec;
    char byte;
    socket_.read_some(net::buffer(&byte, 1), ec);
    return ec == net::error::eof || ec == net::error::connection_reset;
  }

  tcp::socket& socket() { return socket_; }

 private:
  net::io_context ioc_;
  tcp::socket socket_;
  beast::flat_buffer buffer_;
};

HttpResult Call(uint16_t port, const std::string& method, const std::string& target,
                std::string body = "",
                const std::vector<std::pair<std::string, std::string>>& headers = {}) {
  HttpClient client(port);
  return client.Call(method, target, std::move(body), headers);
}

// An upgrade request the server is expected to refuse (Beast's synchronous client drops the
// refusal's body).
HttpResult RefusedUpgrade(uint16_t port, const std::string& target) {
  return Call(port, "GET", target, "",
              {{"Upgrade", "websocket"},
               {"Connection", "Upgrade"},
               {"Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="},
               {"Sec-WebSocket-Version", "13"}});
}

// Sends raw bytes and returns everything the server answers until it closes.
std::string RawExchange(uint16_t port, const std::string& bytes) {
  net::io_context ioc;
  tcp::socket socket(ioc);
  socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
  net::write(socket, net::buffer(bytes));
  std::string out;
  beast::error_code ec;
  std::array<char, 4096> buf;
  while (!ec) {
    size_t n = socket.read_some(net::buffer(buf), ec);
    out.append(buf.data(), n);
  }
  return out;
}

class WsClient {
 public:
  // Handshakes; on failure the error is returned and response() holds the server's answer.
  beast::error_code Connect(uint16_t port, const std::string& target,
                            const std::string& protocols = "") {
    ws_.next_layer().connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
    if (!protocols.empty()) {
      ws_.set_option(websocket::stream_base::decorator([protocols](websocket::request_type& req) {
        req.set(bhttp::field::sec_websocket_protocol, protocols);
      }));
    }
    beast::error_code ec;
    ws_.handshake(response_, "127.0.0.1", target, ec);
    return ec;
  }

  void SendText(const std::string& s) {
    ws_.text(true);
    ws_.write(net::buffer(s));
  }
  void SendBinary(const std::string& s) {
    ws_.binary(true);
    ws_.write(net::buffer(s));
  }

  struct Message {
    bool text = false;
    std::string data;
  };
  // The next message, or the error that ended the connection.
  beast::error_code Read(Message* m) {
    beast::flat_buffer buffer;
    beast::error_code ec;
    ws_.read(buffer, ec);
    if (!ec) *m = {ws_.got_text(), beast::buffers_to_string(buffer.data())};
    return ec;
  }

  websocket::stream<tcp::socket>& ws() { return ws_; }
  const websocket::response_type& response() const { return response_; }

 private:
  net::io_context ioc_;
  websocket::stream<tcp::socket> ws_{ioc_};
  websocket::response_type response_;
};

// Records what one server-side connection receives; echoes if asked to.
class RecordingHandler : public WsHandler {
 public:
  RecordingHandler(std::shared_ptr<WsConnection> conn, bool echo)
      : conn_(std::move(conn)), echo_(echo) {}

  void OnText(std::string text) override {
    if (text == "throw") throw std::runtime_error("handler failed");
    if (echo_) conn_->SendText(text);
    Record("text:" + text);
  }
  void OnBinary(std::string data) override {
    if (echo_) conn_->SendBinary(data);
    Record("binary:" + data);
  }
  void OnClose() EXCLUDES(mu_) override {
    MutexLock lock(&mu_);
    ++close_calls_;
    cv_.SignalAll();
  }

  bool WaitClosed(std::chrono::milliseconds timeout = 5s) EXCLUDES(mu_) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    MutexLock lock(&mu_);
    while (close_calls_ == 0 && cv_.WaitUntil(&mu_, deadline)) {
    }
    return close_calls_ > 0;
  }
  int close_calls() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return close_calls_;
  }
  std::vector<std::string> received() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return received_;
  }

 private:
  void Record(std::string s) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    received_.push_back(std::move(s));
  }

  std::shared_ptr<WsConnection> conn_;
  const bool echo_;
  Mutex mu_;
  CondVar cv_;
  std::vector<std::string> received_ GUARDED_BY(mu_);
  int close_calls_ GUARDED_BY(mu_) = 0;
};

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_.Route("GET", "/api/kernels/{kernel_id}/info", [](const Request& req) {
      Response r;
      r.body = json{{"method", req.method}, {"path", req.path},   {"target", req.target},
                    {"params", req.params}, {"query", req.query}, {"x_test", req.Header("x-test")}}
                   .dump();
      r.headers.emplace_back("X-Reply", "yes");
      return r;
    });
    server_.Route("POST", "/api/kernels/{kernel_id}/info", [](const Request& req) {
      Response r;
      r.status = 201;
      r.content_type = "text/plain";
      r.body = "posted " + std::to_string(req.body.size());
      return r;
    });
    server_.Route("DELETE", "/api/kernels/{kernel_id}", [](const Request&) {
      Response r;
      r.status = 204;
      r.body = "dropped";  // a 204 never carries a body
      return r;
    });
    server_.Route("GET", "/api/throw",
                  [](const Request&) -> Response { throw std::runtime_error("boom"); });
    server_.Route(
        "GET", "/api/status", [](const Request&) { return Response{.body = "{}"}; },
        RouteOptions{.public_route = true});
    server_.SetAuthenticator([](const Request& req) -> Result<Identity> {
      if (req.Header("authorization") == "token secret") return Identity{"header-user", false};
      auto it = req.query.find("token");
      if (it != req.query.end() && it->second == "secret") return Identity{"query-user", true};
      if (req.Header("authorization") == "token undecided") return Unavailable("ask again");
      return Unauthenticated("missing or bad token");
    });
    server_.Route("GET", "/api/whoami", [](const Request& req) {
      return Response{
          .body =
              nlohmann::json{{"user", req.identity.user}, {"admin", req.identity.admin}}.dump()};
    });
    server_.WebSocket(
        "/api/kernels/{kernel_id}/channels",
        [this](const Request& req,
               std::shared_ptr<WsConnection> conn) -> Result<std::shared_ptr<WsHandler>> {
          if (req.params.at("kernel_id") == "missing") {
            return NotFound("no kernel missing");
          }
          auto handler = std::make_shared<RecordingHandler>(conn, /*echo=*/true);
          MutexLock lock(&mu_);
          conns_.push_back(conn);
          handlers_.push_back(handler);
          cv_.SignalAll();
          return std::shared_ptr<WsHandler>(handler);
        });
  }

  void Start(ServerOptions options = {}) {
    ASSERT_TRUE(server_.Start(options).ok());
    ASSERT_NE(server_.port(), 0);
  }

  // The n-th WebSocket connection the server accepted (0-based), waiting for it.
  std::pair<std::shared_ptr<WsConnection>, std::shared_ptr<RecordingHandler>> Accepted(size_t n)
      EXCLUDES(mu_) {
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    MutexLock lock(&mu_);
    while (conns_.size() <= n && cv_.WaitUntil(&mu_, deadline)) {
    }
    EXPECT_TRUE(conns_.size() > n);
    if (conns_.size() <= n) return {};
    return {conns_[n], handlers_[n]};
  }

  std::string Channels(const std::string& kernel = "k1") {
    return "/api/kernels/" + kernel + "/channels?token=secret";
  }

  Server server_;
  Mutex mu_;
  CondVar cv_;
  std::vector<std::shared_ptr<WsConnection>> conns_ GUARDED_BY(mu_);
  std::vector<std::shared_ptr<RecordingHandler>> handlers_ GUARDED_BY(mu_);
};

const std::vector<std::pair<std::string, std::string>> kAuth = {{"Authorization", "token secret"}};

TEST_F(ServerTest, RoutesWithParamsQueryAndHeaders) {
  Start();
  HttpResult r = Call(server_.port(), "GET", "/api/kernels/k%201/info?token=secret&a=x+y&b=%26", "",
                      {{"X-Test", "hello"}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.Header(bhttp::field::content_type), "application/json");
  EXPECT_EQ(r.Header("X-Reply"), "yes");
  json j = r.Json();
  EXPECT_EQ(j["method"], "GET");
  EXPECT_EQ(j["path"], "/api/kernels/k%201/info");
  EXPECT_EQ(j["target"], "/api/kernels/k%201/info?token=secret&a=x+y&b=%26");
  EXPECT_EQ(j["params"], (json{{"kernel_id", "k 1"}}));
  EXPECT_EQ(j["query"], (json{{"token", "secret"}, {"a", "x y"}, {"b", "&"}}));
  EXPECT_EQ(j["x_test"], "hello");

  r = Call(server_.port(), "POST", "/api/kernels/k1/info/", "12345", kAuth);
  EXPECT_EQ(r.status, 201);
  EXPECT_EQ(r.Header(bhttp::field::content_type), "text/plain");
  EXPECT_EQ(r.body, "posted 5");

  r = Call(server_.port(), "DELETE", "/api/kernels/k1", "", kAuth);
  EXPECT_EQ(r.status, 204);
  EXPECT_EQ(r.body, "");
}

TEST_F(ServerTest, UnknownPathIs404AndWrongMethodIs405) {
  Start();
  HttpResult r = Call(server_.port(), "GET", "/api/nothing", "", kAuth);
  EXPECT_EQ(r.status, 404);
  EXPECT_TRUE(r.Json().contains("message"));

  r = Call(server_.port(), "PUT", "/api/kernels/k1/info", "", kAuth);
  EXPECT_EQ(r.status, 405);
  EXPECT_EQ(r.Header(bhttp::field::allow), "GET, POST");
  EXPECT_TRUE(r.Json()["message"].is_string());

  // A WebSocket path asked for without the upgrade.
  r = Call(server_.port(), "GET", "/api/kernels/k1/channels", "", kAuth);
  EXPECT_EQ(r.status, 400);
}

TEST_F(ServerTest, AuthenticatorGuardsAllButPublicRoutes) {
  Start();
  HttpResult r = Call(server_.port(), "GET", "/api/kernels/k1/info");
  EXPECT_EQ(r.status, 403);
  EXPECT_EQ(r.Json()["message"], "missing or bad token");
  EXPECT_EQ(Call(server_.port(), "GET", "/api/kernels/k1/info?token=wrong").status, 403);
  EXPECT_EQ(Call(server_.port(), "GET", "/api/kernels/k1/info?token=secret").status, 200);
  EXPECT_EQ(Call(server_.port(), "GET", "/api/kernels/k1/info", "", kAuth).status, 200);
  EXPECT_EQ(Call(server_.port(), "GET", "/api/status").status, 200);

  WsClient ws;
  EXPECT_TRUE(ws.Connect(server_.port(), "/api/kernels/k1/channels"));
  r = RefusedUpgrade(server_.port(), "/api/kernels/k1/channels");
  EXPECT_EQ(r.status, 403);
  EXPECT_EQ(r.Json()["message"], "missing or bad token");
}

TEST_F(ServerTest, HandlersSeeWhoTheAuthenticatorSaysSentTheRequest) {
  Start();
  HttpResult r = Call(server_.port(), "GET", "/api/whoami", "", kAuth);
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.Json()["user"], "header-user");
  EXPECT_EQ(r.Json()["admin"], false);
  r = Call(server_.port(), "GET", "/api/whoami?token=secret");
  EXPECT_EQ(r.Json()["user"], "query-user");
  EXPECT_EQ(r.Json()["admin"], true);
  // An authenticator that cannot decide now (its identity service is down) answers 503.
  r = Call(server_.port(), "GET", "/api/whoami", "", {{"Authorization", "token undecided"}});
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.Json()["message"], "ask again");
}

TEST_F(ServerTest, WebSocketFactoryRefusalMapsToHttpStatus) {
  Start();
  WsClient ws;
  EXPECT_TRUE(ws.Connect(server_.port(), Channels("missing")));
  HttpResult r = RefusedUpgrade(server_.port(), Channels("missing"));
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(r.Json()["message"], "no kernel missing");
}

TEST_F(ServerTest, HandlerExceptionIs500WithMessage) {
  Start();
  HttpClient client(server_.port());
  HttpResult r = client.Call("GET", "/api/throw", "", kAuth);
  EXPECT_EQ(r.status, 500);
  EXPECT_EQ(r.Json()["message"], "boom");
  // The connection survives a failed handler.
  EXPECT_EQ(client.Call("GET", "/api/status").status, 200);
}

TEST_F(ServerTest, KeepAliveServesSeveralRequestsOnOneConnection) {
  Start();
  HttpClient client(server_.port());
  tcp::endpoint local = client.socket().local_endpoint();
  EXPECT_EQ(client.Call("GET", "/api/status").status, 200);
  EXPECT_EQ(client.Call("GET", "/api/kernels/k2/info", "", kAuth).Json()["params"]["kernel_id"],
            "k2");
  EXPECT_EQ(client.Call("GET", "/api/nothing").status, 404);
  EXPECT_EQ(client.socket().local_endpoint(), local);
}

TEST_F(ServerTest, ConnectionCloseIsHonoured) {
  Start();
  HttpClient client(server_.port());
  HttpResult r = client.Call("GET", "/api/status", "", {{"Connection", "close"}});
  EXPECT_EQ(r.status, 200);
  EXPECT_TRUE(client.ServerClosed());
}

TEST_F(ServerTest, OversizedBodyIs413AndCloses) {
  ServerOptions options;
  options.max_body_bytes = 1024;
  Start(options);
  HttpClient client(server_.port());
  HttpResult r = client.Call("POST", "/api/kernels/k1/info", std::string(4096, 'x'), kAuth);
  EXPECT_EQ(r.status, 413);
  EXPECT_TRUE(r.Json()["message"].is_string());
  EXPECT_TRUE(client.ServerClosed());
  // At the limit is fine.
  EXPECT_EQ(
      Call(server_.port(), "POST", "/api/kernels/k1/info", std::string(1024, 'x'), kAuth).body,
      "posted 1024");
}

TEST_F(ServerTest, OversizedHeaderIs431) {
  ServerOptions options;
  options.max_header_bytes = 4096;
  Start(options);
  std::string reply = RawExchange(server_.port(), "GET /api/status HTTP/1.1\r\nHost: x\r\nX-Big: " +
                                                      std::string(8192, 'a') + "\r\n\r\n");
  EXPECT_EQ(reply.rfind("HTTP/1.1 431", 0), 0u) << reply;
}

TEST_F(ServerTest, MalformedRequestIs400AndCloses) {
  Start();
  std::string reply = RawExchange(server_.port(), "THIS IS NOT HTTP\r\n\r\n");
  EXPECT_EQ(reply.rfind("HTTP/1.1 400", 0), 0u) << reply;
  EXPECT_NE(reply.find("\"message\""), std::string::npos);

  reply = RawExchange(server_.port(), "GET /api/%zz HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(reply.rfind("HTTP/1.1 400", 0), 0u) << reply;

  reply = RawExchange(server_.port(),
                      "POST /api/status HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n");
  EXPECT_EQ(reply.rfind("HTTP/1.1 400", 0), 0u) << reply;
}

TEST_F(ServerTest, ExpectContinueGetsInterimResponse) {
  Start();
  net::io_context ioc;
  tcp::socket socket(ioc);
  socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), server_.port()));
  net::write(socket, net::buffer(std::string(
                         "POST /api/kernels/k1/info?token=secret HTTP/1.1\r\nHost: x\r\n"
                         "Expect: 100-continue\r\nContent-Length: 3\r\n\r\n")));
  std::array<char, 256> buf;
  size_t n = socket.read_some(net::buffer(buf));
  EXPECT_EQ(std::string(buf.data(), n), "HTTP/1.1 100 Continue\r\n\r\n");
  net::write(socket, net::buffer(std::string("abc")));
  beast::flat_buffer buffer;
  bhttp::response<bhttp::string_body> res;
  bhttp::read(socket, buffer, res);
  EXPECT_EQ(res.result_int(), 201u);
  EXPECT_EQ(res.body(), "posted 3");
}

TEST_F(ServerTest, IdleConnectionTimesOut) {
  ServerOptions options;
  options.read_timeout = 200ms;
  Start(options);
  HttpClient client(server_.port());
  EXPECT_EQ(client.Call("GET", "/api/status").status, 200);
  auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(client.ServerClosed());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
}

TEST_F(ServerTest, WebSocketEchoesTextAndBinary) {
  Start();
  WsClient ws;
  ASSERT_FALSE(ws.Connect(server_.port(), Channels()));
  auto [conn, handler] = Accepted(0);
  ASSERT_TRUE(conn);
  EXPECT_EQ(conn->subprotocol(), "");
  EXPECT_EQ(ws.response()[bhttp::field::sec_websocket_protocol], "");

  ws.SendText("hello");
  WsClient::Message m;
  ASSERT_FALSE(ws.Read(&m));
  EXPECT_TRUE(m.text);
  EXPECT_EQ(m.data, "hello");

  std::string binary("\x00\x01\xff", 3);
  ws.SendBinary(binary);
  ASSERT_FALSE(ws.Read(&m));
  EXPECT_FALSE(m.text);
  EXPECT_EQ(m.data, binary);
  EXPECT_EQ(handler->received(), (std::vector<std::string>{"text:hello", "binary:" + binary}));

  ws.ws().close(websocket::close_code::normal);
  EXPECT_TRUE(handler->WaitClosed());
  EXPECT_TRUE(conn->closed());
  conn->SendText("after close");  // dropped
}

TEST_F(ServerTest, NegotiatesJupyterSubprotocol) {
  Start();
  WsClient ws;
  ASSERT_FALSE(ws.Connect(server_.port(), Channels(), "foo, v1.kernel.websocket.jupyter.org"));
  EXPECT_EQ(ws.response()[bhttp::field::sec_websocket_protocol], "v1.kernel.websocket.jupyter.org");
  auto [conn, handler] = Accepted(0);
  ASSERT_TRUE(conn);
  EXPECT_EQ(conn->subprotocol(), kJupyterKernelSubprotocol);

  WsClient other;
  ASSERT_FALSE(other.Connect(server_.port(), Channels(), "foo, bar"));
  EXPECT_EQ(other.response().count(bhttp::field::sec_websocket_protocol), 0u);
  EXPECT_EQ(Accepted(1).first->subprotocol(), "");
}

TEST_F(ServerTest, OversizedWebSocketMessageClosesWith1009) {
  ServerOptions options;
  options.max_ws_message_bytes = 1024;
  Start(options);
  WsClient ws;
  ASSERT_FALSE(ws.Connect(server_.port(), Channels()));
  auto [conn, handler] = Accepted(0);
  ws.SendText(std::string(1024, 'a'));
  WsClient::Message m;
  ASSERT_FALSE(ws.Read(&m));
  EXPECT_EQ(m.data.size(), 1024u);

  ws.SendText(std::string(2048, 'a'));
  // The client sees the 1009 close frame; the server may drop the unread rest of the message
  // with the connection, so the client's own teardown can fail after it.
  EXPECT_TRUE(ws.Read(&m));
  EXPECT_EQ(ws.ws().reason().code, websocket::close_code::too_big);
  EXPECT_TRUE(handler->WaitClosed());
}

TEST_F(ServerTest, ServerCloseFlushesQueuedMessagesFirst) {
  Start();
  WsClient ws;
  ASSERT_FALSE(ws.Connect(server_.port(), Channels()));
  auto [conn, handler] = Accepted(0);
  conn->SendText("one");
  conn->SendBinary("two");
  conn->Close(4000, "bye");
  conn->SendText("dropped");
  WsClient::Message m;
  ASSERT_FALSE(ws.Read(&m));
  EXPECT_EQ(m.data, "one");
  ASSERT_FALSE(ws.Read(&m));
  EXPECT_EQ(m.data, "two");
  EXPECT_EQ(ws.Read(&m), websocket::error::closed);
  EXPECT_EQ(ws.ws().reason().code, 4000);
  EXPECT_EQ(ws.ws().reason().reason, "bye");
  EXPECT_TRUE(handler->WaitClosed());
}

TEST_F(ServerTest, HandlerExceptionClosesWith1011) {
  Start();
  WsClient ws;
  ASSERT_FALSE(ws.Connect(server_.port(), Channels()));
  auto [conn, handler] = Accepted(0);
  ws.SendText("throw");
  WsClient::Message m;
  EXPECT_EQ(ws.Read(&m), websocket::error::closed);
  EXPECT_EQ(ws.ws().reason().code, websocket::close_code::internal_error);
  EXPECT_TRUE(handler->WaitClosed());
}

TEST_F(ServerTest, ConcurrentSendsFromManyThreadsArriveWholeAndInOrder) {
  Start();
  WsClient ws;
  ASSERT_FALSE(ws.Connect(server_.port(), Channels()));
  auto [conn, handler] = Accepted(0);
  constexpr int kThreads = 4;
  constexpr int kPerThread = 300;
  std::vector<std::thread> senders;
  for (int t = 0; t < kThreads; ++t) {
    senders.emplace_back([conn = conn, t] {
      for (int i = 0; i < kPerThread; ++i) {
        std::string msg = std::to_string(t) + ":" + std::to_string(i) + ":" +
                          std::string(static_cast<size_t>(i % 7) * 100, 'x');
        if (i % 2 == 0) {
          conn->SendText(std::move(msg));
        } else {
          conn->SendBinary(std::move(msg));
        }
      }
    });
  }
  std::vector<int> next(kThreads, 0);
  for (int n = 0; n < kThreads * kPerThread; ++n) {
    WsClient::Message m;
    ASSERT_FALSE(ws.Read(&m));
    int t = std::stoi(m.data.substr(0, m.data.find(':')));
    int i = std::stoi(m.data.substr(m.data.find(':') + 1));
    ASSERT_EQ(i, next[t]) << "thread " << t;
    EXPECT_EQ(m.text, i % 2 == 0);
    EXPECT_EQ(m.data.size(), m.data.find(':', m.data.find(':') + 1) + 1 + (i % 7) * 100);
    ++next[t];
  }
  for (auto& s : senders) s.join();
  // The last write's completion may trail the client's read of it.
  auto deadline = std::chrono::steady_clock::now() + 5s;
  while (conn->queued_bytes() != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(conn->queued_bytes(), 0u);
}

TEST_F(ServerTest, StopClosesOpenConnectionsPromptly) {
  std::promise<void> entered;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  server_.Route(
      "GET", "/slow",
      [&entered, released](const Request&) {
        entered.set_value();
        released.wait();
        return Response{.body = "{}"};
      },
      RouteOptions{.public_route = true});
  ServerOptions options;
  options.stop_grace = 1s;
  Start(options);

  HttpClient idle(server_.port());
  EXPECT_EQ(idle.Call("GET", "/api/status").status, 200);

  WsClient ws;
  ASSERT_FALSE(ws.Connect(server_.port(), Channels()));
  auto [conn, handler] = Accepted(0);
  WsClient quiet;  // never reads, so it never answers the close
  ASSERT_FALSE(quiet.Connect(server_.port(), Channels()));
  auto [quiet_conn, quiet_handler] = Accepted(1);

  std::thread slow_client([port = server_.port()] {
    HttpClient c(port);
    EXPECT_ANY_THROW(c.Call("GET", "/slow"));
  });
  entered.get_future().wait();

  // The polite client gets a 1001 close while Stop runs.
  std::thread reader([&ws] {
    WsClient::Message m;
    EXPECT_EQ(ws.Read(&m), websocket::error::closed);
    EXPECT_EQ(ws.ws().reason().code, websocket::close_code::going_away);
  });
  std::thread unblock([&release] {
    std::this_thread::sleep_for(300ms);
    release.set_value();
  });
  auto start = std::chrono::steady_clock::now();
  server_.Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  reader.join();
  unblock.join();
  slow_client.join();

  EXPECT_TRUE(idle.ServerClosed());
  EXPECT_EQ(handler->close_calls(), 1);
  EXPECT_EQ(quiet_handler->close_calls(), 1);
  EXPECT_TRUE(conn->closed());
  conn->SendText("after stop");  // dropped, no crash
  conn->Close(1000, "");
  server_.Stop();  // idempotent
}

TEST_F(ServerTest, StopPastGraceStillDeliversOnClose) {
  std::promise<void> entered;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  auto slow_handler = std::make_shared<RecordingHandler>(nullptr, /*echo=*/false);
  server_.WebSocket(
      "/ws/slow",
      [&entered, released, slow_handler](
          const Request&, std::shared_ptr<WsConnection>) -> Result<std::shared_ptr<WsHandler>> {
        entered.set_value();
        released.wait();
        return std::shared_ptr<WsHandler>(slow_handler);
      },
      RouteOptions{.public_route = true});
  ServerOptions options;
  options.stop_grace = 20ms;
  Start(options);

  WsClient quiet;
  ASSERT_FALSE(quiet.Connect(server_.port(), Channels()));
  auto [conn, handler] = Accepted(0);
  std::thread slow_client([port = server_.port()] {
    WsClient c;
    EXPECT_TRUE(c.Connect(port, "/ws/slow"));
  });
  entered.get_future().wait();
  std::thread unblock([&release] {
    std::this_thread::sleep_for(200ms);
    release.set_value();
  });
  server_.Stop();
  unblock.join();
  slow_client.join();
  EXPECT_EQ(handler->close_calls(), 1);
  EXPECT_EQ(slow_handler->close_calls(), 1);
}

TEST(ServerStartTest, ReportsBindFailure) {
  Server first;
  ASSERT_TRUE(first.Start({}).ok());
  Server second;
  ServerOptions options;
  options.port = first.port();
  Status st = second.Start(options);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();

  Server third;
  options.address = "not an address";
  EXPECT_EQ(third.Start(options).code(), StatusCode::kInvalidArgument);
}

TEST(ErrorResponseTest, MapsStatusCodes) {
  EXPECT_EQ(HttpStatusFor(NotFound("x")), 404);
  EXPECT_EQ(HttpStatusFor(Unauthenticated("x")), 403);
  EXPECT_EQ(HttpStatusFor(InvalidArgument("x")), 400);
  EXPECT_EQ(HttpStatusFor(Unavailable("x")), 503);
  EXPECT_EQ(HttpStatusFor(PermissionDenied("x")), 403);
  EXPECT_EQ(HttpStatusFor(Internal("x")), 500);
  Response r = ErrorResponse(NotFound("no such kernel"));
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(json::parse(r.body), (json{{"message", "no such kernel"}}));
}

}  // namespace
}  // namespace nbos::http
