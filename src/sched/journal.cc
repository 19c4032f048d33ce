#include "sched/journal.h"

#include <cmath>
#include <nlohmann/json.hpp>
#include <utility>

#include "common/overloaded.h"

namespace nbos::sched {

namespace {

using nlohmann::json;

constexpr std::string_view kCodeNames[] = {"ok",        "invalid_argument",   "unauthenticated",
                                           "not_found", "resource_exhausted", "unavailable",
                                           "internal"};

json Enc(const Resources& r) {
  return {{"millicpus", r.millicpus},
          {"memory_mb", r.memory_mb},
          {"gpus", r.gpus},
          {"vram_mb", r.vram_mb}};
}

json Enc(const ServerView& s) {
  return {{"server_id", s.server_id},
          {"spec", Enc(s.spec)},
          {"subscribed", Enc(s.subscribed)},
          {"committed", Enc(s.committed)},
          {"accepting", s.accepting}};
}

json Enc(const KernelView& k) {
  json replicas = json::array();
  for (const ReplicaView& r : k.replicas) {
    replicas.push_back({{"replica_id", r.replica_id}, {"server_id", r.server_id}});
  }
  return {{"kernel_id", k.kernel_id},
          {"request", Enc(k.request)},
          {"replicas", std::move(replicas)},
          {"last_executor", k.last_executor}};
}

json Enc(const ScalingOptions& o) {
  return {{"scaling_factor", o.scaling_factor}, {"scaling_limit", o.scaling_limit},
          {"buffer_hosts", o.buffer_hosts},     {"min_hosts", o.min_hosts},
          {"max_hosts", o.max_hosts},           {"max_release_per_round", o.max_release_per_round},
          {"gpus_per_host", o.gpus_per_host}};
}

json Enc(const RebalanceOptions& o) {
  return {{"enabled", o.enabled},
          {"max_per_tick", o.max_per_tick},
          {"kernel_cooldown_ms", o.kernel_cooldown_ms},
          {"min_gpus", o.min_gpus},
          {"spare_servers_max_replicas", o.spare_servers_max_replicas},
          {"releasable_target_idle_max_ms", o.releasable_target_idle_max_ms}};
}

json Enc(const ForecastOptions& o) {
  return {{"enabled", o.enabled},
          {"horizon_ms", o.horizon_ms},
          {"prior_weight", o.prior_weight},
          {"kernel_history", o.kernel_history},
          {"cover_chance", o.cover_chance},
          {"pin_min_chance", o.pin_min_chance},
          {"spare_cover_min_chance", o.spare_cover_min_chance}};
}

json Enc(const MigrationPlan& m) {
  return {{"replica_id", m.replica_id},
          {"from_server_id", m.from_server_id},
          {"to_server_id", m.to_server_id},
          {"target_warm", m.target_warm},
          {"scale_out_needed", m.scale_out_needed},
          {"reason", m.reason}};
}

json Enc(const Status& s) {
  return {{"code", kCodeNames[static_cast<int>(s.code())]}, {"message", s.message()}};
}

json EncEvent(const SchedulerEvent& event) {
  return std::visit(
      Overloaded{
          [](const ServerJoined& e) {
            return json{{"server", Enc(e.server)}};
          },
          [](const ServerUpdated& e) {
            return json{{"server", Enc(e.server)}};
          },
          [](const ServerLeft& e) {
            return json{{"server_id", e.server_id}};
          },
          [](const ServerAcceptingChanged& e) {
            return json{{"server_id", e.server_id}, {"accepting", e.accepting}};
          },
          [](const PlacementRequested& e) {
            return json{
                {"kernel_id", e.kernel_id},         {"request", Enc(e.request)},
                {"replicas", e.replicas},           {"excluded_servers", e.excluded_servers},
                {"can_scale_out", e.can_scale_out}, {"require_idle_gpus", e.require_idle_gpus}};
          },
          [](const KernelPlaced& e) {
            return json{{"kernel", Enc(e.kernel)}};
          },
          [](const KernelRemoved& e) {
            return json{{"kernel_id", e.kernel_id}};
          },
          [](const ReplicaAdded& e) {
            return json{{"kernel_id", e.kernel_id},
                        {"replica_id", e.replica_id},
                        {"server_id", e.server_id}};
          },
          [](const ReplicaRemoved& e) {
            return json{{"kernel_id", e.kernel_id}, {"replica_id", e.replica_id}};
          },
          [](const ExecutorRequested& e) {
            json j{{"kernel_id", e.kernel_id},
                   {"gpus", e.gpus},
                   {"excluded_replicas", e.excluded_replicas},
                   {"warm_servers", e.warm_servers}};
            j["target_replica"] = e.target_replica ? json(*e.target_replica) : json(nullptr);
            return j;
          },
          [](const GrantCommitted& e) {
            return json{{"kernel_id", e.kernel_id},
                        {"replica_id", e.replica_id},
                        {"server_id", e.server_id},
                        {"resources", Enc(e.resources)}};
          },
          [](const GrantReleased& e) {
            return json{{"kernel_id", e.kernel_id},
                        {"replica_id", e.replica_id},
                        {"server_id", e.server_id},
                        {"resources", Enc(e.resources)}};
          },
          [](const MoveRequested& e) {
            return json{{"kernel_id", e.kernel_id},
                        {"replica_id", e.replica_id},
                        {"to_server_id", e.to_server_id},
                        {"warm_servers", e.warm_servers}};
          },
          [](const Tick&) { return json::object(); },
      },
      event);
}

json EncDecision(const SchedulerDecision& decision) {
  return std::visit(Overloaded{
                        [](const std::monostate&) { return json(nullptr); },
                        [](const Placement& p) {
                          return json{{"server_ids", p.server_ids},
                                      {"ratio_ignored", p.ratio_ignored},
                                      {"scale_out_needed", p.scale_out_needed},
                                      {"hosts_needed", p.hosts_needed},
                                      {"reason", p.reason}};
                        },
                        [](const ExecutorDecision& d) {
                          json j{{"candidates", d.choice.candidates},
                                 {"target_honoured", d.choice.target_honoured},
                                 {"note", d.choice.note}};
                          j["migration"] = d.migration ? Enc(*d.migration) : json(nullptr);
                          return j;
                        },
                        [](const TickDecision& t) {
                          json j{{"cluster_ratio", t.cluster_ratio},
                                 {"demand_gpus", t.demand_gpus},
                                 {"busy_gpus", t.busy_gpus},
                                 {"scaling_evaluated", t.scaling_evaluated},
                                 {"add_hosts", t.scaling.add_hosts},
                                 {"release_server_ids", t.scaling.release_server_ids},
                                 {"reason", t.scaling.reason}};
                          // Written only when there are moves, so that journals from before
                          // rebalancing existed (and runs with it off) keep their bytes.
                          if (!t.rebalance.empty()) {
                            json moves = json::array();
                            for (const RebalancePlan& p : t.rebalance) {
                              json m = Enc(p.plan);
                              m["kernel_id"] = p.kernel_id;
                              moves.push_back(std::move(m));
                            }
                            j["rebalance"] = std::move(moves);
                          }
                          return j;
                        },
                        [](const MigrationPlan& m) { return Enc(m); },
                    },
                    decision);
}

json EncOutcome(const SchedulerOutcome& outcome) {
  return {{"status", Enc(outcome.status)}, {"decision", EncDecision(outcome.decision)}};
}

// ---- Decoding: throws nlohmann::json exceptions on malformed input; caught at the edge below.

Resources DecResources(const json& j) {
  return Resources{j.at("millicpus").get<int64_t>(), j.at("memory_mb").get<int64_t>(),
                   j.at("gpus").get<int32_t>(), j.at("vram_mb").get<int64_t>()};
}

ServerView DecServer(const json& j) {
  ServerView s;
  s.server_id = j.at("server_id").get<std::string>();
  s.spec = DecResources(j.at("spec"));
  s.subscribed = DecResources(j.at("subscribed"));
  s.committed = DecResources(j.at("committed"));
  s.accepting = j.at("accepting").get<bool>();
  return s;
}

KernelView DecKernel(const json& j) {
  KernelView k;
  k.kernel_id = j.at("kernel_id").get<std::string>();
  k.request = DecResources(j.at("request"));
  for (const json& r : j.at("replicas")) {
    k.replicas.push_back(
        {k.kernel_id, r.at("replica_id").get<uint32_t>(), r.at("server_id").get<std::string>()});
  }
  k.last_executor = j.at("last_executor").get<uint32_t>();
  return k;
}

std::set<std::string, std::less<>> DecStringSet(const json& j) {
  std::set<std::string, std::less<>> out;
  for (const json& s : j) out.insert(s.get<std::string>());
  return out;
}

Result<SchedulerEvent> DecEvent(std::string_view name, const json& j) {
  if (name == "server_joined") return SchedulerEvent{ServerJoined{DecServer(j.at("server"))}};
  if (name == "server_updated") return SchedulerEvent{ServerUpdated{DecServer(j.at("server"))}};
  if (name == "server_left") {
    return SchedulerEvent{ServerLeft{j.at("server_id").get<std::string>()}};
  }
  if (name == "server_accepting") {
    return SchedulerEvent{ServerAcceptingChanged{j.at("server_id").get<std::string>(),
                                                 j.at("accepting").get<bool>()}};
  }
  if (name == "placement") {
    PlacementRequested e;
    e.kernel_id = j.at("kernel_id").get<std::string>();
    e.request = DecResources(j.at("request"));
    e.replicas = j.at("replicas").get<int32_t>();
    e.excluded_servers = DecStringSet(j.at("excluded_servers"));
    e.can_scale_out = j.at("can_scale_out").get<bool>();
    e.require_idle_gpus = j.at("require_idle_gpus").get<bool>();
    return SchedulerEvent{std::move(e)};
  }
  if (name == "kernel_placed") return SchedulerEvent{KernelPlaced{DecKernel(j.at("kernel"))}};
  if (name == "kernel_removed") {
    return SchedulerEvent{KernelRemoved{j.at("kernel_id").get<std::string>()}};
  }
  if (name == "replica_added") {
    return SchedulerEvent{ReplicaAdded{j.at("kernel_id").get<std::string>(),
                                       j.at("replica_id").get<uint32_t>(),
                                       j.at("server_id").get<std::string>()}};
  }
  if (name == "replica_removed") {
    return SchedulerEvent{
        ReplicaRemoved{j.at("kernel_id").get<std::string>(), j.at("replica_id").get<uint32_t>()}};
  }
  if (name == "executor") {
    ExecutorRequested e;
    e.kernel_id = j.at("kernel_id").get<std::string>();
    e.gpus = j.at("gpus").get<int32_t>();
    for (const json& r : j.at("excluded_replicas")) e.excluded_replicas.insert(r.get<uint32_t>());
    if (!j.at("target_replica").is_null()) e.target_replica = j["target_replica"].get<uint32_t>();
    e.warm_servers = DecStringSet(j.at("warm_servers"));
    return SchedulerEvent{std::move(e)};
  }
  if (name == "grant_committed" || name == "grant_released") {
    std::string kernel_id = j.at("kernel_id").get<std::string>();
    const auto replica_id = j.at("replica_id").get<uint32_t>();
    std::string server_id = j.at("server_id").get<std::string>();
    const Resources resources = DecResources(j.at("resources"));
    if (name == "grant_committed") {
      return SchedulerEvent{
          GrantCommitted{std::move(kernel_id), replica_id, std::move(server_id), resources}};
    }
    return SchedulerEvent{
        GrantReleased{std::move(kernel_id), replica_id, std::move(server_id), resources}};
  }
  if (name == "move") {
    return SchedulerEvent{
        MoveRequested{j.at("kernel_id").get<std::string>(), j.at("replica_id").get<uint32_t>(),
                      j.at("to_server_id").get<std::string>(), DecStringSet(j.at("warm_servers"))}};
  }
  if (name == "tick") return SchedulerEvent{Tick{}};
  return InvalidArgument("unknown event '" + std::string(name) + "'");
}

}  // namespace

std::string EncodeJournalHeader(const SchedulerOptions& options) {
  json j{{"journal", "nbos-sched"},
         {"version", kJournalVersion},
         {"options",
          {{"max_subscription_ratio", options.max_subscription_ratio},
           {"ratio_window", options.ratio_window},
           {"auto_scaling", options.auto_scaling},
           {"scaling", Enc(options.scaling)},
           {"pack_gpus", options.pack_gpus},
           {"rebalance", Enc(options.rebalance)},
           {"gpu_wait_expiry_ms", options.gpu_wait_expiry_ms}}}};
  // Written only when the forecast is on, so that headers of runs without it keep their bytes.
  if (options.forecast.enabled) {
    j["options"]["forecast"] = Enc(options.forecast);
    j["options"]["rebalance"]["min_return_chance"] = options.rebalance.min_return_chance;
    j["options"]["rebalance"]["releasable_target_min_chance"] =
        options.rebalance.releasable_target_min_chance;
    j["options"]["rebalance"]["spare_whole_min_chance"] = options.rebalance.spare_whole_min_chance;
    j["options"]["rebalance"]["contended_cover_chance"] = options.rebalance.contended_cover_chance;
    j["options"]["scaling"]["release_max_pinning_replicas"] =
        options.scaling.release_max_pinning_replicas;
    // Likewise only when on, so that forecast journals from before it keep their bytes.
    if (options.forecast.whole_cover_min_chance >= 0) {
      j["options"]["forecast"]["whole_cover_min_chance"] = options.forecast.whole_cover_min_chance;
    }
    if (options.rebalance.make_room_chance_ratio >= 0) {
      j["options"]["rebalance"]["make_room_chance_ratio"] =
          options.rebalance.make_room_chance_ratio;
    }
    if (options.forecast.idle_servers_z >= 0) {
      j["options"]["forecast"]["idle_servers_z"] = options.forecast.idle_servers_z;
      j["options"]["scaling"]["release_idle_servers_margin"] =
          options.scaling.release_idle_servers_margin;
    }
  }
  return j.dump();
}

Result<SchedulerOptions> DecodeJournalHeader(std::string_view line) {
  try {
    const json j = json::parse(line);
    if (!j.is_object() || j.value("journal", "") != "nbos-sched") {
      return InvalidArgument("not an nbos-sched journal header");
    }
    if (j.at("version").get<int>() != kJournalVersion) {
      return InvalidArgument("unsupported journal version " + j.at("version").dump());
    }
    const json& o = j.at("options");
    SchedulerOptions options;
    options.max_subscription_ratio = o.at("max_subscription_ratio").get<double>();
    options.ratio_window = o.at("ratio_window").get<int32_t>();
    options.auto_scaling = o.at("auto_scaling").get<bool>();
    const json& s = o.at("scaling");
    options.scaling.scaling_factor = s.at("scaling_factor").get<double>();
    options.scaling.scaling_limit = s.at("scaling_limit").get<double>();
    options.scaling.buffer_hosts = s.at("buffer_hosts").get<int32_t>();
    options.scaling.min_hosts = s.at("min_hosts").get<int32_t>();
    options.scaling.max_hosts = s.at("max_hosts").get<int32_t>();
    options.scaling.max_release_per_round = s.at("max_release_per_round").get<int32_t>();
    options.scaling.gpus_per_host = s.at("gpus_per_host").get<int32_t>();
    // Absent before scale-in by reliance existed (and without the forecast): off.
    options.scaling.release_max_pinning_replicas = s.value("release_max_pinning_replicas", -1);
    options.scaling.release_idle_servers_margin = s.value("release_idle_servers_margin", 0);
    // Absent in journals written before packing and rebalancing existed: they were off.
    options.pack_gpus = o.value("pack_gpus", false);
    options.gpu_wait_expiry_ms = o.value("gpu_wait_expiry_ms", int64_t{0});
    if (const auto r = o.find("rebalance"); r != o.end()) {
      options.rebalance.enabled = r->at("enabled").get<bool>();
      options.rebalance.max_per_tick = r->at("max_per_tick").get<int32_t>();
      options.rebalance.kernel_cooldown_ms = r->at("kernel_cooldown_ms").get<int64_t>();
      options.rebalance.min_gpus = r->at("min_gpus").get<int32_t>();
      options.rebalance.spare_servers_max_replicas =
          r->at("spare_servers_max_replicas").get<int32_t>();
      options.rebalance.releasable_target_idle_max_ms =
          r->at("releasable_target_idle_max_ms").get<int64_t>();
      // Absent before the forecast existed: off.
      options.rebalance.min_return_chance = r->value("min_return_chance", -1.0);
      options.rebalance.releasable_target_min_chance =
          r->value("releasable_target_min_chance", -1.0);
      options.rebalance.spare_whole_min_chance = r->value("spare_whole_min_chance", -1.0);
      options.rebalance.contended_cover_chance = r->value("contended_cover_chance", -1.0);
      options.rebalance.make_room_chance_ratio = r->value("make_room_chance_ratio", -1.0);
    }
    if (const auto f = o.find("forecast"); f != o.end()) {
      options.forecast.enabled = f->at("enabled").get<bool>();
      options.forecast.horizon_ms = f->at("horizon_ms").get<int64_t>();
      options.forecast.prior_weight = f->at("prior_weight").get<double>();
      options.forecast.kernel_history = f->at("kernel_history").get<int32_t>();
      options.forecast.cover_chance = f->at("cover_chance").get<double>();
      options.forecast.pin_min_chance =
          f->value("pin_min_chance", ForecastOptions{}.pin_min_chance);
      options.forecast.spare_cover_min_chance =
          f->value("spare_cover_min_chance", ForecastOptions{}.spare_cover_min_chance);
      options.forecast.idle_servers_z = f->value("idle_servers_z", -1.0);
      options.forecast.whole_cover_min_chance = f->value("whole_cover_min_chance", -1.0);
    }
    if (!(options.max_subscription_ratio > 0) || options.ratio_window <= 0 ||
        options.scaling.gpus_per_host <= 0 || options.scaling.min_hosts < 0 ||
        options.scaling.buffer_hosts < 0 || options.rebalance.max_per_tick < 0 ||
        options.forecast.kernel_history <= 0) {
      return InvalidArgument("journal header has invalid scheduler options");
    }
    return options;
  } catch (const json::exception& e) {
    return InvalidArgument(std::string("malformed journal header: ") + e.what());
  }
}

std::string EncodeOutcome(const SchedulerOutcome& outcome) { return EncOutcome(outcome).dump(); }

std::string EncodeJournalRecord(int64_t seq, int64_t now_ms, const SchedulerEvent& event,
                                const SchedulerOutcome& outcome) {
  json j{{"seq", seq},
         {"t_ms", now_ms},
         {"event", EventName(event)},
         {"input", EncEvent(event)},
         {"outcome", EncOutcome(outcome)}};
  return j.dump();
}

Result<JournalRecord> DecodeJournalRecord(std::string_view line) {
  try {
    const json j = json::parse(line);
    JournalRecord record;
    record.seq = j.at("seq").get<int64_t>();
    record.now_ms = j.at("t_ms").get<int64_t>();
    Result<SchedulerEvent> event = DecEvent(j.at("event").get<std::string>(), j.at("input"));
    if (!event.ok()) return event.status();
    record.event = std::move(event).value();
    record.outcome_json = j.at("outcome").dump();
    return record;
  } catch (const json::exception& e) {
    return InvalidArgument(std::string("malformed journal record: ") + e.what());
  }
}

JournalWriter::JournalWriter(std::ostream& out, const SchedulerOptions& options) : out_(out) {
  out_ << EncodeJournalHeader(options) << '\n';
}

void JournalWriter::OnEvent(int64_t now_ms, const SchedulerEvent& event,
                            const SchedulerOutcome& outcome) {
  out_ << EncodeJournalRecord(++seq_, now_ms, event, outcome) << '\n';
}

Result<ReplayReport> ReplayJournal(std::istream& in) {
  std::string line;
  if (!std::getline(in, line)) return InvalidArgument("empty journal");
  Result<SchedulerOptions> options = DecodeJournalHeader(line);
  if (!options.ok()) return options.status();
  Scheduler scheduler(*options);
  ReplayReport report;
  int64_t line_number = 1;
  while (std::getline(in, line)) {
    ++line_number;
    if (line.empty()) continue;
    Result<JournalRecord> record = DecodeJournalRecord(line);
    if (!record.ok()) {
      return InvalidArgument("line " + std::to_string(line_number) + ": " +
                             record.status().message());
    }
    if (record->now_ms < scheduler.last_event_ms()) {
      return InvalidArgument("line " + std::to_string(line_number) + ": time goes backwards");
    }
    ++report.records;
    const std::string derived = EncodeOutcome(scheduler.Apply(record->now_ms, record->event));
    if (derived != record->outcome_json) {
      report.matched = false;
      report.mismatch_seq = record->seq;
      report.mismatch = "record seq " + std::to_string(record->seq) + " (line " +
                        std::to_string(line_number) + ", event " +
                        std::string(EventName(record->event)) + " at t_ms " +
                        std::to_string(record->now_ms) + "): journal says " + record->outcome_json +
                        " but the scheduler derives " + derived;
      return report;
    }
  }
  return report;
}

}  // namespace nbos::sched
