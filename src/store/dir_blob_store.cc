#include "store/dir_blob_store.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "common/check.h"
#include "store/resident_buffer.h"

namespace nbos::store {

namespace {

// Largest single write(): Linux moves at most ~2 GiB per call anyway.
constexpr size_t kMaxIo = size_t{1} << 30;
// Get reads in segments of this size, each hashed (on helper threads) while later ones are read.
constexpr size_t kSegmentBytes = size_t{4} << 20;

Status IoError(std::string_view what, const std::filesystem::path& path, int err) {
  std::string message = std::string(what) + " " + path.string() + ": " +
                        std::error_code(err, std::generic_category()).message();
  if (err == ENOSPC || err == EDQUOT) return ResourceExhausted(std::move(message));
  return Unavailable(std::move(message));
}

// Closes the fd and removes the temporary file unless released (after the rename).
class TempFile {
 public:
  TempFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  // close(2) can report a deferred write error (NFS does), so it is checked like a write.
  int Close() {
    int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }
  void Release() { path_.clear(); }
  // An unnamed file (a spare) got its temporary name.
  void Named(std::string path) { path_ = std::move(path); }

 private:
  int fd_;
  std::string path_;
};

// 16 random hex characters, so temporary names are unique across processes and hosts sharing the
// directory (a pid is not).
std::string RandomSuffix() {
  unsigned char bytes[8] = {};
  ssize_t n = ::getrandom(bytes, sizeof(bytes), 0);
  (void)n;  // on failure the zero bytes still work: O_EXCL catches the collision and we retry
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += kHex[b >> 4];
    out += kHex[b & 0xf];
  }
  return out;
}

Status SyncDirectory(const std::filesystem::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IoError("cannot open", dir, errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) return IoError("cannot fsync", dir, err);
  return Status::Ok();
}

// A new temporary file in `dir`. A dot name: listings of blobs (and a future garbage collector)
// skip unfinished files.
Result<std::unique_ptr<TempFile>> CreateTempFile(const std::filesystem::path& dir,
                                                 std::string_view stem) {
  for (int attempt = 0;; ++attempt) {
    std::string path = (dir / ("." + std::string(stem) + ".tmp." + RandomSuffix())).string();
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) return std::make_unique<TempFile>(fd, std::move(path));
    if (errno != EEXIST || attempt == 3)
      return IoError("cannot create temporary file in", dir, errno);
  }
}

// Gives the unnamed `temp` a temporary name in `dir`. Through /proc, since linking a descriptor
// itself (AT_EMPTY_PATH) needs CAP_DAC_READ_SEARCH.
Status LinkUnnamed(TempFile& temp, const std::filesystem::path& dir) {
  const std::string proc = "/proc/self/fd/" + std::to_string(temp.fd());
  for (int attempt = 0;; ++attempt) {
    std::string path = (dir / (".put.tmp." + RandomSuffix())).string();
    if (::linkat(AT_FDCWD, proc.c_str(), AT_FDCWD, path.c_str(), AT_SYMLINK_FOLLOW) == 0) {
      temp.Named(std::move(path));
      return Status::Ok();
    }
    if (errno != EEXIST || attempt == 3)
      return IoError("cannot link a spare file into", dir, errno);
  }
}

// Whether spare files work in `dir`: an unnamed file can be made and linked there (no O_TMPFILE
// on some filesystems, no /proc in some sandboxes).
bool CanLinkUnnamed(const std::filesystem::path& dir) {
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  TempFile probe(fd, "");
  return LinkUnnamed(probe, dir).ok();  // the probe's name goes with `probe`
}

bool OnTmpfs(const std::filesystem::path& dir) {
  struct statfs fs {};
  return ::statfs(dir.c_str(), &fs) == 0 && fs.f_type == TMPFS_MAGIC;
}

// Straight from the caller's buffer: no copy in user space.
Status WriteAll(TempFile& temp, std::string_view data) {
  const char* p = data.data();
  size_t left = data.size();
  while (left > 0) {
    ssize_t n = ::write(temp.fd(), p, std::min(left, kMaxIo));
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("cannot write", temp.path(), errno);
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

// Copies `data` into `spare`'s mapping, unmaps it, and makes the file (`temp`, which owns its
// descriptor) exactly `data`'s size: trimmed, or written on past the spare's end.
Status FillSpare(SpareFile& spare, TempFile& temp, std::string_view data,
                 const std::filesystem::path& dir) {
  const size_t copied = std::min(spare.allocated_bytes, data.size());
  std::memcpy(spare.map, data.data(), copied);
  spare.Unmap();
  if (copied < data.size()) {
    if (::lseek(temp.fd(), static_cast<off_t>(copied), SEEK_SET) < 0) {
      return IoError("cannot seek in a spare file in", dir, errno);
    }
    return WriteAll(temp, data.substr(copied));
  }
  if (spare.allocated_bytes > data.size() &&
      ::ftruncate(temp.fd(), static_cast<off_t>(data.size())) != 0) {
    return IoError("cannot truncate a spare file in", dir, errno);
  }
  return Status::Ok();
}

// Syncs (with `fsync`) and closes the temporary file, then renames it to root/key[0:2]/key.
Status Publish(TempFile& temp, const std::filesystem::path& root, std::string_view key,
               bool fsync) {
  if (fsync && ::fsync(temp.fd()) != 0) return IoError("cannot fsync", temp.path(), errno);
  if (temp.Close() != 0) return IoError("cannot write", temp.path(), errno);

  std::filesystem::path dir = root / key.substr(0, 2);
  bool created_dir = ::mkdir(dir.c_str(), 0755) == 0;
  if (!created_dir && errno != EEXIST) return IoError("cannot create", dir, errno);
  std::filesystem::path final_path = dir / key;
  const std::filesystem::path temp_dir = std::filesystem::path(temp.path()).parent_path();
  if (::rename(temp.path().c_str(), final_path.c_str()) != 0) {
    return IoError("cannot rename into", final_path, errno);
  }
  temp.Release();
  if (fsync) {
    if (Status s = SyncDirectory(dir); !s.ok()) return s;
    // The temporary file left its own directory.
    if (temp_dir != dir) {
      if (Status s = SyncDirectory(temp_dir); !s.ok()) return s;
    }
    if (created_dir) return SyncDirectory(root);
  }
  return Status::Ok();
}

// A private mapping of a whole blob file: the holder's writes copy the pages they touch.
class MappedBlobBuffer final : public BlobBuffer {
 public:
  MappedBlobBuffer(char* base, size_t size) : base_(base), size_(size) {}
  ~MappedBlobBuffer() override { ::munmap(base_, size_); }
  MappedBlobBuffer(const MappedBlobBuffer&) = delete;
  MappedBlobBuffer& operator=(const MappedBlobBuffer&) = delete;
  char* data() override { return base_; }
  size_t size() const override { return size_; }

 private:
  char* const base_;
  const size_t size_;
};

// Maps `size` bytes of `fd` copy-on-write, populated with the file's pages. Read-only first:
// populating a writable private mapping would copy every page (breaking copy-on-write up front);
// write permission is added once the file's own pages are in place.
Result<std::unique_ptr<MappedBlobBuffer>> MapPrivate(int fd, size_t size,
                                                     const std::filesystem::path& path) {
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) return IoError("cannot map", path, errno);
  auto buffer = std::make_unique<MappedBlobBuffer>(static_cast<char*>(p), size);
  if (::mprotect(p, size, PROT_READ | PROT_WRITE) != 0) return IoError("cannot map", path, errno);
  return buffer;
}

// A stored blob's file, open for reading, with its size; closed with the object.
struct BlobFile {
  int fd = -1;
  size_t size = 0;
  ~BlobFile() {
    if (fd >= 0) ::close(fd);
  }
};

// NotFound (naming `key` and the store `where`) when no blob file is at `path`.
Result<std::unique_ptr<BlobFile>> OpenBlobFile(const std::filesystem::path& path,
                                               std::string_view key, const std::string& where) {
  auto file = std::make_unique<BlobFile>();
  file->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file->fd < 0) {
    if (errno == ENOENT) return NotFound("blob " + std::string(key) + " not in " + where);
    return IoError("cannot open", path, errno);
  }
  struct stat st;
  if (::fstat(file->fd, &st) != 0) return IoError("cannot stat", path, errno);
  file->size = static_cast<size_t>(st.st_size);
  return file;
}

}  // namespace

Result<std::unique_ptr<DirBlobStore>> DirBlobStore::Open(const std::filesystem::path& root,
                                                         DirBlobStoreOptions options) {
  if (!root.is_absolute()) {
    return InvalidArgument("blob store directory must be an absolute path: '" + root.string() +
                           "'");
  }
  std::error_code ec;
  std::filesystem::create_directories(root, ec);
  if (ec) {
    return Unavailable("cannot create blob store directory " + root.string() + ": " + ec.message());
  }
  if (!std::filesystem::is_directory(root, ec)) {
    return Unavailable("blob store path " + root.string() + " is not a directory");
  }
  std::filesystem::path normal = root.lexically_normal();
  if (normal.has_parent_path() && !normal.has_filename()) normal = normal.parent_path();  // "a/"
  return std::unique_ptr<DirBlobStore>(new DirBlobStore(std::move(normal), options));
}

std::filesystem::path DirBlobStore::PathFor(std::string_view key) const {
  // Callers check keys (CheckBlobKey) first: one that is not 64 hex characters could name a path
  // outside the store.
  NBOS_CHECK(IsValidBlobKey(key), "blob keys are checked before they become paths");
  return root_ / key.substr(0, 2) / key;
}

std::string DirBlobStore::Describe() const {
  std::string query = options_.fsync ? "fsync=1" : "";
  if (options_.spare_bytes) {
    query += (query.empty() ? "" : "&") + std::string("spare_mb=") +
             std::to_string(*options_.spare_bytes >> 20);
  }
  return "dir:" + root_.string() + (query.empty() ? "" : "?" + query);
}

Result<std::string> DirBlobStore::Put(std::string_view data) {
  const int helpers = ConcurrentBlobHasher::HelpersFor(data.size());
  if (helpers == 0) {
    std::string key = BlobKey(data);
    Status s = PutVerified(key, data);
    if (!s.ok()) return s;
    return key;
  }
  return PutWhileHashing(data, helpers);
}

// Large blobs: the key is computed on helper threads while this thread writes the bytes to a
// temporary file, so the put takes about max(hash, write) instead of their sum. The price: a put
// of content already stored writes it once more (then drops it) instead of only hashing. Callers
// put large buffers when their content changed, so that is rare.
Result<std::string> DirBlobStore::PutWhileHashing(std::string_view data, int helpers) {
  ConcurrentBlobHasher hasher(data.data(), helpers);
  hasher.Advance(data.size());
  // Temporary files go in a fan-out directory, never in the root: the root of a store shared by
  // sandboxed replicas is not theirs to write (the daemon's PrepareSharedBlobDirectory). The key
  // is not known yet, so any fan-out directory will do; a random one spreads concurrent puts.
  const std::filesystem::path temp_dir = root_ / RandomSuffix().substr(0, 2);
  if (::mkdir(temp_dir.c_str(), 0755) != 0 && errno != EEXIST)
    return IoError("cannot create", temp_dir, errno);
  SpareFiles* spares = SparesForPut();
  std::optional<SpareFile> spare = spares != nullptr ? spares->Take(data.size()) : std::nullopt;
  Result<std::unique_ptr<TempFile>> temp =
      spare ? std::make_unique<TempFile>(spare->fd, std::string())
            : CreateTempFile(temp_dir, "put");
  if (!temp.ok()) return temp.status();
  Status written = spare ? FillSpare(*spare, **temp, data, temp_dir) : WriteAll(**temp, data);
  std::string key = hasher.Finish();
  if (!written.ok()) return written;
  struct stat st;
  if (::stat(PathFor(key).c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
      static_cast<size_t>(st.st_size) == data.size()) {
    return key;  // already stored; the temporary file goes with `temp`
  }
  if (spare) {
    if (Status s = LinkUnnamed(**temp, temp_dir); !s.ok()) return s;
  }
  if (Status s = Publish(**temp, root_, key, options_.fsync); !s.ok()) return s;
  return key;
}

SpareFiles* DirBlobStore::SparesForPut() {
  std::call_once(spares_once_, [this] {
    const size_t budget = options_.spare_bytes.value_or(OnTmpfs(root_) ? kDefaultSpareBytes : 0);
    if (budget == 0) return;
    // Spares are made in a fan-out directory: the root may not be writable (see PutWhileHashing).
    const std::filesystem::path dir = root_ / "00";
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return;
    if (!CanLinkUnnamed(dir)) return;
    spares_ = std::make_unique<SpareFiles>(dir, SpareFilesOptions{.budget_bytes = budget});
  });
  return spares_.get();
}

Status DirBlobStore::PutWithKey(std::string_view key, std::string_view data) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  if (!BlobKeyMatches(key, data, BlobKey(data))) {
    return InvalidArgument("blob key " + std::string(key) + " does not match the content (" +
                           std::to_string(data.size()) + " bytes)");
  }
  return PutVerified(key, data);
}

Status DirBlobStore::PutVerified(std::string_view key, std::string_view data) {
  // An existing file of the right size is the blob (names are content hashes and files appear only
  // by rename). A wrong size means a damaged file: rewriting it repairs the store.
  struct stat st;
  if (::stat(PathFor(key).c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
      static_cast<size_t>(st.st_size) == data.size()) {
    return Status::Ok();
  }
  return WriteAtomically(key, data);
}

Status DirBlobStore::WriteAtomically(std::string_view key, std::string_view data) {
  // In the blob's own subdirectory, so the rename never crosses directories.
  std::filesystem::path dir = root_ / key.substr(0, 2);
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
    return IoError("cannot create", dir, errno);
  auto temp = CreateTempFile(dir, key);
  if (!temp.ok()) return temp.status();
  if (Status s = WriteAll(**temp, data); !s.ok()) return s;
  return Publish(**temp, root_, key, options_.fsync);
}

Result<std::string> DirBlobStore::Get(std::string_view key) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  std::filesystem::path path = PathFor(key);
  auto file = OpenBlobFile(path, key, Describe());
  if (!file.ok()) return file.status();
  const int fd = (*file)->fd;
  const size_t size = (*file)->size;
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);  // a hint; failure is harmless

  // One allocation of the final size, read into in place, segment by segment: each segment is
  // made resident, read, and handed to the hashing threads, so hashing (the slowest step, ~1.6
  // GB/s per thread) overlaps reading and page population instead of following them.
  std::string data;
  data.reserve(size);
  const char* const base = data.data();
  ConcurrentBlobHasher hasher(base, ConcurrentBlobHasher::HelpersFor(size));
  size_t done = 0;
  while (done < size) {
    const size_t segment = std::min(size - done, kSegmentBytes);
    MakeResident(data.data() + done, segment);
    // Zero-fills the new segment only, and within the capacity, so `base` stays valid. The hashing
    // threads read bytes below `done` and never touch the string object itself.
    data.resize(done + segment);
    NBOS_CHECK(data.data() == base, "the hasher thread reads the buffer in place");
    size_t got = 0;
    while (got < segment) {
      ssize_t n = ::read(fd, data.data() + done + got, segment - got);
      if (n < 0) {
        if (errno == EINTR) continue;
        return IoError("cannot read", path, errno);
      }
      if (n == 0) break;  // shorter than fstat said: the hash check below reports it
      got += static_cast<size_t>(n);
    }
    done += got;
    hasher.Advance(done);
    if (got < segment) break;
  }
  data.resize(done);
  std::string actual = hasher.Finish();
  if (!BlobKeyMatches(key, data, actual)) {
    return Internal("corrupt blob " + std::string(key) + " in " + Describe() + ": " +
                    std::to_string(data.size()) + " bytes hash to " + actual);
  }
  return data;
}

Result<std::unique_ptr<BlobBuffer>> DirBlobStore::GetBuffer(std::string_view key) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  std::filesystem::path path = PathFor(key);
  auto file = OpenBlobFile(path, key, Describe());
  if (!file.ok()) return file.status();
  const size_t size = (*file)->size;
  if (size <= kBlobChunkBytes) return BlobStore::GetBuffer(key);  // a copy costs less than a map

  auto mapped = MapPrivate((*file)->fd, size, path);
  if (!mapped.ok()) return mapped.status();
  const std::string_view bytes((*mapped)->data(), size);
  const std::string actual = BlobKey(bytes);
  if (!BlobKeyMatches(key, bytes, actual)) {
    return Internal("corrupt blob " + std::string(key) + " in " + Describe() + ": " +
                    std::to_string(size) + " bytes hash to " + actual);
  }
  return std::unique_ptr<BlobBuffer>(std::move(*mapped));
}

Result<bool> DirBlobStore::Contains(std::string_view key) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  std::filesystem::path path = PathFor(key);
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) return S_ISREG(st.st_mode);
  if (errno == ENOENT || errno == ENOTDIR) return false;
  return IoError("cannot stat", path, errno);
}

// Blobs live only in the 256 fan-out directories, under their keys; temporary and spare files
// there have other names.
Result<std::vector<StoredBlob>> DirBlobStore::List() {
  std::vector<StoredBlob> blobs;
  std::error_code ec;
  for (const auto& fan : std::filesystem::directory_iterator(root_, ec)) {
    const std::string fan_name = fan.path().filename().string();
    if (fan_name.size() != 2 || !fan.is_directory(ec)) continue;
    std::error_code inner;
    for (const auto& entry : std::filesystem::directory_iterator(fan.path(), inner)) {
      const std::string name = entry.path().filename().string();
      if (!IsValidBlobKey(name) || name.compare(0, 2, fan_name) != 0) continue;
      struct stat st;
      if (::stat(entry.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;  // deleted
      blobs.push_back({name, static_cast<uint64_t>(st.st_size)});
    }
    if (inner && inner != std::errc::no_such_file_or_directory) {
      return Unavailable("cannot list " + fan.path().string() + ": " + inner.message());
    }
  }
  if (ec) return Unavailable("cannot list " + root_.string() + ": " + ec.message());
  return blobs;
}

Status DirBlobStore::Delete(std::string_view key) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  std::filesystem::path path = PathFor(key);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return IoError("cannot delete", path, errno);
  return Status::Ok();
}

}  // namespace nbos::store
