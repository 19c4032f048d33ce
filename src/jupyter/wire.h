// The ZeroMQ wire format of Jupyter messages: routing identities, the "<IDS|MSG>" delimiter, an
// HMAC signature over the four JSON frames, the frames, then raw binary buffers.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "jupyter/message.h"

namespace nbos::jupyter {

inline constexpr std::string_view kDelimiter = "<IDS|MSG>";

// HMAC signer for one key. An empty key disables signing: signatures are empty and every
// message verifies, as jupyter_client does. Thread-safe; copies share the prepared key.
class Signer {
 public:
  // Fails for schemes other than "hmac-sha256" (the only one Jupyter uses in practice).
  static Result<Signer> Create(std::string_view key, std::string_view scheme = "hmac-sha256");
  Signer();  // no key: unsigned
  ~Signer();
  Signer(const Signer&);
  Signer& operator=(const Signer&);

  bool enabled() const { return state_ != nullptr; }
  // Lowercase hex HMAC over the concatenation of `parts`.
  std::string Sign(const std::vector<std::string_view>& parts) const;
  // Constant-time comparison against Sign(parts).
  bool Verify(std::string_view signature, const std::vector<std::string_view>& parts) const;

 private:
  struct State;
  std::shared_ptr<const State> state_;
};

struct DecodeLimits {
  size_t max_message_bytes = 512u << 20;  // all frames together
  size_t max_identities = 16;
  int max_json_depth = 1024;  // per JSON frame (Python's own recursion limit is 1000)
};

// Frames of `m` ready to send: identities, delimiter, signature, header, parent_header, metadata,
// content, buffers.
std::vector<std::string> EncodeFrames(const Message& m, const Signer& signer);

// Same as EncodeFrames, for a caller that already holds the serialized content (saves a parse and
// a dump on large outputs). `content_json` must be a JSON object.
std::vector<std::string> EncodeFramesWithContent(const Message& m, std::string content_json,
                                                 const Signer& signer);

// Parses frames received from a socket. Never crashes on malformed input. Errors:
// InvalidArgument (no delimiter, too few frames, a JSON frame that is not an object),
// Unauthenticated (signature mismatch), ResourceExhausted (over `limits`: size, identities or
// nesting).
Result<Message> DecodeFrames(std::vector<std::string> frames, const Signer& signer,
                             const DecodeLimits& limits = {});

}  // namespace nbos::jupyter
