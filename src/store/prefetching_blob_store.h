// A BlobStore in front of another that can fetch blobs ahead of need: a standby replica asks for
// the blobs of a delta as soon as the delta commits, so applying it (and a failover right after)
// finds them in memory instead of waiting on the store.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

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
  void Prefetch(const std::vector<std::string>& keys);
  // Drops `keys` from the queue and from memory, and a fetch of one of them under way is
  // discarded when it ends: blobs fetched on a hint that no delta took. Thread-safe.
  void Forget(const std::vector<std::string>& keys);

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
  Status Delete(std::string_view key) override;
  std::string Describe() const override { return backing_->Describe(); }

  uint64_t hits() const;
  // Keys queued or being fetched now.
  size_t pending() const;
  size_t cached_bytes() const;

 private:
  void Work();
  // The prefetched buffer for `key` (waiting if it is being fetched now), or null.
  std::unique_ptr<BlobBuffer> TakeCached(std::string_view key);
  void DropCachedLocked(const std::string& key);

  std::unique_ptr<BlobStore> backing_;
  const size_t max_cached_bytes_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> queue_;     // guarded by mu_
  std::string in_flight_;             // guarded by mu_: key being fetched now
  bool in_flight_forgotten_ = false;  // guarded by mu_: discard in_flight_ when fetched
  std::map<std::string, std::unique_ptr<BlobBuffer>> cache_;  // guarded by mu_
  std::deque<std::string> cache_order_;                       // guarded by mu_: oldest first
  size_t cached_bytes_ = 0;                                   // guarded by mu_
  uint64_t hits_ = 0;                                         // guarded by mu_
  bool stopping_ = false;                                     // guarded by mu_
  std::thread worker_;
};

}  // namespace nbos::store
