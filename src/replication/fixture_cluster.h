// Test support: a group of StateMachines on C-Raft's in-memory fixture (virtual time, simulated
// network and disk, fault injection), so tests of any state machine replay a cluster exactly.
#pragma once

#include <memory>
#include <string>
#include <vector>

extern "C" {
#include <raft.h>
#include <raft/fixture.h>
}

#include "replication/replicated_log.h"

namespace nbos::replication {

class FixtureCluster {
 public:
  static constexpr raft_time kTimeout = 20000;  // virtual ms

  // The first `voters` of `machines` are bootstrapped as voters; the machines outlive the cluster.
  FixtureCluster(unsigned voters, const std::vector<StateMachine*>& machines);
  ~FixtureCluster();
  FixtureCluster(const FixtureCluster&) = delete;
  FixtureCluster& operator=(const FixtureCluster&) = delete;

  // Adds a server with an empty log (a joining member) and starts it; returns its index.
  unsigned Join(StateMachine* machine);

  struct raft* raft(unsigned i) {
    return raft_fixture_get(&f_, i);
  }
  struct raft_fixture* f() {
    return &f_;
  }
  unsigned size() { return raft_fixture_n(&f_); }

  // Index of the leader every live server acknowledges (fails the test if none in time).
  unsigned Leader();
  // The fixture never reports a leader while a live server is partitioned away; this waits for
  // one of `candidates` to lead.
  unsigned StepUntilOneLeads(const std::vector<unsigned>& candidates);
  // Proposes `command` on server i; returns raft_apply's code.
  int Propose(unsigned i, const std::string& command);
  // Steps until server i (or every server, RAFT_FIXTURE_MAX_SERVERS) applied `index`.
  bool StepUntilApplied(unsigned i, raft_index index);

 private:
  unsigned Grow(StateMachine* machine);

  struct raft_fixture f_ {};  // value-initialised: raft_fixture_initialize does not zero it
  std::vector<std::unique_ptr<struct raft_fsm>> fsms_;
  std::vector<std::unique_ptr<struct raft_apply>> requests_;
};

// A loopback TCP port nobody listens on now, with port + 1 free too (members serve forwarded
// proposals there). C-Raft addresses have no port 0, so tests that run members ask for these.
int FreeLoopbackPortPair();

}  // namespace nbos::replication
