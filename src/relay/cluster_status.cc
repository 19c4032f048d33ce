#include "relay/cluster_status.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

namespace nbos::relay {
namespace {

using Json = nlohmann::json;

// A value as text: "-" for null, strings bare, fractions with two decimals.
std::string Text(const Json& v) {
  if (v.is_null()) return "-";
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_float()) return fmt::format("{:.2f}", v.get<double>());
  return v.dump();
}

std::string Field(const Json& j, const char* key) {
  return j.is_object() && j.contains(key) ? Text(j[key]) : "-";
}

int64_t Int(const Json& j, const char* key) {
  return j.is_object() && j.contains(key) && j[key].is_number() ? j[key].get<int64_t>() : 0;
}

const Json& Array(const Json& j, const char* key) {
  static const Json kEmpty = Json::array();
  return j.is_object() && j.contains(key) && j[key].is_array() ? j[key] : kEmpty;
}

// Rows padded to their columns' widths, two spaces apart.
std::string Table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    width.resize(std::max(width.size(), row.size()));
    for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += i + 1 == row.size() ? row[i] : fmt::format("{:<{}}  ", row[i], width[i]);
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

std::string ServerState(const Json& s) {
  if (!s.value("alive", false)) return "lost";
  if (s.value("draining", false)) return "draining";
  return s.value("accepting", true) ? "alive" : "closed";
}

std::string Servers(const Json& cluster) {
  std::vector<std::vector<std::string>> rows = {
      {"SERVER", "STATE", "GPUS IDLE/COMMITTED/ALL", "SUBSCRIBED", "WARM", "ADDRESS"}};
  for (const Json& s : Array(cluster, "servers")) {
    const Json& warm = s.value("warm_pool", Json::object());
    rows.push_back(
        {Field(s, "server_id"), ServerState(s),
         fmt::format("{}/{}/{}", Field(s, "gpus_idle"), Field(s, "gpus_committed"),
                     Field(s.value("spec", Json::object()), "gpus")),
         Field(s.value("subscribed", Json::object()), "gpus"),
         warm.empty() ? "-" : fmt::format("{}/{}", Field(warm, "ready"), Field(warm, "target")),
         Field(s, "address")});
  }
  return Table(rows);
}

std::string Replicas(const Json& k) {
  std::string out;
  for (const Json& r : Array(k, "replicas")) {
    if (!out.empty()) out += " ";
    out += fmt::format("{}@{}:{}{}", Field(r, "replica_id"), Field(r, "server_id"),
                       Field(r, "state"), Field(r, "role") == "executor" ? "*" : "");
  }
  const Json m = k.value("migration", Json());
  if (m.is_object()) {
    out += fmt::format("  (moving {} to {}: {})", Field(m, "leaving_replica"),
                       Field(m, "to_server_id"), Field(m, "reason"));
  }
  return out.empty() ? "-" : out;
}

std::string Kernels(const Json& cluster) {
  const Json& kernels = Array(cluster, "kernels");
  if (kernels.empty()) return "no kernels\n";
  std::vector<std::vector<std::string>> rows = {
      {"KERNEL", "OWNER", "NAME", "STATE", "GPUS", "REPLICAS (* executes)"}};
  for (const Json& k : kernels) {
    std::string state = Field(k, "execution_state");
    if (k.value("suspended", false)) state = "suspended";
    const std::string owner = Field(k, "owner");
    rows.push_back({Field(k, "id"), owner.empty() ? "-" : owner, Field(k, "name"), state,
                    Field(k.value("resources", Json::object()), "gpus"), Replicas(k)});
  }
  return Table(rows);
}

// The cluster's events (migrations, scaling, lost servers, suspensions) as "HH:MM:SS UTC".
std::string ClusterEvents(const Json& events, size_t max_events) {
  std::string out;
  const size_t first = events.size() > max_events ? events.size() - max_events : 0;
  for (size_t i = first; i < events.size(); ++i) {
    const Json& e = events[i];
    const int64_t s = Int(e, "at_unix_ms") / 1000 % 86400;
    std::string kernel = Field(e, "kernel_id");
    kernel = kernel == "-" ? "" : kernel.substr(0, 8);
    out += fmt::format("  {:02}:{:02}:{:02} {} {}{}\n", s / 3600, s / 60 % 60, s % 60,
                       Field(e, "kind"), kernel.empty() ? "" : kernel + ": ", Field(e, "text"));
  }
  return out;
}

std::string Events(const Json& cluster, size_t max_events) {
  const Json& scaling = cluster.value("scaling", Json::object());
  const Json& events = Array(scaling, "events");
  std::string out;
  const size_t first = events.size() > max_events ? events.size() - max_events : 0;
  if (cluster.contains("events")) {
    out = ClusterEvents(Array(cluster, "events"), max_events);
  } else {
    // An older gateway lists scaling events only.
    for (size_t i = first; i < events.size(); ++i) {
      const Json& e = events[i];
      std::string servers;
      for (const Json& id : Array(e, "server_ids"))
        servers += (servers.empty() ? "" : ",") + Text(id);
      out += fmt::format("  {} {}: {}\n", Field(e, "kind"), servers, Field(e, "reason"));
    }
  }
  const Json& mig = cluster.value("migrations", Json::object());
  const Json& sus = cluster.value("suspensions", Json::object());
  out += fmt::format(
      "migrations {} done, {} failed; replicas replaced {}; kernels suspended {}, resumed {}; "
      "scale-outs {}, scale-ins {}\n",
      Int(mig, "done"), Int(mig, "failed"), Int(mig, "replacements_done"), Int(sus, "suspended"),
      Int(sus, "resumed"), Int(scaling, "scale_outs"), Int(scaling, "scale_ins"));
  return out;
}

}  // namespace

std::string RenderClusterStatus(const Json& cluster, const std::string& gateway_url,
                                size_t max_events) {
  int64_t alive = 0, gpus = 0, committed = 0;
  for (const Json& s : Array(cluster, "servers")) {
    alive += s.value("alive", false) ? 1 : 0;
    gpus += Int(s.value("spec", Json::object()), "gpus");
    committed += Int(s, "gpus_committed");
  }
  std::string out = fmt::format(
      "nbos at {}: {} servers ({} alive, {} pending), {} kernels, GPUs {} committed of {}, "
      "subscription ratio {}\n\n",
      gateway_url, Array(cluster, "servers").size(), alive,
      Array(cluster, "pending_servers").size(), Array(cluster, "kernels").size(), committed, gpus,
      Field(cluster, "cluster_subscription_ratio"));
  out += Servers(cluster) + "\n" + Kernels(cluster) + "\n" + Events(cluster, max_events);
  return out;
}

}  // namespace nbos::relay
