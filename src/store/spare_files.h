// Spare files: unnamed files whose pages are allocated ahead of the puts that will fill them.
//
// A put of a large blob to a RAM filesystem (tmpfs) through write() pays for more than the copy:
// the new file's pages are allocated, and the kernel touches each page of the caller's buffer.
// Where page tables are shadowed by a hypervisor, as on the virtual machines nbos is measured on,
// the kernel's first touch of a page the process has just filled costs a fault of its own: write()
// of 8 MiB of freshly made tensor ran at 0.7 GB/s there, a copy in user space into a mapping whose
// pages were allocated and touched before at 17 GB/s (docs/performance.md). A directory store given
// a SpareFiles keeps files of the sizes its recent puts had, allocated, mapped and touched by a
// thread of its own between puts; a put takes one, copies into its mapping, trims the file to the
// blob's size and links it into the store. Allocating still costs what it costs, but off the
// put's path.
//
// Rules:
// - Spares are O_TMPFILE files: they have no name until a put links one in, so a process that
//   dies, however it dies, leaves nothing behind; the kernel frees them with the last descriptor.
// - Take(bytes) returns the smallest spare of at least `bytes`, else the largest one (its pages
//   still save part of the cost), else none. Every Take asks for a spare of `bytes` to be made
//   for next time: workloads repeat their shapes (a training loop's tensors, a re-run cell).
// - Spares never hold more than `budget_bytes` in all. A new spare pushes out the oldest ones;
//   one larger than the budget is made at the budget's size.
// - A spare is made only when its size fits a quarter of the memory this process may still use
//   (its memory cgroup's limit less its usage, and the machine's available memory): spare pages
//   count against the replica's memory limit, and a user's kernel must not be killed for them.
// - Once no Take has come for `idle_release_ms`, every spare is dropped: an idle kernel holds no
//   memory for puts that are not coming.
// - Failures (no O_TMPFILE on this filesystem, ENOSPC) only mean fewer spares; puts go on
//   without them.
//
// Threading: Take may be called from any thread. The refill thread is the only one that
// allocates; the destructor stops it and closes every spare. The refill thread runs at idle
// priority (SCHED_IDLE): spares are for later puts, and the cores are wanted first by whatever
// follows a put (standbys on the same host verifying the blobs just written), so it holds the
// lock that Take needs only for list updates, never while it maps, unmaps or touches pages.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <optional>
#include <thread>
#include <vector>

#include "common/thread_annotations.h"

namespace nbos::store {

struct SpareFilesOptions {
  size_t budget_bytes = 0;
  int64_t idle_release_ms = 60'000;
  // The refill thread allocates once no Take came for this long.
  int64_t refill_pause_ms = 20;
  // Bytes this process may still allocate; the default reads its memory cgroup and
  // /proc/meminfo. Tests pass their own.
  std::function<uint64_t()> memory_headroom_bytes;
  // false: no thread; the owner calls RefillOnce (tests).
  bool refill_thread = true;
};

// An allocated, unnamed, writable file of `allocated_bytes` (its size as well), mapped shared and
// writable at `map`, every page touched. Close() unmaps it and closes the descriptor.
struct SpareFile {
  int fd = -1;
  char* map = nullptr;
  size_t allocated_bytes = 0;

  // Unmaps; the file stays open (fd).
  void Unmap();
  void Close();
};

class SpareFiles {
 public:
  // `dir`: where spares are made; links from them must land on the same filesystem.
  SpareFiles(std::filesystem::path dir, SpareFilesOptions options);
  ~SpareFiles();
  SpareFiles(const SpareFiles&) = delete;
  SpareFiles& operator=(const SpareFiles&) = delete;

  // The caller owns the returned file (SpareFile::Close).
  std::optional<SpareFile> Take(size_t bytes) EXCLUDES(mu_);

  // Makes the spares asked for so far (within the rules above) and drops idle ones; what the
  // refill thread does each time it wakes. `now_ms` on the steady clock.
  void RefillOnce(int64_t now_ms) EXCLUDES(mu_);

  size_t spare_bytes() const EXCLUDES(mu_);
  size_t spare_count() const EXCLUDES(mu_);

  // What the default memory_headroom_bytes reads.
  static uint64_t MemoryHeadroomBytes();

 private:
  void RefillLoop() EXCLUDES(mu_);
  // Empties the spares (the caller closes them, outside mu_ where others may wait for it).
  std::deque<SpareFile> TakeAllLocked() REQUIRES(mu_);
  std::optional<SpareFile> Allocate(size_t bytes) const;

  const std::filesystem::path dir_;
  const SpareFilesOptions options_;

  mutable Mutex mu_;
  CondVar wake_;
  std::deque<SpareFile> spares_ GUARDED_BY(mu_);  // oldest first
  std::deque<size_t> wanted_ GUARDED_BY(mu_);     // sizes asked for by Take, oldest first
  size_t spare_bytes_ GUARDED_BY(mu_) = 0;
  int64_t last_take_ms_ GUARDED_BY(mu_) = 0;
  // Written under mu_ (for wake_); read without it by Allocate, which stops touching pages.
  std::atomic<bool> stopping_{false};
  std::thread refill_;
};

// Now on the steady clock, in ms (what SpareFiles passes to RefillOnce).
int64_t SteadyNowMs();

}  // namespace nbos::store
