// The replica's side of its workspace under the daemon's sandbox (the I/O edge of workspace.h).
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace nbos::workspace {

struct WorkspaceMount {
  std::string root;     // the exported root, bound into every sandbox by the daemon
  std::string visible;  // what this kernel sees of it (the root, or its user's subtree)
  uint32_t uid = 0;     // the kernel's user and group ids in the sandbox
  uint32_t gid = 0;
};

// Inside a replica's sandbox (its own mount namespace), as root, before the process takes the
// kernel's user id: `visible` becomes the only part of `root` this process sees (a tmpfs covers
// the rest; mounts below `visible`, such as hidden state, stay), and the files of `visible`'s
// owner read and write as the kernel's uid:gid (an idmapped mount: what the kernel creates belongs
// to that owner on disk, so the user's tools, the front end and every replica share the files).
// Returns "" when all of that holds, or a note when the filesystem cannot map ids (files then
// keep their owners and permissions decide). Errors: Unavailable when `visible` cannot be made
// the only part seen (the kernel must not start then).
Result<std::string> MountWorkspace(const WorkspaceMount& mount);

}  // namespace nbos::workspace
