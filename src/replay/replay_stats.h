// What a trace replayed against a live cluster measured (`nbos replay`), summarised in the
// simulator's terms (sim::SimResult) so that the live run and `nbos sim` on the same slice print
// side by side. Pure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sim/simulator.h"

namespace nbos::replay {

// One cell as replayed. Times are on the replay's clock (ms since it began).
struct CellOutcome {
  int32_t gpus = 0;
  int64_t duration_ms = 0;  // the body's asked time (the trace's, compressed)
  int64_t arrival_ms = -1;  // sent: its submit time, or its session's previous reply if later
  int64_t reply_ms = -1;    // its execute_reply arrived; -1: none (timed out, kernel lost)
  int64_t body_ms = -1;     // the body's own time by the kernel's clock; -1: it did not run
  std::vector<std::string> waits;  // the gateway's nbos.waits: why the cell waited, in order
  bool ok = false;                 // execute_reply status "ok" and the body ran
};

// The cluster as polled from /api/nbos/cluster.
struct ClusterSample {
  int64_t t_ms = 0;
  int32_t servers = 0;  // alive
  int32_t gpus = 0;     // on alive servers
  int32_t gpus_committed = 0;
  int64_t migrations_done = 0;  // the gateway's counter since it started
};

// How the summary reads the outcomes:
//   delay     reply − arrival − body: all a cell paid that was not its body (waiting for GPUs,
//             election, sync, transport), so no clock is shared with the kernel;
//   TCT       reply − arrival;
//   immediate ok and no wait: the gateway committed the GPUs as the cell arrived. A cell that
//             waited for a replica's move counts as late_migrated, one that waited for
//             anything else as late_migration_wait (GPUs in use, a server starting), as the
//             simulator splits them; failed cells count in cells_failed only;
//   GPU-hours provisioned / committed: the samples' step function from the first sample to
//             end_ms; oracle: Σ gpus × asked duration of the cells that ran;
//   servers   peak and time-weighted mean of the samples; migrations: the counter's growth.
// Percentiles cover the cells that got a reply.
sim::SimResult SummarizeReplay(const std::vector<CellOutcome>& cells,
                               const std::vector<ClusterSample>& samples, int64_t sessions,
                               int64_t end_ms);

// What `nbos sim` needs to run the slice a replay ran, on the same cluster: notebookos with the
// scheduler knobs the gateway uses (gateway.cc: min hosts = the servers it started with, no
// buffer hosts, no proactive rebalancing, no GPU packing, no demand forecast, scale-in drains
// any server), auto-scaling up to `max_servers` when
// that is above `servers` (a fixed cluster otherwise), and `base`'s latencies.
sim::SimOptions SimOptionsForLive(const sim::SimConfig& base, int32_t servers,
                                  int32_t gpus_per_server, int32_t max_servers,
                                  int64_t scaling_interval_ms, uint64_t seed);

// One line per metric: live, simulated, and live / simulated.
std::string ComparisonTable(const sim::SimResult& live, const sim::SimResult& simulated);

}  // namespace nbos::replay
