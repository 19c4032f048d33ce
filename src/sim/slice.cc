#include "sim/slice.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <string>
#include <tuple>

namespace nbos::sim {

namespace {

int64_t Scaled(int64_t ms, double speedup) {
  return static_cast<int64_t>(std::llround(static_cast<double>(ms) / speedup));
}

Result<int64_t> ParseDurationMs(std::string_view text) {
  if (text == "0") return int64_t{0};
  if (text.size() < 2)
    return InvalidArgument("'" + std::string(text) + "' needs a unit s, m, h or d");
  double per_unit_ms = 0;
  switch (text.back()) {
    case 's':
      per_unit_ms = 1000;
      break;
    case 'm':
      per_unit_ms = 60000;
      break;
    case 'h':
      per_unit_ms = 3600000;
      break;
    case 'd':
      per_unit_ms = 86400000;
      break;
    default:
      return InvalidArgument("'" + std::string(text) + "' needs a unit s, m, h or d");
  }
  text.remove_suffix(1);
  double value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || !(value >= 0)) {
    return InvalidArgument("'" + std::string(text) + "' is not a non-negative number");
  }
  return static_cast<int64_t>(std::llround(value * per_unit_ms));
}

}  // namespace

Result<std::pair<int64_t, int64_t>> ParseWindow(std::string_view text) {
  const size_t dash = text.find('-');
  if (dash == std::string_view::npos) {
    return InvalidArgument("window '" + std::string(text) + "' is not START-END, e.g. 566h-568h");
  }
  auto start = ParseDurationMs(text.substr(0, dash));
  if (!start.ok()) return InvalidArgument("window start: " + start.status().message());
  auto end = ParseDurationMs(text.substr(dash + 1));
  if (!end.ok()) return InvalidArgument("window end: " + end.status().message());
  if (*end <= *start)
    return InvalidArgument("window '" + std::string(text) + "' ends before it starts");
  return std::make_pair(*start, *end);
}

Result<Workload> SliceWorkload(const Workload& workload, const SliceOptions& options) {
  if (!(options.speedup > 0)) return InvalidArgument("speedup must be > 0");
  const int64_t end_ms = options.end_ms < 0 ? INT64_MAX : options.end_ms;
  if (end_ms <= options.start_ms) return InvalidArgument("the window is empty");
  Workload out;
  out.title = workload.title;
  for (const Session& s : workload.sessions) {
    Session kept;
    kept.id = s.id;
    for (const Cell& c : s.cells) {
      if (c.submit_ms < options.start_ms || c.submit_ms >= end_ms) continue;
      Cell cell = c;
      cell.submit_ms = Scaled(c.submit_ms - options.start_ms, options.speedup);
      cell.duration_ms = std::max<int64_t>(1, Scaled(c.duration_ms, options.speedup));
      kept.gpus = std::max(kept.gpus, cell.gpus);
      kept.stop_ms = std::max(kept.stop_ms, cell.submit_ms + cell.duration_ms);
      kept.cells.push_back(cell);
    }
    if (kept.cells.empty()) continue;
    kept.start_ms = Scaled(std::max<int64_t>(0, s.start_ms - options.start_ms), options.speedup);
    kept.start_ms = std::min(kept.start_ms, kept.cells.front().submit_ms);
    out.sessions.push_back(std::move(kept));
  }
  std::stable_sort(out.sessions.begin(), out.sessions.end(),
                   [](const Session& a, const Session& b) {
                     return std::tie(a.start_ms, a.id) < std::tie(b.start_ms, b.id);
                   });
  const auto m = static_cast<int64_t>(out.sessions.size());
  if (options.max_sessions > 0 && options.max_sessions < m) {
    std::vector<Session> chosen;
    for (int64_t i = 0; i < options.max_sessions; ++i) {
      chosen.push_back(std::move(out.sessions[static_cast<size_t>(i * m / options.max_sessions)]));
    }
    out.sessions = std::move(chosen);
  }
  return out;
}

}  // namespace nbos::sim
