#include "http/router.h"

#include <set>

namespace nbos::http {
namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::optional<std::string> PercentDecode(std::string_view s, bool plus_as_space) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (c == '%') {
      if (i + 2 >= s.size()) return std::nullopt;
      int hi = HexValue(s[i + 1]);
      int lo = HexValue(s[i + 2]);
      if (hi < 0 || lo < 0) return std::nullopt;
      out.push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
    } else if (c == '+' && plus_as_space) {
      out.push_back(' ');
    } else {
      out.push_back(c);
    }
  }
  return out;
}

std::optional<std::map<std::string, std::string>> ParseQuery(std::string_view query) {
  std::map<std::string, std::string> out;
  while (!query.empty()) {
    size_t amp = query.find('&');
    std::string_view piece = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (piece.empty()) continue;
    size_t eq = piece.find('=');
    auto key = PercentDecode(piece.substr(0, eq), /*plus_as_space=*/true);
    auto value =
        PercentDecode(eq == std::string_view::npos ? std::string_view() : piece.substr(eq + 1),
                      /*plus_as_space=*/true);
    if (!key || !value) return std::nullopt;
    out.emplace(std::move(*key), std::move(*value));
  }
  return out;
}

std::optional<std::vector<std::string>> SplitPath(std::string_view raw_path) {
  if (raw_path.empty() || raw_path.front() != '/') return std::nullopt;
  raw_path.remove_prefix(1);
  if (!raw_path.empty() && raw_path.back() == '/') raw_path.remove_suffix(1);
  std::vector<std::string> segments;
  if (raw_path.empty()) return segments;
  while (true) {
    size_t slash = raw_path.find('/');
    auto segment = PercentDecode(raw_path.substr(0, slash), /*plus_as_space=*/false);
    if (!segment) return std::nullopt;
    segments.push_back(std::move(*segment));
    if (slash == std::string_view::npos) break;
    raw_path.remove_prefix(slash + 1);
  }
  return segments;
}

std::optional<PathPattern> PathPattern::Parse(std::string_view pattern) {
  if (pattern.empty() || pattern.front() != '/') return std::nullopt;
  if (pattern.size() > 1 && pattern.back() == '/') return std::nullopt;
  PathPattern out;
  out.text_ = std::string(pattern);
  std::string_view rest = pattern.substr(1);
  std::set<std::string, std::less<>> names;
  while (!rest.empty()) {
    size_t slash = rest.find('/');
    std::string_view piece = rest.substr(0, slash);
    rest = slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1);
    if (!out.segments_.empty() && out.segments_.back().rest) return std::nullopt;
    Segment seg;
    if (!piece.empty() && piece.front() == '{') {
      if (piece.size() < 3 || piece.back() != '}') return std::nullopt;
      std::string_view name = piece.substr(1, piece.size() - 2);
      if (name.back() == '*') {
        seg.rest = true;
        name.remove_suffix(1);
      }
      if (name.empty() || name.find_first_of("{}/*") != std::string_view::npos) return std::nullopt;
      if (!names.emplace(name).second) return std::nullopt;
      seg.capture = true;
      seg.text = std::string(name);
    } else {
      if (piece.find_first_of("{}") != std::string_view::npos) return std::nullopt;
      seg.text = std::string(piece);
    }
    out.segments_.push_back(std::move(seg));
  }
  return out;
}

bool PathPattern::Match(const std::vector<std::string>& segments,
                        std::map<std::string, std::string>* params) const {
  std::map<std::string, std::string> captured;
  size_t i = 0;
  for (const Segment& seg : segments_) {
    if (seg.rest) {
      std::string joined;
      for (size_t j = i; j < segments.size(); ++j) {
        if (j > i) joined.push_back('/');
        joined += segments[j];
      }
      captured[seg.text] = std::move(joined);
      i = segments.size();
      break;
    }
    if (i >= segments.size()) return false;
    if (seg.capture) {
      // An empty segment ("/api/kernels//x") is not an id.
      if (segments[i].empty()) return false;
      captured[seg.text] = segments[i];
    } else if (seg.text != segments[i]) {
      return false;
    }
    ++i;
  }
  if (i != segments.size()) return false;
  for (auto& [name, value] : captured) (*params)[name] = std::move(value);
  return true;
}

}  // namespace nbos::http
