#include "auth/users.h"

#include <gtest/gtest.h>

#include "common/hex.h"

namespace nbos::auth {
namespace {

constexpr char kAliceToken[] = "alice-token-0123456789";
constexpr char kBobToken[] = "bob-token-0123456789ab";

std::string HexSha256(const std::string& token) {
  const TokenDigest d = Sha256(token);
  return HexEncode(d.data(), d.size());
}

TEST(UsersTest, ParsesTokensHashesAndAdmins) {
  auto users = ParseUsers(R"({"users": [
      {"name": "alice", "token": "alice-token-0123456789"},
      {"name": "bob", "token_sha256": ")" +
                          HexSha256(kBobToken) + R"("},
      {"name": "ops", "token": "ops-token-0123456789ab", "admin": true}]})");
  ASSERT_TRUE(users.ok()) << users.status().message();
  ASSERT_EQ(users->size(), 3u);
  auto alice = FindUser(*users, Sha256(kAliceToken));
  ASSERT_TRUE(alice);
  EXPECT_EQ(alice->user, "alice");
  EXPECT_FALSE(alice->admin);
  auto bob = FindUser(*users, Sha256(kBobToken));
  ASSERT_TRUE(bob);
  EXPECT_EQ(bob->user, "bob");
  auto ops = FindUser(*users, Sha256("ops-token-0123456789ab"));
  ASSERT_TRUE(ops);
  EXPECT_TRUE(ops->admin);
  EXPECT_FALSE(FindUser(*users, Sha256("nobody's token 0123456789")));
  EXPECT_FALSE(FindUser(*users, Sha256("")));
}

TEST(UsersTest, ABareListIsAcceptedAndAnEmptyOneKnowsNobody) {
  auto users = ParseUsers(R"([{"name": "alice", "token": "alice-token-0123456789"}])");
  ASSERT_TRUE(users.ok()) << users.status().message();
  EXPECT_EQ(users->size(), 1u);
  auto none = ParseUsers(R"({"users": []})");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(FindUser(*none, Sha256(kAliceToken)));
}

TEST(UsersTest, BadFilesAreRefusedNamingTheEntryAndField) {
  struct Case {
    const char* json;
    const char* says;
  };
  const Case cases[] = {
      {"not json", "not JSON"},
      {R"({"people": []})", "no \"users\" list"},
      {R"({"users": {}})", "must be a list"},
      {R"({"users": [7]})", "users[0] must be an object"},
      {R"({"users": [{"token": "alice-token-0123456789"}]})", "users[0].name"},
      {R"({"users": [{"name": "", "token": "alice-token-0123456789"}]})", "users[0].name"},
      {R"({"users": [{"name": "a\u0001b", "token": "alice-token-0123456789"}]})", "name"},
      {R"({"users": [{"name": "alice"}]})", "exactly one of token and token_sha256"},
      {R"({"users": [{"name": "alice", "token": "short"}]})", "at least 16 characters"},
      {R"({"users": [{"name": "alice", "token": 12345678901234567}]})", "token must be"},
      {R"({"users": [{"name": "alice", "token_sha256": "abc"}]})", "64 hexadecimal digits"},
      {R"({"users": [{"name": "alice", "token": "alice-token-0123456789", "admin": "yes"}]})",
       "(alice).admin must be true or false"},
      {R"({"users": [{"name": "alice", "token": "alice-token-0123456789"},
                     {"name": "alice", "token": "other-token-0123456789"}]})",
       "users[1]: alice is listed twice"},
      {R"({"users": [{"name": "alice", "token": "alice-token-0123456789"},
                     {"name": "bob", "token": "alice-token-0123456789"}]})",
       "users[1] (bob) has the token of another user"},
  };
  for (const Case& c : cases) {
    auto users = ParseUsers(c.json);
    ASSERT_FALSE(users.ok()) << c.json;
    EXPECT_EQ(users.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(users.status().message().find(c.says), std::string::npos)
        << users.status().message() << " should say " << c.says;
  }
}

TEST(UsersTest, AMissingFileIsNamed) {
  auto users = ReadUsersFile("/nonexistent/users.json");
  ASSERT_FALSE(users.ok());
  EXPECT_NE(users.status().message().find("/nonexistent/users.json"), std::string::npos);
}

}  // namespace
}  // namespace nbos::auth
