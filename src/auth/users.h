// The users file (`nbos gateway --users FILE`): who may call the gateway, with which token.
//
//   {"users": [{"name": "alice", "token": "T"},
//              {"name": "bob", "token_sha256": "<64 hex digits: SHA-256 of bob's token>"},
//              {"name": "ops", "token": "U", "admin": true}]}
//
// A bare array of the same objects is accepted too. Names are non-empty, unique, at most 128
// characters without control characters; tokens at least 16 characters (a hash stands for one),
// and no two users share one. Only SHA-256 digests of tokens are kept in memory, and a token is
// looked up in time that does not depend on which user (if any) it belongs to.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "http/server.h"

namespace nbos::auth {

using TokenDigest = std::array<unsigned char, 32>;

TokenDigest Sha256(std::string_view token);

struct User {
  std::string name;
  bool admin = false;
  TokenDigest token_sha256{};
};

// Errors: InvalidArgument naming the entry and field at fault.
Result<std::vector<User>> ParseUsers(std::string_view json_text);
// ParseUsers of the file's contents; InvalidArgument naming the file when it cannot be read.
Result<std::vector<User>> ReadUsersFile(const std::string& path);

// The user whose token has `digest`. Compares against every user, each in constant time.
std::optional<http::Identity> FindUser(const std::vector<User>& users, const TokenDigest& digest);

}  // namespace nbos::auth
