#include "store/prefetching_blob_store.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

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
