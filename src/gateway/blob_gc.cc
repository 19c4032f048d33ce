#include "gateway/blob_gc.h"

#include <spdlog/spdlog.h>

#include <thread>

#include "common/thread_annotations.h"
#include "gateway/registry.h"
#include "store/blob_refs.h"

namespace nbos::gateway {

struct BlobGc::Impl {
  BlobGcOptions options;
  Registry* registry = nullptr;
  std::unique_ptr<store::BlobStore> store;
  BlobCollector collector{std::chrono::milliseconds(0)};  // used by the rounds' thread only
  std::thread thread;
  Mutex mu;
  CondVar wake;
  bool stopping GUARDED_BY(mu) = false;
  BlobGcStats stats GUARDED_BY(mu);

  void Run() EXCLUDES(mu) {
    MutexLock lock(&mu);
    while (!stopping) {
      wake.WaitFor(&mu, options.interval);
      if (stopping) break;
      lock.Unlock();
      try {
        Round();
      } catch (const std::exception& e) {
        spdlog::error("blob collection: {}", e.what());
      }
      lock.Lock();
    }
  }

  void Round() EXCLUDES(mu) {
    if (!store) {
      auto opened = store::OpenBlobStore(options.store_url);
      if (opened.ok()) store = std::move(*opened);
    }
    auto listed = store ? store->List()
                        : Result<std::vector<store::StoredBlob>>(
                              Unavailable("cannot open " + options.store_url));
    if (!listed.ok()) {
      spdlog::warn("blob collection: cannot list {}: {}", options.store_url,
                   listed.status().ToString());
      MutexLock lock(&mu);
      ++stats.rounds;
      ++stats.rounds_failed;
      return;
    }
    BlobGcRound round;
    round.stored = std::move(*listed);
    round.every_kernel_answered = true;
    round.now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                       std::chrono::steady_clock::now().time_since_epoch())
                       .count();
    for (const KernelRecord& k : registry->Kernels()) {
      std::string why;
      if (!AddKernelRefs(k, &round.referenced, &why)) {
        spdlog::info("blob collection: kernel {} {}; no blob is deleted this round",
                     k.meta.kernel_id, why);
        round.every_kernel_answered = false;
      }
    }
    const BlobGcDecision decision = collector.Round(round);
    uint64_t deleted = 0, freed = 0, errors = 0;
    for (const store::StoredBlob& blob : decision.to_delete) {
      if (Status s = store->Delete(blob.key); !s.ok()) {
        ++errors;
        spdlog::warn("blob collection: deleting {}: {}", blob.key, s.ToString());
        continue;
      }
      ++deleted;
      freed += blob.size_bytes;
    }
    if (deleted > 0) {
      spdlog::info("blob collection: deleted {} blobs ({} bytes) no kernel needed", deleted, freed);
    }
    MutexLock lock(&mu);
    ++stats.rounds;
    if (!round.every_kernel_answered) ++stats.rounds_incomplete;
    stats.blobs_deleted += deleted;
    stats.bytes_freed += freed;
    stats.delete_errors += errors;
    stats.blobs_stored = decision.blobs_stored - deleted;
    stats.bytes_stored = decision.bytes_stored - freed;
    stats.bytes_referenced = decision.bytes_referenced;
    stats.candidates = decision.candidates;
  }

  // Adds what kernel `k` needs to `refs`; false (and why) if that cannot be known now.
  bool AddKernelRefs(const KernelRecord& k, std::set<std::string>* refs, std::string* why) {
    if (!k.meta.checkpoint.empty()) {
      refs->insert(k.meta.checkpoint);
      auto checkpoint = store->Get(k.meta.checkpoint);
      if (checkpoint.ok()) {
        store::AddBlobKeysIn(*checkpoint, refs);
      } else if (checkpoint.status().code() != StatusCode::kNotFound) {
        *why = "has a checkpoint that cannot be read (" + checkpoint.status().message() + ")";
        return false;
      }
    }
    if (k.suspended) return true;  // its checkpoint is all it has
    if (!k.session) {
      *why = "is starting or restarting";
      return false;
    }
    bool answered = false;
    for (const StoredReplica& r : k.meta.replicas) {
      auto live = k.replica_live.find(r.replica_id);
      if (live != k.replica_live.end() && !live->second) continue;
      auto reply = k.session->CallControl(r.replica_id, "nbos_blob_refs_request",
                                          jupyter::Json::object(), options.answer_timeout);
      if (!reply.ok() || reply->value("status", "") != "ok" || !(*reply)["keys"].is_array()) {
        continue;
      }
      for (const auto& key : (*reply)["keys"]) {
        if (key.is_string()) refs->insert(key.get<std::string>());
      }
      answered = true;
    }
    if (!answered) *why = "had no replica that answered which blobs it needs";
    return answered;
  }
};

Result<std::unique_ptr<BlobGc>> BlobGc::Start(BlobGcOptions options, Registry* registry) {
  auto store = store::OpenBlobStore(options.store_url);
  // A store that cannot be reached now (Redis or S3 down) is opened again by each round.
  if (!store.ok() && store.status().code() == StatusCode::kInvalidArgument) return store.status();
  if (!store.ok()) {
    spdlog::warn("blob collection: {} (tried again each round)", store.status().ToString());
  }
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  impl->registry = registry;
  if (store.ok()) impl->store = std::move(*store);
  impl->collector = BlobCollector(impl->options.grace);
  spdlog::info("blob collection: every {} s in {}, blobs unused for {} s go",
               impl->options.interval.count() / 1000, impl->options.store_url,
               impl->options.grace.count() / 1000);
  Impl* p = impl.get();
  p->thread = std::thread([p] { p->Run(); });
  return std::unique_ptr<BlobGc>(new BlobGc(std::move(impl)));
}

BlobGc::BlobGc(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

BlobGc::~BlobGc() {
  {
    MutexLock lock(&impl_->mu);
    impl_->stopping = true;
  }
  impl_->wake.SignalAll();
  if (impl_->thread.joinable()) impl_->thread.join();
}

BlobGcStats BlobGc::stats() const {
  MutexLock lock(&impl_->mu);
  return impl_->stats;
}

}  // namespace nbos::gateway
