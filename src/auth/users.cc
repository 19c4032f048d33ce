#include "auth/users.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace nbos::auth {
namespace {

using Json = nlohmann::json;

constexpr size_t kMinTokenChars = 16;
constexpr size_t kMaxNameChars = 128;

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > kMaxNameChars) return false;
  for (unsigned char c : name) {
    if (c < 0x20 || c == 0x7f) return false;
  }
  return true;
}

std::optional<TokenDigest> ParseHexDigest(const std::string& hex) {
  if (hex.size() != 64) return std::nullopt;
  TokenDigest out{};
  for (size_t i = 0; i < 32; ++i) {
    unsigned value = 0;
    for (char c : hex.substr(2 * i, 2)) {
      const int d = std::isdigit(static_cast<unsigned char>(c)) ? c - '0'
                    : (c >= 'a' && c <= 'f')                    ? c - 'a' + 10
                    : (c >= 'A' && c <= 'F')                    ? c - 'A' + 10
                                                                : -1;
      if (d < 0) return std::nullopt;
      value = value * 16 + static_cast<unsigned>(d);
    }
    out[i] = static_cast<unsigned char>(value);
  }
  return out;
}

Result<User> ParseUser(const Json& entry, size_t index) {
  const std::string where = "users[" + std::to_string(index) + "]";
  if (!entry.is_object()) return InvalidArgument(where + " must be an object");
  User user;
  auto name = entry.find("name");
  if (name == entry.end() || !name->is_string() || !ValidName(name->get<std::string>())) {
    return InvalidArgument(where + ".name must be a name of 1-128 printable characters");
  }
  user.name = name->get<std::string>();
  const std::string who = where + " (" + user.name + ")";
  if (auto admin = entry.find("admin"); admin != entry.end()) {
    if (!admin->is_boolean()) return InvalidArgument(who + ".admin must be true or false");
    user.admin = admin->get<bool>();
  }
  auto token = entry.find("token");
  auto hash = entry.find("token_sha256");
  if ((token == entry.end()) == (hash == entry.end())) {
    return InvalidArgument(who + " needs exactly one of token and token_sha256");
  }
  if (token != entry.end()) {
    if (!token->is_string() || token->get<std::string>().size() < kMinTokenChars) {
      return InvalidArgument(who + ".token must be a string of at least 16 characters");
    }
    user.token_sha256 = Sha256(token->get<std::string>());
  } else {
    auto digest = hash->is_string() ? ParseHexDigest(hash->get<std::string>()) : std::nullopt;
    if (!digest) return InvalidArgument(who + ".token_sha256 must be 64 hexadecimal digits");
    user.token_sha256 = *digest;
  }
  return user;
}

}  // namespace

TokenDigest Sha256(std::string_view token) {
  TokenDigest out{};
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), out.data());
  return out;
}

Result<std::vector<User>> ParseUsers(std::string_view json_text) {
  const Json doc = Json::parse(json_text, nullptr, false);
  if (doc.is_discarded()) return InvalidArgument("the users file is not JSON");
  const Json* list = &doc;
  if (doc.is_object()) {
    auto it = doc.find("users");
    if (it == doc.end()) return InvalidArgument("the users file has no \"users\" list");
    list = &*it;
  }
  if (!list->is_array()) return InvalidArgument("\"users\" must be a list");
  std::vector<User> users;
  std::set<std::string> names;
  std::set<TokenDigest> tokens;
  for (size_t i = 0; i < list->size(); ++i) {
    auto user = ParseUser((*list)[i], i);
    if (!user.ok()) return user.status();
    if (!names.insert(user->name).second) {
      return InvalidArgument("users[" + std::to_string(i) + "]: " + user->name +
                             " is listed twice");
    }
    if (!tokens.insert(user->token_sha256).second) {
      return InvalidArgument("users[" + std::to_string(i) + "] (" + user->name +
                             ") has the token of another user");
    }
    users.push_back(std::move(*user));
  }
  return users;
}

Result<std::vector<User>> ReadUsersFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return InvalidArgument("cannot read the users file " + path);
  std::stringstream text;
  text << in.rdbuf();
  auto users = ParseUsers(text.str());
  if (!users.ok()) return InvalidArgument(path + ": " + users.status().message());
  return users;
}

std::optional<http::Identity> FindUser(const std::vector<User>& users, const TokenDigest& digest) {
  const User* found = nullptr;
  for (const User& user : users) {
    // Every entry is compared in full, so the time taken says nothing about which one matched.
    const bool same = CRYPTO_memcmp(user.token_sha256.data(), digest.data(), digest.size()) == 0;
    if (same) found = &user;
  }
  if (found == nullptr) return std::nullopt;
  return http::Identity{found->name, found->admin};
}

}  // namespace nbos::auth
