// Keys, URLs, and the behaviour every BlobStore backend must share (a typed suite run against the
// directory store, a real redis-server and a real S3-compatible server, npm's s3rver).
#include "store/blob_store.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <thread>
#include <vector>

#include "common/thread_annotations.h"
#include "store/dir_blob_store.h"
#include "store/redis_blob_store.h"
#include "store/s3_blob_store.h"
#include "store/testing.h"

namespace nbos::store {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr char kEmptyKey[] = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
constexpr char kAbcKey[] = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

// ---------------------------------------------------------------------------------------------
// Keys

TEST(BlobStoreKeyTest, IsLowercaseHexSha256) {
  EXPECT_EQ(BlobKey(""), kEmptyKey);
  EXPECT_EQ(BlobKey("abc"), kAbcKey);
  EXPECT_TRUE(IsValidBlobKey(BlobKey(RandomBytes(1000))));
}

TEST(BlobStoreKeyTest, HasherMatchesOneShot) {
  std::string data = RandomBytes(100'000, 7);
  BlobHasher hasher;
  hasher.Update(std::string_view(data).substr(0, 12'345));
  hasher.Update("");
  hasher.Update(std::string_view(data).substr(12'345));
  EXPECT_EQ(hasher.HexDigest(), BlobKey(data));
}

// Byte i is (131 i + 7) mod 256: the same data as the reference computation in the comment below.
std::string Pattern(size_t n) {
  std::string out(n, '\0');
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<char>((i * 131 + 7) & 0xff);
  return out;
}

// Keys from an independent implementation of the definition in blob_store.h (Python):
//   sha256(d) if len(d) <= 2**20 else sha512_256(b"nbos-blob-tree-1" + pack("<Q", len(d)) +
//   b"".join(sha256(d[i:i + 2**20]).digest() for i in range(0, len(d), 2**20)))
TEST(BlobStoreKeyTest, LargeBlobsAreKeyedByAHashTree) {
  EXPECT_EQ(BlobKey(Pattern(kBlobChunkBytes)),
            "b7f7ba5ce5463b3c84a283f779d7a652cbf99122de5923ba51627607ff1497d5");
  EXPECT_EQ(BlobKey(Pattern(kBlobChunkBytes)), Sha256Hex(Pattern(kBlobChunkBytes)));
  EXPECT_EQ(BlobKey(Pattern(2 * kBlobChunkBytes)),
            "2c6af60ef89f74b7dd23f25b015f9c828cd9b8a3a9073184606d8f2f3cb2304a");
  EXPECT_EQ(BlobKey(Pattern(3 * kBlobChunkBytes + 5)),
            "4b84efbf1b9e7fbb54babdeb8d861929dbf11327d3b84a642c4a65578ac8b95b");
}

TEST(BlobStoreKeyTest, AChangeInAnyChunkChangesTheKey) {
  std::string data = RandomBytes(5 * kBlobChunkBytes + 17, 3);
  const std::string key = BlobKey(data);
  for (size_t at : {size_t{0}, kBlobChunkBytes - 1, 3 * kBlobChunkBytes, data.size() - 1}) {
    std::string changed = data;
    changed[at] = static_cast<char>(changed[at] ^ 1);
    EXPECT_NE(BlobKey(changed), key) << at;
  }
  EXPECT_NE(BlobKey(std::string_view(data).substr(0, data.size() - 1)), key);
}

TEST(BlobStoreKeyTest, HasherMatchesOneShotAcrossChunks) {
  for (size_t size : {size_t{0}, kBlobChunkBytes, kBlobChunkBytes + 1, 3 * kBlobChunkBytes,
                      3 * kBlobChunkBytes + 12'345}) {
    std::string data = RandomBytes(size, 11);
    BlobHasher hasher;
    for (size_t at = 0; at < size; at += 700'001) {
      hasher.Update(std::string_view(data).substr(at, 700'001));
    }
    EXPECT_EQ(hasher.HexDigest(), BlobKey(data)) << size;
  }
}

TEST(BlobStoreKeyTest, ConcurrentHasherMatchesOneShot) {
  std::string data = RandomBytes(7 * kBlobChunkBytes + 999, 5);
  for (int helpers : {0, 1, 3}) {
    ConcurrentBlobHasher hasher(data.data(), helpers);
    for (size_t filled = 0; filled < data.size(); filled += 1'234'567) hasher.Advance(filled);
    hasher.Advance(data.size());
    EXPECT_EQ(hasher.Finish(), BlobKey(data)) << helpers;
  }
  ConcurrentBlobHasher prefix(data.data(), 2);  // Finish hashes what was advanced, no more
  prefix.Advance(2 * kBlobChunkBytes + 3);
  EXPECT_EQ(prefix.Finish(), BlobKey(std::string_view(data).substr(0, 2 * kBlobChunkBytes + 3)));
  ConcurrentBlobHasher empty(data.data(), 1);
  EXPECT_EQ(empty.Finish(), kEmptyKey);
  ConcurrentBlobHasher abandoned(data.data(), 2);  // destroyed without Finish: helpers stop
  abandoned.Advance(data.size());
}

std::vector<std::string> BadKeys() {
  std::string valid = kAbcKey;
  std::string upper = valid;
  for (char& c : upper) c = static_cast<char>(std::toupper(c));
  return {"",
          "abc",
          valid.substr(1),
          valid + "0",
          upper,
          "../../../../etc/passwd" + std::string(42, 'a'),
          valid.substr(0, 63) + "g",
          valid.substr(0, 62) + "\r\n",
          valid.substr(0, 63) + "*",
          valid.substr(0, 63) + " ",
          std::string(valid.substr(0, 63)) + std::string(1, '\0')};
}

TEST(BlobStoreKeyTest, ValidatesKeys) {
  EXPECT_TRUE(IsValidBlobKey(kAbcKey));
  EXPECT_TRUE(CheckBlobKey(kEmptyKey).ok());
  for (const auto& bad : BadKeys()) {
    EXPECT_FALSE(IsValidBlobKey(bad)) << bad;
    EXPECT_EQ(CheckBlobKey(bad).code(), StatusCode::kInvalidArgument) << bad;
  }
}

// ---------------------------------------------------------------------------------------------
// URLs

TEST(OpenBlobStoreTest, DirectoryUrlForms) {
  ScopedTempDir tmp;
  std::string path = (tmp.path() / "a" / "b").string();
  for (const std::string& url : {"dir://" + path, "dir:" + path, path, path + "/"}) {
    auto store = OpenBlobStore(url);
    ASSERT_TRUE(store.ok()) << url << ": " << store.status().ToString();
    EXPECT_EQ((*store)->Describe(), "dir:" + path) << url;
    EXPECT_TRUE(std::filesystem::is_directory(path));
  }
  auto synced = OpenBlobStore("dir://" + path + "?fsync=1");
  ASSERT_TRUE(synced.ok()) << synced.status().ToString();
  EXPECT_EQ((*synced)->Describe(), "dir:" + path + "?fsync=1");
  // What Describe prints opens the same store.
  auto again = OpenBlobStore((*synced)->Describe());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->Describe(), (*synced)->Describe());
  auto spared = OpenBlobStore("dir://" + path + "?spare_mb=64&fsync=1");
  ASSERT_TRUE(spared.ok()) << spared.status().ToString();
  EXPECT_EQ((*spared)->Describe(), "dir:" + path + "?fsync=1&spare_mb=64");
  EXPECT_EQ((*OpenBlobStore((*spared)->Describe()))->Describe(), (*spared)->Describe());
}

TEST(OpenBlobStoreTest, RejectsMalformedUrls) {
  for (const char* url : {"",
                          "relative/path",
                          "dir:relative",
                          "dir://relative/x",
                          "ftp://host/x",
                          "rediss://h:1",
                          "redis://",
                          "redis://:6379",
                          "redis://h:0",
                          "redis://h:70000",
                          "redis://h:abc",
                          "redis://h:",
                          "redis://h:1/x",
                          "redis://user:pw@h:1",
                          "redis://h:1?chunk_bytes=0",
                          "redis://h:1?chunk_bytes=x",
                          "redis://h:1?fsync=1",
                          "/tmp/x?bogus=1",
                          "/tmp/x?fsync=2",
                          "/tmp/x?spare_mb=",
                          "/tmp/x?spare_mb=-1",
                          "/tmp/x?spare_mb=1k",
                          "redis://h:1?spare_mb=1",
                          "s3:/bucket",
                          "s3://?endpoint=http://127.0.0.1:1",
                          "s3://b?endpoint=127.0.0.1:1",
                          "s3://b?parallel=0"}) {
    auto store = OpenBlobStore(url);
    ASSERT_FALSE(store.ok()) << url;
    EXPECT_EQ(store.status().code(), StatusCode::kInvalidArgument) << url;
    EXPECT_FALSE(store.status().message().empty());
  }
  EXPECT_THAT(OpenBlobStore("ftp://host/x").status().message(),
              HasSubstr("expected dir:///abs/path, /abs/path, redis://host[:port][/db] or s3://"));
  EXPECT_THAT(OpenBlobStore("/tmp/x?bogus=1").status().message(), HasSubstr("unknown option"));
}

TEST(OpenBlobStoreTest, RedisWithNothingListeningIsUnavailable) {
  int port = FreeLocalPort();
  auto store = OpenBlobStore("redis://127.0.0.1:" + std::to_string(port));
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(store.status().message(),
            "cannot reach redis at 127.0.0.1:" + std::to_string(port) + ": Connection refused");
}

TEST(OpenBlobStoreTest, RedisUrl) {
  RedisTestServer server;
  ASSERT_TRUE(server.Start().ok());
  auto store = OpenBlobStore(server.url());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ((*store)->Describe(), server.url() + "/0");
  auto db2 = OpenBlobStore(server.url() + "/2?chunk_bytes=1024");
  ASSERT_TRUE(db2.ok()) << db2.status().ToString();
  EXPECT_EQ((*db2)->Describe(), server.url() + "/2");
  auto key = (*db2)->Put(RandomBytes(3000));
  ASSERT_TRUE(key.ok()) << key.status().ToString();
  // Stored in db 2, chunked by the URL's chunk size.
  EXPECT_EQ(*RedisCall(server.port(), {"EXISTS", RedisBlobStore::RedisKey(*key)}, 2), "1");
  EXPECT_EQ(*RedisCall(server.port(), {"EXISTS", RedisBlobStore::RedisKey(*key)}, 0), "0");
  EXPECT_EQ(*RedisCall(server.port(), {"HGET", RedisBlobStore::RedisKey(*key), "chunks"}, 2), "3");
}

// ---------------------------------------------------------------------------------------------
// The contract, per backend

// Each backend: SetUp() prepares the backing store, Open() a BlobStore on it, Corrupt() damages
// a stored blob behind the store's back keeping its size.
// Damages a stored blob behind its store's back, keeping its size.
void FlipFirstByte(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  char c = 0;
  ASSERT_EQ(::pread(fd, &c, 1, 0), 1);
  c = static_cast<char>(c ^ 0x01);
  ASSERT_EQ(::pwrite(fd, &c, 1, 0), 1);
  ::close(fd);
}

struct DirBackend {
  static constexpr const char* kName = "Dir";
  static constexpr bool kServerPublishesAtomically = true;
  static constexpr size_t kLargeBytes = size_t{200} << 20;  // the size of real tensors

  Status SetUp() { return Status::Ok(); }
  Result<std::unique_ptr<BlobStore>> Open() {
    return OpenBlobStore("dir://" + tmp.path().string());
  }
  void Corrupt(const std::string& key) {
    auto store = DirBlobStore::Open(tmp.path());
    FlipFirstByte((*store)->PathFor(key).string());
  }

  ScopedTempDir tmp;
};

struct RedisBackend {
  static constexpr const char* kName = "Redis";
  static constexpr bool kServerPublishesAtomically = true;
  static constexpr size_t kChunkBytes = size_t{1} << 20;
  static constexpr size_t kLargeBytes = 5 * kChunkBytes + 123;  // 6 chunks, the last partial

  Status SetUp() { return server.Start(); }
  Result<std::unique_ptr<BlobStore>> Open() {
    return OpenBlobStore(server.url() + "?chunk_bytes=" + std::to_string(kChunkBytes));
  }
  void Corrupt(const std::string& key) {
    std::string redis_key = RedisBlobStore::RedisKey(key);
    auto type = RedisCall(server.port(), {"TYPE", redis_key});
    ASSERT_TRUE(type.ok());
    if (*type == "hash") redis_key = RedisBlobStore::ChunkRedisKey(key, 1);
    auto value = RedisCall(server.port(), {"GET", redis_key});
    ASSERT_TRUE(value.ok());
    ASSERT_FALSE(value->empty());
    (*value)[0] = static_cast<char>((*value)[0] ^ 0x01);
    ASSERT_EQ(*RedisCall(server.port(), {"SET", redis_key, *value}), "OK");
  }

  RedisTestServer server;
};

struct S3Backend {
  static constexpr const char* kName = "S3";
  static constexpr bool kServerPublishesAtomically = false;  // s3rver; S3 itself does
  static constexpr size_t kLargeBytes = 3 * S3BlobStore::kMinPartBytes + 123;  // multipart

  Status SetUp() { return server.Start(); }
  Result<std::unique_ptr<BlobStore>> Open() {
    S3TestServer::ExportCredentials();
    return OpenBlobStore("s3://" + std::string(S3TestServer::kBucket) +
                         "/blobs?endpoint=" + server.endpoint() +
                         "&part_bytes=" + std::to_string(S3BlobStore::kMinPartBytes));
  }
  void Corrupt(const std::string& key) {
    FlipFirstByte(server.bucket_directory() / "blobs" / (key + "._S3rver_object"));
  }

  S3TestServer server;
};

template <typename Backend>
class BlobStoreContractTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Status s = backend_.SetUp();
    ASSERT_TRUE(s.ok()) << s.ToString();
    auto store = backend_.Open();
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(*store);
  }

  // Put, then Get must return exactly `data`.
  void ExpectRoundTrip(const std::string& data) {
    auto key = store_->Put(data);
    ASSERT_TRUE(key.ok()) << key.status().ToString();
    EXPECT_EQ(*key, BlobKey(data));
    auto contains = store_->Contains(*key);
    ASSERT_TRUE(contains.ok()) << contains.status().ToString();
    EXPECT_TRUE(*contains);
    auto got = store_->Get(*key);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(got->size(), data.size());
    ASSERT_TRUE(*got == data);  // not EXPECT_EQ: a failure would print both blobs
  }

  Backend backend_;
  std::unique_ptr<BlobStore> store_;
};

struct BackendName {
  template <typename T>
  static std::string GetName(int) {
    return T::kName;
  }
};

using Backends = ::testing::Types<DirBackend, RedisBackend, S3Backend>;
TYPED_TEST_SUITE(BlobStoreContractTest, Backends, BackendName);

TYPED_TEST(BlobStoreContractTest, RoundTripEmpty) {
  this->ExpectRoundTrip("");
  EXPECT_EQ(*this->store_->Put(""), kEmptyKey);
}

TYPED_TEST(BlobStoreContractTest, RoundTripSmall) { this->ExpectRoundTrip("hello, blob"); }

TYPED_TEST(BlobStoreContractTest, RoundTripAllByteValues) {
  std::string data;
  for (int round = 0; round < 4; ++round) {
    for (int b = 0; b < 256; ++b) data += static_cast<char>(b);
  }
  this->ExpectRoundTrip(data);
}

TYPED_TEST(BlobStoreContractTest, RoundTripLarge) {
  this->ExpectRoundTrip(RandomBytes(TypeParam::kLargeBytes, 42));
}

TYPED_TEST(BlobStoreContractTest, PutIsIdempotent) {
  std::string data = RandomBytes(TypeParam::kLargeBytes / 3, 3);
  auto first = this->store_->Put(data);
  auto second = this->store_->Put(data);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(*first, *second);
  EXPECT_TRUE(this->store_->PutWithKey(*first, data).ok());
  auto got = this->store_->Get(*first);
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(*got == data);
  EXPECT_NE(*this->store_->Put(data + "x"), *first);
}

TYPED_TEST(BlobStoreContractTest, PutWithKey) {
  ASSERT_TRUE(this->store_->PutWithKey(kAbcKey, "abc").ok());
  EXPECT_EQ(*this->store_->Get(kAbcKey), "abc");

  std::string claimed = BlobKey("what the sender said");
  Status s = this->store_->PutWithKey(claimed, "what arrived");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("does not match"));
  EXPECT_FALSE(*this->store_->Contains(claimed));
  EXPECT_FALSE(*this->store_->Contains(BlobKey("what arrived")));
}

// Stores and journals from before the hash tree name large blobs by the SHA-256 of all their
// bytes (key version 0). Those keys still store, read and verify; a damaged one is still caught.
TYPED_TEST(BlobStoreContractTest, VersionZeroKeysOfLargeBlobsStillRead) {
  const std::string data = RandomBytes(TypeParam::kLargeBytes, 7);
  ASSERT_GT(data.size(), kBlobChunkBytes);
  const std::string old_key = Sha256Hex(data);
  ASSERT_NE(old_key, BlobKey(data));
  ASSERT_TRUE(this->store_->PutWithKey(old_key, data).ok());
  auto got = this->store_->Get(old_key);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(*got == data);
  auto buffer = this->store_->GetBuffer(old_key);
  ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
  EXPECT_TRUE(std::string_view((*buffer)->data(), (*buffer)->size()) == data);

  EXPECT_EQ(this->store_->PutWithKey(Sha256Hex("other bytes"), data).code(),
            StatusCode::kInvalidArgument);
  this->backend_.Corrupt(old_key);
  EXPECT_THAT(this->store_->Get(old_key).status().message(), HasSubstr("corrupt blob " + old_key));
  EXPECT_THAT(this->store_->GetBuffer(old_key).status().message(),
              HasSubstr("corrupt blob " + old_key));
}

// Garbage collection weighs what List names: every stored blob once, with its size, and none
// that was deleted.
TYPED_TEST(BlobStoreContractTest, ListNamesEveryBlobWithItsSize) {
  auto listed = [this] {
    auto blobs = this->store_->List();
    EXPECT_TRUE(blobs.ok()) << blobs.status().ToString();
    std::map<std::string, uint64_t> sizes;
    for (const StoredBlob& b : blobs.ok() ? *blobs : std::vector<StoredBlob>()) {
      EXPECT_TRUE(sizes.emplace(b.key, b.size_bytes).second) << "listed twice: " << b.key;
    }
    return sizes;
  };
  const auto before = listed();
  const std::string small = "a small blob", large = RandomBytes(TypeParam::kLargeBytes, 11);
  const std::string small_key = *this->store_->Put(small), large_key = *this->store_->Put(large);
  auto after = listed();
  EXPECT_EQ(after.size(), before.size() + 2);
  EXPECT_EQ(after[small_key], small.size());
  EXPECT_EQ(after[large_key], large.size());
  ASSERT_TRUE(this->store_->Delete(large_key).ok());
  after = listed();
  EXPECT_EQ(after.count(large_key), 0u);
  EXPECT_EQ(after.count(small_key), 1u);
}

TYPED_TEST(BlobStoreContractTest, UnknownKeyIsNotFound) {
  std::string key = BlobKey("never stored");
  auto got = this->store_->Get(key);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(got.status().message(), HasSubstr(key));
  EXPECT_FALSE(*this->store_->Contains(key));
  EXPECT_TRUE(this->store_->Delete(key).ok());
}

TYPED_TEST(BlobStoreContractTest, BadKeysAreInvalidArgument) {
  for (const auto& bad : BadKeys()) {
    EXPECT_EQ(this->store_->Get(bad).status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(this->store_->Contains(bad).status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(this->store_->Delete(bad).code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(this->store_->PutWithKey(bad, "x").code(), StatusCode::kInvalidArgument) << bad;
  }
}

TYPED_TEST(BlobStoreContractTest, CorruptBlobIsDetected) {
  for (const std::string& data : {std::string("small blob"), RandomBytes(TypeParam::kLargeBytes)}) {
    auto key = this->store_->Put(data);
    ASSERT_TRUE(key.ok()) << key.status().ToString();
    this->backend_.Corrupt(*key);
    auto got = this->store_->Get(*key);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), StatusCode::kInternal);
    EXPECT_THAT(got.status().message(), HasSubstr("corrupt blob " + *key));
    auto buffer = this->store_->GetBuffer(*key);
    ASSERT_FALSE(buffer.ok());
    EXPECT_EQ(buffer.status().code(), StatusCode::kInternal);
    EXPECT_THAT(buffer.status().message(), HasSubstr("corrupt blob " + *key));
  }
}

// Each GetBuffer is the caller's own: writing to it changes neither the store nor other buffers.
TYPED_TEST(BlobStoreContractTest, GetBufferIsAPrivateCopy) {
  for (const std::string& data : {std::string("small blob"), RandomBytes(TypeParam::kLargeBytes)}) {
    auto key = this->store_->Put(data);
    ASSERT_TRUE(key.ok()) << key.status().ToString();
    auto a = this->store_->GetBuffer(*key);
    auto b = this->store_->GetBuffer(*key);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << b.status().ToString();
    ASSERT_EQ((*a)->size(), data.size());
    ASSERT_TRUE(std::string_view((*a)->data(), (*a)->size()) == data);
    for (size_t i = 0; i < data.size(); i += 4096) (*a)->data()[i] ^= 1;
    EXPECT_TRUE(std::string_view((*b)->data(), (*b)->size()) == data);
    EXPECT_TRUE(*this->store_->Get(*key) == data);
  }
  EXPECT_EQ(this->store_->GetBuffer(BlobKey("never stored")).status().code(),
            StatusCode::kNotFound);
}

TYPED_TEST(BlobStoreContractTest, DeleteRemovesTheBlob) {
  for (const std::string& data : {std::string("small blob"), RandomBytes(TypeParam::kLargeBytes)}) {
    auto key = this->store_->Put(data);
    ASSERT_TRUE(key.ok());
    ASSERT_TRUE(this->store_->Delete(*key).ok());
    EXPECT_FALSE(*this->store_->Contains(*key));
    EXPECT_EQ(this->store_->Get(*key).status().code(), StatusCode::kNotFound);
    EXPECT_TRUE(this->store_->Delete(*key).ok());  // again: still fine
    this->ExpectRoundTrip(data);                   // and it can come back
  }
}

TYPED_TEST(BlobStoreContractTest, ConcurrentPutsOfTheSameBlob) {
  const std::string data = RandomBytes(3 * (size_t{1} << 20) + 7, 9);
  const std::string key = BlobKey(data);
  constexpr int kThreads = 8;
  std::atomic<int> failures{0};
  Mutex mu;  // guards first_failure
  std::string first_failure;
  auto failed = [&](const Status& s) {
    ++failures;
    MutexLock lock(&mu);
    if (first_failure.empty()) first_failure = s.ToString();
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 3; ++i) {
        if (t % 2 == 0) {
          auto k = this->store_->Put(data);
          if (!k.ok() || *k != key) failed(k.status());
        } else if (Status s = this->store_->PutWithKey(key, data); !s.ok()) {
          failed(s);
        }
        auto got = this->store_->Get(key);
        // s3rver rewrites an object in place for each upload: a read can catch it torn and must
        // then fail (corrupt, or s3rver's own HTTP 500 mid-rewrite), never return other bytes.
        const bool torn = !TypeParam::kServerPublishesAtomically && !got.ok() &&
                          (got.status().code() == StatusCode::kInternal ||
                           got.status().message().find("HTTP 500") != std::string::npos);
        if (got.ok() ? *got != data : !torn) failed(got.status());
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0) << first_failure;
  EXPECT_TRUE(*this->store_->Get(key) == data);
}

TYPED_TEST(BlobStoreContractTest, ConcurrentPutsOfDifferentBlobs) {
  constexpr int kThreads = 6;
  std::vector<std::string> blobs;
  for (int t = 0; t < kThreads; ++t) blobs.push_back(RandomBytes(1'500'000 + t, 100 + t));
  std::vector<std::thread> threads;
  std::vector<Status> results(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] { results[t] = this->store_->Put(blobs[t]).status(); });
  }
  for (auto& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_TRUE(results[t].ok()) << results[t].ToString();
    EXPECT_TRUE(*this->store_->Get(BlobKey(blobs[t])) == blobs[t]);
  }
}

// A reader polling while a blob is written sees either nothing or all of it. The reader has its
// own store (its own Redis connection), as another replica would.
TYPED_TEST(BlobStoreContractTest, ReaderNeverSeesAPartialBlob) {
  const std::string data = RandomBytes(TypeParam::kLargeBytes / 2, 11);
  const std::string key = BlobKey(data);
  auto reader_store = this->backend_.Open();
  ASSERT_TRUE(reader_store.ok());
  std::atomic<bool> done{false};
  std::atomic<int> partial{0}, polls{0};
  std::thread reader([&] {
    while (!done) {
      ++polls;
      auto got = (*reader_store)->Get(key);
      // s3rver, unlike S3, writes an object in place, so a reader can catch it half written:
      // the store must then report it corrupt, never return it.
      const bool torn = !TypeParam::kServerPublishesAtomically && !got.ok() &&
                        got.status().code() == StatusCode::kInternal;
      if (got.ok() ? *got != data : got.status().code() != StatusCode::kNotFound && !torn)
        ++partial;
    }
  });
  auto put = this->store_->Put(data);
  done = true;
  reader.join();
  ASSERT_TRUE(put.ok());
  EXPECT_EQ(partial.load(), 0);
  EXPECT_GT(polls.load(), 0);
  EXPECT_TRUE(*(*reader_store)->Get(key) == data);
}

TYPED_TEST(BlobStoreContractTest, DescribeNamesTheStore) {
  EXPECT_THAT(this->store_->Describe(),
              ::testing::AnyOf(StartsWith("dir:/"), StartsWith("redis://127.0.0.1:"),
                               StartsWith("s3://nbos/blobs/?endpoint=http://127.0.0.1:")));
}

}  // namespace
}  // namespace nbos::store
