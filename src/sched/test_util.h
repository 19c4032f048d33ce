// Builders shared by the sched tests (test-only).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "sched/cluster.h"

namespace nbos::sched::test {

inline Resources Req(int32_t gpus, int64_t millicpus = 1000, int64_t memory_mb = 1024,
                     int64_t vram_mb = 0) {
  return Resources{millicpus, memory_mb, gpus, vram_mb};
}

// A server with `gpus` GPUs and, by default, generous CPU and memory.
inline ServerView Server(std::string id, int32_t gpus, int64_t millicpus = 64000,
                         int64_t memory_mb = 128000, int64_t vram_mb = 80000) {
  ServerView s;
  s.server_id = std::move(id);
  s.spec = Resources{millicpus, memory_mb, gpus, vram_mb};
  return s;
}

inline KernelView Kernel(std::string id, Resources request,
                         const std::vector<std::string>& servers) {
  KernelView k;
  k.kernel_id = std::move(id);
  k.request = request;
  uint32_t replica_id = 1;
  for (const std::string& s : servers) k.replicas.push_back({k.kernel_id, replica_id++, s});
  return k;
}

inline ClusterState Cluster(const std::vector<ServerView>& servers) {
  ClusterState c;
  for (const ServerView& s : servers) EXPECT_TRUE(c.AddServer(s).ok()) << s.server_id;
  return c;
}

inline Resources Gpus(int32_t n) { return Resources{0, 0, n, 0}; }

}  // namespace nbos::sched::test
