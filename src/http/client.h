// A small synchronous HTTP/1.1 and WebSocket client (Boost.Beast underneath, kept out of this
// header), for the command-line tools that talk to a gateway: `nbos relay` and `nbos run`.
//
// Plain http:// and ws:// only (no TLS). Every call takes a timeout and never blocks longer than
// it (plus name resolution of a host name, which the timeout also bounds).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace nbos::http {

// Header name/value pairs, sent as given (repeats allowed).
using Headers = std::vector<std::pair<std::string, std::string>>;

// An http:// or ws:// URL split into what a request needs.
struct Url {
  std::string scheme;  // "http" or "ws", lower-case
  std::string host;    // without brackets for IPv6 literals
  uint16_t port = 0;   // the scheme's default (80) when the URL has none
  std::string target;  // path and query, "/" when the URL has no path
};

// Errors: InvalidArgument for other schemes (https/wss included: no TLS), a missing host or a bad
// port.
Result<Url> ParseUrl(std::string_view url);

struct ClientResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // lower-case names; repeats joined by ", "
  std::string body;
};

// Sends one request on a fresh connection and reads the whole response. `body` is sent with a
// Content-Length (and no Content-Type unless `headers` has one) when non-empty or when `method`
// is POST/PUT/PATCH. Any HTTP status is a successful Result; errors are transport failures:
// InvalidArgument (bad URL or method), Unavailable (cannot connect, connection broken, timed
// out; the message says which).
Result<ClientResponse> HttpRequest(std::string_view method, std::string_view url,
                                   const Headers& headers, std::string_view body,
                                   std::chrono::milliseconds timeout);

// One received WebSocket frame (a whole message), or the end of the connection.
struct WsFrame {
  enum class Type { kText, kBinary, kClose };
  Type type = Type::kText;
  std::string data;         // the message; for kClose the peer's close reason
  uint16_t close_code = 0;  // kClose: the peer's code, or 1006 when the connection broke
};

// A client WebSocket. Thread-safe: one thread may block in Receive while others send. Messages
// are read in the background as they arrive (so control frames are answered even when nobody
// calls Receive) and queued for Receive without limit.
class WsClient {
 public:
  // Opens a connection with the HTTP upgrade handshake, offering no subprotocol. Errors:
  // InvalidArgument (bad URL), Unavailable (cannot connect, timed out, broken), and for a refused
  // upgrade the HTTP status mapped like HttpStatusFor in reverse (403 Unauthenticated, 404
  // NotFound, 400 InvalidArgument, other Unavailable) with "HTTP <status>: <body>" as message.
  static Result<std::unique_ptr<WsClient>> Connect(std::string_view url, const Headers& headers,
                                                   std::chrono::milliseconds timeout);
  ~WsClient();  // Close(1001, "") and joins the I/O thread
  WsClient(const WsClient&) = delete;
  WsClient& operator=(const WsClient&) = delete;

  // Writes one message and returns once it is written. Unavailable once the connection is
  // closing or broken.
  Status SendText(std::string_view text);
  Status SendBinary(std::string_view data);

  // The next frame, waiting up to `timeout`; nullopt when none came in time. Once the connection
  // has ended, every call returns the same kClose frame at once.
  std::optional<WsFrame> Receive(std::chrono::milliseconds timeout);

  // Starts the close handshake with `code` and waits (up to about a second) for the peer's close.
  // Later sends fail; frames received before the close are still delivered. Idempotent.
  void Close(uint16_t code = 1000, std::string_view reason = "");

  // False once the connection has ended (closed by either side or broken).
  bool open() const;

 private:
  struct Impl;
  explicit WsClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace nbos::http
