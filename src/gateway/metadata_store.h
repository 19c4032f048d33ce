// The gateway's durable metadata: every kernel with its resources and replicas, in SQLite (WAL,
// synchronous=FULL), so a gateway restart keeps every kernel and clients reconnect. A write that
// another process holds the database against waits up to 2 s, then fails with kUnavailable.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "jupyter/message.h"

struct sqlite3;

namespace nbos::gateway {

struct StoredReplica {
  uint32_t replica_id = 0;
  std::string server_id;
  std::string raft_address;
  std::string connection_json;  // Jupyter connection file contents
  // Removed from the kernel's Raft group ahead of its replacement (Migrator::LeaveIfLost), which
  // has not been recorded yet: a restarted gateway must not count it live again.
  bool left_group = false;
};

struct StoredKernel {
  std::string kernel_id;
  std::string kernelspec;
  std::string key;
  std::string session_id;
  jupyter::Json resources = jupyter::Json::object();  // millicpus, memory_mb, gpus, vram_mb
  std::string created;
  std::vector<StoredReplica> replicas;
  // The environment the kernel was started with (KERNEL_* and allowed names): restarted and
  // migrated replicas get it too.
  std::map<std::string, std::string> env;
  // Blob key of the state the replicas start from: set when the kernel is suspended (it then has
  // no replicas) and kept after it resumes, for replicas that join its group before the group's
  // first Raft snapshot. Empty: a kernel that was never suspended.
  std::string checkpoint;
  // The user who started the kernel (http::Identity::user); only they and admins may use it.
  // Empty: started by an unnamed caller, or recorded before kernels had owners.
  std::string owner;
  // Set while the recorded replicas are in passage around `checkpoint`: a resume's new replicas
  // until they have all answered, or a suspension's old ones until they are stopped. A gateway
  // restarted meanwhile restores the kernel suspended on `checkpoint`, and those replicas, unknown
  // to it, are stopped as orphans.
  bool resuming = false;
  // Set while a new kernel's replicas are recorded but have not all answered yet (its client has
  // had no 201): a gateway restarted meanwhile forgets the kernel, and its replicas, unknown to
  // it, are stopped as orphans.
  bool starting = false;
  // Set from a restart's first step (before its old replicas are stopped) until its new replicas
  // have all answered: a gateway restarted meanwhile restarts the kernel again, since its
  // recorded replicas may be stopped ones, or new ones under a key it never recorded.
  bool restarting = false;
};

class MetadataStore {
 public:
  // Creates the file and schema if needed. Errors: Unavailable when the file cannot be opened.
  static Result<std::unique_ptr<MetadataStore>> Open(const std::string& path);
  ~MetadataStore();

  Status Put(const StoredKernel& kernel);  // insert or replace
  Status Remove(const std::string& kernel_id);
  Result<std::vector<StoredKernel>> List();

 private:
  explicit MetadataStore(sqlite3* db);
  Status Exec(const char* sql);
  sqlite3* db_;
};

}  // namespace nbos::gateway
