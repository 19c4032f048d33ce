// Workloads for `nbos sim`: sessions of cells read from the Adobe June CSV (Tiresias format), from
// a JSON session template (like the reference's workload templates), or generated synthetically.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "common/status.h"

namespace nbos::sim {

struct Cell {
  int64_t submit_ms = 0;    // when the user runs it, from the start of the trace
  int64_t duration_ms = 0;  // GPU-busy time of the cell, > 0
  int32_t gpus = 0;         // GPUs it needs, <= its session's
};

struct Session {
  std::string id;
  int64_t start_ms = 0;     // the notebook is opened (kernel started); <= its first cell's submit
  int64_t stop_ms = 0;      // the notebook is closed; >= start_ms
  int32_t gpus = 0;         // the session's request: max over its cells
  std::vector<Cell> cells;  // by submit_ms
};

struct Workload {
  std::string title;
  std::vector<Session> sessions;  // by start_ms, then id
  int64_t cells() const;
};

// Session reconstruction from the Adobe Tiresias CSV (docs/decisions/0004-simulator.md): rows
// come session by session in time order, so a session ends where submit_time decreases; its GPU
// request is its largest num_gpu; it opens `lead_ms` before its first training and closes at the
// end of its last one. Times in the file are minutes. InvalidArgument names the bad line.
Result<Workload> LoadAdobeCsv(const std::string& path, int64_t lead_ms = 60000);

// JSON template: {"workloadTitle", "tick_ms" (default 60000), "sessions": [{"id", "start_tick",
// "stop_tick", "trainings": [{"start_tick", "duration_in_ticks", "gpus", ...}]}]}; other fields
// of the reference's templates (cpus, memory, vram, gpu_utilizations) are accepted and ignored.
Result<Workload> LoadTemplateJson(const std::string& path);
// Writes a template LoadTemplateJson reads back to the same workload (tick_ms 1000).
void WriteTemplateJson(const Workload& workload, std::ostream& out);

// .csv: LoadAdobeCsv; anything else: LoadTemplateJson.
Result<Workload> LoadTrace(const std::string& path);

struct GeneratorOptions {
  double sessions_per_hour = 10;  // Poisson arrivals of sessions
  double hours = 24;              // arrivals happen in [0, hours)
  double cells_per_session = 20;  // mean (geometric, >= 1)
  double duration_shape = 2;      // Gamma cell durations, minutes (the reference's 2, 10)
  double duration_scale_min = 10;
  double gap_mean_min = 15;  // exponential think time between cells
  std::vector<int32_t> gpu_values = {1, 4, 8};
  std::vector<double> gpu_weights = {0.49, 0.20, 0.31};  // the June trace's mix
  uint64_t seed = 1;
};
// Deterministic for a seed (own generators, not <random>'s implementation-defined ones).
// InvalidArgument for non-positive rates or mismatched GPU mix.
Result<Workload> Generate(const GeneratorOptions& options);

}  // namespace nbos::sim
