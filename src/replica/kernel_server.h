// `nbos kernel`: the execution engine served as a plain Jupyter kernel over ZeroMQ, with the five
// channels of a connection file. Shell and stdin are served on the main thread (which owns
// Python); control, heartbeat, output flushing and fd capture run on their own threads, so
// interrupt and shutdown are answered while a cell runs.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "jupyter/connection_file.h"
#include "replica/execution_gate.h"

namespace nbos::replica {

struct KernelOptions {
  jupyter::ConnectionInfo connection;
  std::string connection_file;  // shown by %connect_info
  std::string version;
  std::string log_level = "warn";
  int stream_flush_interval_ms = 200;
  size_t max_message_bytes = 512u << 20;
  // Set for `nbos replica`: makes the gate that puts elections and state replication around
  // every execution. Called once, on the main thread with SIGINT blocked, once logging is set up
  // and before the sockets are bound; the gate may still be starting when it returns
  // (ReplicaGate::StartInBackground).
  std::function<std::unique_ptr<ExecutionGate>()> start_gate;
};

// Serves until a shutdown_request (or the parent named by JPY_PARENT_PID exits), then ends the
// process with its exit code. Python is not finalized: a user's non-daemon thread would hold the
// exit forever, and IPython's own exit hooks have run by then. Call from the process's main
// thread before any other thread exists.
[[noreturn]] void RunKernel(const KernelOptions& options);

}  // namespace nbos::replica
