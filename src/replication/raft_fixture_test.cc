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

#include "replication/raft_fsm.h"
#include "replication/test_machine.h"

namespace nbos::replication {
namespace {

constexpr raft_time kTimeout = 20000;  // virtual ms

// C-Raft calls request callbacks unconditionally.
void IgnoreChange(struct raft_change*, int) {}
void MarkChanged(struct raft_change* req, int status) {
  *static_cast<int*>(req->data) = status == 0 ? 1 : -1;
}
void IgnoreApply(struct raft_apply*, int, void*) {}

class Cluster {
 public:
  explicit Cluster(unsigned voters, unsigned total) {
    raft_fixture_initialize(&f_);
    for (unsigned i = 0; i < total; ++i) Grow();
    struct raft_configuration conf;
    raft_fixture_configuration(&f_, voters, &conf);
    // Only the initial voters (and any initial standbys) are bootstrapped.
    EXPECT_EQ(raft_fixture_bootstrap(&f_, &conf), 0);
    raft_configuration_close(&conf);
    EXPECT_EQ(raft_fixture_start(&f_), 0);
  }
  ~Cluster() { raft_fixture_close(&f_); }

  unsigned Grow() {
    machines_.push_back(std::make_unique<ListMachine>());
    fsms_.push_back(std::make_unique<struct raft_fsm>());
    BindFsm(fsms_.back().get(), machines_.back().get());
    EXPECT_EQ(raft_fixture_grow(&f_, fsms_.back().get()), 0);
    unsigned i = raft_fixture_n(&f_) - 1;
    raft_set_snapshot_threshold(raft(i), 8);
    raft_set_snapshot_trailing(raft(i), 2);
    raft_set_pre_vote(raft(i), true);  // as RaftNode runs it
    return i;
  }

  struct raft* raft(unsigned i) {
    return raft_fixture_get(&f_, i);
  }
  ListMachine& machine(unsigned i) { return *machines_[i]; }
  struct raft_fixture* f() {
    return &f_;
  }

  unsigned Leader() {
    EXPECT_TRUE(raft_fixture_step_until_has_leader(&f_, kTimeout));
    return raft_fixture_leader_index(&f_);
  }

  // Proposes on server i; returns raft_apply's code (the request stays alive in `requests_`).
  int Propose(unsigned i, const std::string& command) {
    struct raft_buffer buf;
    EXPECT_TRUE(EncodeEntry(command, &buf));
    requests_.push_back(std::make_unique<struct raft_apply>());
    int rv = raft_apply(raft(i), requests_.back().get(), &buf, 1, IgnoreApply);
    if (rv != 0) raft_free(buf.base);
    return rv;
  }

  // The fixture only reports a leader that every live server acknowledges, which never happens
  // while a live server is partitioned away; this waits for one of `candidates` to lead.
  unsigned StepUntilOneLeads(const std::vector<unsigned>& candidates) {
    for (raft_time start = raft_fixture_time(&f_); raft_fixture_time(&f_) - start < kTimeout;) {
      for (unsigned i : candidates) {
        if (raft_state(raft(i)) == RAFT_LEADER) return i;
      }
      raft_fixture_step(&f_);
    }
    ADD_FAILURE() << "no leader among the candidates";
    return candidates.front();
  }

  void StepUntilApplied(unsigned i, raft_index index) {
    ASSERT_TRUE(raft_fixture_step_until_applied(&f_, i, index, kTimeout));
  }

 private:
  struct raft_fixture f_ {};  // value-initialised: raft_fixture_initialize does not zero it
  std::vector<std::unique_ptr<ListMachine>> machines_;
  std::vector<std::unique_ptr<struct raft_fsm>> fsms_;
  std::vector<std::unique_ptr<struct raft_apply>> requests_;
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
