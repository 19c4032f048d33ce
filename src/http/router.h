// Request-target parsing and route patterns for the HTTP server. Pure: no I/O, no Beast, so it
// compiles fast and is tested directly.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace nbos::http {

// Decodes %XX escapes (and '+' as a space when `plus_as_space`, as in query strings). nullopt
// when an escape is truncated or not hex.
std::optional<std::string> PercentDecode(std::string_view s, bool plus_as_space);

// Parses "a=1&b&c=%20x" into {a: "1", b: "", c: " x"}. Keys and values are percent-decoded with
// '+' as space; empty pieces ("a=1&&b=2") are skipped; the first occurrence of a key wins. nullopt
// on a bad escape.
std::optional<std::map<std::string, std::string>> ParseQuery(std::string_view query);

// Splits an origin-form path ("/a/b%20c/") into percent-decoded segments {"a", "b c"}. A
// trailing slash is ignored, so "/a/" and "/a" are the same path; "/" has no segments. nullopt
// when the path does not start with '/' or holds a bad escape.
std::optional<std::vector<std::string>> SplitPath(std::string_view raw_path);

// A route pattern: '/'-separated segments, each a literal, a capture "{name}" (one whole
// segment), or, as the last segment only, a rest capture "{name*}" that takes the remaining
// segments (zero or more) joined by '/'. Example: "/api/kernels/{kernel_id}/channels",
// "/api/contents/{path*}".
class PathPattern {
 public:
  // nullopt when the pattern does not start with '/', has an empty or unterminated capture, a
  // duplicate capture name, a rest capture before the last segment, or a trailing slash.
  static std::optional<PathPattern> Parse(std::string_view pattern);

  // True when `segments` (from SplitPath) match; then `*params` receives the captures (it is
  // left unchanged on a mismatch).
  bool Match(const std::vector<std::string>& segments,
             std::map<std::string, std::string>* params) const;

  const std::string& text() const { return text_; }

 private:
  struct Segment {
    std::string text;  // the literal, or the capture name
    bool capture = false;
    bool rest = false;
  };

  std::string text_;
  std::vector<Segment> segments_;
};

}  // namespace nbos::http
