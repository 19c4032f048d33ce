#include "replication/peer_auth.h"

#include <gtest/gtest.h>

namespace nbos::replication {
namespace {

TEST(PeerAuthTest, TheMacDependsOnTheKeyAndOnEveryPartAndItsBoundaries) {
  const std::string key = PeerKeyFrom("connection key");
  ASSERT_EQ(key.size(), kPeerMacBytes);
  EXPECT_NE(key, PeerKeyFrom("another connection key"));
  EXPECT_EQ(PeerKeyFrom(""), "");
  const std::string mac = PeerMac(key, {"raft", "nonce", PeerIdBytes(1)});
  EXPECT_EQ(mac.size(), kPeerMacBytes);
  EXPECT_EQ(mac, PeerMac(key, {"raft", "nonce", PeerIdBytes(1)}));
  EXPECT_NE(mac, PeerMac(PeerKeyFrom("x"), {"raft", "nonce", PeerIdBytes(1)}));
  EXPECT_NE(mac, PeerMac(key, {"raft", "nonce", PeerIdBytes(2)}));
  // The same bytes split otherwise are another message.
  EXPECT_NE(PeerMac(key, {"ab", "c"}), PeerMac(key, {"a", "bc"}));
  EXPECT_NE(PeerMac(key, {"abc"}), PeerMac(key, {"abc", ""}));
}

TEST(PeerAuthTest, MatchesAcceptsOnlyTheExactMac) {
  const std::string key = PeerKeyFrom("k");
  std::string mac = PeerMac(key, {"a", "b"});
  EXPECT_TRUE(PeerMacMatches(key, {"a", "b"}, mac));
  EXPECT_FALSE(PeerMacMatches(key, {"a", "c"}, mac));
  EXPECT_FALSE(PeerMacMatches(key, {"a", "b"}, mac.substr(1)));
  EXPECT_FALSE(PeerMacMatches(key, {"a", "b"}, ""));
  mac[31] ^= 1;
  EXPECT_FALSE(PeerMacMatches(key, {"a", "b"}, mac));
}

TEST(PeerAuthTest, NoncesDiffer) {
  EXPECT_EQ(PeerNonce().size(), kPeerNonceBytes);
  EXPECT_NE(PeerNonce(), PeerNonce());
}

}  // namespace
}  // namespace nbos::replication
