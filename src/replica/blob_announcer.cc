#include "replica/blob_announcer.h"

#include <spdlog/spdlog.h>

namespace nbos::replica {

BlobAnnouncer::BlobAnnouncer(store::BlobStore* backing, ReplicaId self, size_t min_bytes,
                             Propose propose)
    : backing_(backing), self_(self), min_bytes_(min_bytes), propose_(std::move(propose)) {
  worker_ = std::thread([this] { Work(); });
}

BlobAnnouncer::~BlobAnnouncer() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    keys_.clear();
  }
  cv_.SignalAll();
  worker_.join();
}

void BlobAnnouncer::Open(const std::string& exec_id) {
  MutexLock lock(&mu_);
  exec_id_ = exec_id;
  keys_.clear();
}

void BlobAnnouncer::Close() {
  MutexLock lock(&mu_);
  // No put comes while the caller waits here: the engine's thread puts and closes.
  while (!keys_.empty() || proposing_) cv_.Wait(&mu_);
  exec_id_.clear();
}

uint64_t BlobAnnouncer::keys_announced() const {
  MutexLock lock(&mu_);
  return keys_announced_;
}

Result<std::string> BlobAnnouncer::Put(std::string_view data) {
  Result<std::string> key = backing_->Put(data);
  if (key.ok()) Queue(*key, data.size());
  return key;
}

Status BlobAnnouncer::PutWithKey(std::string_view key, std::string_view data) {
  Status s = backing_->PutWithKey(key, data);
  if (s.ok()) Queue(key, data.size());
  return s;
}

void BlobAnnouncer::Queue(std::string_view key, size_t size) {
  if (size < min_bytes_) return;  // small blobs are fetched faster than a hint commits
  {
    MutexLock lock(&mu_);
    if (exec_id_.empty()) return;
    keys_.emplace_back(key);
  }
  cv_.SignalAll();
}

void BlobAnnouncer::Work() {
  MutexLock lock(&mu_);
  for (;;) {
    while (!stopping_ && keys_.empty()) cv_.Wait(&mu_);
    if (stopping_) return;
    // Whatever was put while the last hint committed goes out as one entry.
    std::string keys;
    for (const std::string& k : keys_) keys += k + "\n";
    const size_t count = keys_.size();
    keys_.clear();
    std::string entry = EncodeKernelEntry(
        {KernelEntry::Type::kBlobHint, exec_id_, self_, jupyter::Json::object(), std::move(keys)});
    proposing_ = true;
    lock.Unlock();
    Status s = propose_(std::move(entry));
    lock.Lock();
    proposing_ = false;
    if (s.ok()) {
      keys_announced_ += count;
    } else {
      spdlog::debug("blob hint not committed: {}", s.ToString());
    }
    cv_.SignalAll();
  }
}

}  // namespace nbos::replica
