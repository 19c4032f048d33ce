// libFuzzer target: websocket text and binary framings. The first byte picks the framing.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "jupyter/websocket_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  bool binary = (data[0] & 1) != 0;
  std::string_view payload(reinterpret_cast<const char*>(data) + 1, size - 1);
  auto decoded = nbos::jupyter::DecodeWs(payload, binary);
  if (decoded.ok()) {
    bool was_binary = false;
    std::string encoded = nbos::jupyter::EncodeWs(*decoded, &was_binary);
    auto again = nbos::jupyter::DecodeWs(encoded, was_binary);
    if (!again.ok() || again->message.buffers != decoded->message.buffers) __builtin_trap();
  }
  return 0;
}
