#include "jupyter/kernelspec.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace nbos::jupyter {

std::string KernelspecJson(const KernelspecOptions& options) {
  nlohmann::json spec{{"argv", options.argv},
                      {"display_name", options.display_name},
                      {"language", "python"},
                      {"interrupt_mode", "signal"},
                      {"metadata", {{"debugger", false}}}};
  return spec.dump(2) + "\n";
}

std::string KernelsDir(bool user, const std::string& prefix) {
  namespace fs = std::filesystem;
  if (user) {
    if (const char* d = std::getenv("JUPYTER_DATA_DIR"); d != nullptr && *d != '\0') {
      return (fs::path(d) / "kernels").string();
    }
    const char* home = std::getenv("HOME");
    return (fs::path(home ? home : "/") / ".local/share/jupyter/kernels").string();
  }
  if (!prefix.empty()) return (fs::path(prefix) / "share/jupyter/kernels").string();
  return "/usr/local/share/jupyter/kernels";
}

Result<std::string> InstallKernelspec(const std::string& kernels_dir,
                                      const KernelspecOptions& options) {
  namespace fs = std::filesystem;
  if (options.name.empty() ||
      options.name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                     "0123456789._-") != std::string::npos) {
    return InvalidArgument("kernelspec name may only contain letters, digits, '.', '_', '-'");
  }
  fs::path dir = fs::path(kernels_dir) / options.name;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Unavailable("cannot create " + dir.string() + ": " + ec.message());
  std::ofstream out(dir / "kernel.json", std::ios::trunc);
  out << KernelspecJson(options);
  out.close();
  if (!out) return Unavailable("cannot write " + (dir / "kernel.json").string());
  return dir.string();
}

}  // namespace nbos::jupyter
