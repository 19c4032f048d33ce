// Lowercase hexadecimal, as Jupyter signatures and blob keys spell digests.
#pragma once

#include <cstddef>
#include <string>

namespace nbos {

inline std::string HexEncode(const unsigned char* bytes, size_t n) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex(n * 2, '0');
  for (size_t i = 0; i < n; ++i) {
    hex[2 * i] = kHex[bytes[i] >> 4];
    hex[2 * i + 1] = kHex[bytes[i] & 0xf];
  }
  return hex;
}

}  // namespace nbos
