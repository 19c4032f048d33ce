// libFuzzer target: the ZeroMQ frame decoder must reject, never crash on, arbitrary frames.
// Input layout: frames separated by the byte 0x00 0xff; the first frame is the HMAC key.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "jupyter/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view input(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> frames;
  size_t start = 0;
  for (;;) {
    size_t sep = input.find(std::string_view("\x00\xff", 2), start);
    if (sep == std::string_view::npos) {
      frames.emplace_back(input.substr(start));
      break;
    }
    frames.emplace_back(input.substr(start, sep - start));
    start = sep + 2;
  }
  std::string key = frames.front();
  frames.erase(frames.begin());
  auto signer = nbos::jupyter::Signer::Create(key);
  if (!signer.ok()) return 0;
  auto decoded = nbos::jupyter::DecodeFrames(frames, *signer);
  if (decoded.ok()) {
    // Whatever decodes must encode again and decode to the same message.
    auto again =
        nbos::jupyter::DecodeFrames(nbos::jupyter::EncodeFrames(*decoded, *signer), *signer);
    if (!again.ok() || again->header != decoded->header || again->content != decoded->content) {
      __builtin_trap();
    }
  }
  return 0;
}
