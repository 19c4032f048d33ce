// What the gateway accepts from a kernel's WebSocket clients, checked before anything else reads
// a message (pure). Two layers:
// - DecodeClientFrame: the frame must be one Jupyter message in the legacy framing (a JSON text
//   frame, or binary offsets + JSON + buffers) within the size and nesting limits, with a header
//   naming msg_id and msg_type. A frame that is not gets a FrameRejection: the connection closes
//   with its code (1009 over the size limit, 1007 otherwise), since there is nothing to answer.
// - ValidateClientMessage: every field the gateway or a replica reads, per message type of the
//   Jupyter messaging protocol 5.3 (types, required fields, ranges), the channel each type may
//   come on, and the nbos metadata of execute_request (GPUs, target replica). A message that
//   fails is answered with an error reply instead of reaching a replica. Types the gateway does
//   not serve (unknown ones, and the nbos_* requests the gateway itself sends to replicas) fail
//   too: a client must never change a kernel's Raft membership or cancel its executions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include "jupyter/websocket_codec.h"

namespace nbos::gateway {

struct ClientLimits {
  size_t max_message_bytes = 64u << 20;
  size_t max_buffers = 64;
  int max_json_depth = 100;    // nesting of arrays and objects in the JSON part
  size_t max_id_bytes = 1024;  // msg_id, msg_type, session and other header strings
  int max_cell_gpus = 1024;    // metadata nbos.gpus above this is absurd, not just unmet
};

// Classes of refusal: the `reason` label of nbos_client_messages_rejected_total.
enum class RejectClass : uint8_t {
  kFrame,      // not a Jupyter message at all
  kTooLarge,   // over max_message_bytes
  kTooDeep,    // JSON nested deeper than max_json_depth
  kChannel,    // a channel the client may not use
  kMsgType,    // a message type the gateway does not serve on that channel
  kField,      // a missing or wrongly typed field
  kResources,  // an impossible resource request
  kQueueFull,  // too many requests waiting
};
const char* RejectClassName(RejectClass reason);
inline constexpr RejectClass kAllRejectClasses[] = {
    RejectClass::kFrame,     RejectClass::kTooLarge, RejectClass::kTooDeep,
    RejectClass::kChannel,   RejectClass::kMsgType,  RejectClass::kField,
    RejectClass::kResources, RejectClass::kQueueFull};

struct Rejection {
  RejectClass reason = RejectClass::kField;
  std::string message;  // for the client: says which field and what was wrong
};

struct FrameRejection {
  Rejection rejection;
  uint16_t close_code = 1007;
};

// A frame that is a message. `rejection` is set when the envelope is already wrong beyond the
// header (an unknown channel, a non-object content): the message is answered, not forwarded.
// With an unknown channel, `message.channel` is shell, where the error reply goes.
struct ClientInput {
  jupyter::WsMessage message;
  std::optional<Rejection> rejection;
};

std::variant<ClientInput, FrameRejection> DecodeClientFrame(std::string_view payload, bool binary,
                                                            const ClientLimits& limits);

// nullopt when the message may be forwarded. Assumes a ClientInput without rejection.
std::optional<Rejection> ValidateClientMessage(const jupyter::WsMessage& message,
                                               const ClientLimits& limits);

// Whether `msg_type` is answered by a reply (an *_request); comm messages and input_reply are not.
bool ExpectsReply(std::string_view msg_type);

}  // namespace nbos::gateway
