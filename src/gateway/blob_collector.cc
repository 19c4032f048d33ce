#include "gateway/blob_collector.h"

namespace nbos::gateway {

BlobGcDecision BlobCollector::Round(const BlobGcRound& round) {
  BlobGcDecision decision;
  std::map<std::string, int64_t> still_unreferenced;
  for (const store::StoredBlob& blob : round.stored) {
    ++decision.blobs_stored;
    decision.bytes_stored += blob.size_bytes;
    if (round.referenced.count(blob.key)) {
      ++decision.blobs_referenced;
      decision.bytes_referenced += blob.size_bytes;
      continue;
    }
    if (!round.every_kernel_answered) continue;  // nothing is known of this blob
    auto seen = unreferenced_since_ms_.find(blob.key);
    const int64_t since = seen == unreferenced_since_ms_.end() ? round.now_ms : seen->second;
    if (round.now_ms - since >= grace_.count()) {
      decision.to_delete.push_back(blob);
    } else {
      still_unreferenced.emplace(blob.key, since);
    }
  }
  // A blob referred to again, gone from the store, or not judged this round starts over.
  unreferenced_since_ms_ = std::move(still_unreferenced);
  decision.candidates = unreferenced_since_ms_.size();
  return decision;
}

}  // namespace nbos::gateway
