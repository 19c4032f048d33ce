#include "store/prefetching_blob_store.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "common/thread_annotations.h"
#include "store/dir_blob_store.h"
#include "store/testing.h"

namespace nbos::store {
namespace {

using namespace std::chrono_literals;

std::unique_ptr<PrefetchingBlobStore> Open(const ScopedTempDir& dir, size_t max_bytes) {
  auto backing = DirBlobStore::Open(dir.path());
  EXPECT_TRUE(backing.ok());
  return std::make_unique<PrefetchingBlobStore>(std::move(*backing), max_bytes);
}

// Until every queued key has been fetched and `bytes` are cached (or about a second passed).
void WaitUntilFetched(const PrefetchingBlobStore& store, size_t bytes) {
  for (int i = 0; i < 500 && (store.pending() > 0 || store.cached_bytes() < bytes); ++i) {
    std::this_thread::sleep_for(2ms);
  }
}

// A directory store that counts GetBuffer calls and, while held, keeps them from finishing.
class CountingStore final : public BlobStore {
 public:
  explicit CountingStore(std::unique_ptr<BlobStore> backing) : backing_(std::move(backing)) {}
  Result<std::string> Put(std::string_view data) override { return backing_->Put(data); }
  Status PutWithKey(std::string_view key, std::string_view data) override {
    return backing_->PutWithKey(key, data);
  }
  Result<std::string> Get(std::string_view key) override { return backing_->Get(key); }
  Result<std::unique_ptr<BlobBuffer>> GetBuffer(std::string_view key) EXCLUDES(mu_) override {
    ++fetches;
    MutexLock lock(&mu_);
    while (held_) cv_.Wait(&mu_);
    return backing_->GetBuffer(key);
  }
  Result<bool> Contains(std::string_view key) override { return backing_->Contains(key); }
  Status Delete(std::string_view key) override { return backing_->Delete(key); }
  std::string Describe() const override { return "counting"; }
  void Hold(bool held) EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      held_ = held;
    }
    cv_.SignalAll();
  }
  std::atomic<int> fetches{0};

 private:
  std::unique_ptr<BlobStore> backing_;
  Mutex mu_;
  CondVar cv_;
  bool held_ GUARDED_BY(mu_) = false;
};

std::unique_ptr<PrefetchingBlobStore> OpenCounting(const ScopedTempDir& dir,
                                                   CountingStore** counting) {
  auto backing = DirBlobStore::Open(dir.path());
  EXPECT_TRUE(backing.ok());
  auto owned = std::make_unique<CountingStore>(std::move(*backing));
  *counting = owned.get();
  return std::make_unique<PrefetchingBlobStore>(std::move(owned), 64 << 20);
}

TEST(PrefetchingBlobStoreTest, PrefetchedBlobsAreServedOnceFromMemory) {
  ScopedTempDir dir;
  auto store = Open(dir, 64 << 20);
  std::string a = RandomBytes(1 << 20, 1), b = RandomBytes(1 << 20, 2);
  std::string ka = *store->Put(a), kb = *store->Put(b);
  store->Prefetch({ka, kb, "not-a-key"});
  WaitUntilFetched(*store, a.size() + b.size());
  EXPECT_EQ(store->cached_bytes(), a.size() + b.size());
  EXPECT_EQ(*store->Get(ka), a);
  EXPECT_EQ(*store->Get(kb), b);
  EXPECT_EQ(store->hits(), 2u);
  EXPECT_EQ(store->cached_bytes(), 0u);
  EXPECT_EQ(*store->Get(ka), a);  // again: from the backing store
  EXPECT_EQ(store->hits(), 2u);
}

TEST(PrefetchingBlobStoreTest, PrefetchedBuffersAreServedOnce) {
  ScopedTempDir dir;
  auto store = Open(dir, 64 << 20);
  std::string a = RandomBytes(5 << 20, 3);
  std::string ka = *store->Put(a);
  store->Prefetch({ka});
  WaitUntilFetched(*store, a.size());
  auto buffer = store->GetBuffer(ka);
  ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
  EXPECT_TRUE(std::string_view((*buffer)->data(), (*buffer)->size()) == a);
  EXPECT_EQ(store->hits(), 1u);
  EXPECT_EQ(store->cached_bytes(), 0u);
}

// Two tensors of equal bytes put one key twice in a delta.
TEST(PrefetchingBlobStoreTest, AKeyNamedTwiceIsFetchedOnceAndServed) {
  ScopedTempDir dir;
  auto store = Open(dir, 64 << 20);
  std::string a = RandomBytes(2 << 20, 4);
  std::string ka = *store->Put(a);
  store->Prefetch({ka, ka});
  WaitUntilFetched(*store, a.size());
  EXPECT_EQ(store->pending(), 0u);
  EXPECT_EQ(store->cached_bytes(), a.size());
  // Once waited forever for a fetch of the duplicate that never happened (ctest's timeout).
  auto buffer = store->GetBuffer(ka);
  ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
  EXPECT_TRUE(std::string_view((*buffer)->data(), (*buffer)->size()) == a);
  EXPECT_EQ(store->hits(), 1u);
}

// A blob hinted while the executor stores it, then named by the committed delta, is fetched
// once whether the second request finds it queued, being fetched or already in memory.
TEST(PrefetchingBlobStoreTest, ABlobAskedForAgainIsNotFetchedAgain) {
  ScopedTempDir dir;
  CountingStore* counting = nullptr;
  auto store = OpenCounting(dir, &counting);
  std::string a = RandomBytes(2 << 20, 5), b = RandomBytes(2 << 20, 6);
  std::string ka = *store->Put(a), kb = *store->Put(b);
  counting->Hold(true);
  store->Prefetch({ka, kb});
  for (int i = 0; i < 500 && counting->fetches.load() == 0; ++i) std::this_thread::sleep_for(2ms);
  store->Prefetch({ka, kb});  // ka being fetched, kb queued
  EXPECT_EQ(store->pending(), 2u);
  counting->Hold(false);
  WaitUntilFetched(*store, a.size() + b.size());
  store->Prefetch({ka, kb});  // both in memory
  WaitUntilFetched(*store, a.size() + b.size());
  EXPECT_EQ(counting->fetches.load(), 2);
  EXPECT_EQ(store->cached_bytes(), a.size() + b.size());
  EXPECT_EQ(*store->Get(ka), a);
  EXPECT_EQ(*store->Get(kb), b);
  EXPECT_EQ(store->hits(), 2u);
}

// A blob read while it waits in the queue is read by the caller and not fetched again after.
TEST(PrefetchingBlobStoreTest, ABlobReadWhileQueuedLeavesTheQueue) {
  ScopedTempDir dir;
  CountingStore* counting = nullptr;
  auto store = OpenCounting(dir, &counting);
  std::string a = RandomBytes(2 << 20, 10), b = RandomBytes(2 << 20, 11);
  std::string ka = *store->Put(a), kb = *store->Put(b);
  counting->Hold(true);
  store->Prefetch({ka, kb});
  for (int i = 0; i < 500 && counting->fetches.load() == 0; ++i) std::this_thread::sleep_for(2ms);
  EXPECT_EQ(*store->Get(kb), b);  // kb queued behind ka
  EXPECT_EQ(store->pending(), 1u);
  counting->Hold(false);
  WaitUntilFetched(*store, a.size());
  EXPECT_EQ(counting->fetches.load(), 1);
  EXPECT_EQ(store->cached_bytes(), a.size());
}

// Forgotten blobs leave memory, whether cached, queued or being fetched when forgotten.
TEST(PrefetchingBlobStoreTest, ForgottenBlobsAreDropped) {
  ScopedTempDir dir;
  CountingStore* counting = nullptr;
  auto store = OpenCounting(dir, &counting);
  std::string a = RandomBytes(2 << 20, 7), b = RandomBytes(2 << 20, 8), c = RandomBytes(1 << 20, 9);
  std::string ka = *store->Put(a), kb = *store->Put(b), kc = *store->Put(c);
  store->Prefetch({kc});
  WaitUntilFetched(*store, c.size());
  ASSERT_EQ(store->cached_bytes(), c.size());
  counting->Hold(true);
  store->Prefetch({ka, kb});
  for (int i = 0; i < 500 && counting->fetches.load() < 2; ++i) std::this_thread::sleep_for(2ms);
  store->Forget({ka, kb, kc});  // ka being fetched, kb queued, kc in memory
  EXPECT_EQ(store->cached_bytes(), 0u);
  counting->Hold(false);
  WaitUntilFetched(*store, 0);
  EXPECT_EQ(store->pending(), 0u);
  EXPECT_EQ(store->cached_bytes(), 0u);
  EXPECT_EQ(counting->fetches.load(), 2);  // kc, then ka; kb never
  EXPECT_EQ(*store->Get(ka), a);           // from the backing store
  EXPECT_EQ(store->hits(), 0u);
}

TEST(PrefetchingBlobStoreTest, CacheIsBoundedOldestFirst) {
  ScopedTempDir dir;
  auto store = Open(dir, 3 << 20);
  std::vector<std::string> keys;
  for (int i = 0; i < 5; ++i) keys.push_back(*store->Put(RandomBytes(1 << 20, 10 + i)));
  store->Prefetch(keys);
  for (int i = 0; i < 500; ++i) {
    std::this_thread::sleep_for(2ms);
    if (store->Get(keys[4]).ok() && store->hits() == 1) break;
  }
  EXPECT_LE(store->cached_bytes(), size_t{3} << 20);
  // The newest survive; the oldest were dropped and come from the backing store.
  EXPECT_EQ(*store->Get(keys[0]), RandomBytes(1 << 20, 10));
}

TEST(PrefetchingBlobStoreTest, MissingBlobsStayNotFound) {
  ScopedTempDir dir;
  auto store = Open(dir, 1 << 20);
  std::string key = BlobKey("never stored");
  store->Prefetch({key});
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(store->Get(key).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace nbos::store
