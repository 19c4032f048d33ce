#include "replay_command.h"

#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>

#include "common/log.h"
#include "relay/stop_signals.h"
#include "relay_commands.h"
#include "replay/replay_stats.h"
#include "replay/replayer.h"
#include "sim/simulator.h"
#include "sim_commands.h"

namespace nbos::app {

namespace {

struct ReplayArgs {
  std::string trace;
  GatewayArgs gateway;
  SliceArgs slice;
  std::string out;
  int32_t max_hosts = 0;  // the live cluster's auto-scaling cap, for the simulation
  int64_t scaling_interval_ms = 15000;
  std::string sim_config;
  uint64_t seed = 1;
  int64_t cell_grace_s = 900;
};

int Fail(const Status& s, int code = 2) {
  std::cerr << "nbos replay: " << s.message() << "\n";
  return code;
}

Status WriteResults(const ReplayArgs& a, const sim::SimResult& live,
                    const sim::SimResult& simulated, const sim::SimOptions& o) {
  std::ofstream out(a.out);
  out << "{\"trace\": \"" << a.trace << "\", \"window\": \"" << a.slice.window
      << "\", \"speedup\": " << a.slice.speedup << ", \"sessions\": " << a.slice.sessions
      << ",\n \"servers\": " << o.initial_hosts << ", \"max_servers\": " << o.max_hosts
      << ", \"gpus_per_server\": " << o.gpus_per_host << ",\n \"live\": " << sim::ResultJson(live)
      << ",\n \"simulated\": " << sim::ResultJson(simulated)
      << ",\n \"sim_config\": " << sim::SimConfigJson(o.config) << "}\n";
  out.close();
  return out ? Status::Ok() : Unavailable("cannot write " + a.out);
}

int RunReplay(const ReplayArgs& a) {
  InitLogging(2, a.gateway.log_level, "nbos-replay");
  auto workload = LoadSlice(a.trace, a.slice);
  if (!workload.ok()) return Fail(workload.status());
  auto gateway = ToOptions(a.gateway, std::filesystem::current_path().string());
  if (!gateway.ok()) return Fail(gateway.status());
  sim::SimConfig base;
  if (!a.sim_config.empty()) {
    auto c = sim::LoadSimConfig(a.sim_config);
    if (!c.ok()) return Fail(c.status());
    base = *c;
  }
  std::atomic<bool> stop{false};
  relay::StopSignals signals([&stop](int) { stop = true; });
  replay::ReplayOptions options;
  options.gateway = std::move(*gateway);
  options.cell_grace = std::chrono::seconds(a.cell_grace_s);
  std::mutex log_mu;
  options.log = [&log_mu](const std::string& line) {
    std::lock_guard lock(log_mu);
    std::cerr << "nbos replay: " << line << "\n";
  };
  std::cerr << "nbos replay: " << workload->sessions.size() << " sessions, " << workload->cells()
            << " cells\n";
  auto run = replay::Replay(*workload, options, &stop);
  if (!run.ok()) return Fail(run.status());
  const sim::SimResult live = replay::SummarizeReplay(
      run->cells, run->samples, static_cast<int64_t>(workload->sessions.size()), run->end_ms);
  const sim::SimOptions o = replay::SimOptionsForLive(
      base, run->initial_servers, run->gpus_per_server, a.max_hosts, a.scaling_interval_ms, a.seed);
  auto simulated = sim::Simulate(*workload, o);
  if (!simulated.ok()) return Fail(simulated.status());
  std::cout << replay::ComparisonTable(live, *simulated);
  if (!a.out.empty()) {
    if (Status s = WriteResults(a, live, *simulated, o); !s.ok()) return Fail(s);
  }
  if (signals.signalled() != 0) return 128 + signals.signalled();
  return live.cells_failed == 0 && run->sessions_failed == 0 ? 0 : 1;
}

}  // namespace

std::function<int()> AddReplayCommand(CLI::App& app) {
  auto a = std::make_shared<ReplayArgs>();
  auto* cmd = app.add_subcommand(
      "replay",
      "Drive a trace slice against a live gateway (sessions as kernels, trainings as cells) and "
      "compare it with `nbos sim` on the same slice and cluster");
  cmd->add_option("--trace", a->trace, "Adobe CSV (.csv) or JSON session template")->required();
  AddGatewayOptions(cmd, &a->gateway);
  AddSliceOptions(cmd, &a->slice);
  cmd->add_option("--out", a->out, "Write live and simulated results (JSON) here");
  cmd->add_option("--max-hosts", a->max_hosts,
                  "The gateway's auto-scaling cap (nbos up --max-hosts), for the simulation "
                  "(default: a fixed cluster of the servers it has)");
  cmd->add_option("--scaling-interval-ms", a->scaling_interval_ms,
                  "The gateway's auto-scaling interval, for the simulation")
      ->capture_default_str();
  cmd->add_option("--sim-config", a->sim_config,
                  "JSON file of the simulator's latencies (nbos sim --config)");
  cmd->add_option("--seed", a->seed, "Seed of the simulation's latency jitter")
      ->capture_default_str();
  cmd->add_option("--cell-grace-s", a->cell_grace_s,
                  "A cell without a reply this long beyond its duration is interrupted")
      ->capture_default_str();
  return [a, cmd]() -> int { return *cmd ? RunReplay(*a) : -1; };
}

}  // namespace nbos::app
