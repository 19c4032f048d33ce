// Replica processes of one daemon: each `nbos replica` runs in its own process group, with its
// stdout and stderr appended to DIR/replica.log, watched by one thread that reaps it with
// waitpid and restarts it from the same data directory when it dies unexpectedly.
//
// A replica's directory DIR holds connection.json (the Jupyter connection file it binds),
// data/ (its Raft log and snapshots) and replica.log. With `raft_log_root` set, the Raft log and
// snapshots live in RAFT_LOG_ROOT/<DIR's name> instead (RAM, see DaemonOptions::raft_log_dir);
// that directory goes with the replica's Stop() whether or not its directory is kept.
//
// Warm pool: the Supervisor can keep pre-started `nbos replica --warm` processes (Python and
// its heavy modules already loaded; a process says "ready" on its stdin socket once they are).
// A launch or restart takes one when there is one, a ready one first, sending it
// the replica's arguments, environment, directory and log over its stdin, and then supervises it
// like any other replica; the pool is topped up on the watch thread, `warm_refill_delay` after
// the last promotion (so as not to slow the replicas just promoted). Warm processes that keep
// dying disable the pool (cold starts go on).
//
// Sandbox (sandbox.h): with `sandbox` set, every replica and warm process runs under bubblewrap
// with only the environment the policy passes; with `sandbox_users`, each kernel's replicas take
// their own user id (its directory is chowned to it, mode 0700); with `cgroups`, each replica gets
// a cgroup limited to its Prepare()'s limits. A replica killed by its cgroup's OOM killer is
// reported with `exit_reason` "out of memory ...". The pid of a sandboxed replica is bubblewrap's
// (the process group leader); Stop() sends SIGTERM to the rest of its group, so the replica shuts
// down before bubblewrap reports its exit.
//
// Thread-safe. Lock order for callers: the Supervisor never calls `on_exit` with its own lock
// held, so `on_exit` may take the caller's locks, and the caller may call into the Supervisor
// while holding its own locks (but not from inside `on_exit`, which runs on the watch thread).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/thread_annotations.h"
#include "daemon/ledger.h"
#include "daemon/sandbox.h"
#include "jupyter/connection_file.h"
#include "workspace/workspace.h"

namespace nbos::daemon {

enum class ReplicaState {
  kPrepared,    // directory and connection file exist; no process yet
  kRunning,     // a process is alive
  kRestarting,  // it died unexpectedly; a new one starts after the restart delay
  kExited,      // it exited with status 0, or kept dying past the restart budget
  kStopped,     // only while Stop() tears it down; Stop() then forgets it
};

// control.proto's spelling: "prepared" | "running" | "restarting" | "exited" | "stopped".
std::string_view ReplicaStateName(ReplicaState state);

struct ReplicaProcess {
  ReplicaKey key;
  ReplicaState state = ReplicaState::kPrepared;
  pid_t pid = 0;            // 0 when no process runs
  int exit_code = 0;        // last exit: the status, or -SIGNAL when killed by a signal
  uint32_t restarts = 0;    // restarts after unexpected exits, over the replica's life
  std::string exit_reason;  // why the last exit happened, when known ("out of memory: ...")
  uint32_t uid = 0;         // the sandbox user id (0: the daemon's own)
  std::string dir;
  std::string raft_dir;  // its Raft log and snapshots: DIR/data or RAFT_LOG_ROOT/<DIR's name>
  std::string raft_address;
  jupyter::ConnectionInfo connection;
};

struct SupervisorOptions {
  std::string nbos_binary;  // path of `nbos`
  std::string log_level = "info";
  std::string raft_log_root;  // empty: each replica's Raft log in DIR/data (see above)
  // Restart budget: at most `max_restarts` restarts within any `restart_window`.
  int max_restarts = 5;
  std::chrono::milliseconds restart_window{std::chrono::minutes(5)};
  std::chrono::milliseconds restart_delay{std::chrono::milliseconds(300)};
  // Stop: SIGTERM to the process group, SIGKILL after this long.
  std::chrono::milliseconds stop_grace{std::chrono::seconds(5)};
  std::chrono::milliseconds poll_interval{std::chrono::milliseconds(25)};
  // Called on the watch thread after a replica's process exited without a Stop() asking for it
  // (its GPUs must be released). `restarting` tells whether a new process will follow.
  std::function<void(const ReplicaKey& key, int exit_code, bool restarting)> on_exit;
  // Warm processes to keep ready (0: none); they log to warm_dir/warm-N.log until promoted.
  int warm_pool_size = 0;
  std::string warm_dir;
  std::vector<std::string> warm_preload;  // Python modules they import ahead (--preload)
  std::chrono::milliseconds warm_refill_delay{std::chrono::milliseconds(500)};
  // Sandboxing (see above).
  bool sandbox = false;
  SandboxPolicy sandbox_policy;  // env_passed without the blob store's (added per launch)
  bool sandbox_users = false;
  uint32_t sandbox_uid_base = 1u << 30;
  uint32_t sandbox_uid_range = 1u << 24;
  std::shared_ptr<ReplicaCgroups> cgroups;  // null: no per-replica limits
  std::string workspace_root;               // DaemonOptions::workspace_root
};

// What a replica may use (its kernel's subscription); 0: unlimited.
struct ReplicaLimits {
  int64_t memory_mb = 0;
  int64_t millicpus = 0;
};

struct WarmPoolStats {
  int ready = 0;          // warm processes waiting, preloaded
  int starting = 0;       // warm processes still preloading
  uint64_t promoted = 0;  // launches and restarts that took one
  uint64_t cold = 0;      // launches and restarts that started a fresh process
  uint64_t died = 0;      // warm processes that exited before promotion
  bool disabled = false;  // too many died: the pool is off
};

class Supervisor {
 public:
  explicit Supervisor(SupervisorOptions options);
  // Stops every process (keeping the directories) and joins the watch thread.
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Registers a replica: creates `dir` and its Raft directory (emptied when it is left from an
  // earlier replica) and writes dir/connection.json. Preparing a replica that is already known is
  // InvalidArgument.
  Status Prepare(const ReplicaKey& key, const std::string& dir,
                 const jupyter::ConnectionInfo& connection, const std::string& raft_address,
                 ReplicaLimits limits = {}) EXCLUDES(mu_);

  // Starts a prepared (or exited) replica's process:
  //   nbos replica -f DIR/connection.json --id N --raft ADDR
  //     --data-dir RAFT_DIR --blob-store URL --log-level L [--peer=ID=ADDR]...
  //     [--workspace-root ROOT --workspace V --working-dir W]
  // with `env` added to the daemon's environment, plus NBOS_KERNEL_ID, NBOS_REPLICA_ID and
  // CUDA_DEVICE_ORDER=PCI_BUS_ID (so CUDA numbers devices as NVML does). With `workspace`
  // (checked by the caller; ROOT is SupervisorOptions::workspace_root) the replica mounts it in
  // its sandbox and runs there. The arguments are remembered for restarts. Returns the pid; a
  // replica already running (or restarting) keeps its process and arguments and returns its pid
  // (0 while restarting). NotFound for unknown replicas, Internal when the process cannot be
  // spawned.
  Result<pid_t> Launch(const ReplicaKey& key,
                       const std::vector<std::pair<uint32_t, std::string>>& peers,
                       const std::string& blob_store_url,
                       const std::map<std::string, std::string>& env,
                       const std::optional<workspace::KernelWorkspace>& workspace = std::nullopt)
      EXCLUDES(mu_);

  // Stops the replica's process group (SIGTERM, SIGKILL after stop_grace; anything left in the
  // group is killed too), removes DIR unless `keep_data` (a Raft directory outside DIR always),
  // and forgets the replica. Blocks until the process is reaped. NotFound for unknown replicas.
  Status Stop(const ReplicaKey& key, bool keep_data) EXCLUDES(mu_);

  // Stops every replica at once (one grace period in total) and forgets them all; stops the
  // warm pool for good.
  void StopAll(bool keep_data) EXCLUDES(mu_);

  std::optional<ReplicaProcess> Get(const ReplicaKey& key) const EXCLUDES(mu_);
  std::vector<ReplicaProcess> List() const EXCLUDES(mu_);
  WarmPoolStats warm_pool() const EXCLUDES(mu_);

 private:
  struct Child {
    ReplicaProcess info;
    std::vector<std::string> argv;  // empty until launched
    std::vector<std::string> envp;
    bool stopping = false;
    std::deque<std::chrono::steady_clock::time_point> restart_times;
    std::chrono::steady_clock::time_point restart_at;
    ReplicaLimits limits;
    uint64_t oom_kills = 0;                   // the cgroup's count when the process started
    std::vector<std::string> extra_writable;  // sandbox binds of this replica alone
  };
  struct WarmProcess {
    pid_t pid = 0;
    int stdin_fd = -1;  // our end of the socket that is its stdin
    bool ready = false;
  };
  struct ExitEvent {
    ReplicaKey key;
    int exit_code;
    bool restarting;
  };

  Status Spawn(Child& child) REQUIRES(mu_);
  // Sandbox set-up at launch: the user id, the directory's owner, the cgroup, and the replica's
  // --run-as / --cgroup arguments.
  Status PrepareSandbox(Child& child, const std::string& blob_store_url) REQUIRES(mu_);
  // Records why `child` exited when its cgroup says the OOM killer did it.
  void NoteOutOfMemory(Child& child) REQUIRES(mu_);
  // Hands `child` to a warm process; false (and the process discarded) if none takes it.
  bool Promote(Child& child) REQUIRES(mu_);
  Status SpawnWarm() REQUIRES(mu_);
  // Reaps warm processes that died and tops the pool up.
  void TendWarmPool() REQUIRES(mu_);
  void StopWarmPool() REQUIRES(mu_);
  void Watch() EXCLUDES(mu_);  // the watch thread
  // Reaps exited children and starts due restarts. Appends unexpected exits.
  void Poll(std::vector<ExitEvent>* exits) REQUIRES(mu_);
  // Signals and waits for the given children, letting go of mu_ while it waits; SIGKILL after
  // the grace.
  void TerminateLocked(const std::vector<ReplicaKey>& keys) REQUIRES(mu_);
  // Whether none of `keys` has a process left (or is known at all).
  bool AllReaped(const std::vector<ReplicaKey>& keys) const REQUIRES(mu_);
  // Waits up to `timeout` (mu_ let go of meanwhile) until AllReaped(keys); whether it is.
  bool AwaitReaped(const std::vector<ReplicaKey>& keys, std::chrono::milliseconds timeout)
      REQUIRES(mu_);
  std::string RaftDirectory(const std::string& dir) const;
  std::vector<std::string> DirectoriesToRemove(const ReplicaProcess& info, bool keep_data) const;

  const SupervisorOptions options_;
  mutable Mutex mu_;
  CondVar cv_;  // wakes the watch thread and Stop() waiters
  std::map<ReplicaKey, Child> children_ GUARDED_BY(mu_);
  bool shutdown_ GUARDED_BY(mu_) = false;
  std::deque<WarmProcess> warm_ GUARDED_BY(mu_);  // oldest first
  WarmPoolStats warm_stats_ GUARDED_BY(mu_);      // (ready, starting derived from warm_)
  std::deque<std::chrono::steady_clock::time_point> warm_deaths_ GUARDED_BY(mu_);
  uint64_t warm_spawned_ GUARDED_BY(mu_) = 0;
  bool warm_closed_ GUARDED_BY(mu_) = false;
  std::chrono::steady_clock::time_point last_promotion_ GUARDED_BY(mu_);
  std::thread watcher_;
};

}  // namespace nbos::daemon
