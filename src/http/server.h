// A small HTTP/1.1 + WebSocket server (Boost.Beast underneath, kept out of this header): routes
// with path captures, an authentication hook, size limits and keep-alive. Used by the gateway to
// serve the Jupyter Kernel Gateway REST and WebSocket API.
//
// Threads: `ServerOptions::threads` I/O threads run all socket work; HTTP handlers, the
// authenticator and WebSocket factories run on a separate pool of `handler_threads`, so a slow
// handler does not stall other connections' I/O. WsHandler callbacks run on the I/O threads
// (serialized per connection) and must not block.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace nbos::http {

// The Jupyter kernel WebSocket subprotocol; the default one a WebSocket route offers.
inline constexpr std::string_view kJupyterKernelSubprotocol = "v1.kernel.websocket.jupyter.org";

// Who sent a request, as the authenticator found it.
struct Identity {
  std::string user;    // "" on public routes, without an authenticator, or for an unnamed caller
  bool admin = false;  // may see and manage what belongs to other users
};

struct Request {
  std::string method;                          // as sent, e.g. "GET"
  std::string target;                          // the request-target as sent, query included
  std::string path;                            // `target` without the query, not percent-decoded
  std::map<std::string, std::string> query;    // decoded; the first of a repeated key wins
  std::map<std::string, std::string> params;   // the route's captures, percent-decoded
  std::map<std::string, std::string> headers;  // lower-case names; repeats joined by ", "
  std::string body;
  std::string remote;  // peer "address:port"
  Identity identity;   // set from the authenticator's answer before the handler runs

  // The header's value, or "" when absent. `name` must be lower-case.
  const std::string& Header(const std::string& name) const;
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";  // no Content-Type header when empty
  std::string body;
  // Extra headers, sent as given (repeats allowed). Content-Length, Connection and Server are
  // set by the server.
  std::vector<std::pair<std::string, std::string>> headers;
};

// The HTTP status a refused request gets: NotFound 404, Unauthenticated and PermissionDenied
// 403, InvalidArgument 400, Unavailable 503, anything else 500.
int HttpStatusFor(const Status& status);
// A JSON error body {"message": message} with `status`.
Response ErrorResponse(int status, std::string_view message);
// ErrorResponse(HttpStatusFor(status), status.message()).
Response ErrorResponse(const Status& status);

using Handler = std::function<Response(const Request&)>;

// The server's side of one open WebSocket. Thread-safe; may be used from any thread and kept
// after the connection or the server has gone (then every call does nothing).
class WsConnection {
 public:
  virtual ~WsConnection() = default;

  // Queue a message. Messages go out in the order queued, one write at a time.
  virtual void SendText(std::string text) = 0;
  virtual void SendBinary(std::string data) = 0;
  // Sends a close frame with `code` (1000 normal, 1001 going away, ...) after the messages
  // already queued; later sends are dropped. Calling it again does nothing.
  virtual void Close(uint16_t code, std::string reason) = 0;

  // The negotiated subprotocol (echoed in Sec-WebSocket-Protocol), or "" when none was chosen.
  virtual const std::string& subprotocol() const = 0;
  virtual const std::string& remote() const = 0;
  // Bytes queued and not yet written; a sender can use it to notice a slow client.
  virtual size_t queued_bytes() const = 0;
  // True once the connection is closing or closed; sends are dropped from then on.
  virtual bool closed() const = 0;
};

// Receives one WebSocket connection's events. Callbacks for one connection never overlap and run
// on an I/O thread. After OnClose (called exactly once, however the connection ends, including
// Server::Stop) no callback follows. An exception from a callback closes the connection with 1011.
class WsHandler {
 public:
  virtual ~WsHandler() = default;
  virtual void OnText(std::string /*text*/) {}
  virtual void OnBinary(std::string /*data*/) {}
  virtual void OnClose() {}
};

// Called (on the handler pool) for an authenticated upgrade request. A non-OK Result refuses the
// upgrade with HttpStatusFor(status) and a JSON body. `conn` may be used (and sent to) at once;
// messages queued before the handshake completes go out after it.
using WsFactory = std::function<Result<std::shared_ptr<WsHandler>>(
    const Request& upgrade_request, std::shared_ptr<WsConnection> conn)>;

// Checks a request before its handler or factory runs and says who sent it (Request::identity).
// A refusal answers with a JSON body {"message": status.message()}: 503 for Unavailable (the
// authenticator could not decide now), 403 for anything else.
using Authenticator = std::function<Result<Identity>(const Request&)>;

struct RouteOptions {
  // Skips the authenticator (health checks, the login page).
  bool public_route = false;
  // WebSocket routes: the subprotocols the server accepts, in its order of preference; the first
  // that the client also offers is chosen. A client that offers none (or none of these) gets a
  // connection without a subprotocol.
  std::vector<std::string> subprotocols = {std::string(kJupyterKernelSubprotocol)};
};

struct ServerOptions {
  std::string address = "127.0.0.1";
  uint16_t port = 0;  // 0: an ephemeral port, see Server::port()
  int threads = 2;    // I/O threads
  int handler_threads = 4;
  size_t max_body_bytes = 64u << 20;        // larger bodies: 413
  size_t max_header_bytes = 64u << 10;      // larger request heads: 431
  size_t max_ws_message_bytes = 64u << 20;  // larger messages: close 1009
  // How long an HTTP connection may sit idle between requests, or take to send one.
  std::chrono::milliseconds read_timeout = std::chrono::seconds(60);
  // A WebSocket with no traffic for this long is pinged; one that stays silent another as long
  // is dropped.
  std::chrono::milliseconds ws_idle_timeout = std::chrono::seconds(300);
  // How long Stop lets WebSockets finish their close handshake before cutting them off.
  std::chrono::milliseconds stop_grace = std::chrono::seconds(2);
};

class Server {
 public:
  Server();
  ~Server();  // Stop()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Routing and the authenticator must be set up before Start and not changed after.
  //
  // `method` is matched exactly ("GET", "POST", ...). Routes are tried in the order added; the
  // first whose pattern and method match wins. A path that matches no route answers 404, one that
  // matches only with other methods 405 (with Allow). Exceptions from `handler` answer 500 with
  // the exception's message. `pattern` must be valid (see PathPattern).
  void Route(std::string method, std::string_view pattern, Handler handler,
             RouteOptions options = {});
  // A WebSocket endpoint. A plain (non-upgrade) request to its path answers 400.
  void WebSocket(std::string_view pattern, WsFactory factory, RouteOptions options = {});
  void SetAuthenticator(Authenticator authenticator);

  // Binds and starts serving. Unavailable when the address cannot be bound; InvalidArgument for
  // a bad address. Call at most once.
  Status Start(const ServerOptions& options);
  // The bound port; 0 before Start.
  uint16_t port() const;

  // Stops accepting, closes every connection (WebSockets with 1001 "going away", within
  // `stop_grace`), waits for running handlers and joins all threads. Idempotent. Must not be
  // called from a handler or a WsHandler callback.
  void Stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nbos::http
