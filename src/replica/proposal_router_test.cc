#include "replica/proposal_router.h"

#include <gtest/gtest.h>
#include <unistd.h>

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

}  // namespace
}  // namespace nbos::replica
