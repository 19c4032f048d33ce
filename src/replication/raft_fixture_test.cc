// Deterministic tests of the FSM adapter on C-Raft's in-memory fixture: virtual time, simulated
// network and disk, fault injection. Same inputs, same event sequence, every run.
#include <cstring>
#include <string>
#include <vector>

extern "C" {
#include <raft.h>
#include <raft/fixture.h>
}

#include <gtest/gtest.h>

#include "replication/fixture_cluster.h"
#include "replication/raft_fsm.h"
#include "replication/test_machine.h"

namespace nbos::replication {
namespace {

constexpr raft_time kTimeout = FixtureCluster::kTimeout;

// C-Raft calls request callbacks unconditionally.
void IgnoreChange(struct raft_change*, int) {}
void MarkChanged(struct raft_change* req, int status) {
  *static_cast<int*>(req->data) = status == 0 ? 1 : -1;
}

// Owns the machines; a base so that it is constructed before FixtureCluster uses them.
struct ListMachines {
  std::vector<std::unique_ptr<ListMachine>> machines_;
};

// A fixture group of ListMachines.
class Cluster : private ListMachines, public FixtureCluster {
 public:
  Cluster(unsigned voters, unsigned total) : FixtureCluster(voters, Make(total, &machines_)) {}

  unsigned Grow() {
    machines_.push_back(std::make_unique<ListMachine>());
    return Join(machines_.back().get());
  }
  ListMachine& machine(unsigned i) { return *machines_[i]; }
  void StepUntilApplied(unsigned i, raft_index index) {
    ASSERT_TRUE(FixtureCluster::StepUntilApplied(i, index));
  }

 private:
  static std::vector<StateMachine*> Make(unsigned n,
                                         std::vector<std::unique_ptr<ListMachine>>* out) {
    std::vector<StateMachine*> raw;
    for (unsigned i = 0; i < n; ++i) {
      out->push_back(std::make_unique<ListMachine>());
      raw.push_back(out->back().get());
    }
    return raw;
  }
};

void ExpectSameState(Cluster& c, const std::vector<unsigned>& servers) {
  auto reference = c.machine(servers.front()).commands();
  for (unsigned s : servers) EXPECT_EQ(c.machine(s).commands(), reference) << "server " << s;
}

TEST(RaftFixtureTest, CommandsApplyInOrderEverywhere) {
  Cluster c(3, 3);
  unsigned leader = c.Leader();
  for (int i = 0; i < 50; ++i) ASSERT_EQ(c.Propose(leader, "cmd" + std::to_string(i)), 0);
  c.StepUntilApplied(RAFT_FIXTURE_MAX_SERVERS, raft_last_index(c.raft(leader)));
  ExpectSameState(c, {0, 1, 2});
  auto commands = c.machine(0).commands();
  ASSERT_EQ(commands.size(), 50u);
  EXPECT_EQ(commands.front(), "cmd0");
  EXPECT_EQ(commands.back(), "cmd49");
}

TEST(RaftFixtureTest, FollowersRejectProposals) {
  Cluster c(3, 3);
  unsigned leader = c.Leader();
  unsigned follower = (leader + 1) % 3;
  EXPECT_EQ(c.Propose(follower, "x"), RAFT_NOTLEADER);
}

TEST(RaftFixtureTest, LeaderLossKeepsCommittedStateAndRevivedServerCatchesUp) {
  Cluster c(3, 3);
  unsigned leader = c.Leader();
  for (int i = 0; i < 20; ++i) ASSERT_EQ(c.Propose(leader, "a" + std::to_string(i)), 0);
  c.StepUntilApplied(RAFT_FIXTURE_MAX_SERVERS, raft_last_index(c.raft(leader)));

  raft_fixture_kill(c.f(), leader);
  // Leader detection is lazy: wait for the loss before waiting for the successor.
  ASSERT_TRUE(raft_fixture_step_until_has_no_leader(c.f(), kTimeout));
  unsigned successor = c.Leader();
  ASSERT_NE(successor, leader);
  for (int i = 0; i < 20; ++i) ASSERT_EQ(c.Propose(successor, "b" + std::to_string(i)), 0);
  raft_index last = raft_last_index(c.raft(successor));
  raft_fixture_revive(c.f(), leader);
  c.StepUntilApplied(RAFT_FIXTURE_MAX_SERVERS, last);
  ExpectSameState(c, {0, 1, 2});
  EXPECT_EQ(c.machine(leader).size(), 40u);
  // 40 entries with a snapshot every 8: the revived server caught up from a snapshot.
  EXPECT_GE(c.machine(leader).restores(), 1);
}

TEST(RaftFixtureTest, PartitionedLeaderLosesItsUncommittedEntries) {
  Cluster c(3, 3);
  unsigned old_leader = c.Leader();
  ASSERT_EQ(c.Propose(old_leader, "before"), 0);
  c.StepUntilApplied(RAFT_FIXTURE_MAX_SERVERS, raft_last_index(c.raft(old_leader)));
  for (unsigned i = 0; i < 3; ++i) {
    if (i != old_leader) {
      raft_fixture_disconnect(c.f(), old_leader, i);
      raft_fixture_disconnect(c.f(), i, old_leader);
    }
  }
  ASSERT_EQ(c.Propose(old_leader, "lost"), 0);  // cannot reach a quorum
  std::vector<unsigned> majority;
  for (unsigned i = 0; i < 3; ++i) {
    if (i != old_leader) majority.push_back(i);
  }
  unsigned new_leader = c.StepUntilOneLeads(majority);
  // A leader cut off from its quorum steps down after an election timeout.
  ASSERT_TRUE(raft_fixture_step_until_state_is(c.f(), old_leader, RAFT_CANDIDATE, kTimeout));
  ASSERT_EQ(c.Propose(new_leader, "after"), 0);
  raft_index last = raft_last_index(c.raft(new_leader));
  for (unsigned i = 0; i < 3; ++i) {
    if (i != old_leader) {
      raft_fixture_reconnect(c.f(), old_leader, i);
      raft_fixture_reconnect(c.f(), i, old_leader);
    }
  }
  c.StepUntilApplied(RAFT_FIXTURE_MAX_SERVERS, last);
  ExpectSameState(c, {0, 1, 2});
  EXPECT_EQ(c.machine(old_leader).commands(), (std::vector<std::string>{"before", "after"}));
}

TEST(RaftFixtureTest, MembershipChangeDuringProposals) {
  Cluster c(3, 3);
  unsigned leader = c.Leader();
  for (int i = 0; i < 12; ++i) ASSERT_EQ(c.Propose(leader, "x" + std::to_string(i)), 0);
  unsigned joiner = c.Grow();                // an empty fourth server, as a migrated replica starts
  ASSERT_EQ(raft_start(c.raft(joiner)), 0);  // the fixture only starts the initial servers
  struct raft_change add {};
  ASSERT_EQ(
      raft_add(c.raft(leader), &add, c.raft(joiner)->id, c.raft(joiner)->address, IgnoreChange), 0);
  for (int i = 0; i < 6; ++i) ASSERT_EQ(c.Propose(leader, "y" + std::to_string(i)), 0);
  ASSERT_TRUE(
      raft_fixture_step_until_applied(c.f(), leader, raft_last_index(c.raft(leader)), kTimeout));
  struct raft_change assign {};
  int promoted = 0;
  assign.data = &promoted;
  ASSERT_EQ(raft_assign(c.raft(leader), &assign, c.raft(joiner)->id, RAFT_VOTER, MarkChanged), 0);
  for (int i = 0; i < 6; ++i) ASSERT_EQ(c.Propose(leader, "z" + std::to_string(i)), 0);
  c.StepUntilApplied(RAFT_FIXTURE_MAX_SERVERS, raft_last_index(c.raft(leader)));
  // One membership change at a time: the promotion (catch-up rounds) must finish first.
  for (int i = 0; i < 100000 && promoted == 0; ++i) raft_fixture_step(c.f());
  ASSERT_EQ(promoted, 1);
  // Remove one of the original followers: the group is back to three voters.
  unsigned removed = (leader + 1) % 3;
  struct raft_change remove {};
  ASSERT_EQ(raft_remove(c.raft(leader), &remove, c.raft(removed)->id, IgnoreChange), 0);
  ASSERT_EQ(c.Propose(leader, "final"), 0);
  raft_index last = raft_last_index(c.raft(leader));
  std::vector<unsigned> members;
  for (unsigned i = 0; i < 4; ++i) {
    if (i != removed) members.push_back(i);
  }
  for (unsigned m : members) c.StepUntilApplied(m, last);
  ExpectSameState(c, members);
  EXPECT_EQ(c.machine(joiner).size(), 25u);
  EXPECT_GE(c.machine(joiner).restores(), 1);
}

// The same scenario twice gives the same sequence of events: tests can replay a cluster exactly.
TEST(RaftFixtureTest, Deterministic) {
  auto run = [] {
    Cluster c(3, 3);
    std::vector<std::string> trace;
    struct raft_fixture_event* ev;
    unsigned leader = c.Leader();
    for (int i = 0; i < 10; ++i) c.Propose(leader, std::to_string(i));
    raft_fixture_kill(c.f(), leader);
    for (int i = 0; i < 400; ++i) {
      ev = raft_fixture_step(c.f());
      trace.push_back(std::to_string(raft_fixture_time(c.f())) + "/" +
                      std::to_string(ev->server_index) + "/" + std::to_string(ev->type) + "/" +
                      std::to_string(c.f()->leader_id));
    }
    return trace;
  };
  EXPECT_EQ(run(), run());
}

}  // namespace
}  // namespace nbos::replication
