// The Jupyter message model (messaging protocol 5.3) shared by every nbos process.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace nbos::jupyter {

using Json = nlohmann::json;

inline constexpr char kProtocolVersion[] = "5.3";

// Channel names exactly as the websocket JSON spells them.
enum class Channel { kShell, kControl, kIopub, kStdin };
const char* ChannelName(Channel c);
// False for names other than shell/control/iopub/stdin.
bool ParseChannel(std::string_view name, Channel* out);

// One message. `identities` are the ROUTER routing frames (or the iopub topic) and are not part
// of the signed content; header/parent_header/metadata/content are always JSON objects.
struct Message {
  std::vector<std::string> identities;
  Json header = Json::object();
  Json parent_header = Json::object();
  Json metadata = Json::object();
  Json content = Json::object();
  std::vector<std::string> buffers;

  // Empty string when the header lacks the field or it is not a string.
  std::string msg_type() const;
  std::string msg_id() const;
  std::string parent_msg_id() const;
};

// Makes headers for one endpoint (a kernel, a client): the same session id on every message, a
// unique msg_id from a per-session counter, the date from the injected clock.
class MessageFactory {
 public:
  using Clock = std::function<std::chrono::system_clock::time_point()>;

  MessageFactory(std::string session, std::string username, Clock clock = {});

  const std::string& session() const { return session_; }

  Json NewHeader(std::string_view msg_type);
  // A new message of `msg_type` whose parent is `parent` (its header is copied), routed back to
  // the parent's identities.
  Message Reply(const Message& parent, std::string_view msg_type, Json content);
  // A new message with the given parent header (may be an empty object).
  Message Make(std::string_view msg_type, Json content, const Json& parent_header);

 private:
  std::string session_;
  std::string username_;
  Clock clock_;
  uint64_t counter_ = 0;
};

// "<msg_type>_request" -> "<msg_type>_reply"; empty if `request_type` is not a request.
std::string ReplyTypeFor(std::string_view request_type);

}  // namespace nbos::jupyter
