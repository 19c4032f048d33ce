// Jupyter connection files: where a kernel binds its five channels and the key it signs with.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace nbos::jupyter {

struct ConnectionInfo {
  std::string transport = "tcp";  // "tcp" or "ipc"
  std::string ip = "127.0.0.1";
  int shell_port = 0;
  int iopub_port = 0;
  int stdin_port = 0;
  int control_port = 0;
  int hb_port = 0;
  std::string key;
  std::string signature_scheme = "hmac-sha256";
  std::string kernel_name;

  // ZeroMQ endpoint of one port: "tcp://IP:PORT", or "ipc://IP-PORT" as jupyter_client names
  // ipc paths.
  std::string Endpoint(int port) const;
};

// Errors: InvalidArgument naming the missing or malformed field.
Result<ConnectionInfo> ParseConnectionInfo(std::string_view json_text);
Result<ConnectionInfo> ReadConnectionFile(const std::string& path);
std::string ConnectionInfoToJson(const ConnectionInfo& info);

}  // namespace nbos::jupyter
