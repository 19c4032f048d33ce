#include "workspace/workspace.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace nbos::workspace {
namespace {

namespace fs = std::filesystem;

TEST(NormalPathTest, RemovesDotsAndDoubledSlashes) {
  EXPECT_EQ(*NormalPath("/a//b/./c/../d/"), "/a/b/d");
  EXPECT_EQ(*NormalPath("/"), "/");
  EXPECT_EQ(*NormalPath("/a/.."), "/");
  EXPECT_FALSE(NormalPath("a/b").ok());
  EXPECT_FALSE(NormalPath("").ok());
  EXPECT_FALSE(NormalPath("/a/../..").ok());
  EXPECT_FALSE(NormalPath(std::string_view("/a\0b", 4)).ok());
}

TEST(ContainsTest, ComparesWholeComponents) {
  EXPECT_TRUE(Contains("/w", "/w"));
  EXPECT_TRUE(Contains("/w", "/w/x"));
  EXPECT_FALSE(Contains("/w", "/wx"));
  EXPECT_FALSE(Contains("/w/x", "/w"));
  EXPECT_TRUE(Contains("/", "/anything"));
}

TEST(ResolveTest, WorkingDirectoryInsideTheRoot) {
  auto ws = Resolve({.root = "/w/", .working_dir = "/w/project/./sub"});
  ASSERT_TRUE(ws.ok()) << ws.status().ToString();
  EXPECT_EQ(*ws, (KernelWorkspace{"/w", "/w/project/sub"}));
}

TEST(ResolveTest, NoDirectoryAskedStartsAtTheVisibleRoot) {
  EXPECT_EQ(*Resolve({.root = "/w"}), (KernelWorkspace{"/w", "/w"}));
  EXPECT_EQ(*Resolve({.root = "/w", .owner = "ada"}), (KernelWorkspace{"/w/ada", "/w/ada"}));
}

TEST(ResolveTest, OutsideTheRootIsRefused) {
  for (const char* dir : {"/etc", "/w/../etc", "/wx", "relative/dir"}) {
    auto ws = Resolve({.root = "/w", .working_dir = dir});
    EXPECT_FALSE(ws.ok()) << dir;
    EXPECT_EQ(ws.status().code(), StatusCode::kInvalidArgument) << dir;
  }
}

TEST(ResolveTest, AUserSeesOnlyTheirOwnSubtree) {
  EXPECT_EQ(*Resolve({.root = "/w", .owner = "ada", .working_dir = "/w/ada/nb"}),
            (KernelWorkspace{"/w/ada", "/w/ada/nb"}));
  auto other = Resolve({.root = "/w", .owner = "ada", .working_dir = "/w/bob/nb"});
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("/w/ada"), std::string::npos);
  for (const char* name : {"..", ".", ".hidden", "a/b"}) {
    EXPECT_FALSE(Resolve({.root = "/w", .owner = name}).ok()) << name;
  }
}

TEST(ResolveTest, APathIsRelativeToTheVisibleRootAndANotebookNamesItsDirectory) {
  EXPECT_EQ(Resolve({.root = "/w", .owner = "ada", .path = "proj/nb.ipynb"})->working_dir,
            "/w/ada/proj");
  EXPECT_EQ(Resolve({.root = "/w", .path = "proj"})->working_dir, "/w/proj");
  EXPECT_FALSE(Resolve({.root = "/w", .path = "../elsewhere"}).ok());
  EXPECT_FALSE(Resolve({.root = "/w", .path = "/w/abs"}).ok());
  // KERNEL_WORKING_DIR wins over the path.
  EXPECT_EQ(Resolve({.root = "/w", .working_dir = "/w/a", .path = "b"})->working_dir, "/w/a");
}

class CheckOnServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/nbos-workspace-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    base_ = tmpl;
    root_ = base_ + "/root";
    fs::create_directories(root_ + "/ada/project");
    fs::create_directories(base_ + "/outside");
    std::ofstream(root_ + "/file.txt") << "x";
    fs::create_directory_symlink(base_ + "/outside", root_ + "/escape");
  }
  void TearDown() override { fs::remove_all(base_); }
  std::string base_, root_;
};

TEST_F(CheckOnServerTest, ExistingDirectoriesInsideTheRootPass) {
  auto ws = CheckOnServer(root_, {root_ + "/ada", root_ + "/ada/project"}, {});
  ASSERT_TRUE(ws.ok()) << ws.status().ToString();
  EXPECT_EQ(ws->working_dir, fs::canonical(root_ + "/ada/project").string());
}

TEST_F(CheckOnServerTest, AMissingDirectorySaysTheWorkspaceMayNotBeMounted) {
  auto ws = CheckOnServer(root_, {root_, root_ + "/gone"}, {});
  ASSERT_FALSE(ws.ok());
  EXPECT_EQ(ws.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(ws.status().message().find("mounted"), std::string::npos);
  EXPECT_EQ(CheckOnServer(base_ + "/no-root", {base_ + "/no-root", base_ + "/no-root"}, {})
                .status()
                .code(),
            StatusCode::kUnavailable);
}

TEST_F(CheckOnServerTest, ASymbolicLinkOutOfTheRootOrAFileIsRefused) {
  EXPECT_EQ(CheckOnServer(root_, {root_, root_ + "/escape"}, {}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckOnServer(root_, {root_, root_ + "/file.txt"}, {}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_F(CheckOnServerTest, AUserSubtreeMustNotHideTheDaemonsState) {
  fs::create_directories(root_ + "/state");
  EXPECT_EQ(
      CheckOnServer(root_, {root_ + "/ada", root_ + "/ada"}, {root_ + "/state"}).status().code(),
      StatusCode::kInvalidArgument);
  // The whole root visible hides nothing; state elsewhere is fine too.
  EXPECT_TRUE(CheckOnServer(root_, {root_, root_}, {root_ + "/state"}).ok());
  EXPECT_TRUE(CheckOnServer(root_, {root_ + "/ada", root_ + "/ada"}, {base_ + "/outside"}).ok());
}

}  // namespace
}  // namespace nbos::workspace
