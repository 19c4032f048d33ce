#include "gateway/raft_group.h"

#include <gtest/gtest.h>

namespace nbos::gateway {
namespace {

GroupAnswer Answer(ReplicaId from, std::set<ReplicaId> members, uint64_t term, bool leading,
                   bool committed = true) {
  return {from, std::move(members), committed, leading, term};
}

KernelRecord Kernel(std::vector<ReplicaId> ids) {
  KernelRecord k;
  for (ReplicaId id : ids) k.meta.replicas.push_back({id, "host", "", "", false});
  return k;
}

TEST(ProvenGroupTest, TheLeadersCommittedConfigurationIsTheGroup) {
  const auto group = ProvenGroup({Answer(6, {6, 7, 8}, 4, false), Answer(7, {7}, 5, true)});
  ASSERT_TRUE(group.has_value());
  EXPECT_EQ(*group, (std::set<ReplicaId>{7}));
}

TEST(ProvenGroupTest, NothingIsProvenWithoutALeaderOrWithAChangeAwaitingCommit) {
  EXPECT_FALSE(ProvenGroup({}).has_value());
  EXPECT_FALSE(ProvenGroup({Answer(6, {6, 7}, 3, false), Answer(7, {6, 7}, 3, false)}));
  // The leader appended a change its group has not committed: it may still be undone.
  EXPECT_FALSE(ProvenGroup({Answer(7, {7, 8}, 3, true, /*committed=*/false)}).has_value());
}

TEST(ProvenGroupTest, ALeaderOfAnEarlierTermProvesNothing) {
  // Replica 9 has seen term 6: replica 7 may have been deposed, and changes committed since.
  EXPECT_FALSE(ProvenGroup({Answer(7, {6, 7}, 5, true), Answer(9, {6, 7, 9}, 6, false)}));
  // Of two that lead, the later term's counts.
  const auto group = ProvenGroup({Answer(7, {6, 7}, 5, true), Answer(9, {6, 7, 9}, 6, true)});
  ASSERT_TRUE(group.has_value());
  EXPECT_EQ(*group, (std::set<ReplicaId>{6, 7, 9}));
}

TEST(DriftFromTest, RemovedMembersAreGoneAndLeavingVotersAreKept) {
  KernelRecord k = Kernel({6, 7, 8});
  k.left_group = {8};
  // The group's leader lists 7 and 8: 6 was removed by a committed change the gateway did not
  // see, and 8, recorded as leaving, never left.
  GroupDrift drift = DriftFrom(k, {7, 8});
  EXPECT_EQ(drift.gone, (std::vector<ReplicaId>{6}));
  EXPECT_EQ(drift.kept, (std::vector<ReplicaId>{8}));
  // A removal already confirmed is no drift; nor is a member the gateway counts as one.
  k.left_confirmed = {6};
  k.left_group = {6};
  drift = DriftFrom(k, {7, 8});
  EXPECT_TRUE(drift.gone.empty());
  EXPECT_TRUE(drift.kept.empty());
  // A group member the gateway has no record of (a joined replica whose migration was cut
  // short) is the orphan cleanup's, not a drift of the record.
  drift = DriftFrom(Kernel({1, 2, 3}), {1, 2, 3, 4});
  EXPECT_TRUE(drift.gone.empty());
  EXPECT_TRUE(drift.kept.empty());
}

}  // namespace
}  // namespace nbos::gateway
