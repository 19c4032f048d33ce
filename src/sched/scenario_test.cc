// End-to-end scenarios over the whole core: place kernels, run cells through executor choice with
// a mock daemon that grants from the same books, migrate when stuck. Deterministic by
// construction, so the whole decision log is compared between runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "sched/executor.h"
#include "sched/migration.h"
#include "sched/placement.h"
#include "sched/scaling.h"
#include "sched/subscription.h"
#include "sched/test_util.h"

namespace nbos::sched {
namespace {

using test::Cluster;
using test::Gpus;
using test::Kernel;
using test::Req;
using test::Server;

void ExpectBooksBalanced(const ClusterState& c) {
  for (const auto& [id, s] : c.servers()) {
    EXPECT_TRUE(s.committed.IsNonNegative()) << id;
    EXPECT_TRUE(s.committed.FitsWithin(s.spec)) << id << " over-committed";
  }
}

// 4 servers × 2 GPUs, 6 kernels × 2 GPUs: GPUs are scarce (at most 4 cells at once).
ClusterState PlaceScarceCluster(std::vector<std::string>* log) {
  ClusterState c = Cluster({Server("s1", 2), Server("s2", 2), Server("s3", 2), Server("s4", 2)});
  SubscriptionRatio ratio;
  for (int i = 0; i < 6; ++i) {
    ratio.AddSample(c);
    PlacementOptions opts;
    opts.cluster_ratio = ratio.value();
    Result<Placement> p = PlaceKernel(c, Req(2), opts);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (!p.ok()) continue;
    EXPECT_FALSE(p->scale_out_needed) << p->reason;
    EXPECT_FALSE(p->ratio_ignored);
    const std::set<std::string> distinct(p->server_ids.begin(), p->server_ids.end());
    EXPECT_EQ(distinct.size(), 3u);
    const std::string kid = "k" + std::to_string(i);
    EXPECT_TRUE(c.AddKernel(Kernel(kid, Req(2), p->server_ids)).ok());
    std::string line = kid + " ->";
    for (const std::string& s : p->server_ids) line += " " + s;
    log->push_back(line);
  }
  return c;
}

// Runs `steps` rounds. Every round each idle kernel k<i> submits a cell lasting (i % 3 + 1)
// rounds; running cells finish first. Returns the decision log.
std::vector<std::string> RunScarceScenario(int steps, int* executed, int* migrated) {
  std::vector<std::string> log;
  ClusterState c = PlaceScarceCluster(&log);
  struct Running {
    std::string server_id;
    int ends_at;
  };
  std::map<std::string, Running> running;  // by kernel id
  uint32_t next_replica_id = 100;
  for (int step = 0; step < steps; ++step) {
    for (auto it = running.begin(); it != running.end();) {
      if (it->second.ends_at <= step) {
        EXPECT_TRUE(c.Release(it->second.server_id, Gpus(2)).ok());
        it = running.erase(it);
      } else {
        ++it;
      }
    }
    // Rotating who asks first gives every kernel a turn at the free GPUs.
    std::vector<std::string> order;
    for (const auto& [kid, kernel] : c.kernels()) order.push_back(kid);
    std::rotate(order.begin(), order.begin() + step % order.size(), order.end());
    for (const std::string& kid : order) {
      if (running.contains(kid)) continue;
      const KernelView& kernel = *c.FindKernel(kid);
      const int index = kid.back() - '0';
      ExecutorChoice choice = ChooseExecutor(c, kernel, 2, {});
      if (choice.migration_needed()) {
        Result<MigrationPlan> plan = ChooseMigration(c, kernel, 2);
        EXPECT_TRUE(plan.ok()) << plan.status().ToString();
        if (!plan.ok() || plan->scale_out_needed) {
          log.push_back(std::to_string(step) + " " + kid + " waits");
          continue;
        }
        // `kernel` stays valid: only its replica vector changes, not the map.
        const uint32_t new_id = next_replica_id++;
        EXPECT_TRUE(c.AddReplica(kid, new_id, plan->to_server_id).ok());
        EXPECT_TRUE(c.RemoveReplica(kid, plan->replica_id).ok());
        log.push_back(std::to_string(step) + " " + kid + " migrates " + plan->from_server_id +
                      "->" + plan->to_server_id);
        ++*migrated;
        choice = ChooseExecutor(c, kernel, 2, {});
        EXPECT_FALSE(choice.migration_needed()) << "a migration target must be able to grant";
        if (choice.migration_needed()) continue;
      }
      // The mock daemon grants from the same books: the first candidate must always succeed.
      const ReplicaView* executor = kernel.FindReplica(choice.candidates.front());
      EXPECT_NE(executor, nullptr);
      if (executor == nullptr) continue;
      EXPECT_TRUE(c.Commit(executor->server_id, Gpus(2)).ok())
          << "executor choice over-committed " << executor->server_id;
      EXPECT_TRUE(c.SetLastExecutor(kid, executor->replica_id).ok());
      running[kid] = Running{executor->server_id, step + index % 3 + 1};
      log.push_back(std::to_string(step) + " " + kid + " runs on " + executor->server_id);
      ++*executed;
      ExpectBooksBalanced(c);
    }
  }
  return log;
}

TEST(ScenarioTest, GpuScarceClusterNeverOverCommitsAndIsDeterministic) {
  int executed = 0, migrated = 0;
  const std::vector<std::string> log = RunScarceScenario(40, &executed, &migrated);
  EXPECT_GT(executed, 40);
  EXPECT_GT(migrated, 0);
  int executed2 = 0, migrated2 = 0;
  EXPECT_EQ(RunScarceScenario(40, &executed2, &migrated2), log);
  EXPECT_EQ(executed2, executed);
  EXPECT_EQ(migrated2, migrated);
}

TEST(ScenarioTest, ScarcePlacementSpreadsSubscriptionEvenly) {
  std::vector<std::string> log;
  ClusterState c = PlaceScarceCluster(&log);
  // 6 × 3 × 2 = 36 subscribed GPUs over 4 servers: 8 or 10 each (SR_h 1.33..1.67).
  for (const auto& [id, s] : c.servers()) {
    EXPECT_GE(s.subscribed.gpus, 8) << id;
    EXPECT_LE(s.subscribed.gpus, 10) << id;
  }
}

TEST(ScenarioTest, StuckKernelMigratesToTheOneFreeServerThenRunsThere) {
  ClusterState c = Cluster({Server("s1", 2), Server("s2", 2), Server("s3", 2), Server("s4", 2)});
  ASSERT_TRUE(c.AddKernel(Kernel("k", Req(2), {"s1", "s2", "s3"})).ok());
  ASSERT_TRUE(c.SetLastExecutor("k", 2).ok());
  for (const char* s : {"s1", "s2", "s3"}) ASSERT_TRUE(c.Commit(s, Gpus(2)).ok());
  const KernelView& k = *c.FindKernel("k");
  ASSERT_TRUE(ChooseExecutor(c, k, 2, {}).migration_needed());
  Result<MigrationPlan> plan = ChooseMigration(c, k, 2, {"s4"});
  ASSERT_TRUE(plan.ok());
  ASSERT_FALSE(plan->scale_out_needed);
  EXPECT_EQ(plan->to_server_id, "s4");
  EXPECT_TRUE(plan->target_warm);
  ASSERT_TRUE(c.AddReplica("k", 4, "s4").ok());
  ASSERT_TRUE(c.RemoveReplica("k", plan->replica_id).ok());
  EXPECT_EQ(ChooseExecutor(c, k, 2, {}).candidates, std::vector<uint32_t>{4});

  // With s4 busy too, nothing can move: scale out, and the scaler agrees the cluster is short.
  ASSERT_TRUE(c.Commit("s4", Gpus(2)).ok());
  ASSERT_TRUE(c.AddKernel(Kernel("k2", Req(2), {"s1", "s2", "s3"})).ok());
  plan = ChooseMigration(c, *c.FindKernel("k2"), 2);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->scale_out_needed);
  ScalingOptions opts;
  opts.gpus_per_host = 2;
  opts.buffer_hosts = 0;
  opts.min_hosts = 3;
  EXPECT_EQ(DecideScaling(c, opts).add_hosts, 1);  // ⌈8 × 1.10 / 2⌉ = 5
}

}  // namespace
}  // namespace nbos::sched
