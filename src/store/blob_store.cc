#include "store/blob_store.h"

#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdlib>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/hex.h"
#include "common/thread_annotations.h"
#include "store/dir_blob_store.h"
#include "store/redis_blob_store.h"
#include "store/s3_blob_store.h"

namespace nbos::store {

namespace {

// Fetched once: EVP_sha256() would make OpenSSL 3 look the implementation up on every digest.
const EVP_MD* Sha256() {
  static const EVP_MD* md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  NBOS_CHECK(md != nullptr, "OpenSSL has no SHA256");
  return md;
}

const EVP_MD* Sha512_256() {
  static const EVP_MD* md = EVP_MD_fetch(nullptr, "SHA512-256", nullptr);
  NBOS_CHECK(md != nullptr, "OpenSSL has no SHA512-256");
  return md;
}

using Digest = std::array<unsigned char, 32>;

Digest ChunkDigest(std::string_view chunk) {
  Digest d;
  unsigned int len = 0;
  const int ok = EVP_Digest(chunk.data(), chunk.size(), d.data(), &len, Sha256(), nullptr);
  // A wrong key would file the blob under another content's name.
  NBOS_CHECK(ok == 1 && len == d.size(), "SHA-256 digest failed");
  return d;
}

// The key of `size` bytes whose chunks hash to `digests` (see blob_store.h).
std::string KeyFromDigests(uint64_t size, const std::vector<Digest>& digests) {
  if (size <= kBlobChunkBytes) {
    const Digest d = digests.empty() ? ChunkDigest("") : digests[0];
    return HexEncode(d.data(), d.size());
  }
  NBOS_CHECK(digests.size() == (size + kBlobChunkBytes - 1) / kBlobChunkBytes,
             "one digest per chunk");
  static constexpr char kTreeTag[] = "nbos-blob-tree-1";
  std::string root(kTreeTag, sizeof(kTreeTag) - 1);
  for (int i = 0; i < 8; ++i) root += static_cast<char>((size >> (8 * i)) & 0xff);
  for (const Digest& d : digests) root.append(reinterpret_cast<const char*>(d.data()), d.size());
  Digest out;
  unsigned int len = 0;
  const int ok = EVP_Digest(root.data(), root.size(), out.data(), &len, Sha512_256(), nullptr);
  NBOS_CHECK(ok == 1 && len == out.size(), "SHA-512/256 digest failed");
  return HexEncode(out.data(), out.size());
}

// Shortened and escaped so a hostile key cannot flood or garble a log line.
std::string Printable(std::string_view s) {
  constexpr size_t kMax = 80;
  std::string out;
  for (char c : s.substr(0, kMax)) {
    if (c >= 0x20 && c < 0x7f) {
      out += c;
    } else {
      out += '?';
    }
  }
  if (s.size() > kMax) out += "...";
  return out;
}

bool ParseSize(std::string_view text, size_t& out) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && end == text.data() + text.size() && !text.empty();
}

// "a=1&b=2" into pairs. InvalidArgument for an option not in `allowed`.
Result<std::vector<std::pair<std::string, std::string>>> ParseOptions(
    std::string_view query, std::string_view url, const std::vector<std::string_view>& allowed) {
  std::vector<std::pair<std::string, std::string>> out;
  while (!query.empty()) {
    size_t amp = query.find('&');
    std::string_view item = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    size_t eq = item.find('=');
    std::string_view name = item.substr(0, eq);
    std::string_view value = eq == std::string_view::npos ? "" : item.substr(eq + 1);
    bool known = false;
    for (std::string_view a : allowed) known = known || a == name;
    if (!known) {
      std::string list;
      for (std::string_view a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
      return InvalidArgument("unknown option '" + Printable(name) + "' in blob store URL '" +
                             Printable(url) + "' (known: " + list + ")");
    }
    out.emplace_back(name, value);
  }
  return out;
}

Result<std::unique_ptr<BlobStore>> OpenDir(std::string_view path, std::string_view query,
                                           std::string_view url) {
  if (path.empty() || path[0] != '/') {
    return InvalidArgument("blob store directory must be an absolute path: '" + Printable(url) +
                           "'");
  }
  auto options = ParseOptions(query, url, {"fsync", "spare_mb"});
  if (!options.ok()) return options.status();
  DirBlobStoreOptions dir_options;
  for (const auto& [name, value] : *options) {
    if (name == "spare_mb") {
      size_t mb = 0;
      if (!ParseSize(value, mb) || mb > (size_t{1} << 20)) {
        return InvalidArgument("spare_mb must be a number of MiB in blob store URL '" +
                               Printable(url) + "'");
      }
      dir_options.spare_bytes = mb << 20;
    } else if (value == "1" || value == "true") {
      dir_options.fsync = true;
    } else if (value == "0" || value == "false") {
      dir_options.fsync = false;
    } else {
      return InvalidArgument("fsync must be 0 or 1 in blob store URL '" + Printable(url) + "'");
    }
  }
  auto store = DirBlobStore::Open(std::filesystem::path(path), dir_options);
  if (!store.ok()) return store.status();
  return std::unique_ptr<BlobStore>(std::move(*store));
}

// `rest` is what follows "redis://": host[:port][/db].
Result<std::unique_ptr<BlobStore>> OpenRedis(std::string_view rest, std::string_view query,
                                             std::string_view url) {
  auto bad = [&](std::string why) {
    return InvalidArgument("bad redis URL '" + Printable(url) + "': " + why +
                           " (expected redis://host[:port][/db])");
  };
  if (rest.find('@') != std::string_view::npos) return bad("credentials are not supported");
  RedisBlobStoreOptions options;
  std::string_view authority = rest.substr(0, rest.find('/'));
  if (authority.size() < rest.size()) {
    std::string_view db = rest.substr(authority.size() + 1);
    size_t n = 0;
    if (!db.empty() && (!ParseSize(db, n) || n > 1'000'000)) return bad("db must be a number");
    options.db = static_cast<int>(n);
  }
  std::string_view host = authority;
  std::string_view port;
  if (!authority.empty() && authority[0] == '[') {  // [IPv6]:port
    size_t close = authority.find(']');
    if (close == std::string_view::npos) return bad("unterminated '['");
    host = authority.substr(1, close - 1);
    std::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after[0] != ':') return bad("expected ':' after ']'");
      port = after.substr(1);
    }
  } else if (size_t colon = authority.rfind(':'); colon != std::string_view::npos) {
    host = authority.substr(0, colon);
    port = authority.substr(colon + 1);
  }
  if (host.empty()) return bad("no host");
  options.host = std::string(host);
  if (!port.empty() || authority.ends_with(':')) {
    size_t n = 0;
    if (!ParseSize(port, n) || n == 0 || n > 65535) return bad("port must be 1-65535");
    options.port = static_cast<int>(n);
  }
  auto parsed = ParseOptions(query, url, {"chunk_bytes"});
  if (!parsed.ok()) return parsed.status();
  for (const auto& [name, value] : *parsed) {
    if (!ParseSize(value, options.chunk_bytes)) return bad("chunk_bytes must be a number");
  }
  auto store = RedisBlobStore::Open(std::move(options));
  if (!store.ok()) return store.status();
  return std::unique_ptr<BlobStore>(std::move(*store));
}

std::string EnvOr(const char* name, std::string fallback = "") {
  const char* value = std::getenv(name);
  return value != nullptr ? std::string(value) : fallback;
}

// `rest` is what follows "s3://": bucket[/prefix]. Credentials come from the environment, as for
// every S3 tool, so that they stay out of command lines and logs.
Result<std::unique_ptr<BlobStore>> OpenS3(std::string_view rest, std::string_view query,
                                          std::string_view url) {
  S3BlobStoreOptions options;
  const size_t slash = rest.find('/');
  options.bucket = std::string(rest.substr(0, slash));
  if (slash != std::string_view::npos) options.prefix = std::string(rest.substr(slash + 1));
  if (!options.prefix.empty() && !options.prefix.ends_with('/')) options.prefix += '/';
  options.region = EnvOr("AWS_REGION", EnvOr("AWS_DEFAULT_REGION", "us-east-1"));
  options.access_key_id = EnvOr("AWS_ACCESS_KEY_ID");
  options.secret_access_key = EnvOr("AWS_SECRET_ACCESS_KEY");
  options.session_token = EnvOr("AWS_SESSION_TOKEN");
  auto parsed = ParseOptions(query, url, {"endpoint", "region", "part_bytes", "parallel"});
  if (!parsed.ok()) return parsed.status();
  for (const auto& [name, value] : *parsed) {
    size_t n = 0;
    if (name == "endpoint") options.endpoint = value;
    if (name == "region") options.region = value;
    if ((name == "part_bytes" || name == "parallel") && !ParseSize(value, n))
      return InvalidArgument(name + " must be a number in blob store URL '" + Printable(url) + "'");
    if (name == "part_bytes") options.part_bytes = n;
    if (name == "parallel") options.parallel = static_cast<int>(std::min<size_t>(n, 1000));
  }
  if (options.endpoint.empty())
    options.endpoint = "https://s3." + options.region + ".amazonaws.com";
  auto store = S3BlobStore::Open(std::move(options));
  if (!store.ok()) return store.status();
  return std::unique_ptr<BlobStore>(std::move(*store));
}

}  // namespace

std::string Sha256Hex(std::string_view data) {
  const Digest d = ChunkDigest(data);
  return HexEncode(d.data(), d.size());
}

std::string BlobKey(std::string_view data) {
  if (data.size() <= kBlobChunkBytes) return Sha256Hex(data);
  ConcurrentBlobHasher hasher(data.data(), ConcurrentBlobHasher::HelpersFor(data.size()));
  hasher.Advance(data.size());
  return hasher.Finish();
}

bool BlobKeyMatches(std::string_view key, std::string_view data, std::string_view computed_key) {
  if (computed_key == key) return true;
  return data.size() > kBlobChunkBytes && Sha256Hex(data) == key;
}

bool IsValidBlobKey(std::string_view key) {
  if (key.size() != kBlobKeyLength) return false;
  for (char c : key) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

Status CheckBlobKey(std::string_view key) {
  if (IsValidBlobKey(key)) return Status::Ok();
  return InvalidArgument("invalid blob key '" + Printable(key) +
                         "': expected 64 lowercase hex characters");
}

// The chunk being filled is hashed as it grows; each full chunk's digest is kept for the root.
struct BlobHasher::Ctx {
  EVP_MD_CTX* md = EVP_MD_CTX_new();
  size_t in_chunk = 0;  // bytes of the current chunk hashed so far
  std::vector<Digest> digests;
  uint64_t size = 0;
  ~Ctx() { EVP_MD_CTX_free(md); }
  void Start() {
    NBOS_CHECK(md != nullptr && EVP_DigestInit_ex(md, Sha256(), nullptr) == 1,
               "cannot start a SHA-256 digest");
    in_chunk = 0;
  }
  void EndChunk() {
    Digest& d = digests.emplace_back();
    unsigned int len = 0;
    NBOS_CHECK(EVP_DigestFinal_ex(md, d.data(), &len) == 1 && len == d.size(),
               "SHA-256 digest failed");
  }
};

BlobHasher::BlobHasher() : ctx_(std::make_unique<Ctx>()) { ctx_->Start(); }

BlobHasher::~BlobHasher() = default;

void BlobHasher::Update(std::string_view data) {
  ctx_->size += data.size();
  while (!data.empty()) {
    if (ctx_->in_chunk == kBlobChunkBytes) {
      ctx_->EndChunk();
      ctx_->Start();
    }
    const size_t n = std::min(data.size(), kBlobChunkBytes - ctx_->in_chunk);
    EVP_DigestUpdate(ctx_->md, data.data(), n);
    ctx_->in_chunk += n;
    data.remove_prefix(n);
  }
}

std::string BlobHasher::HexDigest() {
  ctx_->EndChunk();
  return KeyFromDigests(ctx_->size, ctx_->digests);
}

// Helpers claim chunks in order under the lock and hash them outside it. A chunk is claimed once
// it is full, or once Finish was called (the last, short one).
struct ConcurrentBlobHasher::State {
  explicit State(const char* b) : base(b) {}
  const char* const base;
  Mutex mu;
  CondVar cv;
  size_t filled GUARDED_BY(mu) = 0;
  size_t claimed GUARDED_BY(mu) = 0;  // bytes handed to a hashing thread
  bool finished GUARDED_BY(mu) = false;
  bool abandoned GUARDED_BY(mu) = false;
  // An element is written by its claimer alone, outside the lock.
  std::deque<Digest> digests GUARDED_BY(mu);
  std::vector<std::thread> helpers;

  bool Ready() const REQUIRES(mu) {
    return filled - claimed >= kBlobChunkBytes || (finished && filled > claimed);
  }
  void Work() EXCLUDES(mu) {
    MutexLock lock(&mu);
    for (;;) {
      while (!abandoned && !Ready() && !finished) cv.Wait(&mu);
      if (abandoned || !Ready()) return;
      const size_t begin = claimed;
      const size_t len = std::min(kBlobChunkBytes, filled - begin);
      claimed += len;
      Digest& slot = digests.emplace_back();  // deque: earlier slots stay where they are
      lock.Unlock();
      slot = ChunkDigest(std::string_view(base + begin, len));
      lock.Lock();
    }
  }
};

ConcurrentBlobHasher::ConcurrentBlobHasher(const char* base, int helpers)
    : state_(std::make_unique<State>(base)) {
  for (int i = 0; i < helpers; ++i) state_->helpers.emplace_back([s = state_.get()] { s->Work(); });
}

ConcurrentBlobHasher::~ConcurrentBlobHasher() {
  {
    MutexLock lock(&state_->mu);
    state_->abandoned = !state_->finished;
  }
  state_->cv.SignalAll();
  for (std::thread& t : state_->helpers) {
    if (t.joinable()) t.join();
  }
}

void ConcurrentBlobHasher::Advance(size_t filled_bytes) {
  {
    MutexLock lock(&state_->mu);
    NBOS_CHECK(filled_bytes >= state_->filled && !state_->finished, "Advance only moves forward");
    state_->filled = filled_bytes;
  }
  state_->cv.SignalAll();
}

std::string ConcurrentBlobHasher::Finish() {
  {
    MutexLock lock(&state_->mu);
    NBOS_CHECK(!state_->finished, "Finish is called once");
    state_->finished = true;
  }
  state_->cv.SignalAll();
  state_->Work();  // the owner hashes too
  for (std::thread& t : state_->helpers) t.join();
  state_->helpers.clear();
  MutexLock lock(&state_->mu);  // uncontended: every hashing thread is done
  std::vector<Digest> digests(state_->digests.begin(), state_->digests.end());
  return KeyFromDigests(state_->filled, digests);
}

int ConcurrentBlobHasher::HelpersFor(size_t size_bytes) {
  if (size_bytes <= 2 * kBlobChunkBytes) return 0;
  const int hardware = static_cast<int>(std::thread::hardware_concurrency());
  const size_t chunks = (size_bytes + kBlobChunkBytes - 1) / kBlobChunkBytes;
  return static_cast<int>(
      std::min<size_t>({chunks - 1, static_cast<size_t>(std::max(hardware - 1, 1)), 3}));
}

Result<std::unique_ptr<BlobBuffer>> BlobStore::GetBuffer(std::string_view key) {
  Result<std::string> bytes = Get(key);
  if (!bytes.ok()) return bytes.status();
  return std::unique_ptr<BlobBuffer>(std::make_unique<StringBlobBuffer>(std::move(*bytes)));
}

Result<std::vector<StoredBlob>> BlobStore::List() {
  return InvalidArgument(Describe() + " cannot list its blobs");
}

Result<std::unique_ptr<BlobStore>> OpenBlobStore(std::string_view url) {
  std::string_view base = url.substr(0, url.find('?'));
  std::string_view query = base.size() < url.size() ? url.substr(base.size() + 1) : "";
  if (base.starts_with("redis://")) return OpenRedis(base.substr(8), query, url);
  if (base.starts_with("s3://")) return OpenS3(base.substr(5), query, url);
  if (base.starts_with("dir:")) {
    std::string_view path = base.substr(4);
    // dir:///abs is the URL form ("dir://" + "/abs"); dir:/abs is what Describe prints.
    if (path.starts_with("//")) path.remove_prefix(2);
    return OpenDir(path, query, url);
  }
  if (base.starts_with("/")) return OpenDir(base, query, url);
  return InvalidArgument("unsupported blob store URL '" + Printable(url) +
                         "': expected dir:///abs/path, /abs/path, redis://host[:port][/db] or "
                         "s3://bucket[/prefix]?endpoint=URL");
}

}  // namespace nbos::store
