// Proof that a peer of a replicated log holds the group's key. Every member of a kernel's group
// holds the kernel's connection key, and nothing else on its servers does (another kernel's cells
// run under other users and see neither the key nor the connection file), so a message that
// proves the key comes from a member. docs/decisions/0018-peer-authentication.md.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

namespace nbos::replication {

inline constexpr size_t kPeerMacBytes = 32;
inline constexpr size_t kPeerNonceBytes = 32;

// The key peers prove, derived from a kernel's connection key so that a proof can never stand in
// for a Jupyter message signature or the other way round. Empty for an empty connection key.
std::string PeerKeyFrom(std::string_view connection_key);

// HMAC-SHA256 under `peer_key` of `parts`, each preceded by its length (8 bytes, little endian)
// so that no two different lists of parts read the same: kPeerMacBytes raw bytes.
std::string PeerMac(std::string_view peer_key, std::span<const std::string_view> parts);
inline std::string PeerMac(std::string_view peer_key,
                           std::initializer_list<std::string_view> parts) {
  return PeerMac(peer_key, std::span<const std::string_view>(parts.begin(), parts.size()));
}

// Whether `mac` is PeerMac(peer_key, parts), in time that does not depend on where they differ.
bool PeerMacMatches(std::string_view peer_key, std::span<const std::string_view> parts,
                    std::string_view mac);
inline bool PeerMacMatches(std::string_view peer_key, std::initializer_list<std::string_view> parts,
                           std::string_view mac) {
  return PeerMacMatches(peer_key, std::span<const std::string_view>(parts.begin(), parts.size()),
                        mac);
}

// kPeerNonceBytes bytes from the operating system's random source.
std::string PeerNonce();

// 8 bytes, little endian: how ids enter a MAC.
std::string PeerIdBytes(uint64_t id);

}  // namespace nbos::replication
