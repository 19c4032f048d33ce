#include "gateway/planner.h"

#include <spdlog/spdlog.h>

namespace nbos::gateway {

Planner::Planner(Registry* registry, Migrator* migrator, int threads)
    : registry_(registry), migrator_(migrator), queue_(threads, "planner") {}

void Planner::Plan(const std::string& kernel_id, const PlanWanted& want, PlanCallback done) {
  queue_.Post(kernel_id, [this, kernel_id, want, done = std::move(done)] {
    Result<std::optional<ExecutionPlan>> plan = std::optional<ExecutionPlan>();
    std::string wait;
    try {
      plan = PlanNow(kernel_id, want, &wait);
    } catch (const std::exception& e) {
      // A third-party exception must not leave the cell waiting for an answer forever.
      spdlog::error("kernel {}: planning {} failed: {}", kernel_id, want.exec_id, e.what());
      plan = std::optional<ExecutionPlan>();
    }
    done(std::move(plan), std::move(wait));
  });
}

Result<std::optional<ExecutionPlan>> Planner::PlanNow(const std::string& kernel_id,
                                                      const PlanWanted& want, std::string* wait) {
  auto decision = registry_->RequestExecutor(kernel_id, want.exec_id, want.gpus,
                                             want.requested_target, want.live);
  if (!decision.ok()) {
    if (decision.status().code() == StatusCode::kInvalidArgument) return decision.status();
    if (decision.status().code() == StatusCode::kNotFound) {
      // Its servers have not registered (yet): no grants possible, but a GPU-less cell can run.
      if (want.gpus > 0 || want.live.empty()) {
        *wait = "the kernel's servers have not registered yet";
        return std::optional<ExecutionPlan>();
      }
      const ReplicaId to = want.requested_target && want.live.count(want.requested_target)
                               ? want.requested_target
                               : *want.live.begin();
      return std::optional<ExecutionPlan>(ExecutionPlan{to, "", "", {}});
    }
    spdlog::warn("kernel {}: no executor: {}", kernel_id, decision.status().ToString());
    return std::optional<ExecutionPlan>();
  }
  if (decision->migration) {
    migrator_->Start(kernel_id, *decision->migration, "a cell needs GPUs no replica's server has");
  }
  *wait = decision->candidates.empty()
              ? decision->wait
              : "the GPUs of this kernel's servers are taken by other cells";
  for (const ExecutorCandidates::Candidate& c : decision->candidates) {
    ExecutionPlan plan{c.replica, c.server_id, "", {}};
    if (want.gpus > 0) {
      if (!c.client) continue;
      control::GrantRequest req;
      req.set_kernel_id(kernel_id);
      req.set_replica_id(c.replica);
      req.set_exec_id(want.exec_id);
      req.set_gpus(want.gpus);
      auto granted = c.client->Grant(req);
      if (!granted.ok() || !granted->granted()) {
        registry_->OnGrantRefused();
        continue;
      }
      plan.grant_id = granted->grant_id();
      plan.device_ids.assign(granted->device_ids().begin(), granted->device_ids().end());
    }
    registry_->OnGrantCommitted(kernel_id, want.exec_id, c.replica, c.server_id, want.gpus);
    return std::optional<ExecutionPlan>(std::move(plan));
  }
  return std::optional<ExecutionPlan>();
}

void Planner::Release(const std::string& kernel_id, const ExecutionPlan& plan) {
  queue_.Post(kernel_id, [this, kernel_id, plan] {
    registry_->OnGrantReleased(kernel_id, plan.target_replica, plan.server_id,
                               static_cast<int>(plan.device_ids.size()));
    auto client = registry_->Client(plan.server_id);
    if (!client) return;
    auto released = client->Release(plan.grant_id);
    if (!released.ok()) {
      spdlog::warn("releasing grant {} on {}: {}", plan.grant_id, plan.server_id,
                   released.status().ToString());
    }
  });
}

void Planner::Stop() { queue_.Stop(); }

}  // namespace nbos::gateway
