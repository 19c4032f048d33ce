#include "replication/fixture_cluster.h"

#include <gtest/gtest.h>

#include "common/test_ports.h"
#include "replication/raft_fsm.h"

namespace nbos::replication {

namespace {
// C-Raft calls request callbacks unconditionally.
void IgnoreApply(struct raft_apply*, int, void*) {}
}  // namespace

FixtureCluster::FixtureCluster(unsigned voters, const std::vector<StateMachine*>& machines) {
  raft_fixture_initialize(&f_);
  for (StateMachine* m : machines) Grow(m);
  struct raft_configuration conf;
  raft_fixture_configuration(&f_, voters, &conf);
  EXPECT_EQ(raft_fixture_bootstrap(&f_, &conf), 0);
  raft_configuration_close(&conf);
  EXPECT_EQ(raft_fixture_start(&f_), 0);
}

FixtureCluster::~FixtureCluster() { raft_fixture_close(&f_); }

unsigned FixtureCluster::Grow(StateMachine* machine) {
  fsms_.push_back(std::make_unique<struct raft_fsm>());
  BindFsm(fsms_.back().get(), machine);
  EXPECT_EQ(raft_fixture_grow(&f_, fsms_.back().get()), 0);
  unsigned i = raft_fixture_n(&f_) - 1;
  // Small snapshot settings so that catch-up by snapshot happens within short tests.
  raft_set_snapshot_threshold(raft(i), 8);
  raft_set_snapshot_trailing(raft(i), 2);
  raft_set_pre_vote(raft(i), true);  // as RaftNode runs it
  return i;
}

unsigned FixtureCluster::Join(StateMachine* machine) {
  unsigned i = Grow(machine);
  EXPECT_EQ(raft_start(raft(i)), 0);  // the fixture only starts the initial servers
  return i;
}

unsigned FixtureCluster::Leader() {
  EXPECT_TRUE(raft_fixture_step_until_has_leader(&f_, kTimeout));
  return raft_fixture_leader_index(&f_);
}

unsigned FixtureCluster::StepUntilOneLeads(const std::vector<unsigned>& candidates) {
  for (raft_time start = raft_fixture_time(&f_); raft_fixture_time(&f_) - start < kTimeout;) {
    for (unsigned i : candidates) {
      if (raft_state(raft(i)) == RAFT_LEADER) return i;
    }
    raft_fixture_step(&f_);
  }
  ADD_FAILURE() << "no leader among the candidates";
  return candidates.front();
}

int FixtureCluster::Propose(unsigned i, const std::string& command) {
  struct raft_buffer buf;
  EXPECT_TRUE(EncodeEntry(command, &buf));
  requests_.push_back(std::make_unique<struct raft_apply>());
  int rv = raft_apply(raft(i), requests_.back().get(), &buf, 1, IgnoreApply);
  if (rv != 0) raft_free(buf.base);
  return rv;
}

bool FixtureCluster::StepUntilApplied(unsigned i, raft_index index) {
  return raft_fixture_step_until_applied(&f_, i, index, kTimeout);
}

int FreeLoopbackPortPair() {
  const int port = testing::FreeTestPort(2);
  if (port == 0) ADD_FAILURE() << "no free loopback port pair";
  return port;
}

}  // namespace nbos::replication
