#include "gateway/client_validation.h"

#include <fmt/format.h>

#include <array>
#include <limits>

#include "jupyter/json_limits.h"

namespace nbos::gateway {
namespace {

using jupyter::Channel;
using jupyter::Json;

const char* TypeName(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return "an integer";
    case Json::value_t::number_float:
      return "a number";
    case Json::value_t::string:
      return "a string";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::object:
      return "an object";
    default:
      return "binary";
  }
}

enum class Kind : uint8_t { kString, kBool, kCount, kInt, kObject, kStringMap, kStringOrNull };

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kString:
      return "a string";
    case Kind::kBool:
      return "a boolean";
    case Kind::kCount:
      return "a non-negative integer";
    case Kind::kInt:
      return "an integer";
    case Kind::kObject:
      return "an object";
    case Kind::kStringMap:
      return "an object of strings";
    case Kind::kStringOrNull:
      return "a string or null";
  }
  return "?";
}

bool Fits(const Json& v, Kind k) {
  switch (k) {
    case Kind::kString:
      return v.is_string();
    case Kind::kBool:
      return v.is_boolean();
    case Kind::kCount:
      return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0);
    case Kind::kInt:
      return v.is_number_integer();
    case Kind::kObject:
      return v.is_object();
    case Kind::kStringMap:
      if (!v.is_object()) return false;
      for (const auto& [key, value] : v.items())
        if (!value.is_string()) return false;
      return true;
    case Kind::kStringOrNull:
      return v.is_string() || v.is_null();
  }
  return false;
}

struct Field {
  const char* name;
  Kind kind;
  bool required;
};

struct TypeSpec {
  const char* msg_type;
  uint8_t channels;  // bit per Channel
  std::vector<Field> fields;
};

constexpr uint8_t Bit(Channel c) { return static_cast<uint8_t>(1u << static_cast<int>(c)); }
constexpr uint8_t kShell = Bit(Channel::kShell);
constexpr uint8_t kControl = Bit(Channel::kControl);
constexpr uint8_t kStdin = Bit(Channel::kStdin);

// Messaging protocol 5.3, the requests a client sends and what the gateway or IPython reads of
// them. Optional fields may be absent; present ones must have the type.
const std::vector<TypeSpec>& Specs() {
  static const std::vector<TypeSpec> kSpecs = {
      {"execute_request",
       kShell,
       {{"code", Kind::kString, true},
        {"silent", Kind::kBool, false},
        {"store_history", Kind::kBool, false},
        {"user_expressions", Kind::kStringMap, false},
        {"allow_stdin", Kind::kBool, false},
        {"stop_on_error", Kind::kBool, false}}},
      {"inspect_request",
       kShell,
       {{"code", Kind::kString, true},
        {"cursor_pos", Kind::kCount, true},
        {"detail_level", Kind::kCount, false}}},
      {"complete_request",
       kShell,
       {{"code", Kind::kString, true}, {"cursor_pos", Kind::kCount, true}}},
      {"history_request",
       kShell,
       {{"output", Kind::kBool, false},
        {"raw", Kind::kBool, false},
        {"hist_access_type", Kind::kString, true},
        {"session", Kind::kInt, false},
        {"start", Kind::kInt, false},
        {"stop", Kind::kInt, false},
        {"n", Kind::kCount, false},
        {"pattern", Kind::kString, false},
        {"unique", Kind::kBool, false}}},
      {"is_complete_request", kShell, {{"code", Kind::kString, true}}},
      {"comm_info_request", kShell, {{"target_name", Kind::kStringOrNull, false}}},
      {"kernel_info_request", kShell | kControl, {}},
      {"nbos_namespace_request", kShell, {}},
      {"comm_open",
       kShell,
       {{"comm_id", Kind::kString, true},
        {"target_name", Kind::kString, true},
        {"data", Kind::kObject, false},
        {"target_module", Kind::kStringOrNull, false}}},
      {"comm_msg", kShell, {{"comm_id", Kind::kString, true}, {"data", Kind::kObject, false}}},
      {"comm_close", kShell, {{"comm_id", Kind::kString, true}, {"data", Kind::kObject, false}}},
      {"shutdown_request", kShell | kControl, {{"restart", Kind::kBool, false}}},
      {"interrupt_request", kControl, {}},
      {"input_reply", kStdin, {{"value", Kind::kString, true}}},
  };
  return kSpecs;
}

const TypeSpec* FindSpec(std::string_view msg_type) {
  for (const TypeSpec& s : Specs())
    if (msg_type == s.msg_type) return &s;
  return nullptr;
}

Rejection Field_(std::string message) { return {RejectClass::kField, std::move(message)}; }

std::optional<Rejection> CheckHeader(const Json& header, const ClientLimits& limits) {
  for (const char* key : {"msg_id", "msg_type", "session", "username", "date", "version"}) {
    auto it = header.find(key);
    if (it == header.end()) continue;
    if (!it->is_string()) {
      return Field_(fmt::format("header.{} must be a string, not {}", key, TypeName(*it)));
    }
    if (it->get_ref<const std::string&>().size() > limits.max_id_bytes) {
      return Field_(fmt::format("header.{} is longer than {} bytes", key, limits.max_id_bytes));
    }
  }
  return std::nullopt;
}

std::optional<Rejection> CheckFields(const TypeSpec& spec, const Json& content) {
  for (const Field& f : spec.fields) {
    auto it = content.find(f.name);
    if (it == content.end()) {
      if (f.required) {
        return Field_(fmt::format("{}: content.{} is required ({})", spec.msg_type, f.name,
                                  KindName(f.kind)));
      }
      continue;
    }
    if (Fits(*it, f.kind)) continue;
    if (f.kind == Kind::kStringMap && it->is_object()) {
      for (const auto& [key, value] : it->items()) {
        if (value.is_string()) continue;
        return Field_(fmt::format("{}: content.{}.{} must be a string, not {}", spec.msg_type,
                                  f.name, key.substr(0, 64), TypeName(value)));
      }
    }
    const char* actual =
        f.kind == Kind::kCount && it->is_number_integer() ? "a negative integer" : TypeName(*it);
    return Field_(fmt::format("{}: content.{} must be {}, not {}", spec.msg_type, f.name,
                              KindName(f.kind), actual));
  }
  return std::nullopt;
}

// metadata.nbos of an execute_request: {gpus: 0..max, target_replica: >= 1}; other keys are the
// gateway's own (exec_id, gpu_ids) and are overwritten.
std::optional<Rejection> CheckNbosMetadata(const Json& metadata, const ClientLimits& limits) {
  auto nbos = metadata.find("nbos");
  if (nbos == metadata.end()) return std::nullopt;
  if (!nbos->is_object()) {
    return Field_(fmt::format("metadata.nbos must be an object, not {}", TypeName(*nbos)));
  }
  if (auto gpus = nbos->find("gpus"); gpus != nbos->end()) {
    if (!Fits(*gpus, Kind::kCount)) {
      return Rejection{
          RejectClass::kResources,
          fmt::format("metadata.nbos.gpus must be a non-negative integer, not {}",
                      gpus->is_number_integer() ? "a negative integer" : TypeName(*gpus))};
    }
    if (gpus->get<uint64_t>() > static_cast<uint64_t>(limits.max_cell_gpus)) {
      return Rejection{RejectClass::kResources,
                       fmt::format("metadata.nbos.gpus asks for {} GPUs; a cell may use at most {}",
                                   gpus->get<uint64_t>(), limits.max_cell_gpus)};
    }
  }
  if (auto target = nbos->find("target_replica"); target != nbos->end()) {
    if (!Fits(*target, Kind::kCount) || target->get<uint64_t>() == 0 ||
        target->get<uint64_t>() > std::numeric_limits<uint32_t>::max()) {
      return Field_("metadata.nbos.target_replica must be a replica id (a positive integer)");
    }
  }
  return std::nullopt;
}

ClientInput Parsed(Json j, std::vector<std::string_view> buffers) {
  ClientInput in;
  jupyter::Message& msg = in.message.message;
  msg.header = std::move(j["header"]);
  for (auto [key, field] :
       {std::pair{"parent_header", &msg.parent_header}, std::pair{"metadata", &msg.metadata},
        std::pair{"content", &msg.content}}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;  // parent_header and metadata are often omitted
    if (!it->is_object()) {
      if (!in.rejection) {
        in.rejection = Field_(fmt::format("{} must be an object, not {}", key, TypeName(*it)));
      }
      continue;
    }
    *field = std::move(*it);
  }
  for (std::string_view b : buffers) msg.buffers.emplace_back(b);
  auto channel = j.find("channel");
  if (channel != j.end() && !channel->is_null()) {
    const bool known = channel->is_string() &&
                       jupyter::ParseChannel(channel->get<std::string>(), &in.message.channel);
    if (!known) {
      in.message.channel = Channel::kShell;
      in.rejection = Rejection{
          RejectClass::kChannel,
          fmt::format("unknown channel {}",
                      channel->dump(-1, ' ', false, Json::error_handler_t::replace).substr(0, 64))};
    }
  }
  return in;
}

}  // namespace

const char* RejectClassName(RejectClass reason) {
  switch (reason) {
    case RejectClass::kFrame:
      return "frame";
    case RejectClass::kTooLarge:
      return "too_large";
    case RejectClass::kTooDeep:
      return "too_deep";
    case RejectClass::kChannel:
      return "channel";
    case RejectClass::kMsgType:
      return "msg_type";
    case RejectClass::kField:
      return "field";
    case RejectClass::kResources:
      return "resources";
    case RejectClass::kQueueFull:
      return "queue_full";
  }
  return "frame";
}

std::variant<ClientInput, FrameRejection> DecodeClientFrame(std::string_view payload, bool binary,
                                                            const ClientLimits& limits) {
  auto frame_error = [](RejectClass reason, std::string message, uint16_t code = 1007) {
    return FrameRejection{{reason, std::move(message)}, code};
  };
  if (payload.size() > limits.max_message_bytes) {
    return frame_error(RejectClass::kTooLarge,
                       fmt::format("a message of {} bytes exceeds the limit of {}", payload.size(),
                                   limits.max_message_bytes),
                       1009);
  }
  std::string_view json = payload;
  std::vector<std::string_view> buffers;
  if (binary) {
    auto parts = jupyter::SplitWsBinary(payload, limits.max_buffers);
    if (!parts.ok()) return frame_error(RejectClass::kFrame, parts.status().message());
    json = parts->json;
    buffers = std::move(parts->buffers);
  }
  if (!jupyter::JsonDepthWithin(json, limits.max_json_depth)) {
    return frame_error(RejectClass::kTooDeep,
                       fmt::format("JSON nested deeper than {} levels", limits.max_json_depth));
  }
  Json j = Json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return frame_error(RejectClass::kFrame, "a Jupyter message must be a JSON object");
  }
  auto header = j.find("header");
  if (header == j.end() || !header->is_object()) {
    return frame_error(RejectClass::kFrame, "a Jupyter message needs a header object");
  }
  // Some clients put msg_id and msg_type only at the top level.
  for (const char* key : {"msg_id", "msg_type"}) {
    auto top = j.find(key);
    if (!header->contains(key) && top != j.end()) (*header)[key] = *top;
    auto it = header->find(key);
    if (it == header->end() || !it->is_string() || it->get_ref<const std::string&>().empty()) {
      return frame_error(RejectClass::kFrame,
                         fmt::format("a Jupyter message needs a header.{} string", key));
    }
  }
  ClientInput in = Parsed(std::move(j), std::move(buffers));
  if (!in.rejection) in.rejection = CheckHeader(in.message.message.header, limits);
  return in;
}

std::optional<Rejection> ValidateClientMessage(const jupyter::WsMessage& m,
                                               const ClientLimits& limits) {
  const std::string type = m.message.msg_type();
  const TypeSpec* spec = FindSpec(type);
  if (spec == nullptr) {
    return Rejection{RejectClass::kMsgType,
                     fmt::format("the gateway does not serve '{}' messages", type.substr(0, 64))};
  }
  if ((spec->channels & Bit(m.channel)) == 0) {
    return Rejection{RejectClass::kChannel, fmt::format("{} is not accepted on the {} channel",
                                                        type, jupyter::ChannelName(m.channel))};
  }
  if (auto r = CheckFields(*spec, m.message.content)) return r;
  if (type == "execute_request") return CheckNbosMetadata(m.message.metadata, limits);
  if (type == "history_request") {
    const std::string& access = m.message.content["hist_access_type"].get_ref<const std::string&>();
    if (access != "range" && access != "tail" && access != "search") {
      return Field_("history_request: content.hist_access_type must be range, tail or search");
    }
  }
  return std::nullopt;
}

bool ExpectsReply(std::string_view msg_type) { return msg_type.ends_with("_request"); }

}  // namespace nbos::gateway
