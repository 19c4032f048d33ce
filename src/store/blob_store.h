// Content-addressed blob store: moves large Python objects (tensor and array buffers, up to GBs)
// between kernel replicas outside the Raft log. The log carries only the 64-character key; the
// bytes travel through a store every replica can reach (a shared directory or a Redis server).
//
// A key is a lowercase hex digest of the content (BlobKey), so
//   * an unchanged buffer is stored once, however often it is put;
//   * a blob is immutable: the same key always means the same bytes, and every read re-hashes the
//     bytes, so a damaged or tampered blob is reported instead of returned.
//
// Key definition (version 1 of the tree):
//   * blobs of at most kBlobChunkBytes: SHA-256 of the bytes;
//   * larger blobs: a hash tree of one level. The bytes are cut into kBlobChunkBytes chunks (the
//     last may be shorter), each chunk is hashed with SHA-256, and the key is
//       SHA-512/256("nbos-blob-tree-1" || size as u64 little endian || digest 0 || digest 1 ...).
//     Chunks hash independently, so a large blob is hashed on several threads, alongside its
//     write or read. The root uses SHA-512/256, a different function from SHA-256, so no
//     one-chunk blob (whatever its bytes) can have the key of a tree.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace nbos::store {

inline constexpr size_t kBlobKeyLength = 64;
// Chunk size of the key's hash tree (see above). Part of the key definition: never change it.
inline constexpr size_t kBlobChunkBytes = size_t{1} << 20;

// The key of `data` (see above). Blobs of more than two chunks are hashed on several threads.
std::string BlobKey(std::string_view data);

// Whether `data` is the blob named `key`, given `computed_key` == BlobKey(data). Also accepts the
// keys of version 0 (SHA-256 of the whole blob, whatever its size), which stores and journals
// written before the hash tree hold, so those blobs stay readable; that costs a second hash of a
// large blob, and only when the tree key does not match.
bool BlobKeyMatches(std::string_view key, std::string_view data, std::string_view computed_key);

// Lowercase hex SHA-256 of `data` (the key only for blobs of at most kBlobChunkBytes).
std::string Sha256Hex(std::string_view data);

// True for exactly 64 lowercase hex characters. Every store entry point checks this before using a
// key, so a key can never become a path ("../x"), a Redis key pattern or a protocol injection.
bool IsValidBlobKey(std::string_view key);

// InvalidArgument naming the bad key (shortened) unless IsValidBlobKey(key).
Status CheckBlobKey(std::string_view key);

// Incremental key for data that arrives in pieces, on the caller's thread: Update(a); Update(b);
// HexDigest() equals BlobKey(a + b). Not thread-safe; one hash per object.
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

// BlobKey of a buffer that its owner fills front to back, computed on helper threads while it
// fills (reads from a file or socket, writes of the same bytes elsewhere): chunks are hashed as
// soon as they are final. The owner calls Advance(n) once the first n bytes will no longer change
// (n never decreases) and Finish() at the end, which joins in the hashing and returns the key of
// the first n bytes. The buffer must stay valid and unchanged below n until Finish returns.
// Destruction without Finish (an error path) stops the helpers. Advance and Finish are for the
// owner's thread only.
class ConcurrentBlobHasher {
 public:
  // `helpers`: threads started to hash alongside the owner (0: Finish hashes everything).
  ConcurrentBlobHasher(const char* base, int helpers);
  ~ConcurrentBlobHasher();
  ConcurrentBlobHasher(const ConcurrentBlobHasher&) = delete;
  ConcurrentBlobHasher& operator=(const ConcurrentBlobHasher&) = delete;

  void Advance(size_t filled_bytes);
  std::string Finish();

  // Helper threads worth starting for a blob of `size_bytes`: none for one or two chunks, else
  // up to one less than the hardware threads (the owner hashes too), at most 3.
  static int HelpersFor(size_t size_bytes);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// A blob's bytes in memory that belongs to its holder alone: writes through data() change no other
// buffer and no stored blob.
class BlobBuffer {
 public:
  virtual ~BlobBuffer() = default;
  virtual char* data() = 0;
  virtual size_t size() const = 0;
};

// A BlobBuffer that owns a string.
class StringBlobBuffer final : public BlobBuffer {
 public:
  explicit StringBlobBuffer(std::string bytes) : bytes_(std::move(bytes)) {}
  char* data() override { return bytes_.data(); }
  size_t size() const override { return bytes_.size(); }
  std::string& bytes() { return bytes_; }

 private:
  std::string bytes_;
};

// A blob as a listing names it.
struct StoredBlob {
  std::string key;
  uint64_t size_bytes = 0;
};

// A blob store. Implementations are thread-safe: one store may be shared by all threads.
//
// Errors common to every method: InvalidArgument for a malformed key; Unavailable when the backing
// store cannot be reached or refuses the operation (the message names it, e.g. "cannot reach redis
// at 127.0.0.1:6390: Connection refused"); a later call tries again.
class BlobStore {
 public:
  virtual ~BlobStore() = default;

  // Stores `data` and returns its key. Idempotent: a blob that already exists is not replaced
  // (the directory store may write a large one once more before it knows its key, then drop it).
  // A reader never sees a partially written blob.
  virtual Result<std::string> Put(std::string_view data) = 0;

  // Put for a caller that already knows the key (e.g. one received with the data). InvalidArgument
  // if `key` is not BlobKey(data); nothing is stored then.
  virtual Status PutWithKey(std::string_view key, std::string_view data) = 0;

  // The blob's bytes. NotFound for an unknown key; Internal with "corrupt blob" in the message if
  // the stored bytes no longer hash to `key`.
  virtual Result<std::string> Get(std::string_view key) = 0;

  // Get for a caller that keeps the bytes (arrays and tensors built on them): a buffer of the
  // caller's own per call, checked against the key like Get; errors as Get. This default wraps
  // Get's string; the directory store maps the file copy-on-write instead of copying it.
  virtual Result<std::unique_ptr<BlobBuffer>> GetBuffer(std::string_view key);

  // Whether a complete blob is stored under `key` (no hash check: that costs a full read).
  virtual Result<bool> Contains(std::string_view key) = 0;

  // Removes the blob. Deleting an absent blob is OK, so garbage collection can be retried. A Put
  // of the same content racing with Delete may report success for a blob that is then gone:
  // delete only blobs no replica is still publishing.
  virtual Status Delete(std::string_view key) = 0;

  // Every complete blob in the store (what garbage collection weighs), in no particular order;
  // partial uploads and anything that is not named by a valid key are left out. A blob put or
  // deleted while the listing runs may or may not be in it. This default fails (kInvalidArgument:
  // the store cannot list).
  virtual Result<std::vector<StoredBlob>> List();

  // Where the blobs live, for logs and error messages: "dir:/path" or "redis://127.0.0.1:6379/0".
  virtual std::string Describe() const = 0;
};

// Opens a store from a URL:
//   dir:///abs/path[?fsync=1&spare_mb=N]   (also "dir:/abs/path" and a plain "/abs/path")
//       a directory store (see dir_blob_store.h); the directory is created if missing. spare_mb:
//       MiB of spare files for large puts (default 256 on tmpfs, 0 elsewhere; 0 turns them off).
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
