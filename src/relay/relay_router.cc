#include "relay/relay_router.h"

#include <cassert>
#include <utility>

namespace nbos::relay {

namespace {

jupyter::Channel ChannelOf(Socket s) {
  switch (s) {
    case Socket::kShell:
      return jupyter::Channel::kShell;
    case Socket::kControl:
      return jupyter::Channel::kControl;
    case Socket::kStdin:
      return jupyter::Channel::kStdin;
    case Socket::kIopub:
      return jupyter::Channel::kIopub;
  }
  return jupyter::Channel::kShell;
}

}  // namespace

RelayRouter::RelayRouter(size_t max_pending) : max_pending_(max_pending) {
  assert(max_pending_ > 0);
}

void RelayRouter::Remember(const std::string& msg_id, Socket socket,
                           std::vector<std::string> identities) {
  if (auto it = pending_.find(msg_id); it != pending_.end()) Forget(it);
  order_.push_back(msg_id);
  pending_.emplace(msg_id, Pending{socket, std::move(identities), std::prev(order_.end())});
  while (pending_.size() > max_pending_) Forget(pending_.find(order_.front()));
}

void RelayRouter::Forget(std::unordered_map<std::string, Pending>::iterator it) {
  order_.erase(it->second.age);
  pending_.erase(it);
}

ClientAction RelayRouter::FromClient(Socket socket, jupyter::Message message) {
  assert(socket != Socket::kIopub);
  ClientAction action;
  const std::string type = message.msg_type();
  if (socket != Socket::kStdin) {
    if (type == "shutdown_request") {
      action.kind = ClientAction::Kind::kShutdown;
      auto restart = message.content.find("restart");
      action.restart =
          restart != message.content.end() && restart->is_boolean() && restart->get<bool>();
      return action;
    }
    // Only requests get replies; remembering comm_msg and the like would leak.
    const std::string msg_id = message.msg_id();
    if (!msg_id.empty() && !jupyter::ReplyTypeFor(type).empty()) {
      Remember(msg_id, socket, message.identities);
    }
  } else if (type == "input_reply") {
    auto last = last_input_request_.find(message.identities);
    if (last != last_input_request_.end()) {
      if (message.parent_header.empty()) message.parent_header = last->second;
      last_input_request_.erase(last);
    }
  }
  message.identities.clear();
  action.forward.channel = ChannelOf(socket);
  action.forward.message = std::move(message);
  return action;
}

std::optional<Delivery> RelayRouter::FromKernel(jupyter::WsMessage ws) {
  Delivery d;
  jupyter::Message& m = ws.message;
  switch (ws.channel) {
    case jupyter::Channel::kIopub: {
      std::string session;
      if (auto s = m.header.find("session"); s != m.header.end() && s->is_string()) {
        session = s->get<std::string>();
      }
      m.identities = {"kernel." + session + "." + m.msg_type()};
      d.socket = Socket::kIopub;
      break;
    }
    case jupyter::Channel::kShell:
    case jupyter::Channel::kControl: {
      auto it = pending_.find(m.parent_msg_id());
      if (it == pending_.end()) return std::nullopt;
      d.socket = it->second.socket;
      m.identities = std::move(it->second.identities);
      Forget(it);
      break;
    }
    case jupyter::Channel::kStdin: {
      // input_request: the client's stdin DEALER has the identity of its shell DEALER.
      auto it = pending_.find(m.parent_msg_id());
      if (it == pending_.end()) return std::nullopt;
      d.socket = Socket::kStdin;
      m.identities = it->second.identities;
      if (m.msg_type() == "input_request") last_input_request_[m.identities] = m.header;
      break;
    }
  }
  d.message = std::move(m);
  return d;
}

}  // namespace nbos::relay
