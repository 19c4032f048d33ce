#include "sim_commands.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "sched/journal.h"
#include "sim/report.h"
#include "sim/simulator.h"
#include "sim/slice.h"
#include "sim/trace.h"

namespace nbos::app {

void AddSliceOptions(CLI::App* cmd, SliceArgs* args) {
  cmd->add_option("--window", args->window,
                  "Only the cells submitted in START-END of the trace, e.g. 566h-568h (units s, "
                  "m, h, d)");
  cmd->add_option("--speedup", args->speedup, "Run the trace's time this many times faster")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--sessions", args->sessions,
                  "At most this many of the window's sessions, spread over it (0: all)")
      ->check(CLI::NonNegativeNumber);
}

Result<sim::Workload> LoadSlice(const std::string& path, const SliceArgs& args) {
  auto w = sim::LoadTrace(path);
  if (!w.ok() || (args.window.empty() && args.speedup == 1.0 && args.sessions == 0)) return w;
  sim::SliceOptions o;
  if (!args.window.empty()) {
    auto window = sim::ParseWindow(args.window);
    if (!window.ok()) return window.status();
    std::tie(o.start_ms, o.end_ms) = *window;
  }
  o.speedup = args.speedup;
  o.max_sessions = args.sessions;
  auto sliced = sim::SliceWorkload(*w, o);
  if (sliced.ok() && sliced->sessions.empty()) {
    return InvalidArgument("no cell of the trace is submitted in the window " + args.window);
  }
  return sliced;
}

namespace {

struct SimArgs {
  std::string trace;
  std::string policy = "notebookos";
  std::vector<std::string> policies;  // report
  int32_t hosts = 6;
  int32_t gpus_per_host = 8;
  int32_t max_hosts = -1;
  int32_t fixed_hosts = 0;  // > 0: a fixed cluster of this many servers, no auto-scaling
  uint64_t seed = 1;
  std::string config;
  int64_t idle_reclaim_min = 0;
  bool json = false;
  std::string journal_out;
  std::string out_dir;
  std::string journal_in;
  sim::GeneratorOptions gen;
  std::string gen_out;
  SliceArgs slice;
};

Result<sim::SimOptions> Options(const SimArgs& a, const std::string& policy) {
  auto p = sim::ParsePolicy(policy);
  if (!p.ok()) return p.status();
  sim::SimOptions o;
  o.policy = *p;
  o.initial_hosts = a.hosts;
  o.gpus_per_host = a.gpus_per_host;
  o.max_hosts = a.max_hosts;
  if (a.fixed_hosts > 0) {
    o.initial_hosts = o.max_hosts = a.fixed_hosts;
    o.auto_scaling = false;
  }
  o.seed = a.seed;
  o.idle_reclaim_ms = a.idle_reclaim_min * 60000;
  if (!a.config.empty()) {
    auto c = sim::LoadSimConfig(a.config);
    if (!c.ok()) return c.status();
    o.config = *c;
  }
  return o;
}

int Fail(const std::string& what, const Status& s) {
  std::cerr << "nbos sim" << what << ": " << s.message() << "\n";
  return 2;
}

void AddRunOptions(CLI::App* cmd, SimArgs& a) {
  cmd->add_option("--hosts", a.hosts, "Initial servers")->capture_default_str();
  cmd->add_option("--gpus-per-host", a.gpus_per_host, "GPUs per server")->capture_default_str();
  cmd->add_option("--max-hosts", a.max_hosts, "Cluster size cap (< 0: none)")
      ->capture_default_str();
  cmd->add_option("--fixed-hosts", a.fixed_hosts,
                  "Fixed cluster of N servers: no auto-scaling (overrides --hosts, --max-hosts)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--seed", a.seed, "Seed of the latency jitter")->capture_default_str();
  cmd->add_option("--config", a.config, "JSON file overriding latencies, sizes and prices");
  cmd->add_option("--idle-reclaim", a.idle_reclaim_min,
                  "Reclaim sessions idle this many minutes (0: never)")
      ->capture_default_str();
  AddSliceOptions(cmd, &a.slice);
}

int RunSim(const SimArgs& a) {
  auto w = LoadSlice(a.trace, a.slice);
  if (!w.ok()) return Fail("", w.status());
  auto o = Options(a, a.policy);
  if (!o.ok()) return Fail("", o.status());
  std::ofstream journal_file;
  std::unique_ptr<sched::JournalWriter> journal;
  if (!a.journal_out.empty()) {
    journal_file.open(a.journal_out);
    if (!journal_file) return Fail("", NotFound("cannot write " + a.journal_out));
    journal = std::make_unique<sched::JournalWriter>(journal_file, sim::SchedulerOptionsFor(*o));
    o->observer = journal.get();
  }
  auto r = sim::Simulate(*w, *o);
  if (!r.ok()) return Fail("", r.status());
  if (a.json) {
    std::cout << sim::ResultJson(*r) << "\n";
  } else {
    std::cout << sim::ResultTable({*r});
  }
  return 0;
}

int RunGenerate(const SimArgs& a) {
  auto w = sim::Generate(a.gen);
  if (!w.ok()) return Fail(" generate", w.status());
  if (a.gen_out.empty() || a.gen_out == "-") {
    sim::WriteTemplateJson(*w, std::cout);
  } else {
    std::ofstream out(a.gen_out);
    if (!out) return Fail(" generate", NotFound("cannot write " + a.gen_out));
    sim::WriteTemplateJson(*w, out);
    std::cerr << "wrote " << w->sessions.size() << " sessions, " << w->cells() << " cells to "
              << a.gen_out << "\n";
  }
  return 0;
}

int RunReport(const SimArgs& a) {
  auto w = LoadSlice(a.trace, a.slice);
  if (!w.ok()) return Fail(" report", w.status());
  std::vector<std::pair<std::string, int64_t>> runs;
  std::vector<std::string> policies = a.policies;
  if (policies.empty()) policies = {"reservation", "batch", "notebookos", "notebookos-lcp"};
  for (const std::string& p : policies) runs.emplace_back(p, 0);
  // The idle-reclamation variants of the two policies that hold kernels between cells.
  for (const std::string& p : policies) {
    if (p == "reservation" || p == "notebookos") {
      runs.emplace_back(p, 30);
      runs.emplace_back(p, 180);
    }
  }
  std::vector<sim::SimResult> results;
  for (const auto& [policy, idle] : runs) {
    SimArgs b = a;
    b.idle_reclaim_min = idle;
    auto o = Options(b, policy);
    if (!o.ok()) return Fail(" report", o.status());
    const auto t0 = std::chrono::steady_clock::now();
    auto r = sim::Simulate(*w, *o);
    if (!r.ok()) return Fail(" report", r.status());
    std::cerr << policy << " idle " << idle << ": "
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()
              << " s\n";
    results.push_back(std::move(*r));
  }
  std::error_code ec;
  std::filesystem::create_directories(a.out_dir, ec);
  if (ec) return Fail(" report", Unavailable("cannot create " + a.out_dir + ": " + ec.message()));
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(std::filesystem::path(a.out_dir) / name) << text;
  };
  std::vector<sim::SimResult> no_idle;
  for (const auto& r : results) {
    if (r.idle_reclaim_min == 0) no_idle.push_back(r);
  }
  write("delay_cdf.svg", sim::CdfSvg(no_idle, false));
  write("tct_cdf.svg", sim::CdfSvg(no_idle, true));
  write("servers.svg", sim::ServersSvg(no_idle));
  std::string json = "[";
  for (size_t i = 0; i < results.size(); ++i) {
    json += (i ? ",\n" : "") + sim::ResultJson(results[i]);
  }
  write("results.json", json + "]\n");
  auto o = Options(a, "notebookos");
  write("config.json", sim::SimConfigJson(o->config) + "\n");
  const std::string command = "nbos sim report --trace " + a.trace + " --out " + a.out_dir +
                              (a.fixed_hosts > 0 ? " --fixed-hosts " + std::to_string(a.fixed_hosts)
                                                 : " --hosts " + std::to_string(a.hosts)) +
                              " --gpus-per-host " + std::to_string(a.gpus_per_host) + " --seed " +
                              std::to_string(a.seed);
  write("report.md", sim::MarkdownReport(results, a.trace, command));
  std::cout << sim::ResultTable(results);
  return 0;
}

int RunReplay(const SimArgs& a) {
  std::ifstream in(a.journal_in);
  if (!in) return Fail(" replay", NotFound("cannot open journal " + a.journal_in));
  auto report = sched::ReplayJournal(in);
  if (!report.ok()) return Fail(" replay", report.status());
  if (!report->matched) {
    std::cerr << "nbos sim replay: mismatch at " << report->mismatch << "\n";
    return 1;
  }
  std::cout << "replayed " << report->records << " decisions: all match\n";
  return 0;
}

}  // namespace

std::function<int()> AddSimCommands(CLI::App& app) {
  auto a = std::make_shared<SimArgs>();
  auto* sim = app.add_subcommand("sim", "Trace-driven simulation of the scheduling policies");
  sim->add_option("--trace", a->trace, "Adobe CSV (.csv) or JSON session template");
  sim->add_option("--policy", a->policy, "reservation, batch, notebookos, notebookos-lcp")
      ->capture_default_str();
  AddRunOptions(sim, *a);
  sim->add_flag("--json", a->json, "One JSON object instead of the table");
  sim->add_option("--journal", a->journal_out, "Write the decision journal (JSON lines) here");

  auto* gen = sim->add_subcommand("generate", "Write a synthetic session template (JSON)");
  gen->add_option("--out", a->gen_out, "Output file ('-' or none: stdout)");
  gen->add_option("--sessions-per-hour", a->gen.sessions_per_hour)->capture_default_str();
  gen->add_option("--hours", a->gen.hours)->capture_default_str();
  gen->add_option("--cells-per-session", a->gen.cells_per_session)->capture_default_str();
  gen->add_option("--duration-shape", a->gen.duration_shape)->capture_default_str();
  gen->add_option("--duration-scale-min", a->gen.duration_scale_min)->capture_default_str();
  gen->add_option("--gap-mean-min", a->gen.gap_mean_min)->capture_default_str();
  gen->add_option("--gpu-values", a->gen.gpu_values)->capture_default_str();
  gen->add_option("--gpu-weights", a->gen.gpu_weights)->capture_default_str();
  gen->add_option("--seed", a->gen.seed)->capture_default_str();

  auto* report = sim->add_subcommand("report", "Run every policy, write SVG plots and report.md");
  report->add_option("--trace", a->trace, "Adobe CSV (.csv) or JSON session template")->required();
  report->add_option("--out", a->out_dir, "Output directory")->required();
  report->add_option("--policies", a->policies, "Subset of policies (default: all four)");
  AddRunOptions(report, *a);

  auto* replay = sim->add_subcommand("replay", "Re-derive a decision journal's decisions");
  replay->add_option("--journal", a->journal_in, "Journal (JSON lines)")->required();

  return [a, sim, gen, report, replay]() -> int {
    if (!*sim) return -1;
    if (*gen) return RunGenerate(*a);
    if (*report) return RunReport(*a);
    if (*replay) return RunReplay(*a);
    if (a->trace.empty()) {
      std::cerr << "nbos sim: --trace is required\n";
      return 2;
    }
    return RunSim(*a);
  };
}

}  // namespace nbos::app
