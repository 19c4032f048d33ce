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
  void OnCancelled(const std::string& id) override { events.push_back("cancelled " + id); }
  void OnSuperseded(const std::string& id) override { events.push_back("superseded " + id); }
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
  void OnBlobHint(const std::string& id, ReplicaId executor,
                  const std::vector<std::string>& keys) override {
    std::string text = "hint " + id + " " + std::to_string(executor);
    for (const auto& k : keys) text += " " + k;
    events.push_back(text);
  }
  void OnDuplicateSkipped(const KernelEntry& entry) override { skipped.push_back(entry.id); }
  std::vector<std::string> events;
  std::vector<std::string> skipped;  // proposal ids, not decisions
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

// An entry with a proposal id, as a replica proposes it.
std::string WithId(KernelEntry e, std::string id) {
  e.id = std::move(id);
  return EncodeKernelEntry(e);
}

TEST(KernelEntryTest, ProposalIdRoundTripsAndIsOptional) {
  KernelEntry e{KernelEntry::Type::kDone, "k:1:0", 2, Json{{"status", "ok"}}, "", "2:n:7"};
  auto decoded = DecodeKernelEntry(EncodeKernelEntry(e));
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(*decoded, e);
  // Without an id the header is exactly the old one, so older readers and logs agree.
  e.id.clear();
  const std::string old_format = EncodeKernelEntry(e);
  EXPECT_EQ(old_format.find("\"id\""), std::string::npos);
  decoded = DecodeKernelEntry(old_format);
  ASSERT_TRUE(decoded.ok());
  EXPECT_TRUE(decoded->id.empty());
  // An id that is not a string is malformed.
  const std::string header = R"({"exec_id":"e","replica":1,"id":7})";
  std::string bad("\x01\x04\0\0\0", 5);
  bad.push_back(static_cast<char>(header.size()));
  EXPECT_FALSE(DecodeKernelEntry(bad + header).ok());
}

TEST(ProposalIdsTest, UniquePerReplicaNonceAndSequence) {
  ProposalIds a(2, "nonce-a"), restarted(2, "nonce-b"), other(3, "nonce-a");
  EXPECT_EQ(a.Next(), "2:nonce-a:1");
  EXPECT_EQ(a.Next(), "2:nonce-a:2");
  EXPECT_EQ(restarted.Next(), "2:nonce-b:1");
  EXPECT_EQ(other.Next(), "3:nonce-a:1");
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

std::string LeadRanOn(const std::string& id, ReplicaId r, uint64_t journal_total) {
  return EncodeKernelEntry({KernelEntry::Type::kLead, id, r, Json{{"ran_on", journal_total}}, ""});
}

// One cell executed by `r` after the LEAD round: LEAD, delta, Done.
void ApplyCell(KernelStateMachine& m, const std::string& id, ReplicaId r, std::string delta) {
  m.Apply(Lead(id, r));
  m.Apply(Delta(id, r, std::move(delta)));
  m.Apply(Done(id, r));
}

TEST(KernelStateMachineTest, OptimisticLeadOnTheCurrentNamespaceWins) {
  Recorder r;
  KernelStateMachine m(3, &r);
  ApplyCell(m, "e1", 1, "a=1");
  m.Apply(LeadRanOn("e2", 1, 1));  // ran on the namespace with e1's delta
  m.Apply(Delta("e2", 1, "b=2"));
  m.Apply(Done("e2", 1));
  EXPECT_EQ(m.journal_total(), 2u);
  EXPECT_EQ(m.ElectionFor("e2")->winner, ReplicaId{1});
  EXPECT_EQ(m.losers_skipped(), 0u);
  EXPECT_EQ(r.events.back(), "done e2 1 {\"status\":\"ok\"}");
}

TEST(KernelStateMachineTest, OvertakenOptimisticLeadFailsAndItsEffectsAreSkipped) {
  Recorder r;
  KernelStateMachine m(3, &r);
  // Replica 1 ran e2 on an empty namespace; replica 2's e1 committed its delta first.
  ApplyCell(m, "e1", 2, "a=1");
  r.events.clear();
  m.Apply(LeadRanOn("e2", 1, 0));
  m.Apply(Delta("e2", 1, "b=2"));
  m.Apply(EncodeKernelEntry({KernelEntry::Type::kSideEffect, "e2", 1, Json::object(), "%cd /"}));
  m.Apply(Done("e2", 1));
  m.Apply(Lead("e2", 3));  // the election is over: a later LEAD changes nothing
  EXPECT_EQ(r.events, (std::vector<std::string>{"all-yielded e2"}));
  auto el = m.ElectionFor("e2");
  EXPECT_TRUE(el->failed);
  EXPECT_TRUE(el->overtaken);
  EXPECT_FALSE(el->winner.has_value());
  EXPECT_EQ(m.journal_total(), 1u);
  EXPECT_EQ(m.executions_done(), 1u);
  EXPECT_EQ(m.losers_skipped(), 3u);
  // Every replica restored from a snapshot decides the same for entries still to come.
  KernelStateMachine restored(3, nullptr);
  ASSERT_TRUE(restored.Restore(m.Snapshot()).ok());
  EXPECT_TRUE(restored.ElectionFor("e2")->overtaken);
  restored.Apply(Delta("e2", 1, "b=2"));
  EXPECT_EQ(restored.journal_total(), 1u);
  // A malformed version number is as good as an out-of-date one.
  m.Apply(EncodeKernelEntry({KernelEntry::Type::kLead, "e3", 1, Json{{"ran_on", "1"}}, ""}));
  EXPECT_TRUE(m.ElectionFor("e3")->overtaken);
}

std::string Cancel(const std::string& id, ReplicaId r) {
  return EncodeKernelEntry({KernelEntry::Type::kCancel, id, r, Json::object(), ""});
}

TEST(KernelStateMachineTest, ACancelBeforeAnyLeadDecidesThatTheCellDoesNotRun) {
  Recorder r;
  KernelStateMachine m(3, &r);
  m.Apply(Cancel("e1", 2));
  // The executor, cut off, learns of its own LEAD later, runs the cell and commits its effects:
  // they change nothing anywhere.
  m.Apply(Lead("e1", 1));
  m.Apply(Delta("e1", 1, "x=1"));
  m.Apply(Done("e1", 1));
  m.Apply(Cancel("e1", 3));  // a second cancel changes nothing either
  EXPECT_EQ(r.events, (std::vector<std::string>{"cancelled e1"}));
  auto el = m.ElectionFor("e1");
  EXPECT_TRUE(el->failed);
  EXPECT_TRUE(el->cancelled);
  EXPECT_FALSE(el->winner.has_value());
  EXPECT_EQ(m.journal_total(), 0u);
  EXPECT_EQ(m.losers_skipped(), 2u);
  // A replica that catches up from a snapshot decides the same for what is still to come.
  KernelStateMachine restored(3, nullptr);
  ASSERT_TRUE(restored.Restore(m.Snapshot()).ok());
  EXPECT_TRUE(restored.ElectionFor("e1")->cancelled);
  restored.Apply(Delta("e1", 1, "x=1"));
  EXPECT_EQ(restored.journal_total(), 0u);
}

TEST(KernelStateMachineTest, ACancelAfterTheLeadWonChangesNothing) {
  Recorder r;
  KernelStateMachine m(3, &r);
  m.Apply(Lead("e1", 1));
  m.Apply(Cancel("e1", 2));
  m.Apply(Delta("e1", 1, "x=1"));
  EXPECT_EQ(r.events, (std::vector<std::string>{"elected e1 1", "delta e1 1 x=1"}));
  EXPECT_FALSE(m.ElectionFor("e1")->cancelled);
  EXPECT_EQ(m.journal_total(), 1u);
  // An optimistic LEAD that lands after a cancel loses like any other.
  m.Apply(Cancel("e2", 3));
  m.Apply(LeadRanOn("e2", 1, 1));
  EXPECT_TRUE(m.ElectionFor("e2")->cancelled);
  EXPECT_FALSE(m.ElectionFor("e2")->overtaken);
}

// The campaign's seed 31: cell e1's executor froze with the request queued, the gateway answered
// "not known" and went on; e2 ran on the others. Thawed, the executor proposed e1's LEAD, which
// won and appended e1's effects after e2's. e2's LEAD names e1 as given up on: e1 is decided.
TEST(KernelStateMachineTest, ALeadThatWinsCancelsTheCellsGivenUpBeforeIt) {
  Recorder r;
  KernelStateMachine m(3, &r);
  m.Apply(Lead("e0", 2));  // decided before: a cancel names it in vain
  m.Apply(EncodeKernelEntry(
      {KernelEntry::Type::kLead, "e2", 2, Json{{"cancels", {"e0", "e1", "e2", 7}}}, ""}));
  m.Apply(Lead("e1", 1));
  m.Apply(Delta("e1", 1, "L=[1]"));
  m.Apply(Done("e1", 1));
  EXPECT_EQ(r.events, (std::vector<std::string>{"elected e0 2", "superseded e0", "elected e2 2",
                                                "cancelled e1"}));
  EXPECT_TRUE(m.ElectionFor("e1")->cancelled);
  EXPECT_FALSE(m.ElectionFor("e0")->cancelled);
  EXPECT_EQ(m.ElectionFor("e2")->winner, 2u);
  EXPECT_EQ(m.journal_total(), 0u);
  // A LEAD that loses cancels nothing.
  KernelStateMachine other(3, nullptr);
  other.Apply(Lead("e5", 1));
  other.Apply(
      EncodeKernelEntry({KernelEntry::Type::kLead, "e5", 2, Json{{"cancels", {"e6"}}}, ""}));
  EXPECT_FALSE(other.ElectionFor("e6").has_value());
}

TEST(KernelStateMachineTest, ACellOfAnEarlierGatewaySessionCannotWinAfterALaterSessionsCell) {
  // The gateway of session a1 sent cell 8 to a replica that froze with it queued, then died; the
  // next session (b2) went on. The frozen replica's LEAD for cell 8 comes after b2's cells.
  Recorder r;
  KernelStateMachine m(3, &r);
  ApplyCell(m, "k:a1.7", 1, "L=[7]");
  m.Apply(Yield("k:a1.8", 2));  // decided by no one yet
  ApplyCell(m, "k:b2.1", 2, "L=[7,1]");
  m.Apply(Lead("k:a1.8", 1));
  m.Apply(Delta("k:a1.8", 1, "L=[7,8]"));
  m.Apply(Done("k:a1.8", 1));
  EXPECT_TRUE(m.ElectionFor("k:a1.8")->cancelled);
  EXPECT_FALSE(m.ElectionFor("k:a1.8")->winner.has_value());
  EXPECT_EQ(m.journal_total(), 2u);
  EXPECT_EQ(r.events.back(), "cancelled k:a1.8");
  // A replica that catches up from a snapshot decides the same; a third session retires b2.
  KernelStateMachine restored(3, nullptr);
  ASSERT_TRUE(restored.Restore(m.Snapshot()).ok());
  for (KernelStateMachine* each : {&m, &restored}) {
    each->Apply(Lead("k:a1.9", 3));
    EXPECT_TRUE(each->ElectionFor("k:a1.9")->cancelled);
    ApplyCell(*each, "k:c3.1", 3, "L=[7,1,3]");
    EXPECT_EQ(each->ElectionFor("k:c3.1")->winner, ReplicaId{3});
    each->Apply(Lead("k:b2.2", 2));
    EXPECT_TRUE(each->ElectionFor("k:b2.2")->cancelled);
    // Cells of the current session, and ids without an epoch, win as before.
    ApplyCell(*each, "k:c3.2", 1, "L=[7,1,3,2]");
    ApplyCell(*each, "e1", 2, "L=[]");
    EXPECT_EQ(each->ElectionFor("k:c3.2")->winner, ReplicaId{1});
    EXPECT_EQ(each->ElectionFor("e1")->winner, ReplicaId{2});
  }
  EXPECT_EQ(restored.Snapshot(), m.Snapshot());
}

TEST(KernelStateMachineTest, EffectsOfAnExecutionCommittedAfterALaterWinnerAreSkipped) {
  Recorder r;
  KernelStateMachine m(3, &r);
  // Replica 1 won e1 and ran it, then was cut off; the others gave up on it and went on with e2
  // and e3. Its effects for e1, retried once it was back, commit after theirs: they were computed
  // on a namespace without e2's and e3's and would overwrite them.
  m.Apply(Lead("e1", 1));
  ApplyCell(m, "e2", 2, "L=[2]");
  ApplyCell(m, "e3", 2, "L=[2,3]");
  m.Apply(Delta("e1", 1, "L=[1]"));
  m.Apply(Done("e1", 1));
  EXPECT_EQ(r.events, (std::vector<std::string>{"elected e1 1", "superseded e1", "elected e2 2",
                                                "delta e2 2 L=[2]", "done e2 2 {\"status\":\"ok\"}",
                                                "elected e3 2", "delta e3 2 L=[2,3]",
                                                "done e3 2 {\"status\":\"ok\"}"}));
  EXPECT_TRUE(m.ElectionFor("e1")->superseded);
  EXPECT_FALSE(m.ElectionFor("e2")->superseded);  // its Done came before e3's LEAD won
  EXPECT_EQ(m.ElectionFor("e1")->winner, ReplicaId{1});
  EXPECT_EQ(m.journal_total(), 2u);
  EXPECT_EQ(m.losers_skipped(), 2u);
  // A replica that catches up from a snapshot decides the same, also for an execution that
  // was running when the snapshot was taken.
  m.Apply(Lead("e4", 3));
  KernelStateMachine restored(3, nullptr);
  ASSERT_TRUE(restored.Restore(m.Snapshot()).ok());
  EXPECT_TRUE(restored.ElectionFor("e1")->superseded);
  restored.Apply(Delta("e1", 1, "L=[1]"));
  restored.Apply(Lead("e5", 2));
  restored.Apply(Delta("e4", 3, "L=[4]"));
  EXPECT_TRUE(restored.ElectionFor("e4")->superseded);
  EXPECT_EQ(restored.journal_total(), 2u);
}

TEST(KernelStateMachineTest, EffectsOfAReplicaThatDidNotWinAreSkipped) {
  Recorder r;
  KernelStateMachine m(3, &r);
  m.Apply(Lead("e1", 2));
  m.Apply(Delta("e1", 3, "x=1"));
  m.Apply(Done("e1", 3));
  m.Apply(Delta("e9", 3, "y=1"));  // no election known: applied as before
  EXPECT_EQ(r.events, (std::vector<std::string>{"elected e1 2", "delta e9 3 y=1"}));
  EXPECT_EQ(m.losers_skipped(), 2u);
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

// A blob hint reaches the listener with its keys and changes nothing else: no journal record,
// nothing in a snapshot, no effect on the execution's election or completion.
TEST(KernelStateMachineTest, BlobHintsAreSeenButLeaveNoState) {
  Recorder r;
  KernelStateMachine m(3, &r);
  m.Apply(Lead("e1", 2));
  const std::string empty_snapshot = KernelStateMachine(3, nullptr).Snapshot();
  KernelStateMachine before(3, nullptr);
  before.Apply(Lead("e1", 2));
  m.Apply(EncodeKernelEntry(
      {KernelEntry::Type::kBlobHint, "e1", 2, Json::object(), "key-a\nkey-b\n\nkey-c"}));
  m.Apply(EncodeKernelEntry({KernelEntry::Type::kBlobHint, "e1", 2, Json::object(), ""}));
  EXPECT_TRUE(m.journal().empty());
  EXPECT_EQ(m.journal_total(), 0u);
  EXPECT_EQ(m.executions_done(), 0u);
  EXPECT_EQ(m.Snapshot(), before.Snapshot());
  EXPECT_NE(m.Snapshot(), empty_snapshot);
  m.Apply(Delta("e1", 2, "d1"));
  m.Apply(Done("e1", 2));
  EXPECT_EQ(r.events,
            (std::vector<std::string>{"elected e1 2", "hint e1 2 key-a key-b key-c", "hint e1 2",
                                      "delta e1 2 d1", "done e1 2 {\"status\":\"ok\"}"}));
  EXPECT_EQ(m.malformed_entries(), 0u);
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

// A retried proposal committed twice: every effect reaches the listener once.
TEST(KernelStateMachineTest, EntriesWithAnAppliedIdAreSkipped) {
  Recorder r;
  KernelStateMachine m(3, &r);
  const std::string lead = WithId({KernelEntry::Type::kLead, "e1", 2, Json::object(), ""}, "2:n:1");
  const std::string delta =
      WithId({KernelEntry::Type::kDelta, "e1", 2, Json::object(), "x=1"}, "2:n:2");
  const std::string side =
      WithId({KernelEntry::Type::kSideEffect, "e1", 2, Json::object(), "%cd /x"}, "2:n:3");
  const std::string done =
      WithId({KernelEntry::Type::kDone, "e1", 2, Json{{"status", "ok"}}, ""}, "2:n:4");
  const std::string checkpoint =
      WithId({KernelEntry::Type::kCheckpoint, "", 2, Json{{"covers", 2}}, "ck"}, "2:n:5");
  m.Apply(lead);
  m.Apply(delta);
  m.Apply(delta);  // the retry of a batch whose answer was lost commits it all again
  m.Apply(side);
  m.Apply(done);
  m.Apply(delta);
  m.Apply(side);
  m.Apply(done);
  m.Apply(lead);
  m.Apply(checkpoint);
  m.Apply(checkpoint);
  EXPECT_EQ(r.events,
            (std::vector<std::string>{"elected e1 2", "delta e1 2 x=1", "side-effect e1 %cd /x",
                                      R"(done e1 2 {"status":"ok"})", "checkpoint 2"}));
  EXPECT_EQ(m.duplicates_skipped(), 6u);
  EXPECT_EQ(r.skipped,
            (std::vector<std::string>{"2:n:2", "2:n:2", "2:n:3", "2:n:4", "2:n:1", "2:n:5"}));
  EXPECT_EQ(m.executions_done(), 1u);
  EXPECT_EQ(m.journal_total(), 2u);
  EXPECT_EQ(m.checkpoint(), "ck");
  EXPECT_TRUE(m.journal().empty());
  // The same effects proposed again under new ids (a new proposal, not a retry) do apply.
  m.Apply(WithId({KernelEntry::Type::kDelta, "e1", 2, Json::object(), "x=1"}, "2:n:6"));
  EXPECT_EQ(r.events.back(), "delta e1 2 x=1");
  EXPECT_EQ(m.journal_total(), 3u);
}

TEST(KernelStateMachineTest, EntriesWithoutAnIdApplyEveryTime) {
  Recorder r;
  KernelStateMachine m(3, &r);
  m.Apply(Delta("e1", 1, "d"));
  m.Apply(Delta("e1", 1, "d"));
  m.Apply(Done("e1", 1));
  m.Apply(Done("e1", 1));
  EXPECT_EQ(r.events.size(), 4u);
  EXPECT_EQ(m.journal_total(), 2u);
  EXPECT_EQ(m.executions_done(), 2u);
  EXPECT_EQ(m.duplicates_skipped(), 0u);
  EXPECT_TRUE(m.applied_ids().empty());
}

TEST(KernelStateMachineTest, DedupeSurvivesSnapshotAndRestore) {
  KernelStateMachine a(3, nullptr);
  const std::string delta =
      WithId({KernelEntry::Type::kDelta, "e1", 1, Json::object(), "d1"}, "1:n:1");
  const std::string side =
      WithId({KernelEntry::Type::kSideEffect, "e1", 1, Json::object(), "%pip install x"}, "1:n:2");
  const std::string done =
      WithId({KernelEntry::Type::kDone, "e1", 1, Json{{"status", "ok"}}, ""}, "1:n:3");
  a.Apply(delta);
  a.Apply(side);
  a.Apply(done);
  a.Apply(done);
  Recorder r;
  KernelStateMachine b(3, &r);  // a replica caught up from a's snapshot
  ASSERT_TRUE(b.Restore(a.Snapshot()).ok());
  EXPECT_EQ(b.applied_ids(), a.applied_ids());
  EXPECT_EQ(b.duplicates_skipped(), 1u);
  r.events.clear();
  // The retried copies committed after the snapshot are skipped there as on every other replica.
  for (const auto& e : {delta, side, done}) {
    a.Apply(e);
    b.Apply(e);
  }
  EXPECT_TRUE(r.events.empty());
  EXPECT_EQ(b.duplicates_skipped(), a.duplicates_skipped());
  EXPECT_EQ(b.journal(), a.journal());
  EXPECT_EQ(b.executions_done(), 1u);
  // A snapshot without a window (an older version's) restores with an empty one.
  KernelStateMachine old(3, nullptr);
  old.Apply(Delta("e0", 1, "d0"));
  KernelStateMachine c(3, nullptr);
  ASSERT_TRUE(c.Restore(old.Snapshot()).ok());
  EXPECT_TRUE(c.applied_ids().empty());
}

TEST(KernelStateMachineTest, WindowForgetsTheOldestIds) {
  Recorder r;
  KernelStateMachine m(3, &r);
  auto delta = [](size_t n) {
    return WithId({KernelEntry::Type::kDelta, "e", 1, Json::object(), std::to_string(n)},
                  "1:n:" + std::to_string(n));
  };
  const size_t kept = KernelStateMachine::kAppliedIdsKept;
  for (size_t n = 0; n <= kept; ++n) m.Apply(delta(n));  // one more than the window holds
  ASSERT_EQ(m.applied_ids().size(), kept);
  EXPECT_EQ(m.applied_ids().front(), "1:n:1");
  EXPECT_EQ(m.applied_ids().back(), "1:n:" + std::to_string(kept));
  m.Apply(delta(1));  // still remembered
  EXPECT_EQ(m.duplicates_skipped(), 1u);
  m.Apply(delta(0));  // forgotten: applies again
  EXPECT_EQ(m.duplicates_skipped(), 1u);
  EXPECT_EQ(m.journal_total(), kept + 2);
  EXPECT_EQ(r.events.back(), "delta e 1 0");
  // The window of a restored machine holds the same ids and evicts in the same order.
  KernelStateMachine b(3, nullptr);
  ASSERT_TRUE(b.Restore(m.Snapshot()).ok());
  EXPECT_EQ(b.applied_ids(), m.applied_ids());
  m.Apply(delta(kept + 1));
  b.Apply(delta(kept + 1));
  EXPECT_EQ(b.applied_ids(), m.applied_ids());
  b.Apply(delta(2));  // evicted from both: applies
  EXPECT_EQ(b.duplicates_skipped(), m.duplicates_skipped());
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
