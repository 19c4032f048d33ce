#include "store/dir_blob_store.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>

#include "common/check.h"
#include "store/resident_buffer.h"

namespace nbos::store {

namespace {

// Largest single write(): Linux moves at most ~2 GiB per call anyway.
constexpr size_t kMaxIo = size_t{1} << 30;
// Get reads in segments of this size; blobs of at least kOverlapBytes are hashed on a second
// thread while later segments are still being read.
constexpr size_t kSegmentBytes = size_t{16} << 20;
constexpr size_t kOverlapBytes = 2 * kSegmentBytes;

// SHA-256 of a buffer that is still being filled, on its own thread. The owner fills the buffer
// front to back and calls Advance(n) once the first n bytes are final; Finish() returns the key of
// everything advanced. Destruction without Finish (an error path) stops the thread.
class BackgroundHasher {
 public:
  explicit BackgroundHasher(const char* base) : base_(base), thread_([this] { Run(); }) {}
  ~BackgroundHasher() { Finish(); }
  BackgroundHasher(const BackgroundHasher&) = delete;
  BackgroundHasher& operator=(const BackgroundHasher&) = delete;

  void Advance(size_t filled) {
    {
      std::lock_guard lock(mu_);
      filled_ = filled;
    }
    cv_.notify_one();
  }

  std::string Finish() {
    {
      std::lock_guard lock(mu_);
      finished_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
    return digest_;
  }

 private:
  void Run() {
    BlobHasher hasher;
    size_t hashed = 0;
    for (;;) {
      size_t filled = 0;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return filled_ > hashed || finished_; });
        filled = filled_;
      }
      if (filled == hashed) break;  // finished, and all of it hashed
      hasher.Update(std::string_view(base_ + hashed, filled - hashed));
      hashed = filled;
    }
    digest_ = hasher.HexDigest();
  }

  const char* const base_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t filled_ = 0;      // guarded by mu_
  bool finished_ = false;  // guarded by mu_
  std::string digest_;     // written by the thread before it ends
  std::thread thread_;     // last: starts once the members above exist
};

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
  return "dir:" + root_.string() + (options_.fsync ? "?fsync=1" : "");
}

Result<std::string> DirBlobStore::Put(std::string_view data) {
  std::string key = BlobKey(data);
  Status s = PutVerified(key, data);
  if (!s.ok()) return s;
  return key;
}

Status DirBlobStore::PutWithKey(std::string_view key, std::string_view data) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  if (BlobKey(data) != key) {
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
  std::filesystem::path dir = root_ / key.substr(0, 2);
  bool created_dir = ::mkdir(dir.c_str(), 0755) == 0;
  if (!created_dir && errno != EEXIST) return IoError("cannot create", dir, errno);

  // A dot name: listings of blobs (and a future garbage collector) skip unfinished files.
  int fd = -1;
  std::string temp_path;
  for (int attempt = 0; fd < 0; ++attempt) {
    temp_path = (dir / ("." + std::string(key) + ".tmp." + RandomSuffix())).string();
    fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && (errno != EEXIST || attempt == 3)) {
      return IoError("cannot create temporary file in", dir, errno);
    }
  }
  TempFile temp(fd, temp_path);

  // Straight from the caller's buffer: no copy in user space.
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
  if (options_.fsync && ::fsync(temp.fd()) != 0) return IoError("cannot fsync", temp.path(), errno);
  if (temp.Close() != 0) return IoError("cannot write", temp.path(), errno);

  std::filesystem::path final_path = dir / key;
  if (::rename(temp.path().c_str(), final_path.c_str()) != 0) {
    return IoError("cannot rename into", final_path, errno);
  }
  temp.Release();
  if (options_.fsync) {
    if (Status s = SyncDirectory(dir); !s.ok()) return s;
    if (created_dir) return SyncDirectory(root_);
  }
  return Status::Ok();
}

Result<std::string> DirBlobStore::Get(std::string_view key) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  std::filesystem::path path = PathFor(key);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return NotFound("blob " + std::string(key) + " not in " + Describe());
    return IoError("cannot open", path, errno);
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};

  struct stat st;
  if (::fstat(fd, &st) != 0) return IoError("cannot stat", path, errno);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);  // a hint; failure is harmless
  const auto size = static_cast<size_t>(st.st_size);

  // One allocation of the final size, read into in place, segment by segment: each segment is
  // made resident, read, and handed to the hasher thread, so hashing (the slowest step at
  // ~1.5 GB/s) overlaps reading and page population instead of following them.
  std::string data;
  data.reserve(size);
  const char* const base = data.data();
  std::optional<BackgroundHasher> hasher;
  if (size >= kOverlapBytes) hasher.emplace(base);
  size_t done = 0;
  while (done < size) {
    const size_t segment = std::min(size - done, kSegmentBytes);
    MakeResident(data.data() + done, segment);
    // Zero-fills the new segment only, and within the capacity, so `base` stays valid. The hasher
    // reads bytes below `done` and never touches the string object itself.
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
    if (hasher) hasher->Advance(done);
    if (got < segment) break;
  }
  data.resize(done);
  std::string actual = hasher ? hasher->Finish() : BlobKey(data);
  if (actual != key) {
    return Internal("corrupt blob " + std::string(key) + " in " + Describe() + ": " +
                    std::to_string(data.size()) + " bytes hash to " + actual);
  }
  return data;
}

Result<bool> DirBlobStore::Contains(std::string_view key) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  std::filesystem::path path = PathFor(key);
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) return S_ISREG(st.st_mode);
  if (errno == ENOENT || errno == ENOTDIR) return false;
  return IoError("cannot stat", path, errno);
}

Status DirBlobStore::Delete(std::string_view key) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  std::filesystem::path path = PathFor(key);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return IoError("cannot delete", path, errno);
  return Status::Ok();
}

}  // namespace nbos::store
