// Blob store in a local or shared directory. Layout: <root>/<key[0:2]>/<key>, a two-level
// fan-out that keeps directories small (256 subdirectories, each holding 1/256 of the blobs).
//
// Each blob is written to a temporary file in its final subdirectory (".<key>.tmp.XXXXXX") and
// renamed into place. rename() is atomic, so readers see either no blob or the whole blob, and any
// number of concurrent writers (threads or processes) of the same blob are fine: they write the
// same bytes and the last rename wins. A writer that crashes leaves only a stray temporary file.
//
// Speed: Put of a blob of up to two key chunks (2 MiB) hashes, checks for the file, then writes
// straight from the caller's buffer. A larger blob is written to a temporary file in a fan-out
// directory (the root may not be writable: see the daemon's PrepareSharedBlobDirectory) while
// helper threads hash it, then renamed into place (or dropped, when the blob was already there).
// Get reads into one buffer of the file's size, in segments, and hashes each segment on helper
// threads while later ones are read. GetBuffer maps large blobs copy-on-write instead of reading
// them (blob files are never changed in place, only replaced by rename, so a mapping stays valid
// and unchanged) and hashes the mapping on helper threads.
//
// Spare files (spare_files.h): on a RAM filesystem a large put writes into an unnamed file whose
// pages were allocated ahead of it, then links it in, so the put pays a memory copy instead of
// first-touch page faults. Only the process that puts large blobs holds spares (a replica that
// never runs a cell has none), at most `spare_bytes` of them, dropped after a minute without puts.
//
// Durability: by default blobs are not fsynced. A blob is a cache of state that the Raft log
// references by key and that its producer can put again; losing the last seconds of blobs in a
// power cut costs a re-put, while fsync on every put would cap throughput at the disk's sync rate
// (on network or cloud disks often far below the 500 MB/s we need for tensors). Enable `fsync` when
// the directory is the only copy; then the file and its directory entry are synced before Put
// returns.
#pragma once

#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "store/blob_store.h"
#include "store/spare_files.h"

namespace nbos::store {

struct DirBlobStoreOptions {
  bool fsync = false;  // fsync each blob file and its directory before Put returns
  // Spare files for large puts, in bytes at most; nullopt: kDefaultSpareBytes on tmpfs, none on
  // other filesystems (where allocating a file's blocks does not allocate its page cache).
  std::optional<size_t> spare_bytes;
};

inline constexpr size_t kDefaultSpareBytes = size_t{256} << 20;

class DirBlobStore final : public BlobStore {
 public:
  // Creates `root` (and parents) if missing. InvalidArgument for a relative path; Unavailable if
  // the directory cannot be created or is not a directory.
  static Result<std::unique_ptr<DirBlobStore>> Open(const std::filesystem::path& root,
                                                    DirBlobStoreOptions options = {});

  Result<std::string> Put(std::string_view data) override;
  Status PutWithKey(std::string_view key, std::string_view data) override;
  Result<std::string> Get(std::string_view key) override;
  // Blobs over kBlobChunkBytes are mapped (MAP_PRIVATE) instead of read: no copy and no fresh
  // memory; the page cache's pages are shared until the holder writes to one.
  Result<std::unique_ptr<BlobBuffer>> GetBuffer(std::string_view key) override;
  Result<bool> Contains(std::string_view key) override;
  Status Delete(std::string_view key) override;
  Result<std::vector<StoredBlob>> List() override;
  // "dir:/root", plus "?fsync=1" when enabled and "spare_mb=N" when set: a URL for OpenBlobStore.
  std::string Describe() const override;

  // Where the blob with `key` lives (whether or not it exists). `key` must be valid.
  std::filesystem::path PathFor(std::string_view key) const;

  // The spares of this store, made at its first large put; nullptr before that or without them.
  const SpareFiles* spare_files() const { return spares_.get(); }

 private:
  DirBlobStore(std::filesystem::path root, DirBlobStoreOptions options)
      : root_(std::move(root)), options_(options) {}

  // Stores `data` under the already verified `key` unless a file of the right size is there.
  Status PutVerified(std::string_view key, std::string_view data);
  Status WriteAtomically(std::string_view key, std::string_view data);
  Result<std::string> PutWhileHashing(std::string_view data, int helpers);
  SpareFiles* SparesForPut();

  const std::filesystem::path root_;
  const DirBlobStoreOptions options_;
  std::once_flag spares_once_;
  std::unique_ptr<SpareFiles> spares_;
};

}  // namespace nbos::store
