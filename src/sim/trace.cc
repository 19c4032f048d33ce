#include "sim/trace.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "sim/random.h"

namespace nbos::sim {

namespace {

using nlohmann::json;

void SortSessions(Workload& w) {
  std::stable_sort(w.sessions.begin(), w.sessions.end(), [](const Session& a, const Session& b) {
    return std::tie(a.start_ms, a.id) < std::tie(b.start_ms, b.id);
  });
}

bool ParseInt(std::string_view s, int64_t* out) {
  while (!s.empty() && (s.back() == '\r' || s.back() == ' ')) s.remove_suffix(1);
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

void FinishSession(Session& s, int64_t lead_ms) {
  std::stable_sort(s.cells.begin(), s.cells.end(),
                   [](const Cell& a, const Cell& b) { return a.submit_ms < b.submit_ms; });
  s.gpus = 0;
  s.stop_ms = 0;
  for (const Cell& c : s.cells) {
    s.gpus = std::max(s.gpus, c.gpus);
    s.stop_ms = std::max(s.stop_ms, c.submit_ms + c.duration_ms);
  }
  if (!s.cells.empty()) s.start_ms = std::max<int64_t>(0, s.cells.front().submit_ms - lead_ms);
}

}  // namespace

int64_t Workload::cells() const {
  int64_t n = 0;
  for (const Session& s : sessions) n += static_cast<int64_t>(s.cells.size());
  return n;
}

Result<Workload> LoadAdobeCsv(const std::string& path, int64_t lead_ms) {
  std::ifstream in(path);
  if (!in) return NotFound("cannot open trace '" + path + "'");
  std::string line;
  if (!std::getline(in, line) || line.rfind("job_id,num_gpu,submit_time", 0) != 0) {
    return InvalidArgument(path + ": not a Tiresias CSV (header job_id,num_gpu,submit_time,...)");
  }
  Workload w;
  w.title = path;
  Session current;
  int64_t previous_submit = -1;
  int64_t line_number = 1;
  auto flush = [&] {
    if (current.cells.empty()) return;
    FinishSession(current, lead_ms);
    current.id = "s" + std::to_string(w.sessions.size());
    w.sessions.push_back(std::move(current));
    current = Session{};
  };
  std::vector<std::string_view> fields;
  while (std::getline(in, line)) {
    ++line_number;
    if (line.empty() || line == "\r") continue;
    fields.clear();
    std::string_view rest(line);
    for (size_t comma; (comma = rest.find(',')) != std::string_view::npos;) {
      fields.push_back(rest.substr(0, comma));
      rest.remove_prefix(comma + 1);
    }
    fields.push_back(rest);
    int64_t gpus = 0, submit_min = 0, duration_min = 0;
    if (fields.size() < 6 || !ParseInt(fields[1], &gpus) || !ParseInt(fields[2], &submit_min) ||
        !ParseInt(fields[5], &duration_min) || gpus < 0 || submit_min < 0 || duration_min <= 0) {
      return InvalidArgument(path + ":" + std::to_string(line_number) + ": malformed row '" + line +
                             "'");
    }
    if (submit_min < previous_submit) flush();  // the reconstruction rule
    previous_submit = submit_min;
    current.cells.push_back({submit_min * 60000, duration_min * 60000, static_cast<int32_t>(gpus)});
  }
  flush();
  SortSessions(w);
  return w;
}

Result<Workload> LoadTemplateJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound("cannot open template '" + path + "'");
  try {
    const json j = json::parse(in);
    Workload w;
    w.title = j.value("workloadTitle", path);
    const int64_t tick_ms = j.value("tick_ms", int64_t{60000});
    if (tick_ms <= 0) return InvalidArgument(path + ": tick_ms must be positive");
    for (const json& js : j.at("sessions")) {
      Session s;
      s.id = js.at("id").is_string() ? js["id"].get<std::string>() : js["id"].dump();
      for (const json& jt : js.at("trainings")) {
        Cell c;
        c.submit_ms = jt.at("start_tick").get<int64_t>() * tick_ms;
        c.duration_ms = jt.at("duration_in_ticks").get<int64_t>() * tick_ms;
        c.gpus = jt.at("gpus").get<int32_t>();
        if (c.duration_ms <= 0 || c.gpus < 0 || c.submit_ms < 0) {
          return InvalidArgument(path + ": session '" + s.id + "' has an invalid training");
        }
        s.cells.push_back(c);
      }
      FinishSession(s, 0);
      s.start_ms = js.at("start_tick").get<int64_t>() * tick_ms;
      s.stop_ms = std::max(s.stop_ms, js.at("stop_tick").get<int64_t>() * tick_ms);
      if (!s.cells.empty() && s.start_ms > s.cells.front().submit_ms) {
        return InvalidArgument(path + ": session '" + s.id + "' starts after its first training");
      }
      w.sessions.push_back(std::move(s));
    }
    SortSessions(w);
    return w;
  } catch (const json::exception& e) {
    return InvalidArgument(path + ": malformed template: " + e.what());
  }
}

void WriteTemplateJson(const Workload& workload, std::ostream& out) {
  json sessions = json::array();
  for (const Session& s : workload.sessions) {
    json trainings = json::array();
    for (const Cell& c : s.cells) {
      trainings.push_back({{"start_tick", c.submit_ms / 1000},
                           {"duration_in_ticks", c.duration_ms / 1000},
                           {"gpus", c.gpus}});
    }
    sessions.push_back({{"id", s.id},
                        {"start_tick", s.start_ms / 1000},
                        {"stop_tick", s.stop_ms / 1000},
                        {"num_training_events", s.cells.size()},
                        {"trainings", std::move(trainings)}});
  }
  json j{{"workloadTitle", workload.title},
         {"tick_ms", 1000},
         {"numberOfSessions", workload.sessions.size()},
         {"sessions", std::move(sessions)}};
  out << j.dump(1) << '\n';
}

Result<Workload> LoadTrace(const std::string& path) {
  if (path.size() >= 4 && path.compare(path.size() - 4, 4, ".csv") == 0) {
    return LoadAdobeCsv(path);
  }
  return LoadTemplateJson(path);
}

Result<Workload> Generate(const GeneratorOptions& o) {
  if (!(o.sessions_per_hour > 0) || !(o.hours > 0) || !(o.cells_per_session >= 1) ||
      !(o.duration_shape > 0) || !(o.duration_scale_min > 0) || !(o.gap_mean_min >= 0) ||
      o.gpu_values.empty() || o.gpu_values.size() != o.gpu_weights.size()) {
    return InvalidArgument(
        "generator: rates, hours, shape and scale must be positive, "
        "cells per session >= 1, and GPU values and weights the same length");
  }
  Rng rng(o.seed);
  Workload w;
  w.title = "synthetic seed " + std::to_string(o.seed);
  double total_weight = 0;
  for (double x : o.gpu_weights) total_weight += x;
  const double horizon_ms = o.hours * 3600e3;
  double t_ms = 0;
  for (int i = 0;; ++i) {
    t_ms += rng.Exponential(3600e3 / o.sessions_per_hour);
    if (t_ms >= horizon_ms) break;
    Session s;
    s.id = "g" + std::to_string(i);
    double pick = rng.Uniform() * total_weight;
    int32_t gpus = o.gpu_values.back();
    for (size_t k = 0; k < o.gpu_values.size(); ++k) {
      if (pick < o.gpu_weights[k]) {
        gpus = o.gpu_values[k];
        break;
      }
      pick -= o.gpu_weights[k];
    }
    // Geometric number of cells with the requested mean, at least one.
    const double p = 1.0 / o.cells_per_session;
    int64_t cells = 1;
    while (rng.Uniform() > p && cells < 100000) ++cells;
    const auto start_ms = static_cast<int64_t>(t_ms);
    int64_t at_ms = start_ms + 60000;  // the first cell a minute after opening
    for (int64_t c = 0; c < cells; ++c) {
      const auto duration_ms = std::max<int64_t>(
          1000, static_cast<int64_t>(rng.Gamma(o.duration_shape, o.duration_scale_min) * 60e3));
      s.cells.push_back({at_ms / 1000 * 1000, duration_ms / 1000 * 1000, gpus});
      at_ms += duration_ms + static_cast<int64_t>(rng.Exponential(o.gap_mean_min * 60e3));
    }
    FinishSession(s, 0);
    s.start_ms = start_ms / 1000 * 1000;
    w.sessions.push_back(std::move(s));
  }
  SortSessions(w);
  return w;
}

}  // namespace nbos::sim
