// HostProvider: where the gateway's servers come from when the cluster scales itself (DESIGN §5).
// The gateway asks for servers when the scheduler decides to scale out (a tick's add_hosts, or a
// cell or kernel that no server can take), and gives back servers it has emptied: draining, no
// replicas left, no GPUs committed. A server that was asked for starts an `nbos daemon` that
// registers with the gateway's control service under the id the provider gave it; until then it
// is pending. A cloud or Kubernetes node pool implements this interface by creating and deleting
// machines (or nodes) whose boot starts `nbos daemon --server-id <id> --gateway <control>`.
//
// Threading: the gateway calls a provider from its monitor thread only.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace nbos::gateway {

class HostProvider {
 public:
  virtual ~HostProvider() = default;

  // Starts `count` new servers; returns their ids, pending until they register. May start fewer
  // (its own limit). Errors: Unavailable when it can start none.
  virtual Result<std::vector<std::string>> AddServers(int count) = 0;
  // Stops a server the gateway emptied; its id may be reused later. NotFound: not one of this
  // provider's servers.
  virtual Status RemoveServer(const std::string& server_id) = 0;
  // Ids asked for that have not registered yet.
  virtual std::vector<std::string> Pending() const = 0;
  // Servers it runs, pending ones included.
  virtual int Count() const = 0;
  // Whether the provider started (and may remove) this server.
  virtual bool Owns(const std::string& server_id) const = 0;
  // The gateway saw `server_id` register: no longer pending.
  virtual void OnRegistered(const std::string& server_id) = 0;
  // Called every monitor round: e.g. restart a server that exited without being asked to.
  virtual void Poll() {}
  // The gateway stops: the provider may stop its servers (the local one does).
  virtual void Shutdown() {}
};

}  // namespace nbos::gateway
