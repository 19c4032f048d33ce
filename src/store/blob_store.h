// Content-addressed blob store: moves large Python objects (tensor and array buffers, up to GBs)
// between kernel replicas outside the Raft log. The log carries only the 64-character key; the
// bytes travel through a store every replica can reach (a shared directory or a Redis server).
//
// A key is the lowercase hex SHA-256 of the content, so
//   * an unchanged buffer is stored once, however often it is put;
//   * a blob is immutable: the same key always means the same bytes, and every read re-hashes the
//     bytes, so a damaged or tampered blob is reported instead of returned.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace nbos::store {

inline constexpr size_t kBlobKeyLength = 64;

// Lowercase hex SHA-256 of `data`.
std::string BlobKey(std::string_view data);

// True for exactly 64 lowercase hex characters. Every store entry point checks this before using a
// key, so a key can never become a path ("../x"), a Redis key pattern or a protocol injection.
bool IsValidBlobKey(std::string_view key);

// InvalidArgument naming the bad key (shortened) unless IsValidBlobKey(key).
Status CheckBlobKey(std::string_view key);

// Incremental SHA-256 for data that arrives in pieces: Update(a); Update(b); HexDigest() equals
// BlobKey(a + b). Not thread-safe; one hash per object.
class BlobHasher {
 public:
  BlobHasher();
  ~BlobHasher();
  BlobHasher(const BlobHasher&) = delete;
  BlobHasher& operator=(const BlobHasher&) = delete;

  void Update(std::string_view data);
  // The key of everything passed to Update. Call once; the hasher is spent afterwards.
  std::string HexDigest();

 private:
  struct Ctx;
  std::unique_ptr<Ctx> ctx_;
};

// A blob store. Implementations are thread-safe: one store may be shared by all threads.
//
// Errors common to every method: InvalidArgument for a malformed key; Unavailable when the backing
// store cannot be reached or refuses the operation (the message names it, e.g. "cannot reach redis
// at 127.0.0.1:6390: Connection refused"); a later call tries again.
class BlobStore {
 public:
  virtual ~BlobStore() = default;

  // Stores `data` and returns its key. Idempotent and cheap when the blob already exists: the
  // store checks before writing. A reader never sees a partially written blob.
  virtual Result<std::string> Put(std::string_view data) = 0;

  // Put for a caller that already knows the key (e.g. one received with the data). InvalidArgument
  // if `key` is not BlobKey(data); nothing is stored then.
  virtual Status PutWithKey(std::string_view key, std::string_view data) = 0;

  // The blob's bytes. NotFound for an unknown key; Internal with "corrupt blob" in the message if
  // the stored bytes no longer hash to `key`.
  virtual Result<std::string> Get(std::string_view key) = 0;

  // Whether a complete blob is stored under `key` (no hash check: that costs a full read).
  virtual Result<bool> Contains(std::string_view key) = 0;

  // Removes the blob. Deleting an absent blob is OK, so garbage collection can be retried. A Put
  // of the same content racing with Delete may report success for a blob that is then gone:
  // delete only blobs no replica is still publishing.
  virtual Status Delete(std::string_view key) = 0;

  // Where the blobs live, for logs and error messages: "dir:/path" or "redis://127.0.0.1:6379/0".
  virtual std::string Describe() const = 0;
};

// Opens a store from a URL:
//   dir:///abs/path[?fsync=1]   (also "dir:/abs/path" and a plain "/abs/path")
//       a directory store (see dir_blob_store.h); the directory is created if missing.
//   redis://host[:port][/db][?chunk_bytes=N]
//       a Redis store (see redis_blob_store.h); port defaults to 6379, db to 0. Connects (PING)
//       before returning, so a missing server is reported here as Unavailable.
//   s3://bucket[/prefix][?endpoint=URL&region=R&part_bytes=N&parallel=N]
//       an S3 store (see s3_blob_store.h); endpoint defaults to AWS (https://s3.R.amazonaws.com),
//       region to $AWS_REGION or us-east-1; credentials from $AWS_ACCESS_KEY_ID,
//       $AWS_SECRET_ACCESS_KEY (and $AWS_SESSION_TOKEN). Checks the bucket before returning.
// Anything else, relative paths and unknown options are InvalidArgument.
Result<std::unique_ptr<BlobStore>> OpenBlobStore(std::string_view url);

}  // namespace nbos::store
