#include "jupyter/connection_file.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace nbos::jupyter {

using Json = nlohmann::json;

std::string ConnectionInfo::Endpoint(int port) const {
  if (transport == "ipc") return "ipc://" + ip + "-" + std::to_string(port);
  return transport + "://" + ip + ":" + std::to_string(port);
}

Result<ConnectionInfo> ParseConnectionInfo(std::string_view json_text) {
  Json j = Json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgument("connection file is not a JSON object");
  }
  ConnectionInfo info;
  auto get_string = [&](const char* key, std::string* out, bool required) -> Status {
    auto it = j.find(key);
    if (it == j.end()) {
      return required ? InvalidArgument(std::string("connection file lacks '") + key + "'")
                      : Status::Ok();
    }
    if (!it->is_string()) {
      return InvalidArgument(std::string("connection file field '") + key + "' is not a string");
    }
    *out = it->get<std::string>();
    return Status::Ok();
  };
  auto get_port = [&](const char* key, int* out) -> Status {
    auto it = j.find(key);
    if (it == j.end() || !it->is_number_integer()) {
      return InvalidArgument(std::string("connection file lacks integer '") + key + "'");
    }
    long long v = it->get<long long>();
    if (v < 0 || v > 65535) {
      return InvalidArgument(std::string("connection file port '") + key + "' out of range");
    }
    *out = static_cast<int>(v);
    return Status::Ok();
  };
  for (Status s :
       {get_string("transport", &info.transport, false), get_string("ip", &info.ip, false),
        get_string("key", &info.key, false),
        get_string("signature_scheme", &info.signature_scheme, false),
        get_string("kernel_name", &info.kernel_name, false),
        get_port("shell_port", &info.shell_port), get_port("iopub_port", &info.iopub_port),
        get_port("stdin_port", &info.stdin_port), get_port("control_port", &info.control_port),
        get_port("hb_port", &info.hb_port)}) {
    if (!s.ok()) return s;
  }
  if (info.transport != "tcp" && info.transport != "ipc") {
    return InvalidArgument("connection file transport must be tcp or ipc, not '" + info.transport +
                           "'");
  }
  if (info.signature_scheme.empty()) info.signature_scheme = "hmac-sha256";
  return info;
}

Result<ConnectionInfo> ReadConnectionFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot read connection file " + path);
  std::ostringstream text;
  text << in.rdbuf();
  auto info = ParseConnectionInfo(text.str());
  if (!info.ok()) return Status(info.status().code(), path + ": " + info.status().message());
  return info;
}

std::string ConnectionInfoToJson(const ConnectionInfo& info) {
  Json j{{"transport", info.transport},
         {"ip", info.ip},
         {"shell_port", info.shell_port},
         {"iopub_port", info.iopub_port},
         {"stdin_port", info.stdin_port},
         {"control_port", info.control_port},
         {"hb_port", info.hb_port},
         {"key", info.key},
         {"signature_scheme", info.signature_scheme}};
  if (!info.kernel_name.empty()) j["kernel_name"] = info.kernel_name;
  return j.dump(2);
}

}  // namespace nbos::jupyter
