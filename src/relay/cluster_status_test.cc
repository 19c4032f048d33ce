#include "relay/cluster_status.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace nbos::relay {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const char* kCluster = R"({
  "servers": [
    {"server_id": "host-1", "address": "10.0.0.1:4000", "alive": true, "draining": false,
     "accepting": true, "spec": {"gpus": 2}, "subscribed": {"gpus": 3}, "gpus_idle": 1,
     "gpus_committed": 1, "warm_pool": {"ready": 1, "target": 1}},
    {"server_id": "host-2", "address": "10.0.0.2:4000", "alive": false, "spec": {"gpus": 2},
     "subscribed": {"gpus": 0}, "gpus_idle": 2, "gpus_committed": 0, "warm_pool": {}}
  ],
  "kernels": [
    {"id": "k-1", "owner": "alice", "name": "python3", "execution_state": "busy",
     "suspended": false, "resources": {"gpus": 1},
     "replicas": [{"replica_id": 1, "server_id": "host-1", "state": "live", "role": "executor"},
                  {"replica_id": 2, "server_id": "host-2", "state": "lost", "role": "standby"},
                  {"replica_id": 4, "server_id": "host-3", "state": "joining", "role": "standby"}],
     "migration": {"leaving_replica": 2, "joining_replica": 4, "to_server_id": "host-3",
                   "reason": "server lost"}}
  ],
  "cluster_subscription_ratio": 0.75,
  "pending_servers": ["host-3"],
  "migrations": {"done": 2, "failed": 1, "replacements_done": 1},
  "suspensions": {"suspended": 0, "resumed": 0},
  "scaling": {"scale_outs": 1, "scale_ins": 0, "events": [
    {"kind": "scale-out", "server_ids": ["host-3"], "reason": "2 cells waiting for GPUs"}]}
})";

TEST(ClusterStatus, SummarisesServersKernelsAndEvents) {
  const std::string text =
      RenderClusterStatus(nlohmann::json::parse(kCluster), "http://127.0.0.1:8889");
  EXPECT_THAT(text, HasSubstr("nbos at http://127.0.0.1:8889: 2 servers (1 alive, 1 pending), 1 "
                              "kernels, GPUs 1 committed of 4, subscription ratio 0.75\n"));
  // Columns line up: each server row starts with its id padded to the header's width.
  EXPECT_THAT(text, HasSubstr("host-1  alive  1/1/2"));
  EXPECT_THAT(text, HasSubstr("host-2  lost   2/0/2"));
  EXPECT_THAT(text, HasSubstr("1/1"));  // warm pool ready/target
  EXPECT_THAT(text, HasSubstr("k-1     alice  python3  busy"));
  EXPECT_THAT(text, HasSubstr("1@host-1:live* 2@host-2:lost 4@host-3:joining"));
  EXPECT_THAT(text, HasSubstr("(moving 2 to host-3: server lost)"));
  EXPECT_THAT(text, HasSubstr("  scale-out host-3: 2 cells waiting for GPUs\n"));
  EXPECT_THAT(text, HasSubstr("migrations 2 done, 1 failed; replicas replaced 1"));
}

TEST(ClusterStatus, AnEmptyOrForeignDocumentStillReads) {
  const std::string empty = RenderClusterStatus(nlohmann::json::object(), "http://gw");
  EXPECT_THAT(empty, HasSubstr("0 servers (0 alive, 0 pending), 0 kernels"));
  EXPECT_THAT(empty, HasSubstr("no kernels"));
  const std::string odd = RenderClusterStatus(
      nlohmann::json::parse(R"({"servers": [{"server_id": 7}], "kernels": "x"})"), "http://gw");
  EXPECT_THAT(odd, HasSubstr("7       lost"));
  EXPECT_THAT(odd, Not(HasSubstr("KERNEL ")));
}

TEST(ClusterStatus, ListsOnlyTheLatestEvents) {
  nlohmann::json cluster = {{"scaling", {{"events", nlohmann::json::array()}}}};
  for (int i = 0; i < 8; ++i) {
    cluster["scaling"]["events"].push_back(
        {{"kind", "scale-in"}, {"server_ids", {"h" + std::to_string(i)}}, {"reason", "idle"}});
  }
  const std::string text = RenderClusterStatus(cluster, "http://gw", 3);
  EXPECT_THAT(text, Not(HasSubstr("scale-in h4:")));
  EXPECT_THAT(text, HasSubstr("scale-in h5:"));
  EXPECT_THAT(text, HasSubstr("scale-in h7:"));
}

TEST(ClusterStatus, ListsTheClustersEventsWithTheirTimes) {
  const auto cluster = nlohmann::json::parse(R"js({"events": [
    {"seq": 1, "at_unix_ms": 3723000, "kind": "migration-done", "kernel_id": "0123456789ab",
     "text": "replica 1 on host-1 is now replica 4 on host-3 (700 ms)"},
    {"seq": 2, "at_unix_ms": 3724000, "kind": "scale-out", "kernel_id": "", "text": "adding host-5"},
    "not an event"]})js");
  const std::string text = RenderClusterStatus(cluster, "http://gw");
  EXPECT_THAT(text, HasSubstr("  01:02:03 migration-done 01234567: replica 1 on host-1 is now"));
  EXPECT_THAT(text, HasSubstr("  01:02:04 scale-out adding host-5\n"));
  EXPECT_THAT(text, HasSubstr("  00:00:00 - -\n"));
}

}  // namespace
}  // namespace nbos::relay
