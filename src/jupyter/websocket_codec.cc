#include "jupyter/websocket_codec.h"

#include <cstdint>

#include "jupyter/json_limits.h"

namespace nbos::jupyter {

namespace {

Json ToJsonObject(const WsMessage& m) {
  const Message& msg = m.message;
  return Json{{"header", msg.header},     {"parent_header", msg.parent_header},
              {"metadata", msg.metadata}, {"content", msg.content},
              {"buffers", Json::array()}, {"channel", ChannelName(m.channel)},
              {"msg_id", msg.msg_id()},   {"msg_type", msg.msg_type()}};
}

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

void PutU32(std::string* out, uint32_t v) {
  out->push_back(static_cast<char>(v >> 24));
  out->push_back(static_cast<char>(v >> 16));
  out->push_back(static_cast<char>(v >> 8));
  out->push_back(static_cast<char>(v));
}

uint32_t GetU32(std::string_view s, size_t pos) {
  auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<unsigned char>(s[pos + i])); };
  return (b(0) << 24) | (b(1) << 16) | (b(2) << 8) | b(3);
}

Result<WsMessage> FromJson(std::string_view text) {
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgument("websocket message is not a JSON object");
  }
  WsMessage out;
  auto channel = j.find("channel");
  if (channel != j.end() && !channel->is_null()) {
    if (!channel->is_string() || !ParseChannel(channel->get<std::string>(), &out.channel)) {
      return InvalidArgument("websocket message has an unknown channel");
    }
  }
  Message& msg = out.message;
  for (auto [key, field] :
       {std::pair{"header", &msg.header}, std::pair{"parent_header", &msg.parent_header},
        std::pair{"metadata", &msg.metadata}, std::pair{"content", &msg.content}}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;  // parent_header/metadata are often omitted
    if (!it->is_object()) {
      return InvalidArgument(std::string("websocket message field '") + key + "' is not an object");
    }
    *field = std::move(*it);
  }
  if (msg.msg_type().empty()) {
    // Some clients put msg_type only at the top level.
    auto top = j.find("msg_type");
    if (top == j.end() || !top->is_string()) {
      return InvalidArgument("websocket message has no header.msg_type");
    }
    msg.header["msg_type"] = *top;
  }
  if (msg.msg_id().empty()) {
    auto top = j.find("msg_id");
    if (top != j.end() && top->is_string()) msg.header["msg_id"] = *top;
  }
  return out;
}

}  // namespace

std::string EncodeWsText(const WsMessage& m) { return Dump(ToJsonObject(m)); }

std::string EncodeWsBinary(const WsMessage& m) {
  Json j = ToJsonObject(m);
  j.erase("buffers");
  std::string json_text = Dump(j);
  const auto& buffers = m.message.buffers;
  const uint32_t n = static_cast<uint32_t>(1 + buffers.size());
  size_t offset = 4 + 4 * static_cast<size_t>(n);
  std::string out;
  PutU32(&out, n);
  PutU32(&out, static_cast<uint32_t>(offset));
  offset += json_text.size();
  for (const auto& b : buffers) {
    PutU32(&out, static_cast<uint32_t>(offset));
    offset += b.size();
  }
  out.reserve(offset);
  out += json_text;
  for (const auto& b : buffers) out += b;
  return out;
}

std::string EncodeWs(const WsMessage& m, bool* binary) {
  *binary = !m.message.buffers.empty();
  return *binary ? EncodeWsBinary(m) : EncodeWsText(m);
}

Result<WsBinaryParts> SplitWsBinary(std::string_view payload, size_t max_buffers) {
  if (payload.size() < 8) return InvalidArgument("binary websocket frame too short");
  const uint32_t n = GetU32(payload, 0);
  if (n == 0 || n - 1 > max_buffers) {
    return InvalidArgument("binary websocket frame has a bad offset count");
  }
  const size_t header_bytes = 4 + 4 * static_cast<size_t>(n);
  if (header_bytes > payload.size()) {
    return InvalidArgument("binary websocket frame shorter than its offset table");
  }
  std::vector<size_t> offsets(n);
  for (uint32_t i = 0; i < n; ++i) {
    offsets[i] = GetU32(payload, 4 + 4 * static_cast<size_t>(i));
    const size_t lower = i == 0 ? header_bytes : offsets[i - 1];
    if (offsets[i] < lower || offsets[i] > payload.size()) {
      return InvalidArgument("binary websocket frame has offsets out of order or range");
    }
  }
  auto part = [&](uint32_t i) {
    size_t end = i + 1 < n ? offsets[i + 1] : payload.size();
    return payload.substr(offsets[i], end - offsets[i]);
  };
  WsBinaryParts parts;
  parts.json = part(0);
  for (uint32_t i = 1; i < n; ++i) parts.buffers.push_back(part(i));
  return parts;
}

Result<WsMessage> DecodeWs(std::string_view payload, bool binary, const WsLimits& limits) {
  if (payload.size() > limits.max_message_bytes) {
    return ResourceExhausted("websocket message of " + std::to_string(payload.size()) +
                             " bytes exceeds the limit of " +
                             std::to_string(limits.max_message_bytes));
  }
  std::string_view json = payload;
  std::vector<std::string_view> buffers;
  if (binary) {
    auto parts = SplitWsBinary(payload, limits.max_buffers);
    if (!parts.ok()) return parts.status();
    json = parts->json;
    buffers = std::move(parts->buffers);
  }
  if (!JsonDepthWithin(json, limits.max_json_depth)) {
    return ResourceExhausted("websocket message nested deeper than " +
                             std::to_string(limits.max_json_depth) + " levels");
  }
  auto decoded = FromJson(json);
  if (!decoded.ok()) return decoded;
  for (std::string_view b : buffers) decoded->message.buffers.emplace_back(b);
  return decoded;
}

}  // namespace nbos::jupyter
