// Process-wide logging setup. Logs go to a file descriptor given at start-up, so a kernel whose
// fds 1 and 2 are captured for the notebook still logs to its real stderr.
#pragma once

#include <string_view>

namespace nbos {

// Installs the default spdlog logger writing to `fd` with `level` ("trace".."off"). Unknown
// levels mean "info".
void InitLogging(int fd, std::string_view level, std::string_view name = "nbos");

}  // namespace nbos
