// The websocket framings of Jupyter messages that gateways speak (jupyter_server's "legacy"
// protocol): a text frame holding one JSON object with a `channel` field, or, when the message
// carries binary buffers, a binary frame of big-endian uint32 offsets, the JSON, then the buffers.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "jupyter/message.h"

namespace nbos::jupyter {

struct WsMessage {
  Channel channel = Channel::kShell;
  Message message;  // identities unused
};

struct WsLimits {
  size_t max_message_bytes = 512u << 20;
  size_t max_buffers = 1024;
  int max_json_depth = 512;  // see json_limits.h
};

// The parts of a binary frame: the JSON text and the buffers, as views into the frame.
struct WsBinaryParts {
  std::string_view json;
  std::vector<std::string_view> buffers;
};

// Text frame JSON: header, parent_header, metadata, content, buffers ([]), channel, and the
// top-level msg_id/msg_type copies that jupyter_server's gateway client reads.
std::string EncodeWsText(const WsMessage& m);
// Binary frame; used when m.message.buffers is non-empty.
std::string EncodeWsBinary(const WsMessage& m);
// Picks the framing the message needs. `*binary` tells which one was used.
std::string EncodeWs(const WsMessage& m, bool* binary);

// Splits a binary frame at its offsets. Errors: InvalidArgument for a malformed offset table.
Result<WsBinaryParts> SplitWsBinary(std::string_view payload, size_t max_buffers);

// Parses one received websocket frame. A message without `channel` is a shell message.
// Errors: InvalidArgument for malformed frames, ResourceExhausted over `limits` (size or depth).
Result<WsMessage> DecodeWs(std::string_view payload, bool binary, const WsLimits& limits = {});

}  // namespace nbos::jupyter
