// Planner: turns a kernel's PlanWanted into an ExecutionPlan (the scheduler's executor choice,
// then GPUs from the chosen replica's daemon, trying the next candidate when a daemon refuses)
// and gives grants back, on its own pool of threads. Work for one kernel runs in order; kernels
// run in parallel, so a daemon that answers slowly or not at all stalls only the kernels waiting
// for it, never a kernel's session thread. When no replica's server can grant the GPUs it hands
// the scheduler's migration plan to the Migrator.
#pragma once

#include <memory>
#include <string>

#include "common/work_queue.h"
#include "gateway/kernel_session.h"
#include "gateway/migrator.h"
#include "gateway/registry.h"

namespace nbos::gateway {

class Planner {
 public:
  Planner(Registry* registry, Migrator* migrator, int threads);

  // Both return at once; `done` runs on a planner thread.
  void Plan(const std::string& kernel_id, const PlanWanted& want, PlanCallback done);
  void Release(const std::string& kernel_id, const ExecutionPlan& plan);
  // Finishes the work already handed over (releases above all), then joins the threads.
  void Stop();

  uint64_t exceptions_caught() const { return queue_.exceptions_caught(); }

 private:
  // `wait`: with nullopt, what the cell waits for (said to its user).
  Result<std::optional<ExecutionPlan>> PlanNow(const std::string& kernel_id, const PlanWanted& want,
                                               std::string* wait);

  Registry* registry_;
  Migrator* migrator_;
  KeyedWorkQueue queue_;
};

}  // namespace nbos::gateway
