#include "workspace/workspace_mount.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/mount.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "workspace/workspace.h"

namespace nbos::workspace {
namespace {

std::string Errno(const char* what) { return fmt::format("{}: {}", what, std::strerror(errno)); }

bool WriteText(const std::string& path, const std::string& text) {
  const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  close(fd);
  return ok;
}

// A user namespace that maps `owner` to the kernel's ids, as a file descriptor: a child made only
// to hold it, stopped once its namespace file is open. -1 (errno set) when it cannot be made.
int IdMappingNamespace(uid_t owner_uid, gid_t owner_gid, uint32_t uid, uint32_t gid) {
  int ready[2], release[2];
  if (pipe2(ready, O_CLOEXEC) != 0) return -1;
  if (pipe2(release, O_CLOEXEC) != 0) {
    close(ready[0]);
    close(ready[1]);
    return -1;
  }
  const pid_t child = fork();
  if (child == 0) {
    close(ready[0]);
    close(release[1]);  // else the read below never sees the parent close its end
    char byte = unshare(CLONE_NEWUSER) == 0 ? 'y' : 'n';
    (void)!write(ready[1], &byte, 1);
    (void)!read(release[0], &byte, 1);  // returns when the parent closes its end
    _exit(0);
  }
  close(ready[1]);
  close(release[0]);
  char byte = 'n';
  int ns = -1;
  if (child > 0 && read(ready[0], &byte, 1) == 1 && byte == 'y') {
    const std::string proc = "/proc/" + std::to_string(child);
    if (WriteText(proc + "/uid_map", fmt::format("{} {} 1\n", owner_uid, uid)) &&
        WriteText(proc + "/setgroups", "deny") &&
        WriteText(proc + "/gid_map", fmt::format("{} {} 1\n", owner_gid, gid))) {
      ns = open((proc + "/ns/user").c_str(), O_RDONLY | O_CLOEXEC);
    }
  }
  const int saved = errno;
  close(ready[0]);
  close(release[1]);
  if (child > 0) waitpid(child, nullptr, 0);
  errno = saved;
  return ns;
}

// Maps the owner of `visible` onto the kernel's ids on the detached tree `tree`; "" or why not.
std::string MapOwner(int tree, const WorkspaceMount& m) {
  struct stat st {};
  if (stat(m.visible.c_str(), &st) != 0) return Errno("stat");
  const int ns = IdMappingNamespace(st.st_uid, st.st_gid, m.uid, m.gid);
  if (ns < 0) return Errno("user namespace for the id mapping");
  mount_attr attr{};
  attr.attr_set = MOUNT_ATTR_IDMAP;
  attr.userns_fd = static_cast<uint64_t>(ns);
  const int rc = mount_setattr(tree, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr, sizeof attr);
  const std::string why = rc == 0 ? "" : Errno("idmapped mount");
  close(ns);
  return why;
}

// Creates the directories from `root` (a fresh tmpfs) down to `path`, root-owned, mode 0755.
Status MakeDirectories(const std::string& root, const std::string& path) {
  size_t at = root.size();
  while (at < path.size()) {
    const size_t end = std::min(path.find('/', at + 1), path.size());
    const std::string dir = path.substr(0, end);
    if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      return Unavailable(Errno(("mkdir " + dir).c_str()));
    }
    at = end;
  }
  return Status::Ok();
}

}  // namespace

Result<std::string> MountWorkspace(const WorkspaceMount& m) {
  const bool narrower = m.visible != m.root;
  if (narrower && !Contains(m.root, m.visible)) {
    return Unavailable(fmt::format("{} is not inside {}", m.visible, m.root));
  }
  const int tree =
      open_tree(AT_FDCWD, m.visible.c_str(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
  if (tree < 0) {
    if (narrower) return Unavailable("cannot isolate the workspace: " + Errno("open_tree"));
    return "files keep their owners: " + Errno("open_tree");  // the daemon's bind stays
  }
  std::string note = MapOwner(tree, m);
  if (!note.empty()) note = "files keep their owners: " + note;
  Status placed = Status::Ok();
  if (narrower) {
    if (mount("tmpfs", m.root.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755") != 0) {
      placed = Unavailable(Errno(("covering " + m.root).c_str()));
    } else {
      placed = MakeDirectories(m.root, m.visible);
    }
  }
  if (placed.ok() &&
      move_mount(tree, "", AT_FDCWD, m.visible.c_str(), MOVE_MOUNT_F_EMPTY_PATH) != 0) {
    placed = Unavailable(Errno(("mounting " + m.visible).c_str()));
  }
  close(tree);
  if (!placed.ok()) {
    return Unavailable("cannot mount the workspace " + m.visible + ": " + placed.message());
  }
  return note;
}

}  // namespace nbos::workspace
