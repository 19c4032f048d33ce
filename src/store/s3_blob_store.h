// Blob store on any S3-compatible service (AWS S3, MinIO, Ceph's radosgw, s3rver), through
// libcurl and its built-in AWS Signature Version 4 signing: every host of a cluster reaches the
// same blobs, which a directory store cannot offer beyond one machine.
//
// Layout: blob K is the object "<prefix>K" in the bucket (path-style URLs:
// <endpoint>/<bucket>/<prefix>K). An object becomes visible only once completely written, so
// Contains and Get never see a partial blob.
//
// Transfers. A blob up to `part_bytes` is one PUT, signed with its SHA-256 (its key, for a blob of
// one key chunk), so the service checks the bytes too; a larger one is a multipart upload of
// `part_bytes` parts, `parallel` at a time, aborted when any part fails. Get of a large blob reads
// `part_bytes` ranges, `parallel` at a time, into one buffer. Every read re-hashes the bytes; a
// mismatch is read once more before it counts as corruption.
//
// Connections are kept alive in a pool of libcurl handles shared by all threads.
//
// Errors: Unavailable when the service cannot be reached, times out, or refuses the request
// (wrong credentials, no such bucket, a server error); the message names the endpoint and
// bucket and carries S3's error code.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/thread_annotations.h"
#include "store/blob_store.h"

namespace nbos::store {

struct S3BlobStoreOptions {
  std::string endpoint;  // "http://host:port" or "https://host[:port]"
  std::string region = "us-east-1";
  std::string bucket;
  std::string prefix;  // put before every key, e.g. "nbos/"
  std::string access_key_id, secret_access_key, session_token;
  size_t part_bytes = size_t{8} << 20;  // >= 5 MiB (S3's smallest part), <= 5 GiB
  int parallel = 4;                     // transfers at a time for one large blob
  std::chrono::milliseconds connect_timeout{5000};
  // With no byte moving for this long a transfer fails (a slow but moving one goes on).
  std::chrono::milliseconds stall_timeout{30000};
};

class S3BlobStore final : public BlobStore {
 public:
  static constexpr size_t kMinPartBytes = size_t{5} << 20;
  static constexpr size_t kMaxPartBytes = size_t{5} << 30;

  // Checks the options, then the bucket (HEAD): Unavailable when the service cannot be reached,
  // refuses the credentials or has no such bucket; InvalidArgument for bad options.
  static Result<std::unique_ptr<S3BlobStore>> Open(S3BlobStoreOptions options);
  ~S3BlobStore() override;

  Result<std::string> Put(std::string_view data) override;
  Status PutWithKey(std::string_view key, std::string_view data) override;
  Result<std::string> Get(std::string_view key) override;
  Result<bool> Contains(std::string_view key) override;
  Status Delete(std::string_view key) override;
  Result<std::vector<StoredBlob>> List() override;
  std::string Describe() const override;

  struct Response {
    long status = 0;
    std::string body;
    std::map<std::string, std::string> headers;  // lowercase names
  };
  struct Request {
    std::string method = "GET";
    std::string object;  // "" for the bucket itself
    std::string query;   // already encoded, without '?'
    std::string_view body;
    std::string payload_sha256 = "UNSIGNED-PAYLOAD";
    // A ranged GET (range_bytes > 0); with `out`, the bytes go to [out, out + range_bytes)
    // instead of the body.
    size_t range_first = 0;
    size_t range_bytes = 0;
    char* out = nullptr;
  };

 private:
  explicit S3BlobStore(S3BlobStoreOptions options);
  Status Probe();
  Result<std::string> ReadOnce(std::string_view key);
  // SendOnce, again after a pause while S3 answers 500 or 503 (its InternalError and SlowDown,
  // which AWS asks clients to retry), up to three tries; POSTs (multipart uploads' creation and
  // completion, not idempotent) are sent once.
  Result<Response> Send(const Request& request);
  Result<Response> SendOnce(const Request& request);
  Status Check(const Result<Response>& response, std::string_view what,
               std::vector<long> ok = {200}) const;
  Result<std::string> Upload(std::string_view object, std::string_view data);
  Result<std::string> PutPart(std::string_view object, const std::string& upload_id, int number,
                              std::string_view data);
  // Reads [from, size) of `object` into `data`, which has its full size already.
  Status ReadRanges(std::string_view object, size_t from, std::string* data);
  void RunParallel(size_t tasks, const std::function<void()>& work) const;
  std::string ObjectName(std::string_view key) const { return options_.prefix + std::string(key); }
  void* AcquireHandle() EXCLUDES(handles_mu_);
  void ReleaseHandle(void* handle) EXCLUDES(handles_mu_);

  const S3BlobStoreOptions options_;
  Mutex handles_mu_;
  std::vector<void*> idle_handles_ GUARDED_BY(handles_mu_);  // CURL*
};

}  // namespace nbos::store
