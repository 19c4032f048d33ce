#include "replica/proposal_router.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <thread>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "common/thread_annotations.h"
#include "replica/kernel_log.h"
#include "replication/fixture_cluster.h"
#include "replication/peer_auth.h"
#include "replication/test_machine.h"

namespace nbos::replica {
namespace {

using namespace std::chrono_literals;
using replication::ListMachine;
using replication::Member;
using replication::RaftNode;

// Index in the test's arrays (id - 1) of the member `node` takes for the leader. Under load an
// election may be under way, when no leader is known: this waits up to 5 s for one and returns
// SIZE_MAX if none came, which the caller asserts against before indexing with it.
// Both transports of these groups check the key: the tests also cover the signed requests.
const std::string kPeerKey = replication::PeerKeyFrom("the kernel's connection key");

ProposalRouterOptions Signed() {
  ProposalRouterOptions o;
  o.peer_key = kPeerKey;
  return o;
}

// Sends `frames` on a fresh DEALER to the router of `raft_address` and returns the answer's
// frames (empty if none came within 5 s).
std::vector<std::string> AskDirectly(const std::string& raft_address,
                                     const std::vector<std::string>& frames) {
  zmq::context_t ctx;
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  s.connect(PeerEndpointFor(raft_address));
  std::vector<zmq::const_buffer> out;
  for (const auto& f : frames) out.push_back(zmq::buffer(f));
  zmq::send_multipart(s, out);
  zmq::pollitem_t item{s.handle(), 0, ZMQ_POLLIN, 0};
  std::vector<std::string> answer;
  if (zmq::poll(&item, 1, std::chrono::milliseconds(5000)) <= 0) return answer;
  std::vector<zmq::message_t> parts;
  (void)zmq::recv_multipart(s, std::back_inserter(parts));
  for (auto& p : parts) answer.push_back(p.to_string());
  return answer;
}

size_t KnownLeaderIndex(RaftNode& node) {
  for (int t = 0; t < 500; ++t) {
    const replication::ServerId id = node.Leader().id;
    if (id != 0) return id - 1;
    std::this_thread::sleep_for(10ms);
  }
  return SIZE_MAX;
}

TEST(ProposalRouterTest, PeerEndpointIsRaftPortPlusOne) {
  EXPECT_EQ(PeerEndpointFor("127.0.0.1:9000"), "tcp://127.0.0.1:9001");
  EXPECT_EQ(PeerEndpointFor("nonsense"), "");
  EXPECT_EQ(PeerEndpointFor("127.0.0.1:65535"), "");
}

TEST(ProposalRouterTest, AnyMemberCommitsThroughTheLeaderAcrossLeaderChanges) {
  auto root = std::filesystem::temp_directory_path() / ("nbos-router-" + std::to_string(getpid()));
  std::filesystem::remove_all(root);
  std::vector<Member> members;
  for (replication::ServerId id = 1; id <= 3; ++id) {
    members.push_back({id, "127.0.0.1:" + std::to_string(replication::FreeLoopbackPortPair())});
  }
  ListMachine machines[3];
  std::unique_ptr<RaftNode> nodes[3];
  std::unique_ptr<ProposalRouter> routers[3];
  for (int i = 0; i < 3; ++i) {
    replication::RaftNodeOptions o;
    o.id = members[i].id;
    o.address = members[i].address;
    o.data_dir = (root / std::to_string(i)).string();
    o.bootstrap = members;
    o.peer_key = kPeerKey;
    auto node = RaftNode::Start(o, &machines[i]);
    ASSERT_TRUE(node.ok()) << node.status().ToString();
    nodes[i] = std::move(*node);
    auto router = ProposalRouter::Start(nodes[i].get(), members[i].address, Signed());
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    routers[i] = std::move(*router);
  }
  // Every member proposes, leader or not.
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 3; ++i) {
      auto r = routers[i]->Propose("from" + std::to_string(i), 10s);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    }
  }
  uint64_t forwarded = 0;
  for (auto& r : routers) forwarded += r->forwarded_served();
  EXPECT_EQ(forwarded, 6u);  // two of three members were followers each round

  // A follower asks for leadership and gets it; asking again as leader is a no-op.
  const size_t old_leader = KnownLeaderIndex(*nodes[0]);
  ASSERT_LT(old_leader, 3u);
  const size_t follower = (old_leader + 1) % 3;
  Status handed = routers[follower]->RequestLeadership(members[follower].id, 5s);
  ASSERT_TRUE(handed.ok()) << handed.ToString();
  EXPECT_EQ(routers[old_leader]->transfers_served(), 1u);
  for (int t = 0; t < 500 && nodes[follower]->Leader().id != members[follower].id; ++t)
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(nodes[follower]->Leader().id, members[follower].id);
  EXPECT_TRUE(routers[follower]->RequestLeadership(members[follower].id, 5s).ok());

  // Requests without the key's MAC, sent straight to the leader's router: a proposal, a removal,
  // a leadership transfer, unsigned and signed with another key. Each is refused and counted;
  // the log, the members and the router's served counts do not change. (Who leads afterwards is
  // not checked: on a loaded machine a 300 ms election timeout can elect anyone meanwhile.)
  {
    const size_t at = KnownLeaderIndex(*nodes[0]);
    ASSERT_LT(at, 3u);
    const size_t applied = machines[at].size();
    const uint64_t served = routers[at]->forwarded_served();
    const uint64_t transfers = routers[at]->transfers_served();
    const std::string other_key = replication::PeerKeyFrom("another kernel's key");
    const std::string victim = std::to_string(members[(at + 1) % 3].id);
    const std::vector<std::vector<std::string>> forged{
        {"1", "", "forged"},
        {"2", std::string(replication::kPeerMacBytes, 'x'), "forged"},
        {"3", replication::PeerMac(other_key, {"router", "3", "forged"}), "forged"},
        {"4", "", "", "remove", victim},
        {"5", replication::PeerMac(other_key, {"router", "5", "", "remove", victim}), "", "remove",
         victim},
        {"6", "", "", "transfer", victim},
        {"7"},
    };
    for (const auto& request : forged) {
      auto answer = AskDirectly(members[at].address, request);
      if (request.size() < 2) {
        EXPECT_TRUE(answer.empty());  // malformed: dropped
        continue;
      }
      ASSERT_EQ(answer.size(), 3u) << request[0];
      EXPECT_EQ(answer[0], request[0]);
      EXPECT_EQ(answer[1], "refused");
    }
    EXPECT_EQ(routers[at]->requests_refused(), forged.size() - 1);
    EXPECT_EQ(machines[at].size(), applied);
    EXPECT_EQ(nodes[at]->Members().size(), 3u);
    EXPECT_EQ(routers[at]->forwarded_served(), served);
    EXPECT_EQ(routers[at]->transfers_served(), transfers);
  }

  // The leader goes away; the survivors' proposals follow the new leader.
  const size_t leader = KnownLeaderIndex(*nodes[0]);
  ASSERT_LT(leader, 3u);
  routers[leader].reset();
  nodes[leader].reset();
  size_t survivor = (leader + 1) % 3;
  auto r = routers[survivor]->Propose("after-failover", 10s);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  for (size_t i = 0; i < 3; ++i) {
    if (i == leader) continue;
    for (int t = 0; t < 500 && machines[i].size() < 10; ++t) std::this_thread::sleep_for(10ms);
    EXPECT_EQ(machines[i].size(), 10u);
    EXPECT_EQ(machines[i].commands().back(), "after-failover");
  }
  for (auto& rt : routers) rt.reset();
  for (auto& n : nodes) n.reset();
  std::filesystem::remove_all(root);
}

// Migrates a member of a 3-member group: a 4th node starts with an empty log and no bootstrap,
// a follower asks for its addition, then for the removal of the leader.
TEST(ProposalRouterTest, MembershipChangesGoThroughTheLeader) {
  auto root =
      std::filesystem::temp_directory_path() / ("nbos-router-members-" + std::to_string(getpid()));
  std::filesystem::remove_all(root);
  std::vector<Member> members;
  for (replication::ServerId id = 1; id <= 4; ++id) {
    members.push_back({id, "127.0.0.1:" + std::to_string(replication::FreeLoopbackPortPair())});
  }
  const std::vector<Member> initial(members.begin(), members.begin() + 3);
  ListMachine machines[4];
  std::unique_ptr<RaftNode> nodes[4];
  std::unique_ptr<ProposalRouter> routers[4];
  for (int i = 0; i < 4; ++i) {
    replication::RaftNodeOptions o;
    o.id = members[i].id;
    o.address = members[i].address;
    o.data_dir = (root / std::to_string(i)).string();
    if (i < 3) o.bootstrap = initial;  // the 4th joins later
    o.snapshot_threshold = 8;          // the joiner catches up from a snapshot and entries
    o.snapshot_trailing = 2;
    o.peer_key = kPeerKey;
    auto node = RaftNode::Start(o, &machines[i]);
    ASSERT_TRUE(node.ok()) << node.status().ToString();
    nodes[i] = std::move(*node);
    auto router = ProposalRouter::Start(nodes[i].get(), members[i].address, Signed());
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    routers[i] = std::move(*router);
  }
  for (int n = 0; n < 20; ++n) {
    auto r = routers[n % 3]->Propose("before" + std::to_string(n), 10s);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  EXPECT_TRUE(nodes[3]->Members().empty());

  // Added through a follower; the answer comes once it is a voter.
  const size_t leader = KnownLeaderIndex(*nodes[0]);
  ASSERT_LT(leader, 3u);
  const size_t follower = (leader + 1) % 3;
  Status added = routers[follower]->AddMember(members[3], 30s);
  ASSERT_TRUE(added.ok()) << added.ToString();
  auto voters = [&](size_t i) {
    std::vector<replication::ServerId> ids;
    for (const Member& m : nodes[i]->Members()) {
      if (m.role == replication::Role::kVoter) ids.push_back(m.id);
    }
    std::sort(ids.begin(), ids.end());
    return ids;
  };
  EXPECT_EQ(voters(leader), (std::vector<replication::ServerId>{1, 2, 3, 4}));
  for (int t = 0; t < 500 && machines[3].size() < 20; ++t) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(machines[3].commands(), machines[leader].commands());

  // Repeating the addition is fine; a conflicting one is not, wherever it is asked.
  EXPECT_TRUE(routers[leader]->AddMember(members[3], 10s).ok());
  Status moved = routers[follower]->AddMember({4, members[0].address}, 10s);
  EXPECT_EQ(moved.code(), StatusCode::kInvalidArgument) << moved.ToString();
  Status taken = routers[leader]->AddMember({9, members[3].address}, 10s);
  EXPECT_EQ(taken.code(), StatusCode::kInvalidArgument) << taken.ToString();
  EXPECT_EQ(routers[follower]->AddMember({0, members[3].address}, 1s).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(routers[follower]->AddMember({5, "example.com:1"}, 1s).code(),
            StatusCode::kInvalidArgument);

  // The leader is removed at a follower's request: it hands leadership over first.
  Status removed = routers[follower]->RemoveMember(members[leader].id, 30s);
  ASSERT_TRUE(removed.ok()) << removed.ToString();
  // Node 3 may still name the old leader until it hears from the new one.
  const auto new_leader_known = [&] {
    const auto id = nodes[3]->Leader().id;
    return id != 0 && id != members[leader].id;
  };
  for (int t = 0; t < 500 && !new_leader_known(); ++t) std::this_thread::sleep_for(10ms);
  const size_t new_leader = KnownLeaderIndex(*nodes[3]);
  ASSERT_LT(new_leader, 4u);
  ASSERT_NE(new_leader, leader);
  std::vector<replication::ServerId> expected;
  for (size_t i = 0; i < 4; ++i) {
    if (i != leader) expected.push_back(members[i].id);
  }
  EXPECT_EQ(voters(new_leader), expected);
  // Removing it again, or an id that never was a member, is fine.
  EXPECT_TRUE(routers[3]->RemoveMember(members[leader].id, 10s).ok());
  EXPECT_TRUE(routers[3]->RemoveMember(42, 10s).ok());

  // The old leader goes away; the new member proposes and the survivors follow.
  routers[leader].reset();
  nodes[leader].reset();
  auto r = routers[3]->Propose("after-migration", 10s);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  for (size_t i = 0; i < 4; ++i) {
    if (i == leader) continue;
    for (int t = 0; t < 500 && machines[i].size() < 21; ++t) std::this_thread::sleep_for(10ms);
    EXPECT_EQ(machines[i].size(), 21u);
    EXPECT_EQ(machines[i].commands().back(), "after-migration");
  }
  for (auto& rt : routers) rt.reset();
  for (auto& n : nodes) n.reset();
  std::filesystem::remove_all(root);
}

// One replica's KernelStateMachine, with what the log committed to it (every copy) and what the
// state machine made of it (what a replica's engine would act on). Readable from the test.
class KernelReplica final : public replication::StateMachine, private KernelStateMachine::Listener {
 public:
  void Apply(std::string_view command) EXCLUDES(mu_) override {
    MutexLock lock(&mu_);
    ++committed_[std::string(command)];
    machine_.Apply(command);
  }
  std::string Snapshot() EXCLUDES(mu_) override {
    MutexLock lock(&mu_);
    return machine_.Snapshot();
  }
  Status Restore(std::string_view snapshot) EXCLUDES(mu_) override {
    MutexLock lock(&mu_);
    return machine_.Restore(snapshot);
  }
  int Committed(const std::string& command) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    auto it = committed_.find(command);
    return it == committed_.end() ? 0 : it->second;
  }
  std::vector<std::string> Events() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return events_;
  }
  uint64_t DuplicatesSkipped() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return machine_.duplicates_skipped();
  }

 private:
  // Listener, called from machine_.Apply with mu_ held.
  void OnElected(const std::string& id, ReplicaId winner) REQUIRES(mu_) override {
    events_.push_back("elected " + id + " " + std::to_string(winner));
  }
  void OnAllYielded(const std::string& id) REQUIRES(mu_) override {
    events_.push_back("all-yielded " + id);
  }
  void OnCancelled(const std::string& id) REQUIRES(mu_) override {
    events_.push_back("cancelled " + id);
  }
  void OnDelta(const std::string& id, ReplicaId, const std::string& payload)
      REQUIRES(mu_) override {
    events_.push_back("delta " + id + " " + payload);
  }
  void OnSideEffect(const std::string& id, const std::string& statement) REQUIRES(mu_) override {
    events_.push_back("side-effect " + id + " " + statement);
  }
  void OnDone(const std::string& id, ReplicaId, const jupyter::Json&) REQUIRES(mu_) override {
    events_.push_back("done " + id);
  }
  void OnCheckpoint(uint64_t covers) REQUIRES(mu_) override {
    events_.push_back("checkpoint " + std::to_string(covers));
  }
  void OnRestored(const std::string&, const std::vector<JournalRecord>&, uint64_t)
      REQUIRES(mu_) override {
    events_.push_back("restored");
  }

  Mutex mu_;
  KernelStateMachine machine_ GUARDED_BY(mu_){3, this};
  std::map<std::string, int> committed_ GUARDED_BY(mu_);
  std::vector<std::string> events_ GUARDED_BY(mu_);
};

// A follower forwards a cell's delta, side effect and Done; the leader commits them but its answer
// is lost, so the follower sends the same bytes again and the leader commits them a second time.
// Every replica's kernel state machine applies them once.
TEST(ProposalRouterTest, RetriedForwardedProposalIsCommittedTwiceButAppliedOnce) {
  auto root =
      std::filesystem::temp_directory_path() / ("nbos-router-retry-" + std::to_string(getpid()));
  std::filesystem::remove_all(root);
  std::vector<Member> members;
  for (replication::ServerId id = 1; id <= 3; ++id) {
    members.push_back({id, "127.0.0.1:" + std::to_string(replication::FreeLoopbackPortPair())});
  }
  KernelReplica replicas[3];
  std::unique_ptr<RaftNode> nodes[3];
  std::unique_ptr<ProposalRouter> routers[3];
  ProposalRouterOptions lossy;
  lossy.forward_attempt_timeout = 500ms;  // retry sooner than the default second
  lossy.drop_forwarded_answers = 1;       // the first answer a member gets is lost
  for (int i = 0; i < 3; ++i) {
    replication::RaftNodeOptions o;
    o.id = members[i].id;
    o.address = members[i].address;
    o.data_dir = (root / std::to_string(i)).string();
    o.bootstrap = members;
    auto node = RaftNode::Start(o, &replicas[i]);
    ASSERT_TRUE(node.ok()) << node.status().ToString();
    nodes[i] = std::move(*node);
    auto router = ProposalRouter::Start(nodes[i].get(), members[i].address, lossy);
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    routers[i] = std::move(*router);
  }
  // Propose from a follower, once every member knows the same leader.
  auto agreed_leader = [&]() -> replication::ServerId {
    const replication::ServerId id = nodes[0]->Leader().id;
    for (auto& n : nodes) {
      if (n->Leader().id != id) return 0;
    }
    return id;
  };
  for (int t = 0; t < 1000 && agreed_leader() == 0; ++t) std::this_thread::sleep_for(10ms);
  const replication::ServerId leader = agreed_leader();
  ASSERT_NE(leader, 0u);
  const size_t proposer = leader % 3;  // index of member leader + 1 (mod 3): a follower
  ASSERT_NE(members[proposer].id, leader);

  ProposalIds ids(members[proposer].id, "test-nonce");
  auto entry = [&](KernelEntry::Type type, const std::string& exec_id, std::string payload) {
    KernelEntry e{type, exec_id, members[proposer].id, jupyter::Json::object(), std::move(payload)};
    e.id = ids.Next();
    return EncodeKernelEntry(e);
  };
  const std::vector<std::string> cell{
      entry(KernelEntry::Type::kDelta, "cell1", "x=1"),
      entry(KernelEntry::Type::kSideEffect, "cell1", "%pip install nothing"),
      entry(KernelEntry::Type::kDone, "cell1", "")};
  auto committed = routers[proposer]->ProposeAll(cell, 10s);
  ASSERT_TRUE(committed.ok()) << committed.status().ToString();
  EXPECT_GE(routers[proposer]->forward_retries(), 1u);
  // Whatever was committed of the batch is in the log before this, on every member.
  const std::string marker = entry(KernelEntry::Type::kLead, "marker", "");
  auto marked = routers[proposer]->Propose(marker, 10s);
  ASSERT_TRUE(marked.ok()) << marked.status().ToString();
  const std::string elected = "elected marker " + std::to_string(members[proposer].id);
  for (auto& replica : replicas) {
    for (int t = 0; t < 500; ++t) {
      auto events = replica.Events();
      if (std::find(events.begin(), events.end(), elected) != events.end()) break;
      std::this_thread::sleep_for(10ms);
    }
  }

  const int copies = replicas[0].Committed(cell[0]);
  EXPECT_GE(copies, 2) << "the lost answer made the follower commit the cell again";
  for (auto& replica : replicas) {
    uint64_t extra = 0;
    for (const auto& command : cell) {
      EXPECT_EQ(replica.Committed(command), copies);  // the same log everywhere
      extra += replica.Committed(command) - 1;
    }
    EXPECT_EQ(replica.Events(),
              (std::vector<std::string>{"delta cell1 x=1", "side-effect cell1 %pip install nothing",
                                        "done cell1", elected}));
    EXPECT_EQ(replica.DuplicatesSkipped(), extra);
  }
  for (auto& rt : routers) rt.reset();
  for (auto& n : nodes) n.reset();
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace nbos::replica
