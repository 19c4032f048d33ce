// Directory-specific behaviour; the shared contract is in blob_store_test.cc.
#include "store/dir_blob_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include "store/testing.h"

namespace nbos::store {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::vector<std::string> Listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    names.push_back(fs::relative(entry.path(), dir).string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// Regular files only, relative to `dir`: a large put may leave an empty fan-out directory behind.
std::vector<std::string> Files(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) names.push_back(fs::relative(entry.path(), dir).string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

ino_t Inode(const fs::path& p) {
  struct stat st {};
  EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
  return st.st_ino;
}

TEST(DirBlobStoreTest, TwoLevelFanOutAndNoTemporaryFilesLeft) {
  ScopedTempDir tmp;
  auto store = DirBlobStore::Open(tmp.path());
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Put("abc").ok());
  const std::string key = BlobKey("abc");
  EXPECT_EQ((*store)->PathFor(key), tmp.path() / "ba" / key);
  EXPECT_EQ(Listing(tmp.path()), (std::vector<std::string>{"ba", "ba/" + key}));
  std::ifstream in((*store)->PathFor(key), std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "abc");
}

TEST(DirBlobStoreTest, SecondPutDoesNotRewrite) {
  ScopedTempDir tmp;
  auto store = DirBlobStore::Open(tmp.path());
  std::string data = RandomBytes(1 << 20);
  auto key = (*store)->Put(data);
  ASSERT_TRUE(key.ok());
  ino_t before = Inode((*store)->PathFor(*key));
  ASSERT_TRUE((*store)->Put(data).ok());
  ASSERT_TRUE((*store)->PutWithKey(*key, data).ok());
  EXPECT_EQ(Inode((*store)->PathFor(*key)), before);  // a rewrite would rename a new inode in
}

TEST(DirBlobStoreTest, TruncatedBlobIsCorruptAndPutRepairsIt) {
  ScopedTempDir tmp;
  auto store = DirBlobStore::Open(tmp.path());
  std::string data = RandomBytes(40 << 20);
  auto key = (*store)->Put(data);
  ASSERT_TRUE(key.ok());
  fs::resize_file((*store)->PathFor(*key), (20 << 20) + 5);
  auto got = (*store)->Get(*key);
  EXPECT_EQ(got.status().code(), StatusCode::kInternal);
  EXPECT_THAT(got.status().message(), HasSubstr("corrupt blob"));
  auto buffer = (*store)->GetBuffer(*key);
  EXPECT_EQ(buffer.status().code(), StatusCode::kInternal);
  EXPECT_THAT(buffer.status().message(), HasSubstr("corrupt blob"));
  ASSERT_TRUE((*store)->Put(data).ok());  // the size differs, so it is written again
  EXPECT_TRUE(*(*store)->Get(*key) == data);
}

TEST(DirBlobStoreTest, LargePutsLeaveNoTemporaryFiles) {
  ScopedTempDir tmp;
  auto store = DirBlobStore::Open(tmp.path());
  std::string data = RandomBytes(9 * kBlobChunkBytes + 1);
  auto key = (*store)->Put(data);
  ASSERT_TRUE(key.ok()) << key.status().ToString();
  EXPECT_EQ(*key, BlobKey(data));
  ino_t before = Inode((*store)->PathFor(*key));
  ASSERT_TRUE((*store)->Put(data).ok());  // written while hashed, then dropped: already there
  EXPECT_EQ(Inode((*store)->PathFor(*key)), before);
  EXPECT_EQ(Files(tmp.path()), (std::vector<std::string>{key->substr(0, 2) + "/" + *key}));
  EXPECT_TRUE(*(*store)->Get(*key) == data);
}

// A store shared by sandboxed replicas (the daemon's PrepareSharedBlobDirectory): its root is not
// writable by them, its fan-out directories are. Puts of every size still work, as another user.
TEST(DirBlobStoreTest, PutsNeedOnlyTheFanOutDirectoriesWritable) {
  ScopedTempDir tmp;
  for (int i = 0; i < 256; ++i) {
    char name[3];
    std::snprintf(name, sizeof(name), "%02x", i);
    ASSERT_EQ(::mkdir((tmp.path() / name).c_str(), 0777), 0);
    ASSERT_EQ(::chmod((tmp.path() / name).c_str(), 01777), 0);
  }
  ASSERT_EQ(::chmod(tmp.path().c_str(), 0511), 0);
  const std::string small = "small blob", large = RandomBytes(3 * kBlobChunkBytes + 5, 9);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // As root, permissions would not apply: put as nobody.
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) ::_exit(2);
    auto store = DirBlobStore::Open(tmp.path());
    const bool ok = store.ok() && (*store)->Put(small).ok() && (*store)->Put(large).ok();
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ::chmod(tmp.path().c_str(), 0755);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0) << "a put failed in a store whose root is not writable";
  auto store = DirBlobStore::Open(tmp.path());
  EXPECT_EQ(*(*store)->Get(BlobKey(small)), small);
  EXPECT_TRUE(*(*store)->Get(BlobKey(large)) == large);
}

TEST(DirBlobStoreTest, MappedBufferOutlivesDeleteAndSeesNoLaterWrite) {
  ScopedTempDir tmp;
  auto store = DirBlobStore::Open(tmp.path());
  std::string data = RandomBytes(3 * kBlobChunkBytes);
  auto key = (*store)->Put(data);
  ASSERT_TRUE(key.ok());
  auto buffer = (*store)->GetBuffer(*key);
  ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
  ASSERT_TRUE((*store)->Delete(*key).ok());
  ASSERT_TRUE((*store)->Put(data).ok());  // a new file under the same name
  (*buffer)->data()[0] ^= 1;
  EXPECT_TRUE(*(*store)->Get(*key) == data);
  (*buffer)->data()[0] ^= 1;
  EXPECT_TRUE(std::string_view((*buffer)->data(), (*buffer)->size()) == data);
}

TEST(DirBlobStoreTest, UnfinishedTemporaryFilesAreInvisible) {
  ScopedTempDir tmp;
  auto store = DirBlobStore::Open(tmp.path());
  const std::string key = BlobKey("abc");
  fs::create_directories(tmp.path() / "ba");
  std::ofstream(tmp.path() / "ba" / ("." + key + ".tmp.0123456789abcdef")) << "ab";
  EXPECT_FALSE(*(*store)->Contains(key));
  EXPECT_EQ((*store)->Get(key).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE((*store)->Put("abc").ok());
  EXPECT_EQ(*(*store)->Get(key), "abc");
}

TEST(DirBlobStoreTest, FsyncOptionStillRoundTrips) {
  ScopedTempDir tmp;
  auto store = DirBlobStore::Open(tmp.path() / "synced", {.fsync = true});
  ASSERT_TRUE(store.ok());
  EXPECT_EQ((*store)->Describe(), "dir:" + (tmp.path() / "synced").string() + "?fsync=1");
  std::string data = RandomBytes(300'000);
  auto key = (*store)->Put(data);
  ASSERT_TRUE(key.ok()) << key.status().ToString();
  EXPECT_TRUE(*(*store)->Get(*key) == data);
}

// Waits until the store's spares hold one of `want` bytes totals (the refill thread is done), and
// returns what they hold.
size_t SettledSpareBytes(const DirBlobStore& store, std::vector<size_t> want) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    const size_t now = store.spare_files()->spare_bytes();
    if (std::find(want.begin(), want.end(), now) != want.end() ||
        std::chrono::steady_clock::now() > deadline) {
      return now;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

TEST(DirBlobStoreTest, LargePutsWriteIntoSpareFilesAndLeaveNoOtherFile) {
  constexpr size_t kMiB = size_t{1} << 20;
  // A RAM filesystem where there is one, as spares are meant for; they work on others too.
  ScopedTempDir tmp("nbos-store", fs::is_directory("/dev/shm") ? "/dev/shm" : "");
  auto store = DirBlobStore::Open(tmp.path(), {.spare_bytes = 64 * kMiB});
  ASSERT_TRUE(store.ok());
  EXPECT_EQ((*store)->spare_files(), nullptr);  // made at the first large put
  const std::string first = RandomBytes(8 * kMiB, 1);
  auto first_key = (*store)->Put(first);
  ASSERT_TRUE(first_key.ok()) << first_key.status().ToString();
  ASSERT_NE((*store)->spare_files(), nullptr);
  ASSERT_EQ(SettledSpareBytes(**store, {8 * kMiB}), 8 * kMiB);

  // Smaller than the spare: the spare is trimmed to the blob. Had the put not taken it, the
  // spares would settle at 8 + 3 MiB.
  const std::string smaller = RandomBytes(3 * kMiB, 2);
  auto smaller_key = (*store)->Put(smaller);
  ASSERT_TRUE(smaller_key.ok()) << smaller_key.status().ToString();
  EXPECT_EQ(SettledSpareBytes(**store, {3 * kMiB, 11 * kMiB}), 3 * kMiB);
  // Larger than the spare: the put writes past its end.
  const std::string larger = RandomBytes(5 * kMiB + 123, 3);
  auto larger_key = (*store)->Put(larger);
  ASSERT_TRUE(larger_key.ok()) << larger_key.status().ToString();
  EXPECT_EQ(SettledSpareBytes(**store, {5 * kMiB + 123, 8 * kMiB + 123}), 5 * kMiB + 123);

  for (const auto& [key, data] : {std::pair{*first_key, first}, std::pair{*smaller_key, smaller},
                                  std::pair{*larger_key, larger}}) {
    EXPECT_EQ(key, BlobKey(data));
    EXPECT_EQ(fs::file_size((*store)->PathFor(key)), data.size());
    auto got = (*store)->Get(key);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(*got == data);
  }
  // The same content again: found, and the spare it took is dropped.
  ASSERT_TRUE((*store)->Put(larger).ok());
  std::vector<std::string> expected = {first_key->substr(0, 2) + "/" + *first_key,
                                       smaller_key->substr(0, 2) + "/" + *smaller_key,
                                       larger_key->substr(0, 2) + "/" + *larger_key};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(Files(tmp.path()), expected);
}

TEST(DirBlobStoreTest, SparesAreOnByDefaultOnTmpfsOnly) {
  const std::string data = RandomBytes(4 << 20);
  for (std::string parent : {"/dev/shm", ""}) {
    if (!parent.empty() && !fs::is_directory(parent)) continue;
    ScopedTempDir tmp("nbos-store", parent);
    struct statfs st {};
    ASSERT_EQ(::statfs(tmp.path().c_str(), &st), 0);
    const bool tmpfs = st.f_type == TMPFS_MAGIC;
    auto store = DirBlobStore::Open(tmp.path());
    ASSERT_TRUE((*store)->Put(data).ok());
    EXPECT_EQ((*store)->spare_files() != nullptr, tmpfs) << tmp.path();
    auto off = DirBlobStore::Open(tmp.path(), {.spare_bytes = 0});
    ASSERT_TRUE((*off)->Put(RandomBytes(4 << 20, 9)).ok());
    EXPECT_EQ((*off)->spare_files(), nullptr);
  }
}

TEST(DirBlobStoreTest, OpenErrors) {
  EXPECT_EQ(DirBlobStore::Open("relative").status().code(), StatusCode::kInvalidArgument);
  ScopedTempDir tmp;
  std::ofstream(tmp.path() / "file") << "x";
  auto store = DirBlobStore::Open(tmp.path() / "file");
  EXPECT_EQ(store.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(store.status().message(), HasSubstr((tmp.path() / "file").string()));
}

TEST(DirBlobStoreTest, TwoStoresOnOneDirectoryShareBlobs) {
  ScopedTempDir tmp;
  auto writer = DirBlobStore::Open(tmp.path());
  auto reader = DirBlobStore::Open(tmp.path());
  auto key = (*writer)->Put("shared tensor");
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(*(*reader)->Get(*key), "shared tensor");
}

}  // namespace
}  // namespace nbos::store
