// Identifiers and wall-clock stamps. Everything that needs randomness or time takes it from here
// at the I/O edge, so pure code can be handed fixed values in tests.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace nbos {

// A random RFC 4122 version-4 UUID in canonical lowercase form, from the OS entropy source.
std::string NewUuid();

// ISO 8601 UTC with microseconds and a literal Z: "2024-01-01T00:00:00.000000Z". This exact shape
// is what jupyter_server's gateway client parses.
std::string FormatIsoUtc(std::chrono::system_clock::time_point t);
inline std::string NowIsoUtc() { return FormatIsoUtc(std::chrono::system_clock::now()); }

}  // namespace nbos
