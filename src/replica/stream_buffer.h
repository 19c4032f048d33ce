// Coalesces a cell's stdout/stderr text into few `stream` messages, keeping the order in which
// the two streams were written. Thread-safe: Python, captured fds and the flush timer all use it.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/thread_annotations.h"

namespace nbos::replica {

struct StreamSegment {
  std::string name;  // "stdout" or "stderr"
  std::string text;  // UTF-8
};

class StreamBuffer {
 public:
  void Append(std::string_view name, std::string_view text) EXCLUDES(mu_);
  // Everything buffered so far, consecutive writes to one stream merged, in write order.
  std::vector<StreamSegment> Take() EXCLUDES(mu_);
  size_t buffered_bytes() const EXCLUDES(mu_);

 private:
  mutable Mutex mu_;
  std::vector<StreamSegment> segments_ GUARDED_BY(mu_);
  size_t bytes_ GUARDED_BY(mu_) = 0;
};

// Length of the longest prefix of `bytes` that does not end inside a UTF-8 sequence, so text
// read from a pipe in chunks is never split mid-character.
size_t CompleteUtf8Prefix(std::string_view bytes);

}  // namespace nbos::replica
