// Garbage collection of the blob store: mark and sweep with a grace period, decided from what it
// is told. Pure: the caller lists the store, asks every kernel which blobs it refers to, passes
// both in with the time, and deletes what the round returns (BlobGc does, in the gateway).
//
// A blob is deleted only once it has been stored and referred to by no kernel in every round for
// at least `grace`, and each of those rounds heard from every kernel. So a blob a cell has put
// but whose delta has not committed yet is kept (it is referred to well within the grace), and
// so is one that a kernel which did not answer may name: a round that did not hear from every
// kernel forgets every candidate and starts their grace again.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "store/blob_store.h"

namespace nbos::gateway {

struct BlobGcRound {
  // The store's listing, taken before the references were asked for: a blob put later is not
  // weighed until the next round.
  std::vector<store::StoredBlob> stored;
  std::set<std::string> referenced;
  bool every_kernel_answered = false;
  int64_t now_ms = 0;  // any monotonic clock, the same in every round
};

struct BlobGcDecision {
  std::vector<store::StoredBlob> to_delete;
  uint64_t blobs_stored = 0, bytes_stored = 0;
  uint64_t blobs_referenced = 0, bytes_referenced = 0;  // of those stored
  uint64_t candidates = 0;  // unreferenced, kept until their grace is over
};

class BlobCollector {
 public:
  explicit BlobCollector(std::chrono::milliseconds grace) : grace_(grace) {}

  BlobGcDecision Round(const BlobGcRound& round);

 private:
  std::chrono::milliseconds grace_;
  // Each candidate and since when (now_ms) every round found it unreferenced.
  std::map<std::string, int64_t> unreferenced_since_ms_;
};

}  // namespace nbos::gateway
