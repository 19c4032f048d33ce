// Tells a kernel's standbys which blobs the executing cell has stored while the executor goes on
// storing the rest, so that a standby fetches (maps and verifies) one blob while the executor
// writes the next, instead of fetching all of them once the cell's delta has committed.
//
// A BlobStore in front of the replica's store, handed to the Python engine. While an execution
// is open (Open ... Close), each Put of at least `min_bytes` queues the blob's key; a thread of
// its own proposes the queued keys as one kBlobHint entry at a time through `propose`. Hints are
// best effort: one that is not committed only means that the standbys fetch after the delta, as
// they would without hints. All methods are thread-safe.
#pragma once

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/thread_annotations.h"
#include "replica/kernel_log.h"
#include "store/blob_store.h"

namespace nbos::replica {

class BlobAnnouncer final : public store::BlobStore {
 public:
  // Commits one encoded kernel log entry; may block (a Raft round trip).
  using Propose = std::function<Status(std::string entry)>;

  // `backing` must outlive the announcer. `self` is the replica named in the hints.
  BlobAnnouncer(store::BlobStore* backing, ReplicaId self, size_t min_bytes, Propose propose);
  ~BlobAnnouncer() override;  // drops queued keys and joins the thread

  // Announces the blobs put from now on as blobs of execution `exec_id`.
  void Open(const std::string& exec_id) EXCLUDES(mu_);
  // Proposes the keys still queued, then stops announcing. Returns once every key put since Open
  // was proposed (committed or failed), so that all hints of the execution are in the log before
  // whatever the caller proposes next (its delta): a hint behind the delta would have the
  // standbys fetch blobs that applying the delta already fetched.
  void Close() EXCLUDES(mu_);

  // Keys in the kBlobHint entries committed.
  uint64_t keys_announced() const EXCLUDES(mu_);

  Result<std::string> Put(std::string_view data) override;
  Status PutWithKey(std::string_view key, std::string_view data) override;
  Result<std::string> Get(std::string_view key) override { return backing_->Get(key); }
  Result<std::unique_ptr<store::BlobBuffer>> GetBuffer(std::string_view key) override {
    return backing_->GetBuffer(key);
  }
  Result<bool> Contains(std::string_view key) override { return backing_->Contains(key); }
  Status Delete(std::string_view key) override { return backing_->Delete(key); }
  Result<std::vector<store::StoredBlob>> List() override { return backing_->List(); }
  std::string Describe() const override { return backing_->Describe(); }

 private:
  void Queue(std::string_view key, size_t size) EXCLUDES(mu_);
  // The thread: proposes queued keys, the lock let go of while `propose_` runs.
  void Work() EXCLUDES(mu_);

  store::BlobStore* const backing_;
  const ReplicaId self_;
  const size_t min_bytes_;
  const Propose propose_;
  mutable Mutex mu_;
  CondVar cv_;
  std::string exec_id_ GUARDED_BY(mu_);            // empty: closed
  std::vector<std::string> keys_ GUARDED_BY(mu_);  // put, not proposed yet
  bool proposing_ GUARDED_BY(mu_) = false;
  bool stopping_ GUARDED_BY(mu_) = false;
  uint64_t keys_announced_ GUARDED_BY(mu_) = 0;
  std::thread worker_;
};

}  // namespace nbos::replica
