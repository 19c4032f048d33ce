// The one translation unit that includes Beast (it takes ~16 s to compile).
//
// Lifetimes: every connection is a session owned by shared_ptrs held by its pending operations.
// The server keeps only weak references (for Stop). A WsConnection given to users refers to its
// session weakly and keeps a copy of the session's strand executor, which must not outlive the
// io_context; sessions and Stop therefore "detach" every connection before the io_context goes.
#include "http/server.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/websocket.hpp>
#include <cctype>
#include <cstdint>
#include <deque>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "common/check.h"
#include "common/thread_annotations.h"
#include "http/router.h"

namespace nbos::http {
namespace {

namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
namespace websocket = boost::beast::websocket;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using BeastRequest = bhttp::request<bhttp::string_body>;
using BeastResponse = bhttp::response<bhttp::string_body>;

// Set on the server's I/O and handler threads, so Stop can catch being called from one of them
// (it would join itself).
thread_local bool tls_server_thread = false;

constexpr std::chrono::seconds kDrainTime{1};
constexpr size_t kDrainBytes = 4u << 20;

struct HttpRoute {
  std::string method;
  PathPattern pattern;
  Handler handler;
  RouteOptions options;
};

struct WsRoute {
  PathPattern pattern;
  WsFactory factory;
  RouteOptions options;
};

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Beast 1.74 uses boost::string_view.
std::string_view Std(beast::string_view s) { return {s.data(), s.size()}; }

std::string Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return std::string(s);
}

std::string RemoteOf(const tcp::socket& socket) {
  beast::error_code ec;
  tcp::endpoint ep = socket.remote_endpoint(ec);
  if (ec) return "?";
  std::string addr = ep.address().to_string();
  if (ep.address().is_v6()) addr = "[" + addr + "]";
  return addr + ":" + std::to_string(ep.port());
}

// Converts Beast's request into ours (the body is moved out). nullopt when the target is not an
// origin-form path or holds a bad percent escape; `*segments` receives the decoded path.
std::optional<Request> ToRequest(BeastRequest& in, const std::string& remote,
                                 std::vector<std::string>* segments) {
  Request out;
  out.method = std::string(in.method_string());
  out.target = std::string(in.target());
  size_t q = out.target.find('?');
  out.path = out.target.substr(0, q);
  auto split = SplitPath(out.path);
  if (!split) return std::nullopt;
  *segments = std::move(*split);
  if (q != std::string::npos) {
    auto query = ParseQuery(std::string_view(out.target).substr(q + 1));
    if (!query) return std::nullopt;
    out.query = std::move(*query);
  }
  for (const auto& field : in) {
    std::string name = Lower(Std(field.name_string()));
    auto [it, inserted] = out.headers.emplace(std::move(name), std::string(field.value()));
    if (!inserted) {
      it->second += ", ";
      it->second += Std(field.value());
    }
  }
  out.body = std::move(in.body());
  out.remote = remote;
  return out;
}

BeastResponse ToBeastResponse(Response r, unsigned version, bool keep_alive) {
  if (r.status < 100 || r.status > 999) {
    spdlog::error("http: handler returned invalid status {}", r.status);
    r = ErrorResponse(500, "invalid response status");
  }
  BeastResponse res{static_cast<bhttp::status>(r.status), version};
  res.set(bhttp::field::server, "nbos");
  // These statuses must not carry a body; Beast's prepare_payload throws on one.
  bool bodiless = r.status < 200 || r.status == 204 || r.status == 304;
  if (bodiless) {
    r.body.clear();
  } else if (!r.content_type.empty()) {
    res.set(bhttp::field::content_type, r.content_type);
  }
  for (auto& [name, value] : r.headers) res.insert(name, value);
  res.body() = std::move(r.body);
  res.keep_alive(keep_alive);
  res.prepare_payload();
  return res;
}

class SessionBase;

// What the server and its sessions share. Sessions hold it by shared_ptr: their destructors run
// on whichever thread drops the last reference, possibly while Server::Impl is being torn down.
struct Shared {
  ServerOptions options;
  std::vector<HttpRoute> routes;
  std::vector<WsRoute> ws_routes;
  Authenticator authenticator;
  std::unique_ptr<net::thread_pool> pool;

  Mutex mu;
  CondVar cv;  // signalled when a session unregisters
  bool stopping GUARDED_BY(mu) = false;
  uint64_t next_id GUARDED_BY(mu) = 1;
  std::map<uint64_t, std::weak_ptr<SessionBase>> sessions GUARDED_BY(mu);

  // False once Stop has begun; the caller then drops the session.
  bool Register(const std::shared_ptr<SessionBase>& session) EXCLUDES(mu);
  void Unregister(uint64_t id) EXCLUDES(mu);

  // Sets req.identity; a refusal is Unauthenticated, or Unavailable when the authenticator
  // could not decide now.
  Status Authenticate(Request& req, const RouteOptions& route_options) const {
    if (route_options.public_route || !authenticator) return Status::Ok();
    Result<Identity> who = authenticator(req);
    if (who.ok()) {
      req.identity = std::move(*who);
      return Status::Ok();
    }
    const std::string& message = who.status().message();
    if (who.status().code() == StatusCode::kUnavailable) return who.status();
    return Unauthenticated(message.empty() ? "forbidden" : message);
  }

  const WsRoute* MatchWs(const std::vector<std::string>& segments,
                         std::map<std::string, std::string>* params) const {
    for (const WsRoute& route : ws_routes) {
      if (route.pattern.Match(segments, params)) return &route;
    }
    return nullptr;
  }

  // Runs on the handler pool.
  Response Dispatch(Request& req, const std::vector<std::string>& segments) const {
    std::set<std::string> allowed;
    for (const HttpRoute& route : routes) {
      std::map<std::string, std::string> params;
      if (!route.pattern.Match(segments, &params)) continue;
      if (route.method != req.method) {
        allowed.insert(route.method);
        continue;
      }
      req.params = std::move(params);
      try {
        if (Status st = Authenticate(req, route.options); !st.ok()) return ErrorResponse(st);
        return route.handler(req);
      } catch (const std::exception& e) {
        spdlog::warn("http: {} {} failed: {}", req.method, req.path, e.what());
        return ErrorResponse(500, e.what());
      } catch (...) {
        spdlog::warn("http: {} {} failed with a non-standard exception", req.method, req.path);
        return ErrorResponse(500, "internal error");
      }
    }
    if (!allowed.empty()) {
      Response r = ErrorResponse(405, "Method Not Allowed: " + req.method + " " + req.path);
      std::string allow;
      for (const std::string& m : allowed) allow += (allow.empty() ? "" : ", ") + m;
      r.headers.emplace_back("Allow", allow);
      return r;
    }
    std::map<std::string, std::string> ignored;
    if (MatchWs(segments, &ignored) != nullptr) {
      return ErrorResponse(400, "WebSocket upgrade required: " + req.path);
    }
    return ErrorResponse(404, "Not Found: " + req.path);
  }
};

class SessionBase : public std::enable_shared_from_this<SessionBase> {
 public:
  explicit SessionBase(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}
  virtual ~SessionBase() { shared_->Unregister(id_); }
  SessionBase(const SessionBase&) = delete;
  SessionBase& operator=(const SessionBase&) = delete;

  // Both thread-safe. Abort closes the connection (a WebSocket politely); Detach cuts a
  // WsConnection loose before the io_context is destroyed.
  virtual void Abort() = 0;
  virtual void Detach() {}
  // Ends the session at once; only for Stop, after every server thread has been joined.
  virtual void ForceFinish() {}

  uint64_t id_ = 0;  // set by Register, before any other thread sees the session

 protected:
  std::shared_ptr<Shared> shared_;
};

bool Shared::Register(const std::shared_ptr<SessionBase>& session) {
  MutexLock lock(&mu);
  if (stopping) return false;
  session->id_ = next_id++;
  sessions.emplace(session->id_, session);
  return true;
}

void Shared::Unregister(uint64_t id) {
  if (id == 0) return;
  MutexLock lock(&mu);
  sessions.erase(id);
  cv.SignalAll();
}

class WsSession;

class WsConnImpl final : public WsConnection {
 public:
  WsConnImpl(net::any_io_executor executor, std::string subprotocol, std::string remote)
      : executor_(std::move(executor)),
        subprotocol_(std::move(subprotocol)),
        remote_(std::move(remote)) {}

  void SetSession(std::weak_ptr<WsSession> session) { session_ = std::move(session); }

  void SendText(std::string text) override { Send(false, std::move(text)); }
  void SendBinary(std::string data) override { Send(true, std::move(data)); }
  void Close(uint16_t code, std::string reason) override;

  const std::string& subprotocol() const override { return subprotocol_; }
  const std::string& remote() const override { return remote_; }
  size_t queued_bytes() const override { return queued_.load(); }
  bool closed() const override { return closed_.load(); }

  void MarkClosed() { closed_ = true; }
  void Dequeued(size_t n) { queued_ -= n; }
  void Detach() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    closed_ = true;
    executor_.reset();
  }

 private:
  void Send(bool binary, std::string data) EXCLUDES(mu_);

  mutable Mutex mu_;
  // The session's strand; reset by Detach.
  std::optional<net::any_io_executor> executor_ GUARDED_BY(mu_);
  std::weak_ptr<WsSession> session_;  // set once, before the factory sees `this`
  const std::string subprotocol_;
  const std::string remote_;
  std::atomic<size_t> queued_{0};
  std::atomic<bool> closed_{false};
};

class WsSession final : public SessionBase {
 public:
  WsSession(std::shared_ptr<Shared> shared, beast::tcp_stream stream, BeastRequest upgrade,
            Request request, const WsRoute* route, std::string subprotocol)
      : SessionBase(std::move(shared)),
        ws_(std::move(stream)),
        upgrade_(std::move(upgrade)),
        request_(std::move(request)),
        route_(route),
        conn_(std::make_shared<WsConnImpl>(ws_.get_executor(), std::move(subprotocol),
                                           request_.remote)) {}

  ~WsSession() override { conn_->Detach(); }

  void Run() {
    conn_->SetSession(std::static_pointer_cast<WsSession>(shared_from_this()));
    net::post(*shared_->pool, [self = Self()] {
      tls_server_thread = true;
      Result<std::shared_ptr<WsHandler>> result = self->MakeHandler();
      {
        MutexLock lock(&self->factory_mu_);
        self->factory_result_.emplace(std::move(result));
      }
      net::post(self->ws_.get_executor(), [self] { self->OnFactory(); });
    });
  }

  void Abort() override {
    net::post(ws_.get_executor(), [self = Self()] { self->DoAbort(); });
  }
  void Detach() override { conn_->Detach(); }

  void ForceFinish() override {
    // A factory that finished after the io_context stopped has made a handler that is owed its
    // OnClose.
    if (auto result = TakeFactoryResult(); result && result->ok()) {
      handler_ = std::move(*result).value();
    }
    Finish();
    beast::error_code ignored;
    beast::get_lowest_layer(ws_).socket().close(ignored);
  }

  // The rest run on the strand.
  void Enqueue(bool binary, std::string data) {
    if (state_ > State::kOpen || close_request_) {
      conn_->Dequeued(data.size());
      return;
    }
    queue_.push_back({binary, std::move(data)});
    MaybeWrite();
  }

  void RequestClose(uint16_t code, std::string reason) {
    if (state_ > State::kOpen || close_request_) return;
    close_request_.emplace(code, std::move(reason));
    MaybeWrite();
  }

 private:
  enum class State { kFactory, kHandshake, kOpen, kClosing, kDone };
  struct Outgoing {
    bool binary;
    std::string data;
  };

  std::shared_ptr<WsSession> Self() {
    return std::static_pointer_cast<WsSession>(shared_from_this());
  }

  // On the handler pool.
  Result<std::shared_ptr<WsHandler>> MakeHandler() {
    try {
      if (Status st = shared_->Authenticate(request_, route_->options); !st.ok()) return st;
      Result<std::shared_ptr<WsHandler>> result = route_->factory(request_, conn_);
      if (result.ok() && result.value() == nullptr) return Internal("no WebSocket handler");
      return result;
    } catch (const std::exception& e) {
      spdlog::warn("http: WebSocket {} failed: {}", request_.path, e.what());
      return Internal(e.what());
    } catch (...) {
      return Internal("internal error");
    }
  }

  std::optional<Result<std::shared_ptr<WsHandler>>> TakeFactoryResult() EXCLUDES(factory_mu_) {
    MutexLock lock(&factory_mu_);
    return std::exchange(factory_result_, std::nullopt);
  }

  void OnFactory() {
    std::optional<Result<std::shared_ptr<WsHandler>>> taken = TakeFactoryResult();
    if (!taken) return;
    Result<std::shared_ptr<WsHandler>>& result = *taken;
    if (!result.ok()) {
      conn_->MarkClosed();
      state_ = State::kDone;
      if (aborted_) return;
      Refuse(result.status());
      return;
    }
    handler_ = std::move(result).value();
    if (aborted_) return Finish();
    state_ = State::kHandshake;
    const ServerOptions& opt = shared_->options;
    beast::get_lowest_layer(ws_).expires_never();
    websocket::stream_base::timeout timeouts;
    timeouts.handshake_timeout = opt.read_timeout;
    timeouts.idle_timeout = opt.ws_idle_timeout;
    timeouts.keep_alive_pings = true;
    ws_.set_option(timeouts);
    ws_.read_message_max(opt.max_ws_message_bytes);
    ws_.set_option(websocket::stream_base::decorator(
        [proto = conn_->subprotocol()](websocket::response_type& res) {
          res.set(bhttp::field::server, "nbos");
          if (!proto.empty()) res.set(bhttp::field::sec_websocket_protocol, proto);
        }));
    ws_.async_accept(upgrade_, [self = Self()](beast::error_code ec) { self->OnAccept(ec); });
  }

  // Answers the upgrade request with an HTTP error and closes.
  void Refuse(const Status& status) {
    refusal_.emplace(ToBeastResponse(ErrorResponse(status), upgrade_.version(),
                                     /*keep_alive=*/false));
    auto& stream = beast::get_lowest_layer(ws_);
    stream.expires_after(shared_->options.read_timeout);
    bhttp::async_write(stream, *refusal_, [self = Self()](beast::error_code, size_t) {
      beast::error_code ignored;
      beast::get_lowest_layer(self->ws_).socket().shutdown(tcp::socket::shutdown_send, ignored);
      beast::get_lowest_layer(self->ws_).close();
    });
  }

  void OnAccept(beast::error_code ec) {
    if (ec) {
      spdlog::debug("http: WebSocket handshake with {} failed: {}", request_.remote, ec.message());
      return Finish();
    }
    if (aborted_) {
      state_ = State::kOpen;
      return StartClose(websocket::close_code::going_away, "server shutting down");
    }
    state_ = State::kOpen;
    DoRead();
    MaybeWrite();
  }

  void DoRead() {
    ws_.async_read(read_buffer_,
                   [self = Self()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

  void OnRead(beast::error_code ec) {
    if (ec) {
      if (ec != websocket::error::closed) {
        spdlog::debug("http: WebSocket {} from {} ended: {}", request_.path, request_.remote,
                      ec.message());
      }
      Finish();
      // After a peer's close or an oversized message Beast has already done the close
      // handshake; whatever else went wrong, the socket is of no further use.
      if (state_ == State::kDone && !writing_) {
        beast::error_code ignored;
        beast::get_lowest_layer(ws_).socket().close(ignored);
      }
      return;
    }
    std::string message = beast::buffers_to_string(read_buffer_.data());
    read_buffer_.consume(read_buffer_.size());
    if (state_ == State::kOpen || state_ == State::kClosing) {
      try {
        if (ws_.got_text()) {
          handler_->OnText(std::move(message));
        } else {
          handler_->OnBinary(std::move(message));
        }
      } catch (const std::exception& e) {
        spdlog::warn("http: WebSocket handler for {} threw: {}", request_.path, e.what());
        StartCloseIfOpen(websocket::close_code::internal_error, "internal error");
      } catch (...) {
        StartCloseIfOpen(websocket::close_code::internal_error, "internal error");
      }
    }
    DoRead();
  }

  void MaybeWrite() {
    if (state_ != State::kOpen || writing_) return;
    if (queue_.empty()) {
      if (close_request_) StartClose(close_request_->first, close_request_->second);
      return;
    }
    writing_ = true;
    ws_.binary(queue_.front().binary);
    ws_.async_write(net::buffer(queue_.front().data),
                    [self = Self()](beast::error_code ec, size_t) { self->OnWrite(ec); });
  }

  void OnWrite(beast::error_code ec) {
    writing_ = false;
    conn_->Dequeued(queue_.front().data.size());
    queue_.pop_front();
    if (ec) {
      // The pending read fails too once the socket is gone, and ends the session.
      beast::error_code ignored;
      beast::get_lowest_layer(ws_).socket().close(ignored);
      return;
    }
    MaybeWrite();
  }

  void StartCloseIfOpen(uint16_t code, std::string_view reason) {
    if (state_ == State::kOpen) StartClose(code, reason);
  }

  void StartClose(uint16_t code, std::string_view reason) {
    state_ = State::kClosing;
    conn_->MarkClosed();
    ws_.async_close(websocket::close_reason(static_cast<websocket::close_code>(code),
                                            beast::string_view(reason.data(), reason.size())),
                    [self = Self()](beast::error_code ec) {
                      if (ec) {
                        beast::error_code ignored;
                        beast::get_lowest_layer(self->ws_).socket().close(ignored);
                      }
                    });
  }

  void DoAbort() {
    aborted_ = true;
    switch (state_) {
      case State::kFactory:  // OnFactory sees aborted_
        break;
      case State::kHandshake:
        beast::get_lowest_layer(ws_).close();
        break;
      case State::kOpen: {
        // The close handshake uses the handshake timeout; keep it within Stop's grace.
        websocket::stream_base::timeout timeouts;
        timeouts.handshake_timeout = shared_->options.stop_grace / 2;
        timeouts.idle_timeout = websocket::stream_base::none();
        timeouts.keep_alive_pings = false;
        ws_.set_option(timeouts);
        StartClose(websocket::close_code::going_away, "server shutting down");
        break;
      }
      case State::kClosing:
      case State::kDone:
        if (refusal_) beast::get_lowest_layer(ws_).close();
        break;
    }
  }

  // Delivers OnClose once; the session then lives only as long as its remaining operations.
  void Finish() {
    if (finished_) return;
    finished_ = true;
    state_ = State::kDone;
    conn_->MarkClosed();
    if (!handler_) return;
    try {
      handler_->OnClose();
    } catch (const std::exception& e) {
      spdlog::warn("http: WebSocket OnClose for {} threw: {}", request_.path, e.what());
    } catch (...) {
    }
    // The handler often holds the connection; dropping it here breaks that cycle early.
    handler_.reset();
  }

  websocket::stream<beast::tcp_stream> ws_;
  BeastRequest upgrade_;
  Request request_;  // identity set by MakeHandler, on the handler pool, before the factory runs
  const WsRoute* const route_;
  const std::shared_ptr<WsConnImpl> conn_;
  std::shared_ptr<WsHandler> handler_;
  beast::flat_buffer read_buffer_;
  std::deque<Outgoing> queue_;
  bool writing_ = false;
  bool aborted_ = false;
  bool finished_ = false;
  State state_ = State::kFactory;
  std::optional<std::pair<uint16_t, std::string>> close_request_;
  std::optional<BeastResponse> refusal_;
  Mutex factory_mu_;  // the handler pool hands the factory's result over through here
  std::optional<Result<std::shared_ptr<WsHandler>>> factory_result_ GUARDED_BY(factory_mu_);
};

void WsConnImpl::Send(bool binary, std::string data) {
  MutexLock lock(&mu_);
  if (!executor_ || closed_) return;
  queued_ += data.size();
  net::post(*executor_, [session = session_, binary, data = std::move(data)]() mutable {
    if (auto s = session.lock()) s->Enqueue(binary, std::move(data));
  });
}

void WsConnImpl::Close(uint16_t code, std::string reason) {
  MutexLock lock(&mu_);
  if (!executor_ || closed_) return;
  closed_ = true;
  net::post(*executor_, [session = session_, code, reason = std::move(reason)]() mutable {
    if (auto s = session.lock()) s->RequestClose(code, std::move(reason));
  });
}

// Chooses the first of the route's subprotocols that the client offers.
std::string ChooseSubprotocol(const Request& req, const RouteOptions& options) {
  auto it = req.headers.find("sec-websocket-protocol");
  if (it == req.headers.end()) return "";
  std::set<std::string> offered;
  std::string_view rest = it->second;
  while (!rest.empty()) {
    size_t comma = rest.find(',');
    offered.insert(Trim(rest.substr(0, comma)));
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
  }
  for (const std::string& p : options.subprotocols) {
    if (offered.count(p) != 0) return p;
  }
  return "";
}

class HttpSession final : public SessionBase {
 public:
  HttpSession(std::shared_ptr<Shared> shared, tcp::socket socket)
      : SessionBase(std::move(shared)), remote_(RemoteOf(socket)), stream_(std::move(socket)) {}

  void Run() {
    net::dispatch(stream_.get_executor(), [self = Self()] { self->ReadHeader(); });
  }

  void Abort() override {
    net::post(executor_, [self = Self()] {
      self->aborted_ = true;
      if (self->upgraded_) return;
      beast::error_code ignored;
      self->stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
      self->stream_.close();
    });
  }

 private:
  std::shared_ptr<HttpSession> Self() {
    return std::static_pointer_cast<HttpSession>(shared_from_this());
  }

  void ReadHeader() {
    if (aborted_) return;
    parser_.emplace();
    parser_->header_limit(
        static_cast<uint32_t>(std::min<size_t>(shared_->options.max_header_bytes, UINT32_MAX)));
    parser_->body_limit(shared_->options.max_body_bytes);
    stream_.expires_after(shared_->options.read_timeout);
    bhttp::async_read_header(stream_, buffer_, *parser_,
                             [self = Self()](beast::error_code ec, size_t) { self->OnHeader(ec); });
  }

  void OnHeader(beast::error_code ec) {
    if (ec) return OnReadError(ec);
    const auto& req = parser_->get();
    if (!parser_->is_done() && beast::iequals(req[bhttp::field::expect], "100-continue")) {
      net::async_write(stream_, net::buffer(kContinue),
                       [self = Self()](beast::error_code wec, size_t) {
                         if (wec) return self->Close();
                         self->ReadBody();
                       });
      return;
    }
    ReadBody();
  }

  void ReadBody() {
    bhttp::async_read(stream_, buffer_, *parser_,
                      [self = Self()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

  void OnReadError(beast::error_code ec) {
    if (ec == bhttp::error::end_of_stream) return Close();
    if (ec == bhttp::error::body_limit) {
      return WriteError(413, "request body exceeds " +
                                 std::to_string(shared_->options.max_body_bytes) + " bytes");
    }
    if (ec == bhttp::error::header_limit) return WriteError(431, "request header too large");
    if (ec.category() == bhttp::make_error_code(bhttp::error::bad_method).category()) {
      return WriteError(400, "malformed request: " + ec.message());
    }
    if (ec != beast::error::timeout && ec != net::error::operation_aborted) {
      spdlog::debug("http: connection from {} failed: {}", remote_, ec.message());
    }
    Close();
  }

  void OnRead(beast::error_code ec) {
    if (ec) return OnReadError(ec);
    stream_.expires_never();
    BeastRequest req = parser_->release();
    unsigned version = req.version();
    bool keep_alive = req.keep_alive();
    std::vector<std::string> segments;
    std::optional<Request> request = ToRequest(req, remote_, &segments);
    if (!request) return WriteError(400, "malformed request target");
    if (websocket::is_upgrade(req)) {
      std::map<std::string, std::string> params;
      if (const WsRoute* route = shared_->MatchWs(segments, &params)) {
        request->params = std::move(params);
        return Upgrade(std::move(req), std::move(*request), route);
      }
    }
    net::post(*shared_->pool, [self = Self(), request = std::move(*request),
                               segments = std::move(segments), version, keep_alive]() mutable {
      tls_server_thread = true;
      Response response = self->shared_->Dispatch(request, segments);
      spdlog::debug("http: {} {} {} -> {}", request.remote, request.method, request.path,
                    response.status);
      net::post(self->executor_,
                [self, response = std::move(response), version, keep_alive]() mutable {
                  self->Write(std::move(response), version, keep_alive);
                });
    });
  }

  void Upgrade(BeastRequest req, Request request, const WsRoute* route) {
    upgraded_ = true;
    std::string subprotocol = ChooseSubprotocol(request, route->options);
    stream_.expires_never();
    auto ws = std::make_shared<WsSession>(shared_, std::move(stream_), std::move(req),
                                          std::move(request), route, std::move(subprotocol));
    if (shared_->Register(ws)) ws->Run();
  }

  void Write(Response response, unsigned version, bool keep_alive) {
    if (aborted_) return;
    bool stopping;
    {
      MutexLock lock(&shared_->mu);
      stopping = shared_->stopping;
    }
    response_.emplace(ToBeastResponse(std::move(response), version, keep_alive && !stopping));
    stream_.expires_after(shared_->options.read_timeout);
    bhttp::async_write(stream_, *response_, [self = Self()](beast::error_code ec, size_t) {
      if (ec) return self->Close();
      if (self->response_->need_eof()) return self->CloseAfterResponse();
      self->response_.reset();
      self->ReadHeader();
    });
  }

  // For requests the parser rejected: what follows in the stream cannot be trusted, so the
  // connection closes after the answer.
  void WriteError(int status, std::string message) {
    // A request that failed to parse may not have a usable version.
    unsigned version = parser_ && parser_->get().version() == 10 ? 10 : 11;
    Write(ErrorResponse(status, message), version, /*keep_alive=*/false);
  }

  // Half-closes, then reads and drops what the client still sends (for a while), so a client
  // that is still uploading gets to read our answer instead of a connection reset.
  void CloseAfterResponse() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.expires_after(kDrainTime);
    Drain();
  }

  void Drain() {
    stream_.async_read_some(net::buffer(drain_buffer_),
                            [self = Self()](beast::error_code ec, size_t n) {
                              self->drained_ += n;
                              if (ec || self->drained_ > kDrainBytes) return self->Close();
                              self->Drain();
                            });
  }

  void Close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

  static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";

  const std::string remote_;
  beast::tcp_stream stream_;
  const net::any_io_executor executor_ = stream_.get_executor();
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::optional<BeastResponse> response_;
  std::array<char, 16384> drain_buffer_;
  size_t drained_ = 0;
  bool aborted_ = false;
  bool upgraded_ = false;  // stream_ moved into a WsSession
};

}  // namespace

const std::string& Request::Header(const std::string& name) const {
  static const std::string kEmpty;
  auto it = headers.find(name);
  return it == headers.end() ? kEmpty : it->second;
}

int HttpStatusFor(const Status& status) {
  switch (status.code()) {
    case StatusCode::kNotFound:
      return 404;
    case StatusCode::kUnauthenticated:
    case StatusCode::kPermissionDenied:
      return 403;
    case StatusCode::kInvalidArgument:
      return 400;
    case StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

Response ErrorResponse(int status, std::string_view message) {
  Response r;
  r.status = status;
  r.body = nlohmann::json{{"message", message}}.dump(-1, ' ', false,
                                                     nlohmann::json::error_handler_t::replace);
  return r;
}

Response ErrorResponse(const Status& status) {
  return ErrorResponse(HttpStatusFor(status), status.message());
}

struct Server::Impl {
  std::shared_ptr<Shared> shared = std::make_shared<Shared>();
  std::unique_ptr<net::io_context> ioc;
  std::unique_ptr<tcp::acceptor> acceptor;
  std::unique_ptr<net::steady_timer> accept_retry;
  std::vector<std::thread> threads;
  std::atomic<uint16_t> port{0};
  bool started = false;
  bool stopped = false;

  void DoAccept() {
    acceptor->async_accept(net::make_strand(*ioc), [this](beast::error_code ec, tcp::socket s) {
      if (ec == net::error::operation_aborted || !acceptor->is_open()) return;
      if (ec) {
        // Typically out of file descriptors; pausing avoids spinning on the error.
        spdlog::warn("http: accept failed: {}", ec.message());
        accept_retry->expires_after(std::chrono::milliseconds(100));
        accept_retry->async_wait([this](beast::error_code wec) {
          if (!wec && acceptor->is_open()) DoAccept();
        });
        return;
      }
      // Jupyter traffic is many small messages: Nagle's algorithm would hold each one back
      // until the peer's delayed ACK (~40 ms) arrives.
      beast::error_code nodelay_ec;
      s.set_option(tcp::no_delay(true), nodelay_ec);
      auto session = std::make_shared<HttpSession>(shared, std::move(s));
      if (shared->Register(session)) session->Run();
      DoAccept();
    });
  }
};

Server::Server() : impl_(std::make_unique<Impl>()) {}

Server::~Server() { Stop(); }

void Server::Route(std::string method, std::string_view pattern, Handler handler,
                   RouteOptions options) {
  // The server threads read the route table without a lock once started.
  NBOS_CHECK(!impl_->started, "routes must be added before Start");
  auto parsed = PathPattern::Parse(pattern);
  assert(parsed && "malformed route pattern");
  if (!parsed) {
    spdlog::error("http: ignoring malformed route pattern {}", pattern);
    return;
  }
  impl_->shared->routes.push_back(
      {std::move(method), std::move(*parsed), std::move(handler), std::move(options)});
}

void Server::WebSocket(std::string_view pattern, WsFactory factory, RouteOptions options) {
  // The server threads read the route table without a lock once started.
  NBOS_CHECK(!impl_->started, "routes must be added before Start");
  auto parsed = PathPattern::Parse(pattern);
  assert(parsed && "malformed route pattern");
  if (!parsed) {
    spdlog::error("http: ignoring malformed WebSocket pattern {}", pattern);
    return;
  }
  impl_->shared->ws_routes.push_back({std::move(*parsed), std::move(factory), std::move(options)});
}

void Server::SetAuthenticator(Authenticator authenticator) {
  NBOS_CHECK(!impl_->started, "the authenticator must be set before Start");
  impl_->shared->authenticator = std::move(authenticator);
}

Status Server::Start(const ServerOptions& options) {
  Impl& im = *impl_;
  NBOS_CHECK(!im.started, "Start is called once");
  im.started = true;
  im.shared->options = options;
  beast::error_code ec;
  net::ip::address address = net::ip::make_address(options.address, ec);
  if (ec) return InvalidArgument("bad listen address '" + options.address + "'");

  im.ioc = std::make_unique<net::io_context>(std::max(1, options.threads));
  im.acceptor = std::make_unique<tcp::acceptor>(net::make_strand(*im.ioc));
  im.accept_retry = std::make_unique<net::steady_timer>(im.acceptor->get_executor());
  tcp::endpoint endpoint(address, options.port);
  im.acceptor->open(endpoint.protocol(), ec);
  if (!ec) im.acceptor->set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) im.acceptor->bind(endpoint, ec);
  if (!ec) im.acceptor->listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    std::string what = "cannot listen on " + options.address + ":" + std::to_string(options.port) +
                       ": " + ec.message();
    im.accept_retry.reset();
    im.acceptor.reset();
    im.ioc.reset();
    return Unavailable(what);
  }
  im.port = im.acceptor->local_endpoint().port();
  im.shared->pool = std::make_unique<net::thread_pool>(std::max(1, options.handler_threads));
  im.DoAccept();
  for (int i = 0; i < std::max(1, options.threads); ++i) {
    im.threads.emplace_back([ioc = im.ioc.get()] {
      tls_server_thread = true;
      ioc->run();
    });
  }
  spdlog::info("http: listening on {}:{}", options.address, im.port.load());
  return Status::Ok();
}

uint16_t Server::port() const { return impl_->port.load(); }

void Server::Stop() {
  Impl& im = *impl_;
  if (!im.ioc || im.stopped) return;
  NBOS_CHECK(!tls_server_thread, "Stop called from a server thread would join itself");
  im.stopped = true;
  Shared& shared = *im.shared;

  auto live_sessions = [&shared] {
    std::vector<std::shared_ptr<SessionBase>> live;
    MutexLock lock(&shared.mu);
    for (auto& [id, weak] : shared.sessions) {
      if (auto s = weak.lock()) live.push_back(std::move(s));
    }
    return live;
  };

  {
    MutexLock lock(&shared.mu);
    shared.stopping = true;
  }
  net::post(im.acceptor->get_executor(), [&im] {
    beast::error_code ignored;
    im.acceptor->close(ignored);
    im.accept_retry->cancel();
  });
  for (auto& s : live_sessions()) s->Abort();
  {
    const auto deadline = std::chrono::steady_clock::now() + shared.options.stop_grace;
    MutexLock lock(&shared.mu);
    while (!shared.sessions.empty() && shared.cv.WaitUntil(&shared.mu, deadline)) {
    }
  }
  // Whatever is left (a handler still running, a peer that never answered our close) is cut off.
  for (auto& s : live_sessions()) s->Detach();
  im.ioc->stop();
  for (std::thread& t : im.threads) t.join();
  im.threads.clear();
  shared.pool->join();
  for (auto& s : live_sessions()) s->ForceFinish();
  // Handlers left in the stopped io_context own the remaining sessions; destroying the
  // io_context destroys them, after the sockets' owner (the acceptor) is gone.
  im.accept_retry.reset();
  im.acceptor.reset();
  im.ioc.reset();
  shared.pool.reset();
  spdlog::info("http: stopped");
}

}  // namespace nbos::http
