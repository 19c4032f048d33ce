#include "daemon/gpu_inventory.h"

#include <gtest/gtest.h>

namespace nbos::daemon {
namespace {

TEST(GpuInventoryTest, VirtualGpusAreNumberedFromZero) {
  auto inv = DiscoverGpus({GpuSource::kVirtual, 3, 8000});
  ASSERT_TRUE(inv.ok());
  EXPECT_TRUE(inv->is_virtual);
  ASSERT_EQ(inv->devices.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(inv->devices[i].id, i);
    EXPECT_EQ(inv->devices[i].vram_mb, 8000);
  }
}

TEST(GpuInventoryTest, AutoFallsBackToVirtualWithoutNvml) {
  auto nvml = ProbeNvml();
  auto inv = DiscoverGpus({GpuSource::kAuto, 2, 1000});
  ASSERT_TRUE(inv.ok());
  if (nvml.ok()) {
    // A machine with a driver: real devices, each with memory.
    EXPECT_FALSE(inv->is_virtual);
    EXPECT_EQ(inv->devices.size(), nvml->devices.size());
    for (const GpuDevice& d : inv->devices) EXPECT_GT(d.vram_mb, 0);
  } else {
    EXPECT_TRUE(inv->is_virtual);
    EXPECT_EQ(inv->devices.size(), 2u);
    EXPECT_EQ(DiscoverGpus({GpuSource::kNvml, 2, 1000}).status().code(), nvml.status().code());
  }
}

TEST(GpuInventoryTest, NegativeCountsAreRefused) {
  EXPECT_FALSE(DiscoverGpus({GpuSource::kVirtual, -1, 1000}).ok());
}

}  // namespace
}  // namespace nbos::daemon
