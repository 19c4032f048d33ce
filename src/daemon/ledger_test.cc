#include "daemon/ledger.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

namespace nbos::daemon {
namespace {

std::vector<GpuDevice> Gpus(int n, int64_t vram = 16000) {
  std::vector<GpuDevice> out;
  for (int i = 0; i < n; ++i) out.push_back({i, vram});
  return out;
}

const ReplicaKey kA{"k1", 1};
const ReplicaKey kB{"k2", 2};

TEST(LedgerTest, SpecComesFromDevices) {
  Ledger l({8000, 64000, 99, 99}, Gpus(4, 1000));
  EXPECT_EQ(l.spec(), (ResourceVector{8000, 64000, 4, 4000}));
  EXPECT_EQ(l.idle_device_ids(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(l.committed(), ResourceVector{});
}

TEST(LedgerTest, SubscriptionsAddUpAndMayOversubscribe) {
  Ledger l({4000, 8000, 0, 0}, Gpus(2));
  ASSERT_TRUE(l.Subscribe(kA, {3000, 6000, 2, 100}).ok());
  ASSERT_TRUE(l.Subscribe(kB, {3000, 6000, 2, 100}).ok());
  EXPECT_EQ(l.subscribed(), (ResourceVector{6000, 12000, 4, 200}));
  // Resubscribing replaces.
  ASSERT_TRUE(l.Subscribe(kB, {1000, 1000, 1, 0}).ok());
  EXPECT_EQ(l.subscribed(), (ResourceVector{4000, 7000, 3, 100}));
  EXPECT_EQ(l.replica_count(), 2u);
}

TEST(LedgerTest, SubscriptionRefusesImpossibleRequests) {
  Ledger l({4000, 8000, 0, 0}, Gpus(2));
  EXPECT_EQ(l.Subscribe(kA, {0, 0, 3, 0}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(l.Subscribe(kA, {-1, 0, 0, 0}).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(l.IsSubscribed(kA));
}

TEST(LedgerTest, GrantsLowestFreeIdsFirst) {
  Ledger l({}, Gpus(4));
  ASSERT_TRUE(l.Subscribe(kA, {0, 0, 2, 0}).ok());
  ASSERT_TRUE(l.Subscribe(kB, {0, 0, 2, 0}).ok());
  auto g1 = l.Grant(kA, "e1", 2, 0, "g1");
  ASSERT_TRUE(g1.granted) << g1.reason;
  EXPECT_EQ(g1.grant.device_ids, (std::vector<int>{0, 1}));
  auto g2 = l.Grant(kB, "e2", 1, 0, "g2");
  ASSERT_TRUE(g2.granted);
  EXPECT_EQ(g2.grant.device_ids, (std::vector<int>{2}));
  EXPECT_TRUE(l.Release("g1"));
  auto g3 = l.Grant(kB, "e3", 2, 0, "g3");
  ASSERT_TRUE(g3.granted);
  EXPECT_EQ(g3.grant.device_ids, (std::vector<int>{0, 1}));
  EXPECT_EQ(l.idle_device_ids(), (std::vector<int>{3}));
}

TEST(LedgerTest, RefusesWhenGpusRunOut) {
  Ledger l({}, Gpus(2));
  ASSERT_TRUE(l.Subscribe(kA, {0, 0, 2, 0}).ok());
  ASSERT_TRUE(l.Subscribe(kB, {0, 0, 2, 0}).ok());
  ASSERT_TRUE(l.Grant(kA, "e1", 2, 0, "g1").granted);
  auto refused = l.Grant(kB, "e2", 1, 0, "g2");
  EXPECT_FALSE(refused.granted);
  EXPECT_NE(refused.reason.find("0 of 2 idle"), std::string::npos) << refused.reason;
  EXPECT_FALSE(l.FindGrant("g2").has_value());
  EXPECT_EQ(l.committed().gpus, 2);
}

TEST(LedgerTest, RefusesUnplacedReplicasAndNegativeAndTooMuchVram) {
  Ledger l({}, Gpus(2, 1000));
  EXPECT_FALSE(l.Grant(kA, "e1", 1, 0, "g1").granted);
  ASSERT_TRUE(l.Subscribe(kA, {}).ok());
  EXPECT_FALSE(l.Grant(kA, "e1", -1, 0, "g1").granted);
  auto vram = l.Grant(kA, "e1", 1, 1001, "g1");
  EXPECT_FALSE(vram.granted);
  EXPECT_NE(vram.reason.find("VRAM"), std::string::npos);
  EXPECT_TRUE(l.Grant(kA, "e1", 2, 2000, "g1").granted);
  EXPECT_EQ(l.committed().vram_mb, 2000);
}

TEST(LedgerTest, ZeroGpuGrantHoldsNoDevice) {
  Ledger l({}, Gpus(1));
  ASSERT_TRUE(l.Subscribe(kA, {}).ok());
  auto g = l.Grant(kA, "e1", 0, 0, "g1");
  ASSERT_TRUE(g.granted);
  EXPECT_TRUE(g.grant.device_ids.empty());
  EXPECT_EQ(l.idle_device_ids().size(), 1u);
  EXPECT_TRUE(l.Release("g1"));
}

TEST(LedgerTest, RepeatedExecIdIsIdempotent) {
  Ledger l({}, Gpus(4));
  ASSERT_TRUE(l.Subscribe(kA, {}).ok());
  auto first = l.Grant(kA, "e1", 2, 0, "g1");
  auto again = l.Grant(kA, "e1", 2, 0, "g-other");
  ASSERT_TRUE(again.granted);
  EXPECT_TRUE(again.repeated);
  EXPECT_EQ(again.grant.grant_id, "g1");
  EXPECT_EQ(again.grant.device_ids, first.grant.device_ids);
  EXPECT_EQ(l.grants().size(), 1u);
  EXPECT_EQ(l.committed().gpus, 2);
  // The same exec id from another replica of the same kernel is refused, not shared.
  ReplicaKey other{"k1", 2};
  ASSERT_TRUE(l.Subscribe(other, {}).ok());
  EXPECT_FALSE(l.Grant(other, "e1", 1, 0, "g3").granted);
  // After release the exec id may be granted again (a new grant).
  EXPECT_TRUE(l.Release("g1"));
  auto fresh = l.Grant(kA, "e1", 1, 0, "g4");
  ASSERT_TRUE(fresh.granted);
  EXPECT_FALSE(fresh.repeated);
  EXPECT_EQ(fresh.grant.grant_id, "g4");
}

TEST(LedgerTest, ReleaseUnknownIsFalse) {
  Ledger l({}, Gpus(1));
  EXPECT_FALSE(l.Release("nope"));
  ASSERT_TRUE(l.Subscribe(kA, {}).ok());
  ASSERT_TRUE(l.Grant(kA, "e1", 1, 0, "g1").granted);
  EXPECT_TRUE(l.Release("g1"));
  EXPECT_FALSE(l.Release("g1"));
}

TEST(LedgerTest, StoppingOrDyingReplicaReleasesItsGrants) {
  Ledger l({1000, 1000, 0, 0}, Gpus(4));
  ASSERT_TRUE(l.Subscribe(kA, {100, 200, 1, 0}).ok());
  ASSERT_TRUE(l.Subscribe(kB, {300, 400, 1, 0}).ok());
  ASSERT_TRUE(l.Grant(kA, "e1", 1, 0, "g1").granted);
  ASSERT_TRUE(l.Grant(kA, "e2", 1, 0, "g2").granted);
  ASSERT_TRUE(l.Grant(kB, "e3", 1, 0, "g3").granted);
  // CPU and memory of an executing replica count once.
  EXPECT_EQ(l.committed(), (ResourceVector{400, 600, 3, 0}));
  EXPECT_EQ(l.ReleaseAll(kA), (std::vector<std::string>{"g1", "g2"}));
  EXPECT_TRUE(l.IsSubscribed(kA));
  EXPECT_EQ(l.committed(), (ResourceVector{300, 400, 1, 0}));
  EXPECT_EQ(l.Unsubscribe(kB), (std::vector<std::string>{"g3"}));
  EXPECT_FALSE(l.IsSubscribed(kB));
  EXPECT_EQ(l.committed(), ResourceVector{});
  EXPECT_EQ(l.idle_device_ids().size(), 4u);
  EXPECT_TRUE(l.Unsubscribe(ReplicaKey{"nope", 1}).empty());
}

// Randomized: arbitrary interleavings of subscribe, grant, repeated grant, release, release-all
// and unsubscribe never hand one device to two grants, and the ledger's view always matches a
// simple model.
TEST(LedgerTest, RandomizedNoDeviceIsEverHeldTwice) {
  for (uint32_t seed = 1; seed <= 100; ++seed) {
    std::mt19937 rng(seed);
    const int n_gpus = 1 + static_cast<int>(rng() % 8);
    Ledger l({}, Gpus(n_gpus));
    std::vector<ReplicaKey> replicas;
    for (int k = 0; k < 4; ++k) {
      for (uint32_t r = 1; r <= 3; ++r) replicas.push_back({"k" + std::to_string(k), r});
    }
    int next_grant = 0;
    int next_exec = 0;
    std::vector<std::pair<ReplicaKey, std::string>> execs;  // exec ids used so far
    for (int step = 0; step < 300; ++step) {
      const ReplicaKey& key = replicas[rng() % replicas.size()];
      switch (rng() % 7) {
        case 0:
          ASSERT_TRUE(l.Subscribe(key, {0, 0, static_cast<int32_t>(rng() % (n_gpus + 1)), 0}).ok());
          break;
        case 1:
        case 2: {
          std::string exec = "e" + std::to_string(next_exec++);
          int want = static_cast<int>(rng() % (n_gpus + 2));
          size_t idle = l.idle_device_ids().size();
          auto d = l.Grant(key, exec, want, 0, "g" + std::to_string(next_grant++));
          if (d.granted) {
            ASSERT_TRUE(l.IsSubscribed(key));
            ASSERT_EQ(static_cast<int>(d.grant.device_ids.size()), want);
            execs.emplace_back(key, exec);
          } else {
            ASSERT_TRUE(!l.IsSubscribed(key) || static_cast<size_t>(want) > idle) << d.reason;
          }
          break;
        }
        case 3:
          if (!execs.empty()) {  // a retry of an earlier exec id, maybe from another replica
            auto& [owner, exec] = execs[rng() % execs.size()];
            const ReplicaKey& who = rng() % 2 ? owner : key;
            auto before = l.grants();
            auto d = l.Grant(who, exec, 1, 0, "g" + std::to_string(next_grant++));
            if (d.repeated) {
              ASSERT_EQ(l.grants().size(), before.size());
            }
          }
          break;
        case 4: {
          auto grants = l.grants();
          if (!grants.empty()) {
            ASSERT_TRUE(l.Release(grants[rng() % grants.size()].grant_id));
          }
          break;
        }
        case 5:
          l.ReleaseAll(key);
          break;
        case 6:
          l.Unsubscribe(key);
          break;
      }
      // The property: each device in at most one grant; held + idle = all devices.
      std::set<int> held;
      int32_t held_count = 0;
      for (const GpuGrant& g : l.grants()) {
        ASSERT_TRUE(l.IsSubscribed(g.replica));
        for (int id : g.device_ids) {
          ASSERT_TRUE(held.insert(id).second) << "device " << id << " granted twice, seed " << seed;
          held_count++;
        }
      }
      for (int id : l.idle_device_ids()) ASSERT_FALSE(held.contains(id));
      ASSERT_EQ(held.size() + l.idle_device_ids().size(), static_cast<size_t>(n_gpus));
      ASSERT_EQ(l.committed().gpus, held_count);
    }
  }
}

}  // namespace
}  // namespace nbos::daemon
