// Property tests over random clusters: whatever the state, decisions respect the contracts.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <set>

#include "sched/executor.h"
#include "sched/placement.h"
#include "sched/subscription.h"
#include "sched/test_util.h"

namespace nbos::sched {
namespace {

// min_servers to 10 servers of 0-8 GPUs, 8000-64000 millicpus, random subscription (through
// one-replica filler kernels), commitment and accepting flag.
ClusterState GenCluster(int min_servers) {
  ClusterState c;
  const int n = *rc::gen::inRange(min_servers, 11);
  for (int i = 0; i < n; ++i) {
    ServerView s = test::Server("s" + std::to_string(i), *rc::gen::inRange(0, 9),
                                *rc::gen::inRange(8, 65) * 1000);
    s.committed.gpus = *rc::gen::inRange(0, s.spec.gpus + 1);
    s.accepting = *rc::gen::weightedElement<bool>({{4, true}, {1, false}});
    RC_ASSERT(c.AddServer(s).ok());
    const Resources filler{*rc::gen::inRange(0, 9) * 4000, 0, *rc::gen::inRange(0, 30), 0};
    RC_ASSERT(c.AddKernel(test::Kernel("fill" + std::to_string(i), filler, {s.server_id})).ok());
  }
  return c;
}

RC_GTEST_PROP(PropertyTest, PlacementRespectsItsContract, ()) {
  const ClusterState c = GenCluster(0);
  const Resources request{*rc::gen::inRange(0, 17) * 1000, 1024, *rc::gen::inRange(0, 10), 0};
  PlacementOptions opts;
  opts.replicas = *rc::gen::inRange(1, 4);
  opts.cluster_ratio = *rc::gen::inRange(1, 15) / 2.0;
  opts.ignore_ratio_if_no_scale_out = *rc::gen::arbitrary<bool>();

  const Result<Placement> p = PlaceKernel(c, request, opts);
  if (!p.ok()) {
    RC_ASSERT(p.status().code() == StatusCode::kInvalidArgument);
    bool fits_some = false;
    for (const auto& [id, s] : c.servers()) fits_some |= request.FitsWithin(s.spec);
    RC_ASSERT(!fits_some);
    return;
  }
  const Result<Placement> again = PlaceKernel(c, request, opts);
  RC_ASSERT(again.ok());
  RC_ASSERT(again->server_ids == p->server_ids);
  if (p->scale_out_needed) {
    RC_ASSERT(p->server_ids.empty());
    RC_ASSERT(p->hosts_needed > 0);
    return;
  }
  RC_ASSERT(static_cast<int32_t>(p->server_ids.size()) == opts.replicas);
  RC_ASSERT(std::set<std::string>(p->server_ids.begin(), p->server_ids.end()).size() ==
            p->server_ids.size());
  for (const std::string& id : p->server_ids) {
    const ServerView* s = c.FindServer(id);
    RC_ASSERT(s != nullptr);
    RC_ASSERT(s->accepting);
    RC_ASSERT(SubscriptionFits(*s, request));
    if (!p->ratio_ignored && request.gpus > 0) {
      RC_ASSERT(HostSubscriptionRatio(*s, request) < opts.cluster_ratio);
    }
  }
  RC_ASSERT(!p->ratio_ignored || opts.ignore_ratio_if_no_scale_out);
}

RC_GTEST_PROP(PropertyTest, ExecutorCandidatesCanAllGrant, ()) {
  ClusterState c = GenCluster(3);
  std::vector<std::string> ids;
  for (const auto& [id, s] : c.servers()) ids.push_back(id);
  const auto picked =
      *rc::gen::unique<std::vector<int>>(3, rc::gen::inRange(0, static_cast<int>(ids.size())));
  KernelView k =
      test::Kernel("k", Resources{0, 0, 1, 0}, {ids[picked[0]], ids[picked[1]], ids[picked[2]]});
  k.last_executor = *rc::gen::inRange(0, 4);
  RC_ASSERT(c.AddKernel(k).ok());
  const int32_t need = *rc::gen::inRange(0, 9);
  std::set<uint32_t> excluded;
  for (uint32_t id = 1; id <= 3; ++id) {
    if (*rc::gen::weightedElement<bool>({{1, true}, {3, false}})) excluded.insert(id);
  }

  const KernelView& kernel = *c.FindKernel("k");
  const ExecutorChoice choice = ChooseExecutor(c, kernel, need, excluded);
  std::set<uint32_t> seen;
  for (uint32_t id : choice.candidates) {
    RC_ASSERT(seen.insert(id).second);
    RC_ASSERT(!excluded.contains(id));
    const ServerView* s = c.FindServer(kernel.FindReplica(id)->server_id);
    RC_ASSERT(s->accepting);
    RC_ASSERT(s->IdleGpus() >= need);
  }
  // Completeness: every replica that could grant is listed.
  for (const ReplicaView& r : kernel.replicas) {
    const ServerView* s = c.FindServer(r.server_id);
    if (!excluded.contains(r.replica_id) && s->accepting && s->IdleGpus() >= need) {
      RC_ASSERT(seen.contains(r.replica_id));
    }
  }
  if (seen.contains(kernel.last_executor))
    RC_ASSERT(choice.candidates.front() == kernel.last_executor);
}

}  // namespace
}  // namespace nbos::sched
