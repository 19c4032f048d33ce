#include "jupyter/message.h"

#include <fmt/format.h>

#include "common/ids.h"

namespace nbos::jupyter {

const char* ChannelName(Channel c) {
  switch (c) {
    case Channel::kShell:
      return "shell";
    case Channel::kControl:
      return "control";
    case Channel::kIopub:
      return "iopub";
    case Channel::kStdin:
      return "stdin";
  }
  return "shell";
}

bool ParseChannel(std::string_view name, Channel* out) {
  for (Channel c : {Channel::kShell, Channel::kControl, Channel::kIopub, Channel::kStdin}) {
    if (name == ChannelName(c)) {
      *out = c;
      return true;
    }
  }
  return false;
}

namespace {
std::string StringField(const Json& obj, const char* key) {
  if (!obj.is_object()) return {};
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_string()) return {};
  return it->get<std::string>();
}
}  // namespace

std::string Message::msg_type() const { return StringField(header, "msg_type"); }
std::string Message::msg_id() const { return StringField(header, "msg_id"); }
std::string Message::parent_msg_id() const { return StringField(parent_header, "msg_id"); }

MessageFactory::MessageFactory(std::string session, std::string username, Clock clock)
    : session_(std::move(session)), username_(std::move(username)), clock_(std::move(clock)) {
  if (!clock_) clock_ = [] { return std::chrono::system_clock::now(); };
}

Json MessageFactory::NewHeader(std::string_view msg_type) {
  // Like jupyter_client: ids unique within the session by a counter, across sessions by the
  // session's own uuid.
  return Json{{"msg_id", fmt::format("{}_{}", session_, ++counter_)},
              {"session", session_},
              {"username", username_},
              {"date", FormatIsoUtc(clock_())},
              {"msg_type", msg_type},
              {"version", kProtocolVersion}};
}

Message MessageFactory::Make(std::string_view msg_type, Json content, const Json& parent_header) {
  Message m;
  m.header = NewHeader(msg_type);
  m.parent_header = parent_header.is_object() ? parent_header : Json::object();
  m.content = std::move(content);
  return m;
}

Message MessageFactory::Reply(const Message& parent, std::string_view msg_type, Json content) {
  Message m = Make(msg_type, std::move(content), parent.header);
  m.identities = parent.identities;
  return m;
}

std::string ReplyTypeFor(std::string_view request_type) {
  constexpr std::string_view kSuffix = "_request";
  if (request_type.size() <= kSuffix.size() || !request_type.ends_with(kSuffix)) return {};
  return std::string(request_type.substr(0, request_type.size() - kSuffix.size())) + "_reply";
}

}  // namespace nbos::jupyter
