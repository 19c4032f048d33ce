// Sandboxes for replica processes: what one kernel's cells may see and use on a shared server.
//
// A sandboxed replica runs under bubblewrap (`bwrap`) with
//   - its own PID, IPC and UTS namespaces: no other process on the server is visible, so none
//     can be signalled or have its /proc (environ, cmdline, fds) read;
//   - a mount namespace where `/` is read-only, every `hidden` path (the daemon's state
//     directory, the gateway's, anything the operator names) is an empty tmpfs, the `writable`
//     paths inside them (the daemon's replica directories, a directory blob store, the
//     workspace root) are bound back read-write, /tmp is its own tmpfs (mode 1777, so writable by
//     the kernel's user id), /dev holds only the basic nodes and the `devices` (GPU nodes) named;
//   - only the environment it is given: the daemon's secrets (S3 credentials, tokens) are not
//     passed unless the replica needs them (an s3:// blob store);
//   - when the daemon runs as root, a user id of its kernel's own (SandboxUserId), taken by the
//     replica itself before it runs any cell (`nbos replica --run-as`), with its directory owned
//     by that id and mode 0700: the replicas directory is shared inside the sandbox (a warm
//     process learns its directory only when promoted), and ownership keeps kernels apart there;
//   - a cgroup of its own (ReplicaCgroups) limiting memory to the kernel's subscription and
//     weighting CPU by it, joined by the replica before it runs any cell (`--cgroup`).
//
// Pure argument and environment building here; the cgroup code touches only the tree it is
// given, so tests run it against a directory of plain files.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace nbos::daemon {

struct SandboxPolicy {
  std::string bwrap = "bwrap";            // the bubblewrap binary (PATH lookup if no slash)
  std::vector<std::string> hidden;        // absolute directories covered by an empty tmpfs
  std::vector<std::string> hidden_files;  // absolute files replaced by an empty one
  // Absolute paths bound read-only, visible even under a hidden path or /tmp (the nbos binary).
  std::vector<std::string> readable;
  std::vector<std::string> writable;    // absolute paths bound read-write (inside hidden ones)
  std::vector<std::string> devices;     // device nodes bound in (e.g. /dev/nvidia0)
  std::vector<std::string> env_passed;  // names (or PREFIX* patterns) kept from the daemon's env
};

// The daemon environment names a replica needs, before any operator addition: locale, PATH, the
// dynamic loader's path, CUDA's and NVIDIA's settings, the sanitizers' options (so a sanitizer
// build's replicas report as its daemon does). `blob_store_url` s3://... adds AWS_*.
std::vector<std::string> DefaultPassedEnvironment(std::string_view blob_store_url);

// What the sanitizers' options in `daemon_env` (NAME=VALUE; ASAN_, TSAN_, UBSAN_, LSAN_OPTIONS)
// name on disk: the directories of their absolute `log_path`s (`writable`, where replicas must
// write their reports instead of the stderr that a running cell's output captures) and their
// absolute `suppressions` files (`readable`, e.g. under a hidden /tmp).
struct SanitizerPaths {
  std::vector<std::string> writable;
  std::vector<std::string> readable;
};
SanitizerPaths SanitizerPathsIn(const std::vector<std::string>& daemon_env);

// `bwrap ... -- argv...`: the command that runs `argv` in the sandbox `policy` describes.
// argv[0] must be an absolute path visible read-only in the sandbox.
std::vector<std::string> SandboxCommand(const SandboxPolicy& policy,
                                        const std::vector<std::string>& argv);

// From `daemon_env` (NAME=VALUE strings), the entries `policy.env_passed` names, then `extra`
// (NAME=VALUE, later ones win). Sorted by name.
std::vector<std::string> SandboxEnvironment(const SandboxPolicy& policy,
                                            const std::vector<std::string>& daemon_env,
                                            const std::vector<std::string>& extra);

// The user (and group) id of `kernel_id`'s replicas: base + FNV-1a(kernel_id) mod range, the
// same on every server, so a kernel's files in a shared directory store keep one owner.
uint32_t SandboxUserId(std::string_view kernel_id, uint32_t base, uint32_t range);

// `name` if it holds a slash, else the first executable `name` on $PATH (name itself if none).
std::string FindExecutable(const std::string& name);

// A directory blob store shared by replicas of many user ids: each can create blobs and read the
// ones it names, none can list what others wrote (names are content hashes). Makes `root`
// root-owned mode 0711 with its 256 fan-out directories ahead, mode 01733 (sticky).
Status PrepareSharedBlobDirectory(const std::string& root);

// Whether bubblewrap can build a sandbox here and run `probe` in it (e.g. `nbos --version`, which
// also shows that the binary is visible inside); the error says why not.
Status ProbeSandbox(const SandboxPolicy& policy,
                    const std::vector<std::string>& probe = {"/bin/true"});

// Per-replica cgroups under the daemon's own, for cgroup v2 (one unified tree) or v1 (the
// memory and cpu controllers' trees). Not thread-safe: the Supervisor calls it under its lock.
class ReplicaCgroups {
 public:
  // Finds the daemon's cgroups from `proc_self_cgroup` (the text of /proc/self/cgroup) under
  // `root` (/sys/fs/cgroup) and makes `group` (e.g. nbos-host-1) under each. With v2, a parent
  // that holds processes cannot delegate controllers, so the daemon moves itself into a leaf
  // `<group>/daemon` first. Unavailable when neither memory controller is writable.
  static Result<ReplicaCgroups> Open(const std::string& root, std::string_view proc_self_cgroup,
                                     const std::string& group);

  // Creates (or updates) the replica's cgroup `name` with a memory limit of `memory_mb` (swap
  // included where the kernel allows it) and a CPU weight for `millicpus`. Returns the
  // cgroup directories the replica joins (one for v2, memory and cpu for v1).
  Result<std::vector<std::string>> Create(const std::string& name, int64_t memory_mb,
                                          int64_t millicpus);
  // How many times the kernel's OOM killer has killed a process of `name` (0 if unknown).
  uint64_t OomKills(const std::string& name) const;
  // Removes `name` (its processes must be gone); missing is fine.
  void Remove(const std::string& name);
  // Removes the group directories themselves when nothing is left in them (daemon shutdown).
  void RemoveGroups();
  // Removes the empty replica cgroups an earlier daemon of this group left (it was killed).
  void RemoveStale();

  bool unified() const { return unified_; }
  // The directories the replicas' cgroups are made in (a replica writes to its own there).
  std::vector<std::string> group_dirs() const;

 private:
  bool unified_ = false;
  std::string memory_dir_;  // v2: the one tree
  std::string cpu_dir_;     // v1 only; may be empty (no CPU weights)
};

}  // namespace nbos::daemon
