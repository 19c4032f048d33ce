// `nbos replay`: a slice of a trace (sim::SliceWorkload) driven against a live gateway. Each
// session is a kernel (KERNEL_GPUS = the session's request) started at the session's start and
// deleted at its stop; each cell an execute_request, sent at its submit time or at its session's
// previous reply if that is later (a user runs one cell after another), asking
// metadata.nbos.gpus = the cell's GPUs, whose body sleeps for the cell's duration and reports
// how long it slept. Sessions open before the window are started before the replay's clock
// begins, as they were open already. The cluster is polled once a second for its servers, GPUs
// and migrations.
//
// Threads: one per session and one poller, all joined before Replay returns; every kernel the
// replay started is deleted before it returns, also when it is stopped.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "relay/gateway_link.h"
#include "replay/replay_stats.h"
#include "sim/trace.h"

namespace nbos::replay {

struct ReplayOptions {
  relay::GatewayOptions gateway;  // url, token; env gets KERNEL_GPUS per session
  std::chrono::milliseconds sample_interval{1000};
  // A cell without a reply this long after it was sent, beyond its own duration, is interrupted
  // and counted as failed.
  std::chrono::milliseconds cell_grace{std::chrono::minutes(15)};
  std::function<void(const std::string&)> log;  // progress lines; may be empty
};

struct ReplayRun {
  std::vector<CellOutcome> cells;  // session by session, in the workload's order
  std::vector<ClusterSample> samples;
  int64_t end_ms = 0;           // the replay's clock when the last session stopped
  int64_t sessions_failed = 0;  // kernels that could not be started or were lost
  int32_t initial_servers = 0;  // alive when the replay began
  int32_t gpus_per_server = 0;  // the most any of them had
};

// Runs `workload` (times already compressed) on the gateway. Errors before anything starts:
// Unavailable (gateway unreachable or refusing the token, with its answer), InvalidArgument (a
// session wants more GPUs than any server has). Setting `*stop` ends the replay early; the cells
// not run count as failed.
Result<ReplayRun> Replay(const sim::Workload& workload, const ReplayOptions& options,
                         std::atomic<bool>* stop);

// The cell the replay runs for `duration_ms` (Python).
std::string CellCode(int64_t duration_ms);
// The body's time the cell printed in `stdout_text`; -1 when it holds none.
int64_t BodyMsFromOutput(const std::string& stdout_text);

}  // namespace nbos::replay
