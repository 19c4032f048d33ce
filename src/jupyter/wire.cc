#include "jupyter/wire.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <cassert>

#include "common/hex.h"
#include "jupyter/json_limits.h"

namespace nbos::jupyter {

// A MAC context initialised with the key once; each signature duplicates it, which is far cheaper
// than fetching the algorithm and setting the key per message.
struct Signer::State {
  EVP_MAC* mac = nullptr;
  EVP_MAC_CTX* keyed = nullptr;
  ~State() {
    EVP_MAC_CTX_free(keyed);
    EVP_MAC_free(mac);
  }
};

Signer::Signer() = default;
Signer::~Signer() = default;
Signer::Signer(const Signer&) = default;
Signer& Signer::operator=(const Signer&) = default;

Result<Signer> Signer::Create(std::string_view key, std::string_view scheme) {
  if (scheme != "hmac-sha256") {
    return InvalidArgument("unsupported signature_scheme '" + std::string(scheme) +
                           "' (only hmac-sha256)");
  }
  Signer s;
  if (key.empty()) return s;
  auto state = std::make_shared<State>();
  state->mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  if (state->mac == nullptr) return Internal("OpenSSL has no HMAC");
  state->keyed = EVP_MAC_CTX_new(state->mac);
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                         OSSL_PARAM_construct_end()};
  if (state->keyed == nullptr ||
      EVP_MAC_init(state->keyed, reinterpret_cast<const unsigned char*>(key.data()), key.size(),
                   params) != 1) {
    return Internal("HMAC-SHA256 initialisation failed");
  }
  s.state_ = std::move(state);
  return s;
}

std::string Signer::Sign(const std::vector<std::string_view>& parts) const {
  if (!state_) return {};
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_dup(state_->keyed);
  assert(ctx != nullptr);
  for (std::string_view p : parts) {
    EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(p.data()), p.size());
  }
  unsigned char out[EVP_MAX_MD_SIZE];
  size_t out_len = 0;
  EVP_MAC_final(ctx, out, &out_len, sizeof(out));
  EVP_MAC_CTX_free(ctx);
  return HexEncode(out, out_len);
}

bool Signer::Verify(std::string_view signature, const std::vector<std::string_view>& parts) const {
  if (!state_) return true;
  std::string expected = Sign(parts);
  return signature.size() == expected.size() &&
         CRYPTO_memcmp(signature.data(), expected.data(), expected.size()) == 0;
}

namespace {

std::string Dump(const Json& j) {
  // Invalid UTF-8 from user output must not abort the kernel: replace it.
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::vector<std::string> Assemble(const Message& m, std::string header, std::string parent,
                                  std::string metadata, std::string content, const Signer& signer) {
  std::vector<std::string> frames;
  frames.reserve(m.identities.size() + 6 + m.buffers.size());
  frames.insert(frames.end(), m.identities.begin(), m.identities.end());
  frames.emplace_back(kDelimiter);
  frames.push_back(signer.Sign({header, parent, metadata, content}));
  frames.push_back(std::move(header));
  frames.push_back(std::move(parent));
  frames.push_back(std::move(metadata));
  frames.push_back(std::move(content));
  frames.insert(frames.end(), m.buffers.begin(), m.buffers.end());
  return frames;
}

Result<Json> ParseObject(const std::string& text, const char* what, int max_depth) {
  if (!JsonDepthWithin(text, max_depth)) {
    return ResourceExhausted(std::string(what) + " nested deeper than " +
                             std::to_string(max_depth) + " levels");
  }
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument(std::string(what) + " is not valid JSON");
  if (!j.is_object()) return InvalidArgument(std::string(what) + " is not a JSON object");
  return j;
}

}  // namespace

std::vector<std::string> EncodeFrames(const Message& m, const Signer& signer) {
  return Assemble(m, Dump(m.header), Dump(m.parent_header), Dump(m.metadata), Dump(m.content),
                  signer);
}

std::vector<std::string> EncodeFramesWithContent(const Message& m, std::string content_json,
                                                 const Signer& signer) {
  return Assemble(m, Dump(m.header), Dump(m.parent_header), Dump(m.metadata),
                  std::move(content_json), signer);
}

Result<Message> DecodeFrames(std::vector<std::string> frames, const Signer& signer,
                             const DecodeLimits& limits) {
  size_t total = 0;
  for (const auto& f : frames) total += f.size();
  if (total > limits.max_message_bytes) {
    return ResourceExhausted("message of " + std::to_string(total) +
                             " bytes exceeds the limit of " +
                             std::to_string(limits.max_message_bytes));
  }
  size_t delim = 0;
  while (delim < frames.size() && frames[delim] != kDelimiter) ++delim;
  if (delim == frames.size()) return InvalidArgument("no <IDS|MSG> delimiter");
  if (delim > limits.max_identities) return InvalidArgument("too many routing identities");
  if (frames.size() - delim < 6) {
    return InvalidArgument("expected signature and four JSON frames after the delimiter");
  }
  const std::string& signature = frames[delim + 1];
  if (!signer.Verify(signature, {frames[delim + 2], frames[delim + 3], frames[delim + 4],
                                 frames[delim + 5]})) {
    return Unauthenticated("invalid message signature");
  }
  Message m;
  auto header = ParseObject(frames[delim + 2], "header", limits.max_json_depth);
  if (!header.ok()) return header.status();
  auto parent = ParseObject(frames[delim + 3], "parent_header", limits.max_json_depth);
  if (!parent.ok()) return parent.status();
  auto metadata = ParseObject(frames[delim + 4], "metadata", limits.max_json_depth);
  if (!metadata.ok()) return metadata.status();
  auto content = ParseObject(frames[delim + 5], "content", limits.max_json_depth);
  if (!content.ok()) return content.status();
  m.header = std::move(*header);
  if (m.msg_type().empty()) return InvalidArgument("header has no msg_type");
  m.parent_header = std::move(*parent);
  m.metadata = std::move(*metadata);
  m.content = std::move(*content);
  m.identities.assign(std::make_move_iterator(frames.begin()),
                      std::make_move_iterator(frames.begin() + static_cast<long>(delim)));
  m.buffers.assign(std::make_move_iterator(frames.begin() + static_cast<long>(delim) + 6),
                   std::make_move_iterator(frames.end()));
  return m;
}

}  // namespace nbos::jupyter
