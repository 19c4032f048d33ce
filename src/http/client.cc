// Beast is confined to this file, as in server.cc.
//
// Every operation runs asynchronously on an io_context owned by the call (HttpRequest) or by the
// WsClient (one I/O thread), so a deadline can cancel any stage, name resolution included, and a
// WebSocket can be read and written from different threads without racing inside Beast: all
// stream operations happen on the one I/O thread.
#include "http/client.h"

#include <algorithm>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/websocket.hpp>
#include <cctype>
#include <charconv>
#include <deque>
#include <future>
#include <thread>

#include "common/thread_annotations.h"

namespace nbos::http {
namespace {

namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
namespace websocket = boost::beast::websocket;
namespace net = boost::asio;
using tcp = net::ip::tcp;

// Bounds what a misbehaving server can make us buffer.
constexpr size_t kMaxResponseBody = 256u << 20;
constexpr uint64_t kMaxWsMessage = 1ull << 30;
constexpr std::chrono::seconds kCloseWait{1};

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view Std(beast::string_view s) { return {s.data(), s.size()}; }

std::string HostHeader(const Url& url) {
  std::string host = url.host.find(':') != std::string::npos ? "[" + url.host + "]" : url.host;
  return host + ":" + std::to_string(url.port);
}

Status StatusForHttp(int status, std::string message) {
  switch (status) {
    case 401:
    case 403:
      return Unauthenticated(std::move(message));
    case 404:
      return NotFound(std::move(message));
    case 400:
      return InvalidArgument(std::move(message));
    default:
      return Unavailable(std::move(message));
  }
}

// Runs `ioc` until the started operation chain sets `*done` or `timeout` passes. On timeout,
// `cancel` aborts what is pending and the handlers are drained, so nothing outlives the call.
template <typename Cancel>
bool RunWithDeadline(net::io_context& ioc, const bool* done, std::chrono::milliseconds timeout,
                     Cancel cancel) {
  ioc.run_for(timeout);
  if (*done) return true;
  cancel();
  ioc.restart();
  ioc.run();
  return false;
}

}  // namespace

Result<Url> ParseUrl(std::string_view text) {
  Url url;
  size_t sep = text.find("://");
  if (sep == std::string_view::npos) return InvalidArgument("not a URL: " + std::string(text));
  url.scheme = Lower(text.substr(0, sep));
  if (url.scheme != "http" && url.scheme != "ws") {
    return InvalidArgument("unsupported URL scheme '" + url.scheme + "' (only http and ws)");
  }
  std::string_view rest = text.substr(sep + 3);
  size_t slash = rest.find_first_of("/?");
  std::string_view authority = rest.substr(0, slash);
  url.target = slash == std::string_view::npos ? "/" : std::string(rest.substr(slash));
  if (url.target.front() == '?') url.target.insert(0, "/");
  if (authority.find('@') != std::string_view::npos) {
    return InvalidArgument("credentials in URLs are not supported");
  }
  std::string_view port;
  if (!authority.empty() && authority.front() == '[') {
    size_t close = authority.find(']');
    if (close == std::string_view::npos) return InvalidArgument("bad IPv6 host in URL");
    url.host = std::string(authority.substr(1, close - 1));
    std::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') return InvalidArgument("bad host in URL");
      port = after.substr(1);
    }
  } else {
    size_t colon = authority.rfind(':');
    url.host = std::string(authority.substr(0, colon));
    if (colon != std::string_view::npos) port = authority.substr(colon + 1);
  }
  if (url.host.empty()) return InvalidArgument("URL has no host: " + std::string(text));
  url.port = 80;
  if (!port.empty()) {
    unsigned value = 0;
    auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
    if (ec != std::errc() || end != port.data() + port.size() || value == 0 || value > 65535) {
      return InvalidArgument("bad port in URL: " + std::string(text));
    }
    url.port = static_cast<uint16_t>(value);
  }
  return url;
}

namespace {

// A one-shot request (Connection: close) for `url`.
Result<bhttp::request<bhttp::string_body>> BuildRequest(std::string_view method, const Url& url,
                                                        const Headers& headers,
                                                        std::string_view body) {
  bhttp::verb verb = bhttp::string_to_verb(beast::string_view(method.data(), method.size()));
  if (verb == bhttp::verb::unknown) {
    return InvalidArgument("unknown HTTP method " + std::string(method));
  }
  bhttp::request<bhttp::string_body> req{verb, url.target, 11};
  req.set(bhttp::field::host, HostHeader(url));
  req.set(bhttp::field::user_agent, "nbos");
  for (const auto& [name, value] : headers) req.insert(name, value);
  req.body() = std::string(body);
  if (!body.empty() || verb == bhttp::verb::post || verb == bhttp::verb::put ||
      verb == bhttp::verb::patch) {
    req.prepare_payload();
  }
  req.keep_alive(false);
  return req;
}

// Header names lower-cased; repeated headers joined with ", ".
ClientResponse ToClientResponse(bhttp::response<bhttp::string_body>& res) {
  ClientResponse out;
  out.status = static_cast<int>(res.result_int());
  for (const auto& field : res) {
    auto [it, inserted] =
        out.headers.emplace(Lower(Std(field.name_string())), std::string(Std(field.value())));
    if (!inserted) {
      it->second += ", ";
      it->second += Std(field.value());
    }
  }
  out.body = std::move(res.body());
  return out;
}

}  // namespace

Result<ClientResponse> HttpRequest(std::string_view method, std::string_view url_text,
                                   const Headers& headers, std::string_view body,
                                   std::chrono::milliseconds timeout) {
  auto url = ParseUrl(url_text);
  if (!url.ok()) return url.status();
  auto built = BuildRequest(method, *url, headers, body);
  if (!built.ok()) return built.status();
  bhttp::request<bhttp::string_body>& req = *built;

  net::io_context ioc;
  tcp::resolver resolver(ioc);
  beast::tcp_stream stream(ioc);
  beast::flat_buffer buffer;
  bhttp::response_parser<bhttp::string_body> parser;
  parser.body_limit(kMaxResponseBody);
  bool done = false;
  beast::error_code error;
  const char* stage = "resolving the host";

  auto finish = [&](beast::error_code ec) {
    error = ec;
    done = true;
  };
  resolver.async_resolve(
      url->host, std::to_string(url->port),
      [&](beast::error_code ec, tcp::resolver::results_type results) {
        if (ec) return finish(ec);
        stage = "connecting";
        stream.async_connect(results, [&](beast::error_code ec2, const tcp::endpoint&) {
          if (ec2) return finish(ec2);
          stage = "sending the request";
          bhttp::async_write(stream, req, [&](beast::error_code ec3, size_t) {
            if (ec3) return finish(ec3);
            stage = "reading the response";
            bhttp::async_read(stream, buffer, parser,
                              [&](beast::error_code ec4, size_t) { finish(ec4); });
          });
        });
      });
  bool in_time = RunWithDeadline(ioc, &done, timeout, [&] {
    resolver.cancel();
    beast::error_code ignored;
    stream.socket().close(ignored);
  });
  const std::string where = std::string(method) + " " + std::string(url_text);
  if (!in_time) {
    return Unavailable(where + ": timed out after " + std::to_string(timeout.count()) + " ms " +
                       stage);
  }
  if (error) return Unavailable(where + ": " + error.message() + " while " + stage);

  beast::error_code ignored;
  stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
  return ToClientResponse(parser.get());
}

// ---------------------------------------------------------------------------------------------
// WsClient

struct WsClient::Impl {
  net::io_context ioc;
  // Keeps the I/O thread running for sends once connected; reset by the destructor.
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;
  websocket::stream<beast::tcp_stream> ws{ioc};
  std::thread io_thread;

  // I/O thread only.
  beast::flat_buffer read_buffer;
  struct Outgoing {
    std::string data;
    bool binary = false;
    bool close = false;
    websocket::close_reason reason;
    std::promise<Status> done;
  };
  std::deque<std::unique_ptr<Outgoing>> writes;
  bool writing = false;
  bool closing = false;  // a close was started (by us)
  uint16_t sent_close_code = 1000;

  // Shared with callers.
  mutable Mutex mu;
  CondVar cv;
  std::deque<WsFrame> frames GUARDED_BY(mu);
  std::optional<WsFrame> ended GUARDED_BY(mu);  // the kClose frame once the connection is over

  // The read loop (I/O thread).
  void Read() {
    ws.async_read(read_buffer, [this](beast::error_code ec, size_t) {
      if (ec) {
        // A close we started is finished by its own completion, which has the peer's answer.
        if (closing && writing) return;
        End(CloseFrame(ec));
        return;
      }
      WsFrame frame{ws.got_text() ? WsFrame::Type::kText : WsFrame::Type::kBinary,
                    beast::buffers_to_string(read_buffer.data()), 0};
      read_buffer.consume(read_buffer.size());
      {
        MutexLock lock(&mu);
        frames.push_back(std::move(frame));
      }
      cv.SignalAll();
      Read();
    });
  }

  // The frame that reports the end of the connection after `ec` (I/O thread).
  WsFrame CloseFrame(beast::error_code ec) {
    WsFrame close{WsFrame::Type::kClose, "", 1006};
    const websocket::close_reason& peer = ws.reason();
    if (peer.code != websocket::close_code::none) {
      close.close_code = static_cast<uint16_t>(peer.code);
      close.data = std::string(peer.reason.c_str());
    } else if (closing && !ec) {
      close.close_code = sent_close_code;
    } else {
      close.data = ec ? ec.message() : "connection closed";
    }
    return close;
  }

  // Marks the connection over (I/O thread) and fails what is still queued for writing.
  void End(WsFrame close) EXCLUDES(mu) {
    {
      MutexLock lock(&mu);
      if (!ended) ended = std::move(close);
    }
    cv.SignalAll();
    if (!writing) FailQueued();
    beast::error_code ignored;
    beast::get_lowest_layer(ws).socket().close(ignored);
  }

  void FailQueued() {
    for (auto& w : writes) w->done.set_value(Unavailable("websocket closed"));
    writes.clear();
  }

  bool Ended() const EXCLUDES(mu) {
    MutexLock lock(&mu);
    return ended.has_value();
  }

  // Starts the next queued write (I/O thread). Writes and the close never overlap.
  void Pump() {
    if (writing || writes.empty()) return;
    if (Ended()) return FailQueued();
    writing = true;
    Outgoing* w = writes.front().get();
    auto on_done = [this](beast::error_code ec, auto&&...) {
      writing = false;
      std::unique_ptr<Outgoing> finished = std::move(writes.front());
      writes.pop_front();
      finished->done.set_value(ec ? Unavailable("websocket write failed: " + ec.message())
                                  : Status::Ok());
      if (finished->close || ec) {
        End(CloseFrame(ec));
        return;
      }
      Pump();
    };
    if (w->close) {
      ws.async_close(w->reason, [on_done](beast::error_code ec) { on_done(ec); });
      return;
    }
    ws.binary(w->binary);
    ws.async_write(net::buffer(w->data), on_done);
  }

  // Queues a write from any thread and waits for it. `close` writes a close frame.
  Status Write(std::unique_ptr<Outgoing> w, std::optional<std::chrono::milliseconds> wait) {
    auto done = w->done.get_future();
    net::post(ioc, [this, w = std::move(w)]() mutable {
      if (w->close) {
        if (closing) {
          w->done.set_value(Status::Ok());
          return;
        }
        closing = true;
        sent_close_code = static_cast<uint16_t>(w->reason.code);
      } else if (closing) {
        w->done.set_value(Unavailable("websocket is closing"));
        return;
      }
      writes.push_back(std::move(w));
      Pump();
    });
    if (wait) {
      if (done.wait_for(*wait) != std::future_status::ready) {
        return Unavailable("websocket write timed out");
      }
    }
    return done.get();
  }
};

WsClient::WsClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

WsClient::~WsClient() {
  if (!impl_) return;
  Close(1001, "");
  impl_->work.reset();
  // Whatever is still pending (a peer that never answers the close) is cut off.
  net::post(impl_->ioc, [impl = impl_.get()] {
    beast::error_code ignored;
    beast::get_lowest_layer(impl->ws).socket().close(ignored);
  });
  if (impl_->io_thread.joinable()) impl_->io_thread.join();
}

Result<std::unique_ptr<WsClient>> WsClient::Connect(std::string_view url_text,
                                                    const Headers& headers,
                                                    std::chrono::milliseconds timeout) {
  auto url = ParseUrl(url_text);
  if (!url.ok()) return url.status();
  auto impl = std::make_unique<Impl>();
  Impl* p = impl.get();
  p->ws.set_option(websocket::stream_base::decorator([headers](websocket::request_type& req) {
    req.set(bhttp::field::user_agent, "nbos");
    for (const auto& [name, value] : headers) req.insert(name, value);
  }));
  p->ws.read_message_max(kMaxWsMessage);

  tcp::resolver resolver(p->ioc);
  websocket::response_type response;
  bool done = false;
  beast::error_code error;
  const char* stage = "resolving the host";
  auto finish = [&](beast::error_code ec) {
    error = ec;
    done = true;
  };
  const std::string host = HostHeader(*url);
  auto on_connect = [&](beast::error_code ec, const tcp::endpoint&) {
    if (ec) return finish(ec);
    // Jupyter traffic is many small messages: Nagle's algorithm would hold each one back until
    // the peer's delayed ACK.
    beast::error_code ignored;
    beast::get_lowest_layer(p->ws).socket().set_option(tcp::no_delay(true), ignored);
    stage = "in the websocket handshake";
    p->ws.async_handshake(response, host, url->target, [&](beast::error_code ec2) { finish(ec2); });
  };
  auto on_resolve = [&](beast::error_code ec, tcp::resolver::results_type results) {
    if (ec) return finish(ec);
    stage = "connecting";
    beast::get_lowest_layer(p->ws).async_connect(results, on_connect);
  };
  resolver.async_resolve(url->host, std::to_string(url->port), on_resolve);
  const std::string where = "websocket " + std::string(url_text);
  bool in_time = RunWithDeadline(p->ioc, &done, timeout, [&] {
    resolver.cancel();
    beast::error_code ignored;
    beast::get_lowest_layer(p->ws).socket().close(ignored);
  });
  if (!in_time) {
    return Unavailable(where + ": timed out after " + std::to_string(timeout.count()) + " ms " +
                       stage);
  }
  if (error) {
    if (error == websocket::error::upgrade_declined) {
      int status = static_cast<int>(response.result_int());
      std::string body = response.body();
      if (body.size() > 300) body.resize(300);
      return StatusForHttp(
          status, where + ": HTTP " + std::to_string(status) + (body.empty() ? "" : ": " + body));
    }
    return Unavailable(where + ": " + error.message() + " while " + stage);
  }
  // Beast's own timeouts: none for idle (a kernel may be silent for hours), the suggested ones
  // for the close handshake.
  p->ws.set_option(websocket::stream_base::timeout::suggested(beast::role_type::client));
  p->ioc.restart();
  p->work.emplace(p->ioc.get_executor());
  p->Read();
  p->io_thread = std::thread([p] { p->ioc.run(); });
  return std::unique_ptr<WsClient>(new WsClient(std::move(impl)));
}

Status WsClient::SendText(std::string_view text) {
  auto w = std::make_unique<Impl::Outgoing>();
  w->data = std::string(text);
  return impl_->Write(std::move(w), std::nullopt);
}

Status WsClient::SendBinary(std::string_view data) {
  auto w = std::make_unique<Impl::Outgoing>();
  w->data = std::string(data);
  w->binary = true;
  return impl_->Write(std::move(w), std::nullopt);
}

std::optional<WsFrame> WsClient::Receive(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  MutexLock lock(&impl_->mu);
  while (impl_->frames.empty() && !impl_->ended.has_value() &&
         impl_->cv.WaitUntil(&impl_->mu, deadline)) {
  }
  if (!impl_->frames.empty()) {
    WsFrame f = std::move(impl_->frames.front());
    impl_->frames.pop_front();
    return f;
  }
  if (impl_->ended) return *impl_->ended;
  return std::nullopt;
}

void WsClient::Close(uint16_t code, std::string_view reason) {
  if (!open()) return;
  auto w = std::make_unique<Impl::Outgoing>();
  w->close = true;
  w->reason.code = code;
  w->reason.reason = std::string(reason.substr(0, 123));  // the frame's limit
  (void)impl_->Write(std::move(w), kCloseWait);
  // The peer's close frame ends the read loop; wait for it briefly.
  const auto deadline = std::chrono::steady_clock::now() + kCloseWait;
  MutexLock lock(&impl_->mu);
  while (!impl_->ended.has_value() && impl_->cv.WaitUntil(&impl_->mu, deadline)) {
  }
}

bool WsClient::open() const { return !impl_->Ended(); }

}  // namespace nbos::http
