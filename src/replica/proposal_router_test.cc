#include "replica/proposal_router.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <thread>

#include "replication/fixture_cluster.h"
#include "replication/test_machine.h"

namespace nbos::replica {
namespace {

using namespace std::chrono_literals;
using replication::ListMachine;
using replication::Member;
using replication::RaftNode;

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
    auto node = RaftNode::Start(o, &machines[i]);
    ASSERT_TRUE(node.ok()) << node.status().ToString();
    nodes[i] = std::move(*node);
    auto router = ProposalRouter::Start(nodes[i].get(), members[i].address);
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
  const replication::ServerId old_leader = nodes[0]->Leader().id;
  const size_t follower = old_leader % 3;  // index of member old_leader + 1 (mod 3)
  ASSERT_NE(members[follower].id, old_leader);
  Status handed = routers[follower]->RequestLeadership(members[follower].id, 5s);
  ASSERT_TRUE(handed.ok()) << handed.ToString();
  for (int t = 0; t < 500 && nodes[follower]->Leader().id != members[follower].id; ++t)
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(nodes[follower]->Leader().id, members[follower].id);
  EXPECT_TRUE(routers[follower]->RequestLeadership(members[follower].id, 5s).ok());

  // The leader goes away; the survivors' proposals follow the new leader.
  size_t leader = nodes[0]->Leader().id - 1;
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
    auto node = RaftNode::Start(o, &machines[i]);
    ASSERT_TRUE(node.ok()) << node.status().ToString();
    nodes[i] = std::move(*node);
    auto router = ProposalRouter::Start(nodes[i].get(), members[i].address);
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    routers[i] = std::move(*router);
  }
  for (int n = 0; n < 20; ++n) {
    auto r = routers[n % 3]->Propose("before" + std::to_string(n), 10s);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  EXPECT_TRUE(nodes[3]->Members().empty());

  // Added through a follower; the answer comes once it is a voter.
  const size_t leader = nodes[0]->Leader().id - 1;
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
  for (int t = 0; t < 500 && nodes[3]->Leader().id == 0; ++t) std::this_thread::sleep_for(10ms);
  const size_t new_leader = nodes[3]->Leader().id - 1;
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

}  // namespace
}  // namespace nbos::replica
