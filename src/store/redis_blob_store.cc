#include "store/redis_blob_store.h"

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <signal.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <initializer_list>
#include <new>
#include <optional>
#include <set>
#include <stdexcept>
#include <system_error>
#include <vector>

#include "common/check.h"
#include "store/resident_buffer.h"

namespace nbos::store {

namespace {

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

constexpr std::string_view kKeyPrefix = "nbos:blob:";
// Sanity bound on a bulk length from the server (Redis's own limit is 512 MiB by default).
constexpr size_t kMaxBulkBytes = size_t{1} << 40;
// Keys per DEL when removing the chunks of a blob: bounds one command's size.
constexpr size_t kDeleteBatch = 256;

timeval ToTimeval(std::chrono::milliseconds d) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(d.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((d.count() % 1000) * 1000);
  return tv;
}

std::string_view ReplyText(const redisReply& r) { return {r.str, r.len}; }

bool ParseCount(const redisReply* r, size_t& out) {
  if (r == nullptr || r->type != REDIS_REPLY_STRING) return false;
  auto [end, ec] = std::from_chars(r->str, r->str + r->len, out);
  return ec == std::errc() && end == r->str + r->len && r->len > 0;
}

// hiredis's write(2) and our writev(2) raise SIGPIPE on a connection the server has closed, and
// its default action kills the process. A library must not change process-wide signal handling,
// so SIGPIPE is blocked in the calling thread for the duration of a store call and one raised by
// our writes is consumed before unblocking (the technique libpq uses); the write then fails with
// EPIPE, which becomes Unavailable.
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigemptyset(&pending);
    sigpending(&pending);
    // One already pending is not ours to swallow; leave everything alone then.
    if (sigismember(&pending, SIGPIPE) == 1) return;
    active_ = pthread_sigmask(SIG_BLOCK, &pipe_, &old_) == 0;
  }
  ~SigpipeGuard() {
    if (!active_) return;
    sigset_t pending;
    sigemptyset(&pending);
    sigpending(&pending);
    if (sigismember(&pending, SIGPIPE) == 1) {
      timespec zero{};
      sigtimedwait(&pipe_, nullptr, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeGuard(const SigpipeGuard&) = delete;
  SigpipeGuard& operator=(const SigpipeGuard&) = delete;

 private:
  sigset_t pipe_;
  sigset_t old_;
  bool active_ = false;
};

}  // namespace

// One hiredis connection. A transport error (connection refused or closed, timeout, protocol
// error) leaves it broken(): the store then drops it and the next call reconnects.
class RedisBlobStore::Connection {
 public:
  static Result<std::unique_ptr<Connection>> Connect(const RedisBlobStoreOptions& options,
                                                     const std::string& server) {
    redisContext* ctx = redisConnectWithTimeout(options.host.c_str(), options.port,
                                                ToTimeval(options.connect_timeout));
    if (ctx == nullptr) return Unavailable("cannot reach redis at " + server + ": out of memory");
    auto conn = std::unique_ptr<Connection>(new Connection(ctx, server));
    if (ctx->err != 0) return Unavailable("cannot reach redis at " + server + ": " + ctx->errstr);
    if (redisSetTimeout(ctx, ToTimeval(options.command_timeout)) != REDIS_OK) {
      return Unavailable("cannot set timeouts on the connection to redis at " + server + ": " +
                         ctx->errstr);
    }
    if (options.db != 0) {
      std::string db = std::to_string(options.db);
      auto r = conn->Command({"SELECT", db});
      if (!r.ok()) return r.status();
    }
    return conn;
  }

  ~Connection() { redisFree(ctx_); }

  bool broken() const { return broken_ || ctx_->err != 0; }

  // The reply, error replies included. Unavailable on a transport error.
  Result<Reply> Raw(std::initializer_list<std::string_view> args) {
    return RawArgv(std::vector<std::string_view>(args));
  }

  Result<Reply> RawArgv(const std::vector<std::string_view>& args) {
    std::vector<const char*> argv;
    std::vector<size_t> lengths;
    argv.reserve(args.size());
    lengths.reserve(args.size());
    for (std::string_view a : args) {
      argv.push_back(a.data());
      lengths.push_back(a.size());
    }
    auto* reply = static_cast<redisReply*>(
        redisCommandArgv(ctx_, static_cast<int>(argv.size()), argv.data(), lengths.data()));
    if (reply == nullptr) {
      return Unavailable("lost connection to redis at " + server_ + ": " +
                         (ctx_->err != 0 ? ctx_->errstr : "no reply"));
    }
    return Reply(reply);
  }

  // Like Raw, but an error reply is Unavailable too.
  Result<Reply> Command(std::initializer_list<std::string_view> args) {
    return CommandArgv(std::vector<std::string_view>(args));
  }

  Result<Reply> CommandArgv(const std::vector<std::string_view>& args) {
    auto r = RawArgv(args);
    if (r.ok() && (*r)->type == REDIS_REPLY_ERROR) return ErrorReply(**r);
    return r;
  }

  Status ErrorReply(const redisReply& r) const { return ErrorReply(ReplyText(r)); }
  Status ErrorReply(std::string_view text) const {
    return Unavailable("redis at " + server_ + " failed: " + std::string(text));
  }

  // Bulk values bypass hiredis's buffers. hiredis copies a whole command into an output buffer
  // before writing it, and a reply through a growing input buffer into a reply object, so a
  // 64 MiB chunk would cost two extra allocations, their page faults and two copies. With one
  // command in flight at a time the socket holds only that command's reply, so reading it here
  // directly is safe, and hiredis's reader stays empty and in step.

  // SET name value, writing the value straight from `value`.
  Status SetBulk(std::string_view name, std::string_view value) {
    NBOS_CHECK(Idle(), "a connection out of step would read one reply as another's");
    std::string head = "*3\r\n$3\r\nSET\r\n$" + std::to_string(name.size()) + "\r\n" +
                       std::string(name) + "\r\n$" + std::to_string(value.size()) + "\r\n";
    char crlf[] = "\r\n";
    iovec iov[] = {
        {head.data(), head.size()}, {const_cast<char*>(value.data()), value.size()}, {crlf, 2}};
    if (Status s = WriteAll(iov, 3); !s.ok()) return s;
    void* raw = nullptr;
    if (redisGetReply(ctx_, &raw) != REDIS_OK || raw == nullptr) return LostByHiredis();
    Reply reply(static_cast<redisReply*>(raw));
    if (reply->type == REDIS_REPLY_ERROR) return ErrorReply(*reply);
    return Status::Ok();
  }

  // GET name, appending the value to `out` straight from the socket. Returns nullopt for a
  // missing key, else the value's length. A value longer than `max_len` is read and discarded,
  // leaving `out` as it was, so the caller can report it without losing the connection.
  Result<std::optional<size_t>> GetBulk(std::string_view name, std::string& out, size_t max_len) {
    NBOS_CHECK(Idle(), "a connection out of step would read one reply as another's");
    const char* argv[] = {"GET", name.data()};
    const size_t lengths[] = {3, name.size()};
    if (redisAppendCommandArgv(ctx_, 2, argv, lengths) != REDIS_OK) return LostByHiredis();
    for (int done = 0; !done;) {
      if (redisBufferWrite(ctx_, &done) != REDIS_OK) return LostByHiredis();
    }

    // The first line: "$<len>", "$-1" (nil) or "-<error>". Bytes read past it start the value.
    char head[1024];
    size_t have = 0;
    const char* eol = nullptr;
    while (eol == nullptr) {
      if (have == sizeof(head)) return Lost("malformed reply to GET");
      ssize_t n = ::read(ctx_->fd, head + have, sizeof(head) - have);
      if (n <= 0) {
        if (n < 0 && errno == EINTR) continue;
        return LostByRead(n);
      }
      have += static_cast<size_t>(n);
      eol = static_cast<const char*>(memmem(head, have, "\r\n", 2));
    }
    std::string_view line(head, static_cast<size_t>(eol - head));
    const size_t line_bytes = line.size() + 2;
    if (line.starts_with("-") && have == line_bytes) return ErrorReply(line.substr(1));
    if (line == "$-1" && have == line_bytes) return std::optional<size_t>();
    if (line.size() < 2 || line[0] != '$') return Lost("malformed reply to GET");
    size_t len = 0;
    auto [end, ec] = std::from_chars(line.data() + 1, line.data() + line.size(), len);
    if (ec != std::errc() || end != line.data() + line.size() || len > kMaxBulkBytes ||
        have > line_bytes + len + 2) {
      return Lost("malformed reply to GET");
    }

    // The value, then its CRLF. Whatever of them came with the first line is copied first.
    std::string_view early(head + line_bytes, have - line_bytes);
    const bool keep = len <= max_len;
    std::string scratch;
    char* dst = nullptr;
    if (keep) {
      if (out.empty()) ReserveResident(out, len);
      out.resize(out.size() + len);
      dst = out.data() + out.size() - len;
    } else {
      scratch.resize(std::min(len, size_t{1} << 20));
    }
    size_t done = std::min(early.size(), len);
    if (keep) std::memcpy(dst, early.data(), done);
    while (done < len) {
      char* to = keep ? dst + done : scratch.data();
      size_t want = keep ? len - done : std::min(len - done, scratch.size());
      ssize_t n = ::read(ctx_->fd, to, want);
      if (n <= 0) {
        if (n < 0 && errno == EINTR) continue;
        if (keep) out.resize(out.size() - len);
        return LostByRead(n);
      }
      done += static_cast<size_t>(n);
    }
    char tail[2];
    size_t tail_have = early.size() > len ? early.size() - len : 0;
    std::memcpy(tail, early.data() + std::min(early.size(), len), tail_have);
    while (tail_have < 2) {
      ssize_t n = ::read(ctx_->fd, tail + tail_have, 2 - tail_have);
      if (n <= 0) {
        if (n < 0 && errno == EINTR) continue;
        if (keep) out.resize(out.size() - len);
        return LostByRead(n);
      }
      tail_have += static_cast<size_t>(n);
    }
    if (tail[0] != '\r' || tail[1] != '\n') {
      if (keep) out.resize(out.size() - len);
      return Lost("malformed reply to GET");
    }
    return std::optional<size_t>(len);
  }

 private:
  Connection(redisContext* ctx, std::string server) : ctx_(ctx), server_(std::move(server)) {}

  // Nothing buffered on either side: no command queued, no reply bytes unread.
  bool Idle() const { return sdslen(ctx_->obuf) == 0 && ctx_->reader->pos == ctx_->reader->len; }

  Status WriteAll(iovec* iov, int count) {
    while (count > 0) {
      ssize_t n = ::writev(ctx_->fd, iov, count);
      if (n < 0) {
        if (errno == EINTR) continue;
        return Lost(errno == EAGAIN || errno == EWOULDBLOCK ? "timed out" : ErrnoText(errno));
      }
      auto left = static_cast<size_t>(n);
      while (count > 0 && left >= iov->iov_len) {  // vectors written in full
        left -= iov->iov_len;
        ++iov;
        --count;
      }
      if (count > 0) {  // and the one written in part
        iov->iov_base = static_cast<char*>(iov->iov_base) + left;
        iov->iov_len -= left;
      }
    }
    return Status::Ok();
  }

  static std::string ErrnoText(int err) {
    return std::error_code(err, std::generic_category()).message();
  }

  // The connection is out of step with the server (or gone): the store drops it.
  Status Lost(const std::string& why) {
    broken_ = true;
    return Unavailable("lost connection to redis at " + server_ + ": " + why);
  }
  Status LostByHiredis() { return Lost(ctx_->err != 0 ? ctx_->errstr : "no reply"); }
  Status LostByRead(ssize_t n) {
    if (n == 0) return Lost("server closed the connection");
    return Lost(errno == EAGAIN || errno == EWOULDBLOCK ? "timed out" : ErrnoText(errno));
  }

  redisContext* ctx_;
  const std::string server_;
  bool broken_ = false;
};

Result<std::unique_ptr<RedisBlobStore>> RedisBlobStore::Create(RedisBlobStoreOptions options) {
  if (options.chunk_bytes == 0 || options.chunk_bytes > kMaxChunkBytes) {
    return InvalidArgument("redis chunk size must be 1.." + std::to_string(kMaxChunkBytes) +
                           " bytes, not " + std::to_string(options.chunk_bytes));
  }
  if (options.port <= 0 || options.port > 65535) {
    return InvalidArgument("bad redis port " + std::to_string(options.port));
  }
  if (options.db < 0) return InvalidArgument("bad redis db " + std::to_string(options.db));
  if (options.host.empty()) return InvalidArgument("no redis host");
  return std::unique_ptr<RedisBlobStore>(new RedisBlobStore(std::move(options)));
}

Result<std::unique_ptr<RedisBlobStore>> RedisBlobStore::Open(RedisBlobStoreOptions options) {
  auto store = Create(std::move(options));
  if (!store.ok()) return store;
  if (Status s = (*store)->Ping(); !s.ok()) return s;
  return store;
}

RedisBlobStore::RedisBlobStore(RedisBlobStoreOptions options)
    : options_(std::move(options)),
      server_((options_.host.find(':') != std::string::npos ? "[" + options_.host + "]"
                                                            : options_.host) +
              ":" + std::to_string(options_.port)) {}

RedisBlobStore::~RedisBlobStore() = default;

std::string RedisBlobStore::Describe() const {
  return "redis://" + server_ + "/" + std::to_string(options_.db);
}

std::string RedisBlobStore::RedisKey(std::string_view key) {
  return std::string(kKeyPrefix) + std::string(key);
}

std::string RedisBlobStore::ChunkRedisKey(std::string_view key, size_t index) {
  return RedisKey(key) + ":" + std::to_string(index);
}

template <typename Op>
auto RedisBlobStore::WithConnection(Op op) -> decltype(op(std::declval<Connection&>())) {
  MutexLock lock(&mu_);
  SigpipeGuard no_sigpipe;
  for (int attempt = 0;; ++attempt) {
    bool reused = conn_ != nullptr;
    if (!reused) {
      auto fresh = Connection::Connect(options_, server_);
      if (!fresh.ok()) return fresh.status();
      conn_ = std::move(*fresh);
    }
    auto result = op(*conn_);
    if (!conn_->broken()) return result;
    conn_.reset();
    // A reused connection may have died while idle (server restart, idle timeout): that says
    // nothing about the server now, so try once more on a fresh one.
    if (!reused || attempt > 0) return result;
  }
}

Status RedisBlobStore::Ping() {
  return WithConnection([&](Connection& c) -> Status {
    auto r = c.Command({"PING"});
    return r.ok() ? Status::Ok() : r.status();
  });
}

Result<std::string> RedisBlobStore::Put(std::string_view data) {
  std::string key = BlobKey(data);
  Status s = WithConnection([&](Connection& c) { return PutLocked(c, key, data); });
  if (!s.ok()) return s;
  return key;
}

Status RedisBlobStore::PutWithKey(std::string_view key, std::string_view data) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  if (!BlobKeyMatches(key, data, BlobKey(data))) {
    return InvalidArgument("blob key " + std::string(key) + " does not match the content (" +
                           std::to_string(data.size()) + " bytes)");
  }
  return WithConnection([&](Connection& c) { return PutLocked(c, key, data); });
}

Status RedisBlobStore::PutLocked(Connection& c, std::string_view key, std::string_view data) {
  const std::string redis_key = RedisKey(key);
  auto exists = c.Command({"EXISTS", redis_key});
  if (!exists.ok()) return exists.status();
  if ((*exists)->integer == 1) return Status::Ok();

  const size_t chunk = options_.chunk_bytes;
  if (data.size() <= chunk) return c.SetBulk(redis_key, data);
  const size_t chunks = (data.size() + chunk - 1) / chunk;
  for (size_t i = 0; i < chunks; ++i) {
    if (Status s = c.SetBulk(ChunkRedisKey(key, i), data.substr(i * chunk, chunk)); !s.ok()) {
      return s;
    }
  }
  // Last, in one command: the blob becomes visible whole.
  std::string size = std::to_string(data.size());
  std::string count = std::to_string(chunks);
  std::string chunk_bytes = std::to_string(chunk);
  auto r = c.Raw({"HSET", redis_key, "size", size, "chunks", count, "chunk_bytes", chunk_bytes});
  if (!r.ok()) return r.status();
  if ((*r)->type == REDIS_REPLY_ERROR) {
    // A writer with a larger chunk size stored the same content inline meanwhile: it is there.
    if (ReplyText(**r).starts_with("WRONGTYPE")) return Status::Ok();
    return c.ErrorReply(**r);
  }
  return Status::Ok();
}

Result<std::string> RedisBlobStore::Get(std::string_view key) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  return WithConnection([&](Connection& c) { return GetLocked(c, key); });
}

Result<std::string> RedisBlobStore::GetLocked(Connection& c, std::string_view key) {
  const std::string redis_key = RedisKey(key);
  auto not_found = [&] { return NotFound("blob " + std::string(key) + " not in " + Describe()); };
  auto corrupt = [&](const std::string& why) {
    return Internal("corrupt blob " + std::string(key) + " in " + Describe() + ": " + why);
  };

  auto type = c.Command({"TYPE", redis_key});
  if (!type.ok()) return type.status();
  std::string_view type_name = ReplyText(**type);
  std::string data;
  if (type_name == "none") return not_found();
  if (type_name == "string") {
    auto len = c.GetBulk(redis_key, data, kMaxChunkBytes);
    if (!len.ok()) return len.status();
    if (!len->has_value()) return not_found();  // deleted since TYPE
    if (**len > kMaxChunkBytes) return corrupt("inline value over the 512 MiB limit");
    if (std::string actual = BlobKey(data); !BlobKeyMatches(key, data, actual)) {
      return corrupt(std::to_string(data.size()) + " bytes hash to " + actual);
    }
    return data;
  }
  if (type_name != "hash") return corrupt("unexpected redis type " + std::string(type_name));

  auto manifest = c.Command({"HMGET", redis_key, "size", "chunks", "chunk_bytes"});
  if (!manifest.ok()) return manifest.status();
  const redisReply& m = **manifest;
  size_t size = 0, chunks = 0, chunk_bytes = 0;
  if (m.type != REDIS_REPLY_ARRAY || m.elements != 3) return corrupt("bad manifest");
  if (m.element[0]->type == REDIS_REPLY_NIL && m.element[1]->type == REDIS_REPLY_NIL &&
      m.element[2]->type == REDIS_REPLY_NIL) {
    return not_found();  // deleted since TYPE
  }
  if (!ParseCount(m.element[0], size) || !ParseCount(m.element[1], chunks) ||
      !ParseCount(m.element[2], chunk_bytes) || chunk_bytes == 0 || chunk_bytes > kMaxChunkBytes ||
      chunks != (size + chunk_bytes - 1) / chunk_bytes) {
    return corrupt("bad manifest");
  }
  try {
    ReserveResident(data, size);     // one allocation; chunks are appended in place
  } catch (const std::exception&) {  // bad_alloc or length_error
    return ResourceExhausted("blob " + std::string(key) + " of " + std::to_string(size) +
                             " bytes does not fit in memory");
  }
  // Chunks are hashed on helper threads while later ones arrive.
  ConcurrentBlobHasher hasher(data.data(), ConcurrentBlobHasher::HelpersFor(size));
  for (size_t i = 0; i < chunks; ++i) {
    const size_t expected = std::min(chunk_bytes, size - i * chunk_bytes);
    auto len = c.GetBulk(ChunkRedisKey(key, i), data, expected);
    if (!len.ok()) return len.status();
    if (!len->has_value()) {
      auto exists = c.Command({"EXISTS", redis_key});
      if (!exists.ok()) return exists.status();
      if ((*exists)->integer == 0) return not_found();  // deleted while we read
      return corrupt("chunk " + std::to_string(i) + " of " + std::to_string(chunks) +
                     " is missing");
    }
    if (**len != expected) {
      return corrupt("chunk " + std::to_string(i) + " has " + std::to_string(**len) +
                     " bytes, expected " + std::to_string(expected));
    }
    hasher.Advance(data.size());
  }
  if (std::string actual = hasher.Finish(); !BlobKeyMatches(key, data, actual)) {
    return corrupt(std::to_string(data.size()) + " bytes hash to " + actual);
  }
  return data;
}

Result<bool> RedisBlobStore::Contains(std::string_view key) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  return WithConnection([&](Connection& c) -> Result<bool> {
    auto r = c.Command({"EXISTS", RedisKey(key)});
    if (!r.ok()) return r.status();
    return (*r)->integer == 1;
  });
}

// SCAN visits every key present for the whole scan at least once (duplicates are possible and
// dropped); chunk keys ("<blob key>:<i>") are not blobs, the manifest or the value is.
Result<std::vector<StoredBlob>> RedisBlobStore::List() {
  return WithConnection([&](Connection& c) -> Result<std::vector<StoredBlob>> {
    std::set<std::string> keys;
    const std::string pattern = std::string(kKeyPrefix) + "*";
    std::string cursor = "0";
    do {
      auto r = c.Command({"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"});
      if (!r.ok()) return r.status();
      const redisReply& reply = **r;
      if (reply.type != REDIS_REPLY_ARRAY || reply.elements != 2 ||
          reply.element[1]->type != REDIS_REPLY_ARRAY) {
        return c.ErrorReply("SCAN answered something else than [cursor, keys]");
      }
      cursor = std::string(ReplyText(*reply.element[0]));
      for (size_t i = 0; i < reply.element[1]->elements; ++i) {
        std::string_view name = ReplyText(*reply.element[1]->element[i]);
        name.remove_prefix(kKeyPrefix.size());
        if (IsValidBlobKey(name)) keys.emplace(name);
      }
    } while (cursor != "0");
    std::vector<StoredBlob> blobs;
    for (const std::string& key : keys) {
      auto size = SizeLocked(c, key);
      if (!size.ok()) return size.status();
      if (size->has_value()) blobs.push_back({key, **size});
    }
    return blobs;
  });
}

// The blob's size: its value's length, or its manifest's "size"; nullopt if it is gone.
Result<std::optional<uint64_t>> RedisBlobStore::SizeLocked(Connection& c, std::string_view key) {
  const std::string redis_key = RedisKey(key);
  auto length = c.Raw({"STRLEN", redis_key});
  if (!length.ok()) return length.status();
  if ((*length)->type == REDIS_REPLY_INTEGER) {
    if ((*length)->integer == 0) return std::optional<uint64_t>();  // gone (or empty)
    return std::optional<uint64_t>((*length)->integer);
  }
  auto manifest = c.Command({"HGET", redis_key, "size"});
  if (!manifest.ok()) return manifest.status();
  size_t size = 0;
  if (!ParseCount(manifest->get(), size)) return std::optional<uint64_t>();
  return std::optional<uint64_t>(size);
}

Status RedisBlobStore::Delete(std::string_view key) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  return WithConnection([&](Connection& c) { return DeleteLocked(c, key); });
}

Status RedisBlobStore::DeleteLocked(Connection& c, std::string_view key) {
  const std::string redis_key = RedisKey(key);
  auto type = c.Command({"TYPE", redis_key});
  if (!type.ok()) return type.status();
  size_t chunks = 0;
  if (ReplyText(**type) == "hash") {
    auto r = c.Command({"HGET", redis_key, "chunks"});
    if (!r.ok()) return r.status();
    if (!ParseCount(r->get(), chunks)) chunks = 0;  // a bad manifest: at least drop the manifest
  }
  // Manifest first, so readers stop seeing the blob before its chunks go.
  auto r = c.Command({"DEL", redis_key});
  if (!r.ok()) return r.status();
  for (size_t first = 0; first < chunks; first += kDeleteBatch) {
    std::vector<std::string> names;
    for (size_t i = first; i < std::min(chunks, first + kDeleteBatch); ++i) {
      names.push_back(ChunkRedisKey(key, i));
    }
    std::vector<std::string_view> args = {"DEL"};
    args.insert(args.end(), names.begin(), names.end());
    auto d = c.CommandArgv(args);
    if (!d.ok()) return d.status();
  }
  return Status::Ok();
}

}  // namespace nbos::store
