// Redis-specific behaviour against a real redis-server: layout, chunking, and a server that is
// missing, dies, restarts or refuses. The shared contract is in blob_store_test.cc.
#include "store/redis_blob_store.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "store/testing.h"

namespace nbos::store {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr size_t kChunk = size_t{1} << 20;

class RedisBlobStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Status s = server_.Start();
    ASSERT_TRUE(s.ok()) << s.ToString();
    store_ = Open(kChunk);
  }

  std::unique_ptr<RedisBlobStore> Open(size_t chunk_bytes) {
    auto store = RedisBlobStore::Open({.port = server_.port(), .chunk_bytes = chunk_bytes});
    EXPECT_TRUE(store.ok()) << store.status().ToString();
    return store.ok() ? std::move(*store) : nullptr;
  }

  std::string Call(const std::vector<std::string>& args) {
    auto r = RedisCall(server_.port(), args);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : "";
  }

  std::string ServerName() const { return "127.0.0.1:" + std::to_string(server_.port()); }

  RedisTestServer server_;
  std::unique_ptr<RedisBlobStore> store_;
};

TEST_F(RedisBlobStoreTest, ChunkedLayout) {
  std::string data = RandomBytes(5 * kChunk + 123);
  auto key = store_->Put(data);
  ASSERT_TRUE(key.ok()) << key.status().ToString();
  const std::string manifest = RedisBlobStore::RedisKey(*key);
  EXPECT_EQ(manifest, "nbos:blob:" + *key);
  EXPECT_EQ(Call({"TYPE", manifest}), "hash");
  EXPECT_EQ(Call({"HGET", manifest, "size"}), std::to_string(data.size()));
  EXPECT_EQ(Call({"HGET", manifest, "chunks"}), "6");
  EXPECT_EQ(Call({"HGET", manifest, "chunk_bytes"}), std::to_string(kChunk));
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(Call({"STRLEN", RedisBlobStore::ChunkRedisKey(*key, i)}), std::to_string(kChunk));
  }
  EXPECT_EQ(Call({"STRLEN", RedisBlobStore::ChunkRedisKey(*key, 5)}), "123");
  EXPECT_EQ(Call({"DBSIZE"}), "7");
}

TEST_F(RedisBlobStoreTest, BlobsUpToTheChunkSizeAreInline) {
  std::string at_limit = RandomBytes(kChunk, 1);
  std::string over = RandomBytes(kChunk + 1, 2);
  auto k1 = store_->Put(at_limit);
  auto k2 = store_->Put(over);
  ASSERT_TRUE(k1.ok() && k2.ok());
  EXPECT_EQ(Call({"TYPE", RedisBlobStore::RedisKey(*k1)}), "string");
  EXPECT_EQ(Call({"TYPE", RedisBlobStore::RedisKey(*k2)}), "hash");
  EXPECT_TRUE(*store_->Get(*k1) == at_limit);
  EXPECT_TRUE(*store_->Get(*k2) == over);
}

TEST_F(RedisBlobStoreTest, ReadersTakeTheChunkSizeFromTheManifest) {
  std::string data = RandomBytes(3 * kChunk + 5);
  auto key = store_->Put(data);
  ASSERT_TRUE(key.ok());
  auto other = Open(RedisBlobStoreOptions{}.chunk_bytes);  // the 64 MiB default
  ASSERT_NE(other, nullptr);
  EXPECT_TRUE(*other->Get(*key) == data);
  // And a store with a larger chunk writing the same content meanwhile is harmless.
  auto inline_writer = Open(4 * kChunk);
  ASSERT_TRUE(inline_writer->Put(data).ok());
}

TEST_F(RedisBlobStoreTest, ChunksWithoutManifestAreInvisible) {
  // What a writer that died before its manifest leaves behind.
  std::string data = RandomBytes(2 * kChunk + 1);
  const std::string key = BlobKey(data);
  Call({"SET", RedisBlobStore::ChunkRedisKey(key, 0), data.substr(0, kChunk)});
  Call({"SET", RedisBlobStore::ChunkRedisKey(key, 1), data.substr(kChunk, kChunk)});
  EXPECT_FALSE(*store_->Contains(key));
  EXPECT_EQ(store_->Get(key).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(store_->Put(data).ok());  // a retry completes it
  EXPECT_TRUE(*store_->Get(key) == data);
}

TEST_F(RedisBlobStoreTest, MissingOrResizedChunkIsCorrupt) {
  std::string data = RandomBytes(3 * kChunk);
  auto key = store_->Put(data);
  ASSERT_TRUE(key.ok());
  Call({"SET", RedisBlobStore::ChunkRedisKey(*key, 2), "short"});
  auto got = store_->Get(*key);
  EXPECT_EQ(got.status().code(), StatusCode::kInternal);
  EXPECT_THAT(got.status().message(), HasSubstr("corrupt blob " + *key));
  Call({"DEL", RedisBlobStore::ChunkRedisKey(*key, 1)});
  got = store_->Get(*key);
  EXPECT_EQ(got.status().code(), StatusCode::kInternal);
  EXPECT_THAT(got.status().message(), HasSubstr("chunk 1 of 3 is missing"));
  Call({"HSET", RedisBlobStore::RedisKey(*key), "chunks", "7"});
  EXPECT_THAT(store_->Get(*key).status().message(), HasSubstr("bad manifest"));
}

TEST_F(RedisBlobStoreTest, DeleteRemovesManifestAndChunks) {
  auto key = store_->Put(RandomBytes(700 * kChunk / 100));
  ASSERT_TRUE(key.ok());
  ASSERT_NE(Call({"DBSIZE"}), "0");
  ASSERT_TRUE(store_->Delete(*key).ok());
  EXPECT_EQ(Call({"DBSIZE"}), "0");
}

TEST_F(RedisBlobStoreTest, PutOfAnExistingBlobWritesNothing) {
  std::string data = RandomBytes(2 * kChunk + 3);
  ASSERT_TRUE(store_->Put(data).ok());
  Call({"CONFIG", "RESETSTAT"});
  ASSERT_TRUE(store_->Put(data).ok());
  ASSERT_TRUE(store_->PutWithKey(BlobKey(data), data).ok());
  std::string stats = Call({"INFO", "commandstats"});
  EXPECT_THAT(stats, HasSubstr("cmdstat_exists:calls=2"));
  EXPECT_THAT(stats, Not(HasSubstr("cmdstat_set:")));
  EXPECT_THAT(stats, Not(HasSubstr("cmdstat_hset:")));
}

TEST_F(RedisBlobStoreTest, RedisErrorIsUnavailable) {
  Call({"CONFIG", "SET", "maxmemory", "1mb"});
  Call({"CONFIG", "SET", "maxmemory-policy", "noeviction"});
  auto key = store_->Put(RandomBytes(3 * kChunk));
  ASSERT_FALSE(key.ok());
  EXPECT_EQ(key.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(key.status().message(), HasSubstr("redis at " + ServerName() + " failed: OOM"));
  Call({"CONFIG", "SET", "maxmemory", "0"});
  EXPECT_TRUE(store_->Put("fits again").ok());  // the connection survived the error reply
}

// The "missing data store" cases: nothing listening, a server that dies, one that comes back.
TEST(RedisBlobStoreUnavailableTest, NothingListening) {
  const int port = FreeLocalPort();
  const std::string expected =
      "cannot reach redis at 127.0.0.1:" + std::to_string(port) + ": Connection refused";
  auto opened = RedisBlobStore::Open({.port = port});
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(opened.status().message(), expected);

  // A lazily created store reports the same on every call, and keeps trying.
  auto store = RedisBlobStore::Create({.port = port});
  ASSERT_TRUE(store.ok());
  const std::string key = BlobKey("x");
  for (int i = 0; i < 2; ++i) {
    auto put = (*store)->Put("x");
    EXPECT_EQ(put.status().code(), StatusCode::kUnavailable);
    EXPECT_EQ(put.status().message(), expected);
    EXPECT_EQ((*store)->Get(key).status().message(), expected);
    EXPECT_EQ((*store)->Contains(key).status().message(), expected);
    EXPECT_EQ((*store)->Delete(key).message(), expected);
    EXPECT_EQ((*store)->PutWithKey(key, "x").message(), expected);
  }
}

TEST(RedisBlobStoreUnavailableTest, ServerKilledThenRestarted) {
  RedisTestServer server;
  ASSERT_TRUE(server.Start().ok());
  const std::string name = "127.0.0.1:" + std::to_string(server.port());
  auto store = RedisBlobStore::Open({.port = server.port(), .chunk_bytes = kChunk});
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  std::string big = RandomBytes(3 * kChunk + 1);
  auto key = (*store)->Put(big);
  ASSERT_TRUE(key.ok());

  server.Kill();
  for (int i = 0; i < 2; ++i) {
    auto put = (*store)->Put(RandomBytes(2 * kChunk, 5));
    EXPECT_EQ(put.status().code(), StatusCode::kUnavailable);
    EXPECT_THAT(put.status().message(), HasSubstr("redis at " + name));
    auto got = (*store)->Get(*key);
    EXPECT_EQ(got.status().code(), StatusCode::kUnavailable);
    EXPECT_THAT(got.status().message(), HasSubstr("cannot reach redis at " + name));
    EXPECT_EQ((*store)->Contains(*key).status().code(), StatusCode::kUnavailable);
  }

  ASSERT_TRUE(server.Start(server.port()).ok());  // same port, empty
  EXPECT_EQ((*store)->Get(*key).status().code(), StatusCode::kNotFound);
  auto again = (*store)->Put(big);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(*(*store)->Get(*key) == big);
}

// Writing to a connection the server has reset raises SIGPIPE, which by default kills the
// process. The store must turn it into Unavailable and leave signal handling as it found it.
TEST(RedisBlobStoreUnavailableTest, ServerDiesMidTransfer) {
  RedisTestServer server;
  ASSERT_TRUE(server.Start().ok());
  auto store = RedisBlobStore::Open({.port = server.port(), .chunk_bytes = kChunk});
  ASSERT_TRUE(store.ok());
  const std::string big = RandomBytes(64 * kChunk, 8);
  std::thread killer([&] {  // once a few chunks are in
    for (int i = 0; i < 2000; ++i) {
      auto keys = RedisCall(server.port(), {"DBSIZE"});
      if (!keys.ok() || std::stoi(*keys) >= 3) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    server.Kill();
  });
  auto put = (*store)->Put(big);
  killer.join();
  if (!put.ok()) {  // unless the put beat the kill
    EXPECT_EQ(put.status().code(), StatusCode::kUnavailable);
    EXPECT_THAT(put.status().message(), HasSubstr("redis at 127.0.0.1:"));
  }
  EXPECT_EQ((*store)->Put(big).status().code(), StatusCode::kUnavailable);

  struct sigaction action {};
  ASSERT_EQ(::sigaction(SIGPIPE, nullptr, &action), 0);
  EXPECT_EQ(action.sa_handler, SIG_DFL);
  sigset_t mask;
  ASSERT_EQ(::pthread_sigmask(SIG_BLOCK, nullptr, &mask), 0);
  EXPECT_EQ(::sigismember(&mask, SIGPIPE), 0);
  sigset_t pending;
  ::sigpending(&pending);
  EXPECT_EQ(::sigismember(&pending, SIGPIPE), 0);
}

TEST(RedisBlobStoreUnavailableTest, RestartBetweenCallsIsTransparent) {
  RedisTestServer server;
  ASSERT_TRUE(server.Start().ok());
  auto store = RedisBlobStore::Open({.port = server.port()});
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Put("before").ok());
  server.Stop();
  ASSERT_TRUE(server.Start(server.port()).ok());
  // The idle connection died with the old server; the call retries on a fresh one.
  auto contains = (*store)->Contains(BlobKey("before"));
  ASSERT_TRUE(contains.ok()) << contains.status().ToString();
  EXPECT_FALSE(*contains);
  EXPECT_TRUE((*store)->Put("after").ok());
}

TEST(RedisBlobStoreUnavailableTest, UnresponsiveServerTimesOut) {
  // Accepts connections (the kernel completes them from the backlog) but never answers.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 8), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);

  auto store =
      RedisBlobStore::Create({.port = port, .command_timeout = std::chrono::milliseconds(200)});
  ASSERT_TRUE(store.ok());
  auto start = std::chrono::steady_clock::now();
  auto contains = (*store)->Contains(BlobKey("x"));
  auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(contains.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(contains.status().message(), HasSubstr("redis at 127.0.0.1:" + std::to_string(port)));
  EXPECT_LT(elapsed, std::chrono::seconds(3));
  ::close(fd);
}

TEST(RedisBlobStoreOptionsTest, Validation) {
  EXPECT_EQ(RedisBlobStore::Create({.chunk_bytes = 0}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      RedisBlobStore::Create({.chunk_bytes = RedisBlobStore::kMaxChunkBytes + 1}).status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(RedisBlobStore::Create({.port = 0}).status().code(), StatusCode::kInvalidArgument);
  auto store = RedisBlobStore::Create({.host = "10.1.2.3", .port = 6390, .db = 4});
  ASSERT_TRUE(store.ok());
  EXPECT_EQ((*store)->Describe(), "redis://10.1.2.3:6390/4");
}

}  // namespace
}  // namespace nbos::store
