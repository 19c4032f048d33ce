// A kernel's workspace: the directory tree its notebook lives in, which every replica of the
// kernel sees at the same path and writes to (docs/decisions/0015-workspace.md).
//
// The operator exports a workspace root (`nbos gateway --workspace-root`, and the same directory,
// a shared filesystem across machines, mounted at the same path on every server: `nbos daemon
// --workspace-root`). A kernel sees `visible`: the whole root, or, when the gateway knows who
// started the kernel (users file, JupyterHub), that user's own subtree ROOT/<user>. Its cells
// start in `working_dir`, the notebook's directory inside it (KERNEL_WORKING_DIR, or the start
// request's `cwd` or `path`).
//
// Resolve is pure (lexical, no filesystem access): the gateway refuses a start whose directory
// lies elsewhere. CheckOnServer runs where the replica will run and follows symbolic links: a
// directory missing there (the shared filesystem not mounted) or leading out of the root is an
// error, never a silent fallback to a private directory.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace nbos::workspace {

// Environment entries of a kernel start (and of its replicas' launch) that carry its workspace:
// the visible directory (set by the gateway only: clients cannot widen it) and the working one.
inline constexpr char kVisibleEnv[] = "NBOS_WORKSPACE";
inline constexpr char kWorkingDirEnv[] = "KERNEL_WORKING_DIR";

struct KernelWorkspace {
  std::string visible;      // absolute, lexically normal
  std::string working_dir;  // absolute, lexically normal, inside `visible`
  bool operator==(const KernelWorkspace&) const = default;
};

struct WorkspaceRequest {
  std::string root;         // the exported root (absolute)
  std::string owner;        // the kernel's user when the gateway knows users; "" otherwise
  std::string working_dir;  // KERNEL_WORKING_DIR or the start request's `cwd`; "" if none
  // The start request's `path`, relative to `visible` (a notebook's path names its directory);
  // used when `working_dir` is empty.
  std::string path;
};

// "/a/b" for "/a//b/./c/..": absolute, no empty, "." or ".." components, no trailing slash.
// InvalidArgument for a relative path, one that climbs above "/", or one holding a NUL.
Result<std::string> NormalPath(std::string_view path);

// Whether normal path `path` is `dir` or lies under it.
bool Contains(std::string_view dir, std::string_view path);

// The workspace of a kernel start. InvalidArgument when the directory asked for lies outside
// what the kernel may see, or the owner's name cannot be a directory name.
Result<KernelWorkspace> Resolve(const WorkspaceRequest& request);

// On the server a replica runs on: both directories exist there, are directories, and resolve
// (symbolic links followed) inside `root`; `visible` that is not the root itself must not hold
// any of `state_paths` (the daemon's state, replica and Raft directories, a directory blob
// store), which the replica hides from itself when it mounts its workspace. Returns the resolved
// directories. Unavailable (missing: is the shared workspace mounted?), InvalidArgument
// (outside the root, not a directory).
Result<KernelWorkspace> CheckOnServer(const std::string& root, const KernelWorkspace& workspace,
                                      const std::vector<std::string>& state_paths);

}  // namespace nbos::workspace
