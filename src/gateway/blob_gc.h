// The gateway's garbage collector of the blob store its replicas use: every `interval` it lists
// the store, asks every kernel which blobs it needs, and deletes those BlobCollector says no
// kernel, journal or snapshot has needed for the whole grace period.
//
// What a kernel needs: for a running kernel, the union of what its live replicas answer to
// nbos_blob_refs_request (ExecutionGate::BlobRefs: the state's checkpoint and journal, and the
// last deltas and blob hints applied); for a suspended one (or one resuming), its checkpoint blob
// and every blob that checkpoint names. A kernel none of whose replicas answers (starting,
// restarting, every replica lost), or whose checkpoint cannot be read, makes the round
// incomplete: nothing is deleted, and every candidate's grace starts over.
//
// Concurrent puts: a blob put after the listing is not weighed; one put before it waits out the
// grace, within which its cell commits the delta that names it. What remains is a Put of bytes
// already stored as a candidate in the moment between a round's answers and its delete: the Put
// finds the blob and stores nothing, the delete removes it. A grace of an hour makes that a
// blob unused for an hour and needed again in the same second (docs/reliability.md).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "common/status.h"
#include "gateway/blob_collector.h"

namespace nbos::gateway {

class Registry;

struct BlobGcOptions {
  std::string store_url;  // store::OpenBlobStore; empty: no collection
  std::chrono::milliseconds interval{600'000};
  std::chrono::milliseconds grace{3'600'000};
  // How long a replica may take to answer which blobs it needs.
  std::chrono::milliseconds answer_timeout{5'000};
};

struct BlobGcStats {
  uint64_t rounds = 0, rounds_incomplete = 0, rounds_failed = 0;
  uint64_t blobs_deleted = 0, bytes_freed = 0, delete_errors = 0;
  // As of the last round that listed the store.
  uint64_t blobs_stored = 0, bytes_stored = 0, bytes_referenced = 0, candidates = 0;
};

class BlobGc {
 public:
  // Opens the store and starts the rounds on a thread of their own; the first runs one interval
  // after the start. kInvalidArgument for a bad store URL; a store that cannot be reached now is
  // opened again by each round. `registry` must outlive the collector.
  static Result<std::unique_ptr<BlobGc>> Start(BlobGcOptions options, Registry* registry);
  ~BlobGc();  // stops the rounds, waiting for one under way

  BlobGcStats stats() const;

  struct Impl;

 private:
  explicit BlobGc(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace nbos::gateway
