// The execution engine: an embedded CPython running cells through IPython's InteractiveShell
// (python/nbos_engine.py). One per process, driven from the thread that started it.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "jupyter/message.h"

namespace nbos::store {
class BlobStore;
}

namespace nbos::replica {

// What the engine needs from the process hosting it. Called on the engine's thread with the GIL
// held, except WriteStream, which other threads may call too.
class EngineHost {
 public:
  virtual ~EngineHost() = default;
  virtual void WriteStream(std::string_view name, std::string_view text) = 0;
  // Sends everything buffered on stdout/stderr (including captured fds) as stream messages.
  virtual void FlushStreams() = 0;
  // Publishes an iopub message with the current request as parent.
  virtual void Publish(std::string_view msg_type, std::string content_json,
                       std::string metadata_json, std::vector<std::string> buffers) = 0;
  // Asks the client for input over stdin and waits for the reply. Returns kUnavailable with a
  // Python exception set when the wait was interrupted (the engine re-raises it).
  virtual Result<std::string> RequestInput(std::string_view prompt, bool password) = 0;
};

class PythonEngine {
 public:
  // A warm replica process, before it knows its kernel: starts the interpreter on the calling
  // thread (which must later call Start), imports the engine's own modules (IPython's shell)
  // and `modules`, and compiles the engine's sources, so that Start only runs them and builds
  // the shell. At most once per process. Errors: Internal naming the module that failed to
  // import.
  static Status Preload(const std::vector<std::string>& modules);
  // After Preload: makes `env` ("KEY=VALUE" entries) the whole environment, of the process and
  // of os.environ alike.
  static Status ReplaceEnvironment(const std::vector<std::string>& env);

  // Starts the interpreter (unless preloaded) on the calling thread, which keeps the GIL between
  // calls. `connection_file` is what %connect_info shows; may be empty.
  static Result<std::unique_ptr<PythonEngine>> Start(EngineHost* host, std::string version,
                                                     std::string connection_file = "");
  ~PythonEngine();
  PythonEngine(const PythonEngine&) = delete;
  PythonEngine& operator=(const PythonEngine&) = delete;

  // kernel_info_reply content (static for the life of the process).
  const std::string& kernel_info_json() const { return kernel_info_json_; }

  // True for the message types Handle() answers or consumes.
  static bool Handles(std::string_view msg_type);
  // Runs one request. Returns the reply content as JSON text, or nullopt for messages that have
  // no reply (comm_*). A Python exception outside user code becomes kInternal with its text.
  Result<std::optional<std::string>> Handle(const jupyter::Message& request);

  // Saves history and runs IPython's exit hooks.
  void Shutdown();

  // Replication (nbos replica). After EnableReplication, every execute_request records the
  // namespace delta of its cell (python/nbos_state.py); large buffers go to `store`, which must
  // outlive the engine.
  Status EnableReplication(store::BlobStore* store, uint64_t replica_id);
  // The delta of the last executed cell (empty if none); names that could not be replicated were
  // reported on the cell's stderr.
  Result<std::string> TakeDelta();
  // On a standby: applies a delta the executor produced. Returns what this namespace then lacks
  // ("" when nothing): names the log bound whose values could not be rebuilt here, and why.
  Result<std::string> ApplyDelta(const std::string& delta);
  // Changes outside the namespace (cwd, environment, sys.path, package installs) of the last
  // executed cell as JSON, empty if none; and applying them on a standby.
  Result<std::string> TakeSideEffects();
  Status ApplySideEffects(const std::string& changes_json);
  // Then brings the execution count and input history to where the executor's were (`meta` of
  // its kDone entry).
  Status FinishStandby(const jupyter::Json& done_meta);
  // Whole-namespace checkpoint, and rebuilding the namespace from one plus later deltas.
  Result<std::string> Checkpoint();
  // `records`: (is_delta, payload) in log order; a non-delta is a side-effect record. Returns
  // what ApplyDelta returns.
  Result<std::string> Restore(const std::string& checkpoint,
                              const std::vector<std::pair<bool, std::string>>& records);

  // Runs pending Python signal handlers. Returns true, leaving the Python error set, when one of
  // them raised (e.g. KeyboardInterrupt). Requires the GIL.
  static bool RaiseIfSignalled();

  // Releases the GIL for its lifetime.
  class Unlocked {
   public:
    Unlocked();
    ~Unlocked();
    Unlocked(const Unlocked&) = delete;
    Unlocked& operator=(const Unlocked&) = delete;

   private:
    void* state_;
  };

 private:
  struct Impl;
  explicit PythonEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::string kernel_info_json_;
};

}  // namespace nbos::replica
