#include <gtest/gtest.h>

#include "gateway/kernel_manager.h"

namespace nbos::gateway {
namespace {

const sched::Resources kDefaults{1000, 1024, 0, 0};

TEST(ResourcesFromEnvTest, ReadsKernelVariables) {
  auto r = ResourcesFromEnv(
      {{"KERNEL_GPUS", "2"}, {"KERNEL_CPUS", "0.5"}, {"KERNEL_MEMORY", "4Gi"}, {"OTHER", "x"}},
      kDefaults);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->gpus, 2);
  EXPECT_EQ(r->millicpus, 500);
  EXPECT_EQ(r->memory_mb, 4096);
  EXPECT_EQ(r->vram_mb, 0);
  auto m = ResourcesFromEnv({{"KERNEL_CPUS", "1500m"}, {"KERNEL_MEMORY", "512"}}, kDefaults);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->millicpus, 1500);
  EXPECT_EQ(m->memory_mb, 512);
  EXPECT_EQ(m->gpus, 0);
}

TEST(ResourcesFromEnvTest, DefaultsWhenAbsentOrEmpty) {
  auto r = ResourcesFromEnv({{"KERNEL_GPUS", ""}}, kDefaults);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, kDefaults);
}

TEST(ResourcesFromEnvTest, MalformedValuesNameTheVariable) {
  for (const auto& [name, value] :
       std::vector<std::pair<std::string, std::string>>{{"KERNEL_GPUS", "1.5"},
                                                        {"KERNEL_GPUS", "-1"},
                                                        {"KERNEL_GPUS", "many"},
                                                        {"KERNEL_CPUS", "x"},
                                                        {"KERNEL_MEMORY", "4Q"},
                                                        {"KERNEL_MEMORY", "-3"}}) {
    auto r = ResourcesFromEnv({{name, value}}, kDefaults);
    ASSERT_FALSE(r.ok()) << name << "=" << value;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(name), std::string::npos);
  }
}

}  // namespace
}  // namespace nbos::gateway
