#include "replica/blob_announcer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <thread>

#include "common/thread_annotations.h"
#include "store/dir_blob_store.h"
#include "store/testing.h"

namespace nbos::replica {
namespace {

using namespace std::chrono_literals;

// Records what the announcer proposes; while held, a proposal does not finish.
class Log {
 public:
  BlobAnnouncer::Propose Proposer() {
    return [this](std::string entry) {
      MutexLock lock(&mu_);
      while (held_) cv_.Wait(&mu_);
      auto decoded = DecodeKernelEntry(entry);
      EXPECT_TRUE(decoded.ok());
      entries_.push_back(*decoded);
      cv_.SignalAll();
      return fail_ ? Unavailable("no leader") : Status::Ok();
    };
  }
  void Hold(bool held) EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      held_ = held;
    }
    cv_.SignalAll();
  }
  void Fail(bool fail) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    fail_ = fail;
  }
  std::vector<KernelEntry> Entries() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return entries_;
  }
  // The entries proposed once there are `n` of them (or after a second).
  std::vector<KernelEntry> WaitFor(size_t n) EXCLUDES(mu_) {
    const auto deadline = std::chrono::steady_clock::now() + 1s;
    MutexLock lock(&mu_);
    while (entries_.size() < n && cv_.WaitUntil(&mu_, deadline)) {
    }
    return entries_;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::vector<KernelEntry> entries_ GUARDED_BY(mu_);
  bool held_ GUARDED_BY(mu_) = false;
  bool fail_ GUARDED_BY(mu_) = false;
};

// The keys of all hints in `entries`, in order.
std::vector<std::string> Keys(const std::vector<KernelEntry>& entries) {
  std::vector<std::string> keys;
  for (const KernelEntry& e : entries) {
    EXPECT_EQ(e.type, KernelEntry::Type::kBlobHint);
    for (size_t start = 0; start < e.payload.size();) {
      const size_t end = e.payload.find('\n', start);
      keys.push_back(e.payload.substr(start, end - start));
      start = end + 1;
    }
  }
  return keys;
}

class BlobAnnouncerTest : public ::testing::Test {
 protected:
  BlobAnnouncerTest() : dir_("nbos-announcer") {
    auto store = store::DirBlobStore::Open(dir_.path());
    EXPECT_TRUE(store.ok());
    store_ = std::move(*store);
  }
  store::ScopedTempDir dir_;
  std::unique_ptr<store::BlobStore> store_;
  Log log_;
};

// Only blobs of at least min_bytes put between Open and Close are announced, under the open
// execution and this replica's id; the store holds every blob either way.
TEST_F(BlobAnnouncerTest, AnnouncesLargeBlobsPutWhileAnExecutionIsOpen) {
  BlobAnnouncer announcer(store_.get(), 2, 1 << 20, log_.Proposer());
  const std::string before = *announcer.Put(store::RandomBytes(2 << 20, 1));
  announcer.Open("cell-1");
  const std::string small = *announcer.Put(store::RandomBytes(1000, 2));
  const std::string big1 = *announcer.Put(store::RandomBytes(1 << 20, 3));
  log_.WaitFor(1);
  const std::string big2 = *announcer.Put(store::RandomBytes(3 << 20, 4));
  log_.WaitFor(2);
  announcer.Close();
  const std::string after = *announcer.Put(store::RandomBytes(2 << 20, 5));
  std::this_thread::sleep_for(50ms);

  std::vector<KernelEntry> entries = log_.Entries();
  EXPECT_EQ(Keys(entries), (std::vector<std::string>{big1, big2}));
  for (const KernelEntry& e : entries) {
    EXPECT_EQ(e.exec_id, "cell-1");
    EXPECT_EQ(e.replica, 2u);
    EXPECT_TRUE(e.id.empty());  // a repeated hint is harmless: no proposal id to dedupe
  }
  EXPECT_EQ(announcer.keys_announced(), 2u);
  for (const std::string& k : {before, small, big1, big2, after}) {
    EXPECT_TRUE(*store_->Contains(k)) << k;
  }
}

// Keys put while a hint commits go out together in the next one; Close returns once every
// queued key has been proposed, so that no hint follows what the caller commits next.
TEST_F(BlobAnnouncerTest, CloseReturnsOnceEveryQueuedKeyIsProposed) {
  BlobAnnouncer announcer(store_.get(), 1, 1, log_.Proposer());
  announcer.Open("cell-2");
  log_.Hold(true);
  const std::string first = *announcer.Put("first blob");
  std::this_thread::sleep_for(50ms);  // the worker is now blocked proposing `first`
  const std::string second = *announcer.Put("queued while the first commits");
  const std::string third = *announcer.Put("queued too");
  auto closed = std::async(std::launch::async, [&] { announcer.Close(); });
  EXPECT_EQ(closed.wait_for(100ms), std::future_status::timeout);
  log_.Hold(false);
  closed.get();
  std::vector<KernelEntry> entries = log_.Entries();
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(Keys({entries[0]}), (std::vector<std::string>{first}));
  EXPECT_EQ(Keys({entries[1]}), (std::vector<std::string>{second, third}));
  EXPECT_EQ(announcer.keys_announced(), 3u);
  EXPECT_TRUE(announcer.Put("after close").ok());
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(log_.Entries().size(), 2u);
}

TEST_F(BlobAnnouncerTest, AHintThatDoesNotCommitIsNotCounted) {
  BlobAnnouncer announcer(store_.get(), 3, 1, log_.Proposer());
  log_.Fail(true);
  announcer.Open("cell-4");
  EXPECT_TRUE(announcer.Put("some bytes").ok());
  log_.WaitFor(1);
  announcer.Close();
  EXPECT_EQ(announcer.keys_announced(), 0u);
}

}  // namespace
}  // namespace nbos::replica
