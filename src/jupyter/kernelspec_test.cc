#include "jupyter/kernelspec.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

namespace nbos::jupyter {
namespace {

TEST(KernelspecTest, JsonNamesTheBinaryAndPlaceholder) {
  KernelspecOptions o;
  o.argv = {"/opt/nbos/bin/nbos", "kernel", "-f", "{connection_file}"};
  auto spec = nlohmann::json::parse(KernelspecJson(o));
  EXPECT_EQ(spec["argv"][3], "{connection_file}");
  EXPECT_EQ(spec["language"], "python");
  EXPECT_EQ(spec["display_name"], "Python 3 (nbos)");
}

TEST(KernelspecTest, DirectoriesFollowJupyter) {
  EXPECT_EQ(KernelsDir(false, "/opt/x"), "/opt/x/share/jupyter/kernels");
  EXPECT_EQ(KernelsDir(false, ""), "/usr/local/share/jupyter/kernels");
  setenv("JUPYTER_DATA_DIR", "/data/jupyter", 1);
  EXPECT_EQ(KernelsDir(true, ""), "/data/jupyter/kernels");
  unsetenv("JUPYTER_DATA_DIR");
}

TEST(KernelspecTest, InstallRejectsNamesThatLeaveTheDirectory) {
  auto dir = std::filesystem::temp_directory_path() / "nbos-kernelspec-test";
  KernelspecOptions o;
  o.name = "../evil";
  EXPECT_EQ(InstallKernelspec(dir.string(), o).status().code(), StatusCode::kInvalidArgument);
  o.name = "ok-name";
  o.argv = {"nbos", "kernel", "-f", "{connection_file}"};
  auto installed = InstallKernelspec(dir.string(), o);
  ASSERT_TRUE(installed.ok()) << installed.status().ToString();
  EXPECT_TRUE(std::filesystem::exists(dir / "ok-name" / "kernel.json"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace nbos::jupyter
