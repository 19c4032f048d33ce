#include "web/assets.h"

namespace nbos::web {

namespace {

std::string_view ContentType(std::string_view name) {
  if (name.ends_with(".html")) return "text/html; charset=utf-8";
  if (name.ends_with(".js")) return "text/javascript; charset=utf-8";
  if (name.ends_with(".css")) return "text/css; charset=utf-8";
  return "application/octet-stream";
}

}  // namespace

std::optional<Asset> FindAsset(std::string_view name) {
  for (const auto& [file, body] : EmbeddedFiles()) {
    if (file == name) return Asset{body, ContentType(name)};
  }
  return std::nullopt;
}

}  // namespace nbos::web
