#include "replication/peer_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "common/check.h"

namespace nbos::replication {

std::string PeerKeyFrom(std::string_view connection_key) {
  if (connection_key.empty()) return {};
  return PeerMac(connection_key, {"nbos replicated log peers v1"});
}

std::string PeerIdBytes(uint64_t id) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((id >> (8 * i)) & 0xff);
  return out;
}

std::string PeerMac(std::string_view peer_key, std::span<const std::string_view> parts) {
  EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  NBOS_CHECK(mac != nullptr, "OpenSSL has no HMAC");
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_new(mac);
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0),
                         OSSL_PARAM_construct_end()};
  // An empty key is a valid HMAC key, but EVP_MAC_init wants a non-null pointer for it.
  static const unsigned char kNoKey = 0;
  const auto* key =
      peer_key.empty() ? &kNoKey : reinterpret_cast<const unsigned char*>(peer_key.data());
  NBOS_CHECK(EVP_MAC_init(ctx, key, peer_key.size(), params) == 1, "HMAC init failed");
  for (std::string_view part : parts) {
    const std::string length = PeerIdBytes(part.size());
    EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(length.data()), length.size());
    EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(part.data()), part.size());
  }
  std::string out(kPeerMacBytes, '\0');
  size_t written = 0;
  NBOS_CHECK(
      EVP_MAC_final(ctx, reinterpret_cast<unsigned char*>(out.data()), &written, out.size()) == 1 &&
          written == kPeerMacBytes,
      "HMAC final failed");
  EVP_MAC_CTX_free(ctx);
  EVP_MAC_free(mac);
  return out;
}

bool PeerMacMatches(std::string_view peer_key, std::span<const std::string_view> parts,
                    std::string_view mac) {
  if (mac.size() != kPeerMacBytes) return false;
  const std::string expected = PeerMac(peer_key, parts);
  return CRYPTO_memcmp(expected.data(), mac.data(), kPeerMacBytes) == 0;
}

std::string PeerNonce() {
  std::string out(kPeerNonceBytes, '\0');
  NBOS_CHECK(
      RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(out.size())) == 1,
      "no randomness for a nonce");
  return out;
}

}  // namespace nbos::replication
