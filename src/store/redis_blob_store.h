// Blob store on a Redis server (hiredis, blocking API). Chunk values are written and read
// directly on hiredis's socket, without hiredis's intermediate copies (see SetBulk/GetBulk in the
// .cc); everything else goes through hiredis.
//
// Layout, for a blob with key K and the store's chunk size C:
//   size <= C:  nbos:blob:K            STRING, the bytes
//   size >  C:  nbos:blob:K:0 .. :n-1  STRING, consecutive chunks of C bytes (the last may be
//                                      shorter)
//               nbos:blob:K            HASH {size, chunks, chunk_bytes}, the manifest
// Chunks are written first and the manifest last, in one HSET, so nbos:blob:K exists only once
// the whole blob is there: Contains and Get look at it and never see a partial blob. Readers take
// the chunk size from the manifest, so stores with different chunk sizes share blobs. Chunking
// keeps every value under Redis's 512 MB bulk-string limit and bounds the memory of one command.
//
// One connection per store, guarded by a mutex: operations run one at a time (Redis executes one
// command at a time anyway), and a large transfer delays the others. The connection is opened
// lazily and after any connection error it is dropped; the next call reconnects. A call that
// finds its connection broken since the last call (e.g. the server restarted) retries once on a
// fresh connection: every operation is idempotent.
//
// Errors: Unavailable when the server cannot be reached, the connection breaks, a command times
// out, or Redis replies with an error (e.g. OOM); the message names the server.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "common/thread_annotations.h"
#include "store/blob_store.h"

struct redisContext;

namespace nbos::store {

struct RedisBlobStoreOptions {
  std::string host = "127.0.0.1";
  int port = 6379;
  int db = 0;
  // Blobs larger than this are split into chunks of this size. Must be > 0 and <= 512 MiB.
  size_t chunk_bytes = size_t{64} << 20;
  std::chrono::milliseconds connect_timeout{5000};
  // Per socket read or write; a 64 MiB chunk takes well under a second on a LAN.
  std::chrono::milliseconds command_timeout{30000};
};

class RedisBlobStore final : public BlobStore {
 public:
  static constexpr size_t kMaxChunkBytes = size_t{512} << 20;

  // Does not connect; the first call does. InvalidArgument for a bad chunk size, port or db.
  static Result<std::unique_ptr<RedisBlobStore>> Create(RedisBlobStoreOptions options);
  // Create, then connect and PING: Unavailable if the server cannot be reached.
  static Result<std::unique_ptr<RedisBlobStore>> Open(RedisBlobStoreOptions options);

  ~RedisBlobStore() override;

  Result<std::string> Put(std::string_view data) override;
  Status PutWithKey(std::string_view key, std::string_view data) override;
  Result<std::string> Get(std::string_view key) override;
  Result<bool> Contains(std::string_view key) override;
  Status Delete(std::string_view key) override;
  Result<std::vector<StoredBlob>> List() override;
  std::string Describe() const override;  // "redis://host:port/db"

  // Round-trips a PING (connecting first if needed).
  Status Ping();

  // Redis key names of the layout above; `key` must be valid.
  static std::string RedisKey(std::string_view key);
  static std::string ChunkRedisKey(std::string_view key, size_t index);

 private:
  class Connection;
  explicit RedisBlobStore(RedisBlobStoreOptions options);

  // Runs `op` on a connected Connection under mu_, with SIGPIPE suppressed, retrying once if a
  // connection that was reused turns out to be broken.
  template <typename Op>
  auto WithConnection(Op op) -> decltype(op(std::declval<Connection&>()));

  Status PutLocked(Connection& c, std::string_view key, std::string_view data);
  Result<std::string> GetLocked(Connection& c, std::string_view key);
  Status DeleteLocked(Connection& c, std::string_view key);
  Result<std::optional<uint64_t>> SizeLocked(Connection& c, std::string_view key);

  const RedisBlobStoreOptions options_;
  const std::string server_;  // "host:port", for messages
  Mutex mu_;
  std::unique_ptr<Connection> conn_ GUARDED_BY(mu_);  // null when not connected
};

}  // namespace nbos::store
