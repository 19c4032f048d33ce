#include "replica/kernel_log.h"

#include <gtest/gtest.h>

#include "replication/fixture_cluster.h"

namespace nbos::replica {
namespace {

using jupyter::Json;
using replication::FixtureCluster;

// Records every decision, as a replica's engine would act on it.
class Recorder final : public KernelStateMachine::Listener {
 public:
  void OnElected(const std::string& id, ReplicaId winner) override {
    events.push_back("elected " + id + " " + std::to_string(winner));
  }
  void OnAllYielded(const std::string& id) override { events.push_back("all-yielded " + id); }
  void OnDelta(const std::string& id, ReplicaId executor, const std::string& payload) override {
    events.push_back("delta " + id + " " + std::to_string(executor) + " " + payload);
  }
  void OnSideEffect(const std::string& id, const std::string& statement) override {
    events.push_back("side-effect " + id + " " + statement);
  }
  void OnDone(const std::string& id, ReplicaId executor, const Json& meta) override {
    events.push_back("done " + id + " " + std::to_string(executor) + " " + meta.dump());
  }
  void OnCheckpoint(uint64_t covers) override {
    events.push_back("checkpoint " + std::to_string(covers));
  }
  void OnRestored(const std::string& checkpoint, const std::vector<JournalRecord>& journal,
                  uint64_t total) override {
    events.push_back("restored " + checkpoint + " +" + std::to_string(journal.size()) + "/" +
                     std::to_string(total));
  }
  std::vector<std::string> events;
};

std::string Lead(const std::string& id, ReplicaId r) {
  return EncodeKernelEntry({KernelEntry::Type::kLead, id, r, Json::object(), ""});
}
std::string Yield(const std::string& id, ReplicaId r) {
  return EncodeKernelEntry({KernelEntry::Type::kYield, id, r, Json::object(), ""});
}
std::string Delta(const std::string& id, ReplicaId r, std::string payload) {
  return EncodeKernelEntry({KernelEntry::Type::kDelta, id, r, Json::object(), std::move(payload)});
}
std::string Done(const std::string& id, ReplicaId r) {
  return EncodeKernelEntry({KernelEntry::Type::kDone, id, r, Json{{"status", "ok"}}, ""});
}

TEST(KernelEntryTest, RoundTripKeepsBinaryPayload) {
  KernelEntry e{KernelEntry::Type::kDelta, "k:1:0", 2, Json{{"count", 3}},
                std::string("\0\xff\x01pickle", 9)};
  auto decoded = DecodeKernelEntry(EncodeKernelEntry(e));
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(*decoded, e);
}

TEST(KernelEntryTest, MalformedEntriesAreErrors) {
  EXPECT_FALSE(DecodeKernelEntry("").ok());
  EXPECT_FALSE(DecodeKernelEntry(std::string("\x02\x01", 2)).ok());              // unknown version
  EXPECT_FALSE(DecodeKernelEntry(std::string("\x01\x09\0\0\0\0", 6)).ok());      // unknown type
  EXPECT_FALSE(DecodeKernelEntry(std::string("\x01\x01\0\0\0\xff{}", 8)).ok());  // truncated
  EXPECT_FALSE(DecodeKernelEntry(std::string("\x01\x01\0\0\0\x02{}", 8)).ok());  // no fields
}

TEST(KernelStateMachineTest, FirstCommittedLeadWinsAndLateProposalsChangeNothing) {
  Recorder r;
  KernelStateMachine m(3, &r);
  m.Apply(Yield("e1", 1));
  m.Apply(Lead("e1", 3));
  m.Apply(Lead("e1", 2));   // too late
  m.Apply(Yield("e1", 2));  // too late
  auto el = m.ElectionFor("e1");
  ASSERT_TRUE(el.has_value());
  EXPECT_EQ(el->winner, ReplicaId{3});
  EXPECT_EQ(r.events, (std::vector<std::string>{"elected e1 3"}));
}

TEST(KernelStateMachineTest, AllYieldedFailsTheAttempt) {
  Recorder r;
  KernelStateMachine m(3, &r);
  m.Apply(Yield("e1", 1));
  m.Apply(Yield("e1", 1));  // a duplicate does not count twice
  m.Apply(Yield("e1", 2));
  EXPECT_TRUE(r.events.empty());
  m.Apply(Yield("e1", 3));
  m.Apply(Lead("e1", 2));  // after the failure: the retry is a new attempt
  EXPECT_EQ(r.events, (std::vector<std::string>{"all-yielded e1"}));
  EXPECT_TRUE(m.ElectionFor("e1")->failed);
}

TEST(KernelStateMachineTest, MalformedEntriesAreSkippedAndCounted) {
  Recorder r;
  KernelStateMachine m(3, &r);
  m.Apply("garbage");
  m.Apply(Lead("e1", 1));
  EXPECT_EQ(m.malformed_entries(), 1u);
  EXPECT_EQ(r.events, (std::vector<std::string>{"elected e1 1"}));
}

TEST(KernelStateMachineTest, CheckpointReplacesJournal) {
  KernelStateMachine m(3, nullptr);
  m.Apply(Delta("e1", 1, "d1"));
  m.Apply(EncodeKernelEntry({KernelEntry::Type::kSideEffect, "e2", 1, Json::object(), "%cd /x"}));
  EXPECT_EQ(m.journal().size(), 2u);
  m.Apply(EncodeKernelEntry({KernelEntry::Type::kCheckpoint, "e2", 1, Json::object(), "full"}));
  EXPECT_EQ(m.checkpoint(), "full");
  EXPECT_TRUE(m.journal().empty());
  m.Apply(Delta("e3", 2, "d3"));
  EXPECT_EQ(m.journal().size(), 1u);
  EXPECT_EQ(m.journal_total(), 3u);
}

// A checkpoint taken after its author applied N records keeps the records committed after N.
TEST(KernelStateMachineTest, CheckpointKeepsRecordsCommittedAfterItWasTaken) {
  Recorder r;
  KernelStateMachine m(3, &r);
  m.Apply(Delta("e1", 1, "d1"));
  m.Apply(Delta("e2", 2, "d2"));
  m.Apply(Delta("e3", 3, "d3"));
  auto checkpoint = [](uint64_t covers) {
    return EncodeKernelEntry(
        {KernelEntry::Type::kCheckpoint, "c", 1, Json{{"covers", covers}}, "ck"});
  };
  m.Apply(checkpoint(2));  // taken before d3 was applied by its author
  ASSERT_EQ(m.journal().size(), 1u);
  EXPECT_EQ(m.journal()[0].payload, "d3");
  m.Apply(checkpoint(1));  // older than what is already checkpointed: ignored
  m.Apply(checkpoint(9));  // covers records that do not exist: ignored
  EXPECT_EQ(m.journal().size(), 1u);
  EXPECT_EQ(r.events.back(), "checkpoint 2");
}

TEST(KernelStateMachineTest, SnapshotRestoreRoundTrip) {
  KernelStateMachine a(3, nullptr);
  a.Apply(EncodeKernelEntry(
      {KernelEntry::Type::kCheckpoint, "e0", 1, Json::object(), std::string("ck\0pt", 5)}));
  a.Apply(Lead("e1", 2));
  a.Apply(Delta("e1", 2, std::string("\0\1", 2)));
  a.Apply(Done("e1", 2));
  Recorder r;
  KernelStateMachine b(3, &r);
  ASSERT_TRUE(b.Restore(a.Snapshot()).ok());
  EXPECT_EQ(b.checkpoint(), a.checkpoint());
  EXPECT_EQ(b.journal(), a.journal());
  EXPECT_EQ(b.executions_done(), 1u);
  EXPECT_EQ(b.ElectionFor("e1")->winner, ReplicaId{2});
  EXPECT_EQ(r.events.size(), 1u);
  EXPECT_FALSE(b.Restore("junk").ok());
}

// Three replicas over the fixture: every replica sees the same decisions in the same order,
// whatever order the proposals were made in, including across a leader failure and a replica
// that catches up from a snapshot.
TEST(KernelStateMachineTest, ReplicasAgreeOnEveryDecision) {
  Recorder r1, r2, r3, r4;
  KernelStateMachine m1(3, &r1), m2(3, &r2), m3(3, &r3), m4(3, &r4);
  FixtureCluster c(3, {&m1, &m2, &m3});
  unsigned leader = c.Leader();
  for (int cell = 0; cell < 6; ++cell) {
    std::string id = "cell" + std::to_string(cell);
    // Forced targets rotate like a scheduler moving the executor; proposals race.
    ReplicaId target = 1 + cell % 3;
    for (ReplicaId rep = 1; rep <= 3; ++rep) {
      ASSERT_EQ(c.Propose(leader, rep == target ? Lead(id, rep) : Yield(id, rep)), 0);
    }
    ASSERT_EQ(c.Propose(leader, Delta(id, target, "x=" + std::to_string(cell))), 0);
    ASSERT_EQ(c.Propose(leader, Done(id, target)), 0);
  }
  ASSERT_TRUE(c.StepUntilApplied(RAFT_FIXTURE_MAX_SERVERS, raft_last_index(c.raft(leader))));
  EXPECT_EQ(r1.events, r2.events);
  EXPECT_EQ(r1.events, r3.events);
  EXPECT_EQ(m1.executions_done(), 6u);

  // A fourth replica joins with an empty log (a migration target) and catches up.
  unsigned joiner = c.Join(&m4);
  auto mark = [](struct raft_change* req, int status) {
    *static_cast<int*>(req->data) = status + 1;
  };
  int added = 0, assigned = 0;
  struct raft_change add {};
  add.data = &added;
  ASSERT_EQ(raft_add(c.raft(leader), &add, c.raft(joiner)->id, c.raft(joiner)->address, mark), 0);
  for (int i = 0; i < 100000 && added == 0; ++i) raft_fixture_step(c.f());
  ASSERT_EQ(added, 1);
  struct raft_change assign {};
  assign.data = &assigned;
  ASSERT_EQ(raft_assign(c.raft(leader), &assign, c.raft(joiner)->id, RAFT_VOTER, mark), 0);
  for (int i = 0; i < 100000 && assigned == 0; ++i) raft_fixture_step(c.f());
  ASSERT_EQ(assigned, 1);
  ASSERT_EQ(c.Propose(leader, Lead("cell6", 2)), 0);
  ASSERT_TRUE(c.StepUntilApplied(RAFT_FIXTURE_MAX_SERVERS, raft_last_index(c.raft(leader))));
  EXPECT_EQ(m4.journal(), m1.journal());
  EXPECT_EQ(m4.executions_done(), m1.executions_done());
  EXPECT_EQ(m4.ElectionFor("cell5")->winner, ReplicaId{3});
  ASSERT_FALSE(r4.events.empty());
  EXPECT_EQ(r4.events.front().rfind("restored ", 0), 0u) << "caught up from a snapshot";
  EXPECT_EQ(m4.journal_total(), m1.journal_total());
}

}  // namespace
}  // namespace nbos::replica
