// One kernel on an nbos gateway, seen from a client tool (`nbos relay`, `nbos run`): started with
// POST /api/kernels, talked to over its /channels WebSocket (legacy JSON framing), interrupted,
// restarted and deleted over REST. A dropped WebSocket is reopened with backoff and the kernel
// kept; messages sent meanwhile are queued and go out, in order, once it is back. (A message
// already written when the connection breaks may be lost: the WebSocket has no acknowledgements.)
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "common/status.h"
#include "jupyter/websocket_codec.h"

namespace nbos::relay {

struct GatewayOptions {
  std::string url;    // http://host:port, optionally with a base path
  std::string token;  // sent as "Authorization: token <token>"; empty sends none
  std::string kernel_name = "nbos";
  std::map<std::string, std::string> env;  // the "env" of POST /api/kernels
  // POST /api/kernels waits for the kernel's replicas to start.
  std::chrono::milliseconds start_timeout = std::chrono::seconds(120);
  std::chrono::milliseconds request_timeout = std::chrono::seconds(30);
  std::chrono::milliseconds connect_timeout = std::chrono::seconds(30);
  // How long to keep reopening a dropped WebSocket before giving the kernel up.
  std::chrono::milliseconds reconnect_for = std::chrono::minutes(5);
  std::chrono::milliseconds backoff_initial = std::chrono::milliseconds(250);
  std::chrono::milliseconds backoff_max = std::chrono::seconds(5);
};

// The KERNEL_* variables of `environ` (a NULL-terminated "KEY=VALUE" array, like ::environ),
// the convention jupyter_server uses for what a gateway kernel gets.
std::map<std::string, std::string> KernelEnvFrom(char** environ_vars);

class GatewayLink {
 public:
  // Called on the link's reader thread, in the order the gateway sent them.
  using OnMessage = std::function<void(jupyter::WsMessage)>;
  // Called once (reader thread) when the kernel is lost for good: the gateway answers 404 for
  // it, refuses the token, or stayed unreachable for `reconnect_for`. No message follows.
  using OnGone = std::function<void(const Status&)>;

  // Starts a kernel and opens its channels. Errors carry a message fit for a user, naming the
  // gateway: Unauthenticated (token refused), NotFound (no such kernelspec), InvalidArgument,
  // Unavailable (unreachable, timed out, the gateway could not start the kernel). When the
  // WebSocket cannot be opened, the kernel is deleted again.
  static Result<std::unique_ptr<GatewayLink>> Start(GatewayOptions options, OnMessage on_message,
                                                    OnGone on_gone);
  ~GatewayLink();  // Stop()
  GatewayLink(const GatewayLink&) = delete;
  GatewayLink& operator=(const GatewayLink&) = delete;

  const std::string& kernel_id() const;

  // Sends a message to the kernel, or queues it while the WebSocket is being reopened. Thread-
  // safe. Dropped (logged) after the kernel is gone or Stop.
  void Send(const jupyter::WsMessage& message);

  // REST calls on the kernel, each within `request_timeout`.
  Status Interrupt();
  Status Restart();
  // DELETE /api/kernels/{id}; a 404 (already gone) is OK.
  Status Delete(std::chrono::milliseconds timeout);

  // Closes the WebSocket and joins the reader; the gateway kernel is left running. Idempotent;
  // must not be called from OnMessage/OnGone.
  void Stop();

 private:
  struct Impl;
  explicit GatewayLink(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace nbos::relay
