// A BlobStore in front of another that can fetch blobs ahead of need: a standby replica asks for
// the blobs of a delta as soon as the delta commits, so applying it (and a failover right after)
// finds them in memory instead of waiting on the store.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/thread_annotations.h"
#include "store/blob_store.h"

namespace nbos::store {

class PrefetchingBlobStore final : public BlobStore {
 public:
  // Holds at most `max_cached_bytes` of prefetched blobs; the oldest are dropped first.
  PrefetchingBlobStore(std::unique_ptr<BlobStore> backing, size_t max_cached_bytes);
  ~PrefetchingBlobStore() override;

  // Fetches `keys` in the background, in order. Thread-safe; returns at once. Invalid or
  // missing keys are skipped (the later Get reports them), and so are keys already fetched,
  // queued or being fetched: a blob asked for twice is fetched once.
  void Prefetch(const std::vector<std::string>& keys) EXCLUDES(mu_);
  // Drops `keys` from the queue and from memory, and a fetch of one of them under way is
  // discarded when it ends: blobs fetched on a hint that no delta took. Thread-safe.
  void Forget(const std::vector<std::string>& keys) EXCLUDES(mu_);

  // A prefetched blob is served from memory once and then forgotten: each replica applies a
  // delta once. A key still queued leaves the queue: it is read now.
  Result<std::string> Get(std::string_view key) override;
  // As Get; prefetching fetches with the backing store's GetBuffer, so this is the cheap one.
  Result<std::unique_ptr<BlobBuffer>> GetBuffer(std::string_view key) override;
  Result<std::string> Put(std::string_view data) override { return backing_->Put(data); }
  Status PutWithKey(std::string_view key, std::string_view data) override {
    return backing_->PutWithKey(key, data);
  }
  Result<bool> Contains(std::string_view key) override { return backing_->Contains(key); }
  Status Delete(std::string_view key) EXCLUDES(mu_) override;
  Result<std::vector<StoredBlob>> List() override { return backing_->List(); }
  std::string Describe() const override { return backing_->Describe(); }

  uint64_t hits() const EXCLUDES(mu_);
  // Keys queued or being fetched now.
  size_t pending() const EXCLUDES(mu_);
  size_t cached_bytes() const EXCLUDES(mu_);

 private:
  // The thread: fetches queued keys, the lock let go of while the backing store reads.
  void Work() EXCLUDES(mu_);
  // The prefetched buffer for `key` (waiting if it is being fetched now), or null.
  std::unique_ptr<BlobBuffer> TakeCached(std::string_view key) EXCLUDES(mu_);
  void DropCachedLocked(const std::string& key) REQUIRES(mu_);

  std::unique_ptr<BlobStore> backing_;
  const size_t max_cached_bytes_;
  mutable Mutex mu_;
  CondVar cv_;
  std::deque<std::string> queue_ GUARDED_BY(mu_);
  std::string in_flight_ GUARDED_BY(mu_);             // key being fetched now
  bool in_flight_forgotten_ GUARDED_BY(mu_) = false;  // discard in_flight_ when fetched
  std::map<std::string, std::unique_ptr<BlobBuffer>> cache_ GUARDED_BY(mu_);
  std::deque<std::string> cache_order_ GUARDED_BY(mu_);  // oldest first
  size_t cached_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t hits_ GUARDED_BY(mu_) = 0;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace nbos::store
