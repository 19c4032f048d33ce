// Migrator: carries out the scheduler's migration plans (DESIGN §5) on its own threads: each
// takes seconds of waiting on daemons and Raft, which must hold up neither a kernel's session
// nor the planner. The same steps replace a lost replica (its server gone), except that the lost
// one is removed from the group first; nothing is asked of the lost server.
//
// A migration is a sequence of steps, each registered with its undo as soon as it took effect:
//   remove a lost old replica from the Raft group     (no undo: it is lost)
//   prepare + launch the new replica on the target,  undo: remove it from the group through any
//   add it to the Raft group through a live member   live member, then stop it (left running
//                                                    while no member can confirm the removal)
//   hold new executions, wait for the one in flight  undo: release the hold (always, at the end)
//   link it to the kernel's session                  undo: unlink it
//   wait for it to answer kernel_info
//   remove the old replica from the Raft group       (the point of no return)
// then unlink and stop the old replica and record the new membership (registry, database). A
// step that fails runs the undos of the steps before it in reverse, so the kernel is left with
// its old replicas; the failure backs off before this kernel migrates again.
#pragma once

#include <atomic>
#include <chrono>
#include <string>

#include "common/work_queue.h"
#include "gateway/metadata_store.h"
#include "gateway/registry.h"
#include "sched/migration.h"

namespace nbos::gateway {

struct MigratorOptions {
  // A membership change or the new replica's first answer that takes longer than this failed.
  std::chrono::milliseconds step_timeout{60000};
  std::chrono::milliseconds failure_backoff{10000};
  // How long the undo of a join waits for each live member asked to remove the new replica.
  std::chrono::milliseconds withdraw_timeout{15000};
};

class Migrator {
 public:
  Migrator(Registry* registry, MetadataStore* store, MigratorOptions options = {});
  ~Migrator();

  // Queues `plan` for a kernel the registry already marked migrating; `reason` is what the
  // cluster view shows while it runs. Migrations of different kernels run in parallel (up to
  // kParallelMigrations), those of one kernel in order.
  void Start(const std::string& kernel_id, const sched::MigrationPlan& plan, std::string reason);
  static constexpr int kParallelMigrations = 4;
  // Queued migrations end without starting; the one running finishes. Then joins.
  void Stop();

 private:
  struct Move;
  class Rollback;
  class StepClock;
  void Run(const std::string& kernel_id, const sched::MigrationPlan& plan,
           const std::string& reason);
  Result<uint32_t> Migrate(const std::string& kernel_id, const sched::MigrationPlan& plan,
                           const std::string& reason);
  Result<Move> Begin(const std::string& kernel_id, const sched::MigrationPlan& plan,
                     const std::string& reason);
  // Removes the replica being replaced from the Raft group first when it is lost.
  Status LeaveIfLost(Move& m, StepClock* clock);
  Status Join(Move& m, StepClock* clock, Rollback* rollback);
  Status Switch(Move& m, StepClock* clock, Rollback* rollback);
  // The undo of the launch and join: the new replica leaves the Raft group, then stops.
  void Withdraw(Move& m);
  // Records (registry, database) that the replica being replaced leaves the Raft group.
  void RecordLeaving(Move& m, bool lost);

  Registry* registry_;
  MetadataStore* store_;
  const MigratorOptions options_;
  std::atomic<bool> stopping_{false};
  KeyedWorkQueue queue_{kParallelMigrations, "migrator"};
};

}  // namespace nbos::gateway
