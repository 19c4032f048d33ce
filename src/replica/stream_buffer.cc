#include "replica/stream_buffer.h"

#include <utility>

namespace nbos::replica {

void StreamBuffer::Append(std::string_view name, std::string_view text) {
  if (text.empty()) return;
  MutexLock lock(&mu_);
  if (!segments_.empty() && segments_.back().name == name) {
    segments_.back().text.append(text);
  } else {
    segments_.push_back({std::string(name), std::string(text)});
  }
  bytes_ += text.size();
}

std::vector<StreamSegment> StreamBuffer::Take() {
  MutexLock lock(&mu_);
  bytes_ = 0;
  return std::exchange(segments_, {});
}

size_t StreamBuffer::buffered_bytes() const {
  MutexLock lock(&mu_);
  return bytes_;
}

size_t CompleteUtf8Prefix(std::string_view bytes) {
  // Walk back over at most three continuation bytes to the lead byte of the last sequence.
  size_t n = bytes.size();
  size_t i = n;
  int continuation = 0;
  while (i > 0 && continuation < 4) {
    unsigned char c = static_cast<unsigned char>(bytes[i - 1]);
    if ((c & 0xC0) != 0x80) break;
    --i;
    ++continuation;
  }
  if (i == 0) return n;  // only continuation bytes: not UTF-8 we can repair, pass through
  unsigned char lead = static_cast<unsigned char>(bytes[i - 1]);
  int needed = (lead & 0x80) == 0      ? 1
               : (lead & 0xE0) == 0xC0 ? 2
               : (lead & 0xF0) == 0xE0 ? 3
               : (lead & 0xF8) == 0xF0 ? 4
                                       : 1;  // invalid lead: let the JSON encoder replace it
  return continuation + 1 < needed ? i - 1 : n;
}

}  // namespace nbos::replica
