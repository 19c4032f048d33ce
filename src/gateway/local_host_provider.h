// LocalHostProvider: the HostProvider of `nbos up --max-hosts M`: each server is an `nbos
// daemon` process on this machine with virtual GPUs, started by the gateway. Ids are host-1 ..
// host-M, each with its own state directory (STATE/host-i, removed with the server), log
// (STATE/logs/host-i.log) and slice of the replica port range. A pid file per server
// (STATE/hosts/host-i.pid) lets a restarted gateway adopt the servers the previous one started.
// A server that exits without being asked to is started again, as `nbos up` does with its own.
// Shutdown() stops every server it runs.
#pragma once

#include <sys/types.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "daemon/ports.h"
#include "gateway/host_provider.h"

namespace nbos::gateway {

struct LocalHostOptions {
  std::string nbos_binary;      // the `nbos` executable
  std::string control_address;  // the gateway's control service, "host:port"
  std::string state_dir;        // servers' directories, logs and pid files live under it
  std::string blob_store_url;   // shared by every server's replicas
  std::string credential_file;  // the cluster credential (--credential); empty: none
  int gpus_per_host = 1;
  int warm_pool = 1;
  std::string sandbox = "auto";  // the servers' --sandbox; state_dir is hidden from replicas
  std::vector<std::string> sandbox_share;  // the servers' --sandbox-share
  std::string raft_log_dir = "auto";       // the servers' --raft-log-dir
  std::string workspace_root;              // the servers' --workspace-root; empty: none
  int max_hosts = 3;                       // ids host-1 .. host-max_hosts
  daemon::PortRange ports;                 // split evenly among max_hosts servers
  std::string log_level = "info";
};

// The command line of local server host-`index` (1 .. max_hosts) of `options`: virtual GPUs, its
// own directory under state_dir and slice of the port range, state_dir hidden from its replicas.
// `nbos up` starts a fixed cluster's servers with it too.
std::vector<std::string> LocalDaemonArgv(const LocalHostOptions& options, int index);

class LocalHostProvider : public HostProvider {
 public:
  explicit LocalHostProvider(LocalHostOptions options);
  ~LocalHostProvider() override;

  Result<std::vector<std::string>> AddServers(int count) override;
  Status RemoveServer(const std::string& server_id) override;
  std::vector<std::string> Pending() const override;
  int Count() const override { return static_cast<int>(servers_.size()); }
  bool Owns(const std::string& server_id) const override;
  void OnRegistered(const std::string& server_id) override;
  void Poll() override;
  void Shutdown() override;

 private:
  struct Server {
    pid_t pid = -1;
    bool child = true;  // started by this process (else adopted: not waitable)
  };
  void Adopt();
  Status Start(const std::string& id);
  void Stop(const std::string& id, Server& server);
  std::string PidFile(const std::string& id) const;

  const LocalHostOptions options_;
  std::map<std::string, Server> servers_;
  std::set<std::string> pending_;
};

}  // namespace nbos::gateway
