#include "replica/membership.h"

#include <gtest/gtest.h>

namespace nbos::replica {
namespace {

using jupyter::Json;

TEST(MembershipTest, ParsesAddAndRemove) {
  auto add = ParseMembershipRequest(
      Json{{"op", "add"}, {"replica_id", 4}, {"raft_address", "127.0.0.1:9000"}});
  ASSERT_TRUE(add.ok()) << add.status().ToString();
  EXPECT_EQ(add->op, MembershipChange::Op::kAdd);
  EXPECT_EQ(add->replica_id, 4u);
  EXPECT_EQ(add->raft_address, "127.0.0.1:9000");

  auto remove = ParseMembershipRequest(Json{{"op", "remove"}, {"replica_id", 1}});
  ASSERT_TRUE(remove.ok()) << remove.status().ToString();
  EXPECT_EQ(remove->op, MembershipChange::Op::kRemove);
  EXPECT_EQ(remove->replica_id, 1u);
  EXPECT_EQ(remove->timeout.count(), 0);  // not said

  auto bounded =
      ParseMembershipRequest(Json{{"op", "remove"}, {"replica_id", 1}, {"timeout_ms", 5000}});
  ASSERT_TRUE(bounded.ok()) << bounded.status().ToString();
  EXPECT_EQ(bounded->timeout.count(), 5000);
  auto huge = ParseMembershipRequest(
      Json{{"op", "remove"}, {"replica_id", 1}, {"timeout_ms", uint64_t{1} << 62}});
  ASSERT_TRUE(huge.ok()) << huge.status().ToString();
  EXPECT_EQ(huge->timeout.count(), 24 * 3600 * 1000);  // capped at a day
}

TEST(MembershipTest, RejectsMalformedRequests) {
  const Json bad[] = {
      Json::array(),
      Json{{"replica_id", 4}, {"raft_address", "127.0.0.1:9000"}},
      Json{{"op", "grow"}, {"replica_id", 4}},
      Json{{"op", 7}, {"replica_id", 4}},
      Json{{"op", "remove"}, {"replica_id", 0}},
      Json{{"op", "remove"}, {"replica_id", -1}},
      Json{{"op", "remove"}, {"replica_id", "1"}},
      Json{{"op", "remove"}},
      Json{{"op", "add"}, {"replica_id", 4}},
      Json{{"op", "add"}, {"replica_id", 4}, {"raft_address", "localhost:9000"}},
      Json{{"op", "add"}, {"replica_id", 4}, {"raft_address", "127.0.0.1"}},
      Json{{"op", "add"}, {"replica_id", 4}, {"raft_address", "127.0.0.1:65535"}},
      Json{{"op", "add"}, {"replica_id", 4}, {"raft_address", "127.0.0.1:0"}},
      Json{{"op", "add"}, {"replica_id", 4}, {"raft_address", "127.0.0.1:9x"}},
      Json{{"op", "remove"}, {"replica_id", 1}, {"timeout_ms", 0}},
      Json{{"op", "remove"}, {"replica_id", 1}, {"timeout_ms", -5}},
      Json{{"op", "remove"}, {"replica_id", 1}, {"timeout_ms", "5000"}},
      Json{{"op", "remove"}, {"replica_id", 1}, {"timeout_ms", 1.5}},
  };
  for (const Json& content : bad) {
    auto r = ParseMembershipRequest(content);
    ASSERT_FALSE(r.ok()) << content.dump();
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << content.dump();
    EXPECT_FALSE(r.status().message().empty());
  }
}

TEST(MembershipTest, RaftAddressesAreIpv4WithAPort) {
  EXPECT_TRUE(IsRaftAddress("10.0.0.7:1"));
  EXPECT_TRUE(IsRaftAddress("127.0.0.1:65534"));
  EXPECT_FALSE(IsRaftAddress("::1:9000"));
  EXPECT_FALSE(IsRaftAddress(":9000"));
  EXPECT_FALSE(IsRaftAddress("127.0.0.1:123456"));
}

}  // namespace
}  // namespace nbos::replica
