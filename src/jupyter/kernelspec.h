// Installing the `nbos` kernelspec, so Jupyter tools start `nbos kernel` like any other kernel.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace nbos::jupyter {

struct KernelspecOptions {
  std::string name = "nbos";
  std::string display_name = "Python 3 (nbos)";
  std::vector<std::string> argv;  // must contain "{connection_file}"
};

// kernel.json text for `options`.
std::string KernelspecJson(const KernelspecOptions& options);

// Where `jupyter kernelspec install` would put a spec: --user → $JUPYTER_DATA_DIR or
// ~/.local/share/jupyter; --prefix P → P/share/jupyter; neither → /usr/local/share/jupyter.
std::string KernelsDir(bool user, const std::string& prefix);

// Writes <kernels_dir>/<name>/kernel.json; returns the spec directory.
Result<std::string> InstallKernelspec(const std::string& kernels_dir,
                                      const KernelspecOptions& options);

}  // namespace nbos::jupyter
