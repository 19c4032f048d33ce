#include "workspace/workspace.h"

#include <fmt/format.h>

#include <filesystem>
#include <system_error>

namespace nbos::workspace {
namespace {

namespace fs = std::filesystem;

// A user name as one directory name: no separator, not "." or "..", nothing hidden.
bool IsDirectoryName(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.front() != '.' &&
         name.find('/') == std::string_view::npos && name.find('\0') == std::string_view::npos;
}

std::string Join(const std::string& dir, std::string_view rest) {
  return dir == "/" ? "/" + std::string(rest) : dir + "/" + std::string(rest);
}

std::string Parent(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

Result<std::string> NormalPath(std::string_view path) {
  if (path.empty() || path.front() != '/') {
    return InvalidArgument(fmt::format("'{}' is not an absolute path", path));
  }
  if (path.find('\0') != std::string_view::npos) return InvalidArgument("a path holds a NUL");
  std::vector<std::string_view> parts;
  size_t at = 0;
  while (at < path.size()) {
    size_t end = path.find('/', at);
    if (end == std::string_view::npos) end = path.size();
    const std::string_view part = path.substr(at, end - at);
    at = end + 1;
    if (part.empty() || part == ".") continue;
    if (part == "..") {
      if (parts.empty()) return InvalidArgument(fmt::format("'{}' climbs above /", path));
      parts.pop_back();
      continue;
    }
    parts.push_back(part);
  }
  std::string out;
  for (std::string_view p : parts) out.append("/").append(p);
  return out.empty() ? "/" : out;
}

bool Contains(std::string_view dir, std::string_view path) {
  if (dir == "/") return true;
  return path == dir || (path.starts_with(dir) && path[dir.size()] == '/');
}

Result<KernelWorkspace> Resolve(const WorkspaceRequest& request) {
  auto root = NormalPath(request.root);
  if (!root.ok()) return root.status();
  KernelWorkspace ws{*root, *root};
  if (!request.owner.empty()) {
    if (!IsDirectoryName(request.owner)) {
      return InvalidArgument(
          fmt::format("user '{}' cannot have a workspace directory: the name is no directory name",
                      request.owner));
    }
    ws.visible = Join(*root, request.owner);
  }
  std::string asked = request.working_dir;
  if (asked.empty() && !request.path.empty()) {
    if (request.path.front() == '/') {
      return InvalidArgument("the start request's path is relative to the workspace, not '" +
                             request.path + "'");
    }
    asked = Join(ws.visible, request.path);
    if (asked.ends_with(".ipynb")) asked = Parent(asked);  // a notebook: its directory
  }
  if (asked.empty()) {
    ws.working_dir = ws.visible;
    return ws;
  }
  auto working = NormalPath(asked);
  if (!working.ok()) return InvalidArgument("working directory: " + working.status().message());
  if (!Contains(ws.visible, *working)) {
    return InvalidArgument(fmt::format(
        "the working directory {} is outside the workspace {} this kernel may use (nbos gateway "
        "--workspace-root{})",
        *working, ws.visible, request.owner.empty() ? "" : ", one directory per user"));
  }
  ws.working_dir = *working;
  return ws;
}

Result<KernelWorkspace> CheckOnServer(const std::string& root, const KernelWorkspace& workspace,
                                      const std::vector<std::string>& state_paths) {
  std::error_code ec;
  const fs::path real_root = fs::canonical(root, ec);
  if (ec) {
    return Unavailable(fmt::format(
        "the workspace root {} is missing on this server ({}): is the shared workspace mounted?",
        root, ec.message()));
  }
  KernelWorkspace real;
  for (auto [dir, out] : {std::pair{&workspace.visible, &real.visible},
                          std::pair{&workspace.working_dir, &real.working_dir}}) {
    const fs::path resolved = fs::canonical(*dir, ec);
    if (ec) {
      return Unavailable(fmt::format(
          "the workspace directory {} is missing on this server ({}): is the shared workspace "
          "mounted, and does the directory exist?",
          *dir, ec.message()));
    }
    if (!fs::is_directory(resolved, ec)) {
      return InvalidArgument(fmt::format("{} is not a directory", *dir));
    }
    *out = resolved.string();
    if (!Contains(real_root.string(), *out)) {
      return InvalidArgument(
          fmt::format("{} leads out of the workspace root {} (to {})", *dir, root, *out));
    }
  }
  if (!Contains(real.visible, real.working_dir)) {
    return InvalidArgument(
        fmt::format("{} leads out of {}", workspace.working_dir, workspace.visible));
  }
  if (real.visible == real_root.string()) return real;
  for (const std::string& state : state_paths) {
    const fs::path resolved = fs::weakly_canonical(state, ec);
    if (!ec && Contains(real_root.string(), resolved.string()) &&
        !Contains(real.visible, resolved.string())) {
      return InvalidArgument(fmt::format(
          "the workspace root {} holds {}, which a kernel's replica would hide from itself: keep "
          "nbos's state out of the workspace",
          root, state));
    }
  }
  return real;
}

}  // namespace nbos::workspace
