#include "gateway/migrator.h"

#include <spdlog/spdlog.h>

#include <functional>
#include <thread>
#include <vector>

#include "gateway/raft_group.h"
#include "gateway/replica_ops.h"
#include "jupyter/connection_file.h"

namespace nbos::gateway {
namespace {
using jupyter::Json;
}  // namespace

// The undo actions of the steps taken, run in reverse when the scope ends before Commit().
class Migrator::Rollback {
 public:
  Rollback() = default;
  Rollback(const Rollback&) = delete;
  Rollback& operator=(const Rollback&) = delete;
  ~Rollback() {
    if (committed_) return;
    for (auto it = undo_.rbegin(); it != undo_.rend(); ++it) (*it)();
  }
  void OnFailure(std::function<void()> undo) { undo_.push_back(std::move(undo)); }
  void Commit() { committed_ = true; }

 private:
  std::vector<std::function<void()>> undo_;
  bool committed_ = false;
};

// Per-step times for the log: where a slow migration spends its time.
class Migrator::StepClock {
 public:
  void Step(const char* name) {
    const auto now = SteadyClock::now();
    steps_ +=
        fmt::format(" {} {} ms", name,
                    std::chrono::duration_cast<std::chrono::milliseconds>(now - start_).count());
    start_ = now;
  }
  const std::string& steps() const { return steps_; }
  SteadyClock::time_point started() const { return started_; }

 private:
  const SteadyClock::time_point started_ = SteadyClock::now();
  SteadyClock::time_point start_ = started_;
  std::string steps_;
};

Migrator::Migrator(Registry* registry, MetadataStore* store, MigratorOptions options)
    : registry_(registry), store_(store), options_(options) {}

Migrator::~Migrator() { Stop(); }

void Migrator::Start(const std::string& kernel_id, const sched::MigrationPlan& plan,
                     std::string reason) {
  queue_.Post(kernel_id, [this, kernel_id, plan, reason = std::move(reason)] {
    Run(kernel_id, plan, reason);
  });
}

void Migrator::Stop() {
  stopping_ = true;
  queue_.Stop();
}

void Migrator::Run(const std::string& kernel_id, const sched::MigrationPlan& plan,
                   const std::string& reason) {
  const auto started = SteadyClock::now();
  registry_->NoteEvent("migration", kernel_id,
                       fmt::format("moving replica {} from {} to {}: {}", plan.replica_id,
                                   plan.from_server_id, plan.to_server_id, reason));
  Result<uint32_t> moved = stopping_ ? Result<uint32_t>(Unavailable("the gateway is stopping"))
                                     : Migrate(kernel_id, plan, reason);
  const auto took =
      std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - started);
  registry_->EndMigration(kernel_id, moved.status(), options_.failure_backoff);
  if (!moved.ok()) {
    spdlog::error("kernel {}: migrating replica {} from {} to {} failed: {}", kernel_id,
                  plan.replica_id, plan.from_server_id, plan.to_server_id,
                  moved.status().ToString());
    registry_->NoteEvent("migration-failed", kernel_id,
                         fmt::format("moving replica {} to {} failed: {}", plan.replica_id,
                                     plan.to_server_id, moved.status().message()));
    return;
  }
  registry_->NoteEvent(
      "migration-done", kernel_id,
      fmt::format("replica {} on {} is now replica {} on {} ({} ms)", plan.replica_id,
                  plan.from_server_id, *moved, plan.to_server_id, took.count()));
  spdlog::info("kernel {}: replica {} on {} migrated to replica {} on {} in {} ms", kernel_id,
               plan.replica_id, plan.from_server_id, *moved, plan.to_server_id, took.count());
}

// What the steps of one migration share.
struct Migrator::Move {
  std::string kernel_id;
  sched::MigrationPlan plan;
  KernelRecord kernel;  // as of the start, under the kernel's operation lock
  std::shared_ptr<KernelSession> session;
  std::shared_ptr<daemon::DaemonClient> to_client;
  uint32_t new_id = 0;
  ReplicaId via = 0;  // a live member other than the one leaving: takes the membership changes
  StoredReplica prepared;
};

Result<uint32_t> Migrator::Migrate(const std::string& kernel_id, const sched::MigrationPlan& plan,
                                   const std::string& reason) {
  std::optional<KernelRecord> found = registry_->FindKernel(kernel_id);
  if (!found) return Unavailable("the kernel is gone");
  MutexLock op(found->op_mu.get());
  auto move = Begin(kernel_id, plan, reason);
  if (!move.ok()) return move.status();
  Move& m = *move;
  StepClock clock;
  // Declared before the rollback, so that a failure's undos run while executions are still held.
  struct HoldGuard {
    KernelSession* session;
    bool held = false;
    ~HoldGuard() {
      if (held) session->HoldExecutions(false);
    }
  } hold{m.session.get()};
  Rollback rollback;
  if (Status s = LeaveIfLost(m, &clock); !s.ok()) return s;
  if (Status s = Join(m, &clock, &rollback); !s.ok()) return s;
  // No execution may start while four replicas are linked (their election could fail), and none
  // may be running when the fourth is linked.
  m.session->HoldExecutions(
      true, fmt::format("moving replica {} to {}", plan.replica_id, plan.to_server_id));
  hold.held = true;
  if (Status s = Switch(m, &clock, &rollback); !s.ok()) return s;
  rollback.Commit();  // the old replica left the group: from here on the move stands
  m.session->RemoveReplica(plan.replica_id);
  clock.Step("leave");
  // The kernel is whole on its new servers: the scheduler learns so, and a held cell runs on them
  // without waiting for the old process to exit.
  const auto took =
      std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - clock.started());
  if (auto meta = registry_->ReplaceReplica(kernel_id, plan.replica_id, m.prepared, took)) {
    if (Status s = store_->Put(*meta); !s.ok()) {
      spdlog::error("kernel {}: recording the migration: {}", kernel_id, s.ToString());
    }
  }
  clock.Step("record");
  m.session->HoldExecutions(false);
  hold.held = false;
  // A lost server is not waited for: if it comes back, its replica belongs to no kernel and is
  // stopped as an orphan.
  if (auto from_client = registry_->Client(plan.from_server_id);
      from_client && registry_->ServerAlive(plan.from_server_id)) {
    StopReplica(*from_client, kernel_id, plan.replica_id, plan.from_server_id);
    clock.Step("stop");
  }
  spdlog::info("kernel {}: migration steps:{}", kernel_id, clock.steps());
  return m.new_id;
}

Result<Migrator::Move> Migrator::Begin(const std::string& kernel_id,
                                       const sched::MigrationPlan& plan,
                                       const std::string& reason) {
  Move m;
  m.kernel_id = kernel_id;
  m.plan = plan;
  if (!registry_->UpdateKernel(kernel_id, [&](KernelRecord& r) {
        m.new_id = ++r.last_replica_id;
        r.migration = MigrationInProgress{plan.replica_id, m.new_id, plan.to_server_id, reason};
        m.kernel = r;
      })) {
    return Unavailable("the kernel is gone");
  }
  m.session = m.kernel.session;
  if (!m.session) return Unavailable("the kernel has no session");
  m.to_client = registry_->Client(plan.to_server_id);
  if (!m.to_client) return Unavailable("server " + plan.to_server_id + " is gone");
  for (const StoredReplica& r : m.kernel.meta.replicas) {
    auto live = m.kernel.replica_live.find(r.replica_id);
    if (r.replica_id != plan.replica_id && !m.kernel.left_group.count(r.replica_id) &&
        (live == m.kernel.replica_live.end() || live->second)) {
      m.via = r.replica_id;
      break;
    }
  }
  if (m.via == 0) return Unavailable("no live replica to change the Raft group through");
  return m;
}

// A lost replica still counts in the group's majority. Were the new member added first, three
// of four voters would have to answer until the lost one left: one more fault meanwhile (another
// server frozen or cut off) stops the kernel, and neither the removal nor the migration's undo
// can commit then, so the group keeps four voters with one dead for good. Leaving first needs
// the same two live members a cell needs now, and the group never holds more than three.
Status Migrator::LeaveIfLost(Move& m, StepClock* clock) {
  auto live = m.kernel.replica_live.find(m.plan.replica_id);
  if (live == m.kernel.replica_live.end() || live->second) return Status::Ok();
  RecordLeaving(m, /*lost=*/true);
  m.session->ReplicaLost(m.plan.replica_id, "it leaves the kernel's Raft group to be replaced");
  if (Status s = RemoveFromRaftGroup(m.kernel, m.plan.replica_id, options_.step_timeout); !s.ok()) {
    return s;
  }
  registry_->UpdateKernel(m.kernel_id,
                          [&](KernelRecord& r) { r.left_confirmed.insert(m.plan.replica_id); });
  clock->Step("lost-left");
  return Status::Ok();
}

// Recorded before the removal is asked: a removal may commit after the gateway stopped waiting
// (or was killed), and a replica counted live that is no member overstates the majority (the
// next loss then leaves the kernel without one, unseen). One recorded as leaving that is still a
// member understates it, which only costs a replacement: should the rest of the migration fail,
// the replica stays out even if its server reports it running, and the next migration replaces
// it (its removal again first). A lost replica also stops counting live at once; a live one
// (a switch) stays linked until the removal's outcome.
void Migrator::RecordLeaving(Move& m, bool lost) {
  std::optional<StoredKernel> meta;
  registry_->UpdateKernel(m.kernel_id, [&](KernelRecord& r) {
    r.left_group.insert(m.plan.replica_id);
    if (lost) r.replica_live[m.plan.replica_id] = false;
    for (StoredReplica& replica : r.meta.replicas) {
      if (replica.replica_id == m.plan.replica_id) replica.left_group = true;
    }
    meta = r.meta;
  });
  if (Status s = meta ? store_->Put(*meta) : Status::Ok(); !s.ok()) {
    spdlog::error("kernel {}: recording that replica {} leaves the Raft group: {}", m.kernel_id,
                  m.plan.replica_id, s.ToString());
  }
}

// The new replica is prepared and launched on the target and joins the Raft group.
Status Migrator::Join(Move& m, StepClock* clock, Rollback* rollback) {
  const KernelRecord& k = m.kernel;
  auto prepared = PrepareReplica(*m.to_client, k.meta, k.request, m.plan.to_server_id, m.new_id);
  if (!prepared.ok()) return prepared.status();
  m.prepared = std::move(*prepared);
  rollback->OnFailure([this, &m] { Withdraw(m); });
  if (auto launched = m.to_client->LaunchReplica(LaunchRequest(k.meta, m.new_id, {}));
      !launched.ok()) {
    return launched.status();
  }
  clock->Step("launch");
  if (Status s = ChangeRaftGroup(
          *m.session, m.via,
          Json{{"op", "add"}, {"replica_id", m.new_id}, {"raft_address", m.prepared.raft_address}},
          options_.step_timeout);
      !s.ok()) {
    return s;
  }
  clock->Step("join");
  return Status::Ok();
}

// An add that failed may still have made the new replica a member (C-Raft adds it as a spare,
// then a promotion that can fail after its configuration entry went out, or the answer was lost),
// so it leaves the group before it is stopped: a member stopped would stay a dead voter, and one
// more fault would leave the kernel without a majority for good. Removing a non-member is a no-op.
// When no live replica can confirm the removal (the group cannot commit now), the new replica is
// left running, a live voter: the gateway does not list it, so the heartbeats' orphan cleanup
// removes it from the group and stops it once the group commits again.
void Migrator::Withdraw(Move& m) {
  std::optional<KernelRecord> k = registry_->FindKernel(m.kernel_id);
  Status left = k ? RemoveFromRaftGroup(*k, m.new_id, options_.withdraw_timeout)
                  : Unavailable("the kernel is gone");
  if (!left.ok()) {
    spdlog::warn(
        "kernel {}: replica {} on {} is left running until it is known not to be a voter of the "
        "Raft group: {}",
        m.kernel_id, m.new_id, m.plan.to_server_id, left.ToString());
    return;
  }
  StopReplica(*m.to_client, m.kernel_id, m.new_id, m.plan.to_server_id);
}

// With executions held: the new replica is linked to the session and answers, then the old one
// leaves the Raft group.
Status Migrator::Switch(Move& m, StepClock* clock, Rollback* rollback) {
  const auto drain_deadline = SteadyClock::now() + options_.step_timeout;
  while (ReplicaId busy = m.session->executing_replica()) {
    if (busy == m.plan.replica_id) {
      // A cell got GPUs on the leaving replica meanwhile: it no longer needs to move.
      return Unavailable("replica " + std::to_string(m.plan.replica_id) +
                         " started executing; migration abandoned");
    }
    if (SteadyClock::now() > drain_deadline) {
      return Unavailable("an execution did not finish; migration abandoned");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto conn = jupyter::ParseConnectionInfo(m.prepared.connection_json);
  if (!conn.ok()) return conn.status();
  if (Status s = m.session->AddReplica({m.new_id, m.plan.to_server_id, *conn}); !s.ok()) return s;
  rollback->OnFailure([&m] { m.session->RemoveReplica(m.new_id); });
  if (Status s = m.session->AwaitReplicas({m.new_id}, options_.step_timeout); !s.ok()) return s;
  clock->Step("answer");
  // The removal may commit and its answer be lost; undone then, the kernel would have lost both
  // the old replica and the new one, while the gateway still counts the old. Another live member
  // confirms a removal that committed at once.
  std::optional<KernelRecord> k = registry_->FindKernel(m.kernel_id);
  if (!k) return Unavailable("the kernel is gone");
  RecordLeaving(m, /*lost=*/false);
  return RemoveFromRaftGroup(*k, m.plan.replica_id, options_.step_timeout);
}

}  // namespace nbos::gateway
