// Invariants that stay checked in release builds. `assert` vanishes under NDEBUG; NBOS_CHECK does
// not: use it where going on after a violation would corrupt state (a ledger that hands out a GPU
// twice, a Result read without a value) rather than merely misbehave. A failed check logs the
// condition, the place and the message, then aborts, so the process never continues on broken
// state and a core file or the log shows where.
#pragma once

#include <string_view>

namespace nbos::internal {

[[noreturn]] void CheckFailed(const char* condition, const char* file, int line,
                              std::string_view message);

}  // namespace nbos::internal

// NBOS_CHECK(cond) or NBOS_CHECK(cond, "what it means"). The message must be a string (not
// formatted: the failing path must not allocate more than it has to).
#define NBOS_CHECK(condition, ...)                                                   \
  do {                                                                               \
    if (__builtin_expect(!(condition), 0)) {                                         \
      ::nbos::internal::CheckFailed(#condition, __FILE__, __LINE__, "" __VA_ARGS__); \
    }                                                                                \
  } while (false)
