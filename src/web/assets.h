// The gateway's browser pages and the libraries they use, built into the binary (see
// CMakeLists.txt): served by the dashboard at /dashboard/... with no file system access.
#pragma once

#include <optional>
#include <string_view>
#include <utility>
#include <vector>

namespace nbos::web {

struct Asset {
  std::string_view body;
  std::string_view content_type;  // from the name's extension
};

// The file named `name` ("index.html", "vendor/uPlot.esm.js"); nullopt when there is none (a
// vendored library missing at build time among them).
std::optional<Asset> FindAsset(std::string_view name);

// Every embedded file as (name, body); generated.
const std::vector<std::pair<std::string_view, std::string_view>>& EmbeddedFiles();

}  // namespace nbos::web
