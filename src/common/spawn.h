// Starting child processes from a multi-threaded program (the daemon's replicas, the gateway's
// local servers): posix_spawn, which glibc implements like vfork, so no other thread's locks are
// copied into the child.
#pragma once

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "common/status.h"

namespace nbos {

// This process's environment as NAME=VALUE strings, with `overrides` applied in order.
std::vector<std::string> BuildEnvironment(
    const std::vector<std::map<std::string, std::string>>& overrides);

// Starts `argv` in its own process group with default signal handling and mask, stdin from
// `stdin_fd` (-1: /dev/null), stdout and stderr to `log_fd`, no other inherited descriptors, in
// `cwd`. Returns the pid. Errors: Internal with errno's text. The child's parent is one thread
// that lives as long as this process, whichever thread calls: a parent-death signal the child
// asks for (bubblewrap's --die-with-parent, PR_SET_PDEATHSIG) fires when this process exits, not
// when the calling thread does (a gRPC worker thread ends when its pool shrinks).
Result<pid_t> SpawnProcess(std::vector<std::string>& argv, std::vector<std::string>& envp,
                           int stdin_fd, int log_fd, const std::string& cwd);

// One process as its /proc/PID/stat says.
struct ProcessEntry {
  pid_t pid = 0;
  char state = '?';  // R, S, Z...
  pid_t ppid = 0;
  pid_t pgrp = 0;
};

// Every process of this PID namespace (from /proc); ones that exit meanwhile are skipped.
std::vector<ProcessEntry> ListProcesses();

}  // namespace nbos
