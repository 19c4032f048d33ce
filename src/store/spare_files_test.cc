#include "store/spare_files.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include "store/testing.h"

namespace nbos::store {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// Spares are meant for RAM filesystems; on disk, touching them would also write them back.
std::string RamParent() { return std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : ""; }

SpareFilesOptions Manual(size_t budget_bytes, uint64_t headroom_bytes = uint64_t{1} << 40) {
  SpareFilesOptions options;
  options.budget_bytes = budget_bytes;
  options.memory_headroom_bytes = [headroom_bytes] { return headroom_bytes; };
  options.refill_thread = false;
  return options;
}

// Takes a spare for `bytes`, checks it is an allocated file of the size it claims, closes it and
// returns that size (0 for none).
size_t TakeAndCheck(SpareFiles& spares, size_t bytes) {
  std::optional<SpareFile> spare = spares.Take(bytes);
  if (!spare) return 0;
  struct stat st {};
  EXPECT_EQ(::fstat(spare->fd, &st), 0);
  EXPECT_EQ(static_cast<size_t>(st.st_size), spare->allocated_bytes);
  EXPECT_GE(static_cast<size_t>(st.st_blocks) * 512, spare->allocated_bytes);  // not sparse
  EXPECT_EQ(st.st_nlink, 0u);                                                  // unnamed
  // Mapped and writable through the map: the file sees what is written there.
  EXPECT_NE(spare->map, nullptr);
  spare->map[spare->allocated_bytes - 1] = 'x';
  char last = 0;
  EXPECT_EQ(::pread(spare->fd, &last, 1, static_cast<off_t>(spare->allocated_bytes - 1)), 1);
  EXPECT_EQ(last, 'x');
  const size_t bytes_taken = spare->allocated_bytes;
  spare->Close();
  EXPECT_EQ(spare->map, nullptr);
  EXPECT_EQ(spare->fd, -1);
  return bytes_taken;
}

TEST(SpareFilesTest, TakeAsksForASpareOfItsSizeForNextTime) {
  ScopedTempDir tmp("nbos-spares", RamParent());
  SpareFiles spares(tmp.path(), Manual(64 * kMiB));
  EXPECT_EQ(TakeAndCheck(spares, 8 * kMiB), 0u);
  spares.RefillOnce(SteadyNowMs());
  EXPECT_EQ(spares.spare_count(), 1u);
  EXPECT_EQ(spares.spare_bytes(), 8 * kMiB);
  EXPECT_EQ(TakeAndCheck(spares, 8 * kMiB), 8 * kMiB);
  EXPECT_EQ(spares.spare_count(), 0u);
  // Nothing in the directory: spares have no names.
  EXPECT_TRUE(std::filesystem::is_empty(tmp.path()));
}

TEST(SpareFilesTest, TakesTheSmallestThatFitsElseTheLargest) {
  ScopedTempDir tmp("nbos-spares", RamParent());
  SpareFiles spares(tmp.path(), Manual(64 * kMiB));
  for (size_t mb : {4, 16, 8}) spares.Take(mb * kMiB);
  spares.RefillOnce(SteadyNowMs());
  ASSERT_EQ(spares.spare_bytes(), 28 * kMiB);
  EXPECT_EQ(TakeAndCheck(spares, 6 * kMiB), 8 * kMiB);
  EXPECT_EQ(TakeAndCheck(spares, 20 * kMiB), 16 * kMiB);
  EXPECT_EQ(TakeAndCheck(spares, 1 * kMiB), 4 * kMiB);
  EXPECT_EQ(TakeAndCheck(spares, 1 * kMiB), 0u);
}

TEST(SpareFilesTest, NeverHoldsMoreThanTheBudget) {
  ScopedTempDir tmp("nbos-spares", RamParent());
  SpareFiles spares(tmp.path(), Manual(16 * kMiB));
  for (int i = 0; i < 3; ++i) spares.Take(8 * kMiB);  // 24 MiB asked for: the oldest 8 go
  spares.RefillOnce(SteadyNowMs());
  EXPECT_EQ(spares.spare_count(), 2u);
  EXPECT_EQ(spares.spare_bytes(), 16 * kMiB);
  // 12 MiB more: the oldest spare makes room.
  EXPECT_EQ(TakeAndCheck(spares, 12 * kMiB), 8 * kMiB);
  spares.RefillOnce(SteadyNowMs());
  EXPECT_EQ(spares.spare_count(), 1u);
  EXPECT_EQ(spares.spare_bytes(), 12 * kMiB);
  // A wish over the budget is made at the budget's size.
  EXPECT_EQ(TakeAndCheck(spares, 100 * kMiB), 12 * kMiB);
  spares.RefillOnce(SteadyNowMs());
  EXPECT_EQ(spares.spare_bytes(), 16 * kMiB);
}

TEST(SpareFilesTest, MakesNoSpareThatWouldTakeMoreThanAQuarterOfTheHeadroom) {
  ScopedTempDir tmp("nbos-spares", RamParent());
  SpareFiles tight(tmp.path(), Manual(64 * kMiB, /*headroom_bytes=*/32 * kMiB - 1));
  tight.Take(8 * kMiB);
  tight.RefillOnce(SteadyNowMs());
  EXPECT_EQ(tight.spare_count(), 0u);
  SpareFiles enough(tmp.path(), Manual(64 * kMiB, /*headroom_bytes=*/32 * kMiB));
  enough.Take(8 * kMiB);
  enough.RefillOnce(SteadyNowMs());
  EXPECT_EQ(enough.spare_count(), 1u);
}

TEST(SpareFilesTest, DropsEverySpareOnceNoTakeCameForTheIdleTime) {
  ScopedTempDir tmp("nbos-spares", RamParent());
  SpareFilesOptions options = Manual(64 * kMiB);
  options.idle_release_ms = 1'000;
  SpareFiles spares(tmp.path(), options);
  const int64_t before_takes_ms = SteadyNowMs();
  spares.Take(4 * kMiB);
  spares.Take(4 * kMiB);
  spares.RefillOnce(SteadyNowMs());
  ASSERT_EQ(spares.spare_count(), 2u);
  spares.RefillOnce(before_takes_ms + 999);
  EXPECT_EQ(spares.spare_count(), 2u);
  spares.RefillOnce(SteadyNowMs() + 1'000);
  EXPECT_EQ(spares.spare_count(), 0u);
  EXPECT_EQ(spares.spare_bytes(), 0u);
}

TEST(SpareFilesTest, WithoutTmpfileSupportThereAreNoSpares) {
  // A path that is no directory stands in for a filesystem without O_TMPFILE: same outcome.
  ScopedTempDir tmp("nbos-spares", RamParent());
  SpareFiles spares(tmp.path() / "missing", Manual(64 * kMiB));
  spares.Take(4 * kMiB);
  spares.RefillOnce(SteadyNowMs());
  EXPECT_EQ(spares.spare_count(), 0u);
  EXPECT_EQ(TakeAndCheck(spares, 4 * kMiB), 0u);
}

TEST(SpareFilesTest, TheRefillThreadMakesWhatTakeAsksFor) {
  ScopedTempDir tmp("nbos-spares", RamParent());
  SpareFilesOptions options;
  options.budget_bytes = 64 * kMiB;
  SpareFiles spares(tmp.path(), options);
  spares.Take(4 * kMiB);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (spares.spare_count() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(spares.spare_bytes(), 4 * kMiB);
}

TEST(SpareFilesTest, TheRefillThreadWaitsForAPauseInTakesAndStillStopsAtOnce) {
  ScopedTempDir tmp("nbos-spares", RamParent());
  SpareFilesOptions options;
  options.budget_bytes = 64 * kMiB;
  options.refill_pause_ms = 3'600'000;
  SpareFiles spares(tmp.path(), options);
  spares.Take(4 * kMiB);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a refill takes ~1 ms
  EXPECT_EQ(spares.spare_count(), 0u);
  // The destructor stops the thread in its hour-long wait (a hang would time the test out).
}

// Threads of this process whose scheduling policy is SCHED_IDLE.
int IdleThreads() {
  int idle = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    const pid_t tid = static_cast<pid_t>(std::stol(task.path().filename().string()));
    if (::sched_getscheduler(tid) == SCHED_IDLE) ++idle;
  }
  return idle;
}

TEST(SpareFilesTest, TheRefillThreadRunsAtIdlePriority) {
  ScopedTempDir tmp("nbos-spares", RamParent());
  ASSERT_EQ(IdleThreads(), 0);
  SpareFilesOptions options;
  options.budget_bytes = 64 * kMiB;
  SpareFiles spares(tmp.path(), options);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (IdleThreads() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(IdleThreads(), 1);
}

TEST(SpareFilesTest, MemoryHeadroomIsReadFromThisMachine) {
  EXPECT_GT(SpareFiles::MemoryHeadroomBytes(), 0u);
}

}  // namespace
}  // namespace nbos::store
