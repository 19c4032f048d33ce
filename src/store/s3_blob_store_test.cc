// S3-specific behaviour against a real S3-compatible server (npm's s3rver): multipart layout,
// credentials, missing buckets, and a service that is unreachable or goes away and comes back.
// The contract every store shares is in blob_store_test.cc.
#include "store/s3_blob_store.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "common/thread_annotations.h"
#include "store/testing.h"

namespace nbos::store {
namespace {

using ::testing::HasSubstr;

S3BlobStoreOptions OptionsFor(const S3TestServer& server) {
  S3BlobStoreOptions o;
  o.endpoint = server.endpoint();
  o.bucket = S3TestServer::kBucket;
  o.access_key_id = S3TestServer::kAccessKey;
  o.secret_access_key = S3TestServer::kSecretKey;
  o.part_bytes = S3BlobStore::kMinPartBytes;
  o.connect_timeout = std::chrono::milliseconds(2000);
  return o;
}

class S3BlobStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Status s = server_.Start();
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  S3TestServer server_;
};

TEST_F(S3BlobStoreTest, LargeBlobsAreOneObjectUploadedInPartsAndReadInRanges) {
  auto store = S3BlobStore::Open(OptionsFor(server_));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const std::string data = RandomBytes(4 * S3BlobStore::kMinPartBytes + 17, 3);
  auto key = (*store)->Put(data);
  ASSERT_TRUE(key.ok()) << key.status().ToString();
  // One complete object; the upload's parts are gone.
  const auto object = server_.bucket_directory() / (*key + "._S3rver_object");
  ASSERT_TRUE(std::filesystem::exists(object));
  EXPECT_EQ(std::filesystem::file_size(object), data.size());
  const auto uploads = server_.bucket_directory() / "._S3rver_uploads";
  if (std::filesystem::exists(uploads)) {
    EXPECT_TRUE(std::filesystem::is_empty(uploads));
  }
  // Another reader (another host) with another part size reads it whole.
  S3BlobStoreOptions other = OptionsFor(server_);
  other.part_bytes = S3BlobStore::kMinPartBytes * 3;
  other.parallel = 2;
  auto reader = S3BlobStore::Open(other);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  auto got = (*reader)->Get(*key);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(*got == data);
}

TEST_F(S3BlobStoreTest, WrongCredentialsAreRefusedWithS3sReason) {
  S3BlobStoreOptions o = OptionsFor(server_);
  o.access_key_id = "NOT-A-KEY";
  auto store = S3BlobStore::Open(o);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(store.status().message(), HasSubstr("InvalidAccessKeyId"));
  EXPECT_THAT(store.status().message(), HasSubstr(server_.endpoint()));
}

TEST_F(S3BlobStoreTest, AMissingBucketIsNamed) {
  S3BlobStoreOptions o = OptionsFor(server_);
  o.bucket = "no-such-bucket";
  auto store = S3BlobStore::Open(o);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(store.status().message(), HasSubstr("no bucket 'no-such-bucket'"));
}

TEST_F(S3BlobStoreTest, BadOptionsAreInvalidArgument) {
  for (auto change : std::vector<std::function<void(S3BlobStoreOptions&)>>{
           [](auto& o) { o.endpoint = "127.0.0.1:9000"; }, [](auto& o) { o.bucket = ""; },
           [](auto& o) { o.bucket = "a/b"; }, [](auto& o) { o.secret_access_key = ""; },
           [](auto& o) { o.part_bytes = 1 << 20; }, [](auto& o) { o.parallel = 0; }}) {
    S3BlobStoreOptions o = OptionsFor(server_);
    change(o);
    auto store = S3BlobStore::Open(o);
    ASSERT_FALSE(store.ok());
    EXPECT_EQ(store.status().code(), StatusCode::kInvalidArgument) << store.status().ToString();
  }
}

// An HTTP server on 127.0.0.1 that answers each request (one connection each) with the next of
// `statuses` (the last one repeats) and records the requests' methods. A 404 carries S3's
// NoSuchKey, so that opening a store over it succeeds.
class ScriptedHttp {
 public:
  explicit ScriptedHttp(std::vector<int> statuses) : statuses_(std::move(statuses)) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    EXPECT_EQ(bind(listener_, reinterpret_cast<sockaddr*>(&addr), len), 0);
    EXPECT_EQ(listen(listener_, 16), 0);
    EXPECT_EQ(getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~ScriptedHttp() {
    shutdown(listener_, SHUT_RDWR);
    close(listener_);
    thread_.join();
  }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::vector<std::string> methods() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return methods_;
  }

 private:
  void Serve() EXCLUDES(mu_) {
    for (int fd; (fd = accept(listener_, nullptr, nullptr)) >= 0; close(fd)) {
      std::string request;
      char buf[4096];
      for (ssize_t n;
           request.find("\r\n\r\n") == std::string::npos && (n = read(fd, buf, sizeof(buf))) > 0;) {
        request.append(buf, static_cast<size_t>(n));
      }
      // The body (a PUT's bytes) is not needed: the connection closes after the answer.
      int status;
      {
        MutexLock lock(&mu_);
        methods_.push_back(request.substr(0, request.find(' ')));
        status = statuses_[std::min(methods_.size(), statuses_.size()) - 1];
      }
      const std::string body =
          status == 404 ? "<Error><Code>NoSuchKey</Code></Error>" : std::string();
      const std::string answer = "HTTP/1.1 " + std::to_string(status) +
                                 " X\r\nContent-Length: " + std::to_string(body.size()) +
                                 "\r\nConnection: close\r\n\r\n" + body;
      (void)!write(fd, answer.data(), answer.size());
    }
  }

  std::vector<int> statuses_;
  int listener_ = -1;
  int port_ = 0;
  std::thread thread_;
  Mutex mu_;
  std::vector<std::string> methods_ GUARDED_BY(mu_);
};

S3BlobStoreOptions ScriptedOptions(const ScriptedHttp& server) {
  S3BlobStoreOptions o;
  o.endpoint = server.endpoint();
  o.bucket = "b";
  o.access_key_id = "k";
  o.secret_access_key = "s";
  o.connect_timeout = std::chrono::milliseconds(2000);
  return o;
}

// S3 may answer 500 (InternalError) or 503 (SlowDown) for a moment: the request is sent again.
TEST(S3BlobStoreRetryTest, AServerErrorForAMomentIsRetried) {
  // Open's probe, a lookup answered 500 then 503, then 404 (missing), then the upload.
  ScriptedHttp server({404, 500, 503, 404, 200});
  auto store = S3BlobStore::Open(ScriptedOptions(server));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_TRUE((*store)->Put("some bytes").ok());
  EXPECT_EQ(server.methods(), (std::vector<std::string>{"GET", "HEAD", "HEAD", "HEAD", "PUT"}));
}

TEST(S3BlobStoreRetryTest, AServerErrorThatStaysIsUnavailableAfterThreeTries) {
  ScriptedHttp server({404, 500});
  auto store = S3BlobStore::Open(ScriptedOptions(server));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  Status s = (*store)->Put("some bytes").status();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("HTTP 500"));
  EXPECT_EQ(server.methods(), (std::vector<std::string>{"GET", "HEAD", "HEAD", "HEAD"}));
}

// The service goes away: every call fails with Unavailable naming it, nothing stored is lost,
// and the same store works again once the service is back.
TEST_F(S3BlobStoreTest, AnUnreachableServiceIsUnavailableAndNothingIsLost) {
  auto store = S3BlobStore::Open(OptionsFor(server_));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const std::string kept = RandomBytes(100'000, 5);
  auto key = (*store)->Put(kept);
  ASSERT_TRUE(key.ok()) << key.status().ToString();
  const int port = server_.port();
  server_.Stop();
  const std::string other = RandomBytes(7 * S3BlobStore::kMinPartBytes / 2, 6);
  for (Status s :
       {(*store)->Put(kept).status(), (*store)->Put(other).status(), (*store)->Get(*key).status(),
        (*store)->Contains(*key).status(), (*store)->Delete(*key)}) {
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("cannot reach S3 at http://127.0.0.1:"));
  }
  S3BlobStoreOptions o = OptionsFor(server_);
  auto unopened = S3BlobStore::Open(o);
  ASSERT_FALSE(unopened.ok());
  EXPECT_EQ(unopened.status().code(), StatusCode::kUnavailable);
  ASSERT_TRUE(server_.Start(port).ok());
  auto got = (*store)->Get(*key);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(*got == kept);
  EXPECT_TRUE((*store)->Put(other).ok());
}

TEST_F(S3BlobStoreTest, OpenBlobStoreTakesCredentialsFromTheEnvironment) {
  ::unsetenv("AWS_ACCESS_KEY_ID");
  ::unsetenv("AWS_SECRET_ACCESS_KEY");
  const std::string url = "s3://nbos?endpoint=" + server_.endpoint();
  auto none = OpenBlobStore(url);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(), HasSubstr("AWS_ACCESS_KEY_ID"));
  S3TestServer::ExportCredentials();
  auto store = OpenBlobStore(url);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ((*store)->Describe(), "s3://nbos/?endpoint=" + server_.endpoint());
  for (const char* bad : {"s3://nbos?endpoint=x&colour=red", "s3://nbos?part_bytes=lots"}) {
    auto r = OpenBlobStore(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace nbos::store
