// The routing decisions of `nbos relay`, kept pure: which messages from local Jupyter clients
// (ZeroMQ) go to the gateway kernel (WebSocket) and which the relay answers itself, and to which
// client identity each message from the gateway goes back (jupyter-protocol.md §1.6 item 2).
#pragma once

#include <cstddef>
#include <list>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "jupyter/message.h"
#include "jupyter/websocket_codec.h"

namespace nbos::relay {

// The relay's client-facing ZeroMQ sockets.
enum class Socket { kShell, kControl, kStdin, kIopub };

struct ClientAction {
  enum class Kind {
    kForward,   // send `forward` to the gateway
    kShutdown,  // answer shutdown_reply locally, then end the gateway kernel and exit
  };
  Kind kind = Kind::kForward;
  jupyter::WsMessage forward;  // kForward: the message, identities cleared
  bool restart = false;        // kShutdown: the request's `restart`
};

// A message to send on a local socket; `message.identities` are the ROUTER routing frames, or
// the iopub topic.
struct Delivery {
  Socket socket = Socket::kIopub;
  jupyter::Message message;
};

class RelayRouter {
 public:
  // At most `max_pending` requests are remembered while their replies are outstanding; past
  // that the oldest is forgotten (its reply, should one come, is dropped).
  explicit RelayRouter(size_t max_pending = 65536);

  // A message a client sent on `socket` (kShell, kControl or kStdin). Requests (`*_request` with
  // a msg_id) on shell and control remember the sender's identities for the reply and for
  // stdin input_request. shutdown_request on either is not forwarded: the relay answers it.
  // An input_reply without a parent_header (jupyter_client's KernelClient.input sends none) gets
  // the header of the last input_request delivered to its sender, so the gateway can tell which
  // request it answers.
  ClientAction FromClient(Socket socket, jupyter::Message message);

  // A message from the gateway kernel. iopub messages are published (topic
  // "kernel.<session>.<msg_type>"); shell/control replies go to the socket and identities of the
  // request named by parent_header.msg_id, which is then forgotten; stdin messages
  // (input_request) go to the stdin socket with the identities of the shell request that caused
  // them. nullopt when no local client is waiting for it (another client's reply, a reply to an
  // unknown or forgotten request).
  std::optional<Delivery> FromKernel(jupyter::WsMessage ws);

  size_t pending() const { return pending_.size(); }

 private:
  struct Pending {
    Socket socket;
    std::vector<std::string> identities;
    std::list<std::string>::iterator age;  // position in order_
  };
  void Remember(const std::string& msg_id, Socket socket, std::vector<std::string> identities);
  void Forget(std::unordered_map<std::string, Pending>::iterator it);

  size_t max_pending_;
  std::unordered_map<std::string, Pending> pending_;  // by request msg_id
  std::list<std::string> order_;                      // msg_ids, oldest first
  // The header of the last input_request delivered, by the identities it went to.
  std::map<std::vector<std::string>, jupyter::Json> last_input_request_;
};

}  // namespace nbos::relay
