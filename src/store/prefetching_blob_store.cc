#include "store/prefetching_blob_store.h"

#include <algorithm>

namespace nbos::store {

PrefetchingBlobStore::PrefetchingBlobStore(std::unique_ptr<BlobStore> backing,
                                           size_t max_cached_bytes)
    : backing_(std::move(backing)), max_cached_bytes_(max_cached_bytes) {
  worker_ = std::thread([this] { Work(); });
}

PrefetchingBlobStore::~PrefetchingBlobStore() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  worker_.join();
}

void PrefetchingBlobStore::Prefetch(const std::vector<std::string>& keys) {
  {
    MutexLock lock(&mu_);
    for (const auto& k : keys) {
      if (!IsValidBlobKey(k) || cache_.count(k) > 0 || k == in_flight_) continue;
      if (std::find(queue_.begin(), queue_.end(), k) == queue_.end()) queue_.push_back(k);
    }
  }
  cv_.SignalAll();
}

void PrefetchingBlobStore::Forget(const std::vector<std::string>& keys) {
  MutexLock lock(&mu_);
  for (const auto& k : keys) {
    queue_.erase(std::remove(queue_.begin(), queue_.end(), k), queue_.end());
    if (k == in_flight_) in_flight_forgotten_ = true;
    DropCachedLocked(k);
  }
}

void PrefetchingBlobStore::DropCachedLocked(const std::string& key) {
  auto it = cache_.find(key);
  if (it == cache_.end()) return;
  cached_bytes_ -= it->second->size();
  cache_.erase(it);
  cache_order_.erase(std::find(cache_order_.begin(), cache_order_.end(), key));
}

void PrefetchingBlobStore::Work() {
  MutexLock lock(&mu_);
  for (;;) {
    while (!stopping_ && queue_.empty()) cv_.Wait(&mu_);
    if (stopping_) return;
    std::string key = std::move(queue_.front());
    queue_.pop_front();
    // A delta may name one blob twice (two tensors of equal bytes): it is fetched once. Marking
    // it in flight only when it is fetched keeps a Get from waiting for a fetch that never ends.
    if (cache_.count(key) > 0) continue;
    in_flight_ = key;
    in_flight_forgotten_ = false;
    lock.Unlock();
    auto blob = backing_->GetBuffer(key);
    lock.Lock();
    in_flight_.clear();
    if (blob.ok() && (*blob)->size() <= max_cached_bytes_ && !in_flight_forgotten_) {
      while (cached_bytes_ + (*blob)->size() > max_cached_bytes_ && !cache_order_.empty()) {
        auto oldest = cache_.find(cache_order_.front());
        if (oldest != cache_.end()) {
          cached_bytes_ -= oldest->second->size();
          cache_.erase(oldest);
        }
        cache_order_.pop_front();
      }
      cached_bytes_ += (*blob)->size();
      cache_order_.push_back(key);
      cache_.emplace(key, std::move(*blob));
    }
    cv_.SignalAll();  // a Get may be waiting for this key
  }
}

std::unique_ptr<BlobBuffer> PrefetchingBlobStore::TakeCached(std::string_view key) {
  MutexLock lock(&mu_);
  // Fetching the key right now: wait for it rather than read it a second time. Queued and not
  // begun: the caller reads it now, and the worker need not.
  while (in_flight_ == key && !stopping_) cv_.Wait(&mu_);
  queue_.erase(std::remove(queue_.begin(), queue_.end(), key), queue_.end());
  auto it = cache_.find(std::string(key));
  if (it == cache_.end()) return nullptr;
  std::unique_ptr<BlobBuffer> blob = std::move(it->second);
  cached_bytes_ -= blob->size();
  cache_.erase(it);
  cache_order_.erase(std::find(cache_order_.begin(), cache_order_.end(), std::string(key)));
  ++hits_;
  // Prefetched bytes were hashed by the backing store when they were read.
  return blob;
}

Result<std::string> PrefetchingBlobStore::Get(std::string_view key) {
  if (std::unique_ptr<BlobBuffer> blob = TakeCached(key)) {
    return std::string(blob->data(), blob->size());
  }
  return backing_->Get(key);
}

Result<std::unique_ptr<BlobBuffer>> PrefetchingBlobStore::GetBuffer(std::string_view key) {
  if (std::unique_ptr<BlobBuffer> blob = TakeCached(key)) return blob;
  return backing_->GetBuffer(key);
}

Status PrefetchingBlobStore::Delete(std::string_view key) {
  {
    MutexLock lock(&mu_);
    DropCachedLocked(std::string(key));
  }
  return backing_->Delete(key);
}

uint64_t PrefetchingBlobStore::hits() const {
  MutexLock lock(&mu_);
  return hits_;
}

size_t PrefetchingBlobStore::pending() const {
  MutexLock lock(&mu_);
  return queue_.size() + (in_flight_.empty() ? 0 : 1);
}

size_t PrefetchingBlobStore::cached_bytes() const {
  MutexLock lock(&mu_);
  return cached_bytes_;
}

}  // namespace nbos::store
