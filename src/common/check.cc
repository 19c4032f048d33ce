#include "common/check.h"

#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>

namespace nbos::internal {

void CheckFailed(const char* condition, const char* file, int line, std::string_view message) {
  // Both the log (where operators look) and stderr (where a test runner or a core-dump handler
  // looks): the logger may write to a file nobody reads before the abort.
  spdlog::critical("check failed at {}:{}: {}{}{}", file, line, condition,
                   message.empty() ? "" : ": ", message);
  spdlog::default_logger()->flush();
  std::fprintf(stderr, "nbos: check failed at %s:%d: %s%s%.*s\n", file, line, condition,
               message.empty() ? "" : ": ", static_cast<int>(message.size()), message.data());
  std::abort();
}

}  // namespace nbos::internal
