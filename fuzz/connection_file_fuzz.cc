// libFuzzer target: connection file parsing.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "jupyter/connection_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto info = nbos::jupyter::ParseConnectionInfo(
      std::string_view(reinterpret_cast<const char*>(data), size));
  if (info.ok()) {
    auto again = nbos::jupyter::ParseConnectionInfo(nbos::jupyter::ConnectionInfoToJson(*info));
    if (!again.ok() || again->shell_port != info->shell_port) __builtin_trap();
  }
  return 0;
}
