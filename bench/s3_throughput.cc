// S3 blob store throughput against npm's s3rver on 127.0.0.1: put and get of one large blob
// (default 64 MiB) through S3BlobStore, printed beside baselines measured in the same run on the
// same bytes with the same client (libcurl, SigV4):
//   raw multipart   initiate, the same parts PUT `parallel` at a time, complete; no hashing
//   raw GET         one GET of the whole object into a std::string
//   sha256          BlobKey alone (every put hashes, every get verifies)
//
//   build/bin/s3_throughput [--mib N] [--reps N] [--part-mib N] [--parallel N]
//
// Each figure is the median of N runs (default 3) after one unrecorded warm-up run; units MiB/s.
// s3rver (Node.js, writing to a local disk) is the bottleneck here, so the ratios say what the
// store adds to the service, not what S3 itself sustains.
#include <curl/curl.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "store/s3_blob_store.h"
#include "store/testing.h"

namespace nbos::store {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "s3_throughput: %s\n", what.c_str());
  std::exit(1);
}

double Seconds(const std::function<void()>& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

size_t Append(char* p, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(p, size * n);
  return size * n;
}

struct Source {
  std::string_view data;
  size_t offset = 0;
};

size_t Read(char* buffer, size_t size, size_t n, void* user) {
  auto* s = static_cast<Source*>(user);
  const size_t len = std::min(size * n, s->data.size() - s->offset);
  std::memcpy(buffer, s->data.data() + s->offset, len);
  s->offset += len;
  return len;
}

// The plain way with libcurl: one request, no pooling, no checks beyond the status.
std::string Raw(const std::string& method, const std::string& url, std::string_view body,
                std::string* etag = nullptr) {
  CURL* curl = curl_easy_init();
  std::string response, headers;
  Source source{body, 0};
  curl_slist* h = curl_slist_append(nullptr, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
  h = curl_slist_append(h, "Expect:");
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, h);
  curl_easy_setopt(curl, CURLOPT_AWS_SIGV4, "aws:amz:us-east-1:s3");
  curl_easy_setopt(curl, CURLOPT_USERPWD, "S3RVER:S3RVER");
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, Append);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &response);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, Append);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &headers);
  if (method == "PUT") {
    curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(curl, CURLOPT_READFUNCTION, Read);
    curl_easy_setopt(curl, CURLOPT_READDATA, &source);
    curl_easy_setopt(curl, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(body.size()));
  } else if (method == "POST") {
    curl_easy_setopt(curl, CURLOPT_POST, 1L);
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body.data());
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
  }
  long status = 0;
  if (curl_easy_perform(curl) != CURLE_OK) Die(method + " " + url + " failed");
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
  curl_slist_free_all(h);
  curl_easy_cleanup(curl);
  if (status != 200) Die(method + " " + url + ": HTTP " + std::to_string(status));
  if (etag != nullptr) {
    const size_t at = headers.find("ETag: ");
    *etag = headers.substr(at + 6, headers.find('\r', at) - at - 6);
  }
  return response;
}

std::string Between(const std::string& s, const std::string& open, const std::string& close) {
  const size_t a = s.find(open) + open.size();
  return s.substr(a, s.find(close, a) - a);
}

void RawMultipart(const std::string& url, std::string_view data, size_t part, int parallel) {
  const std::string id = Between(Raw("POST", url + "?uploads=", ""), "<UploadId>", "</UploadId>");
  const size_t parts = (data.size() + part - 1) / part;
  std::vector<std::string> etags(parts);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < parts; i = next++) {
      Raw("PUT", url + "?partNumber=" + std::to_string(i + 1) + "&uploadId=" + id,
          data.substr(i * part, part), &etags[i]);
    }
  };
  std::vector<std::thread> threads;
  for (int i = 1; i < parallel; ++i) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  std::string xml = "<CompleteMultipartUpload>";
  for (size_t i = 0; i < parts; ++i)
    xml += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" + etags[i] +
           "</ETag></Part>";
  Raw("POST", url + "?uploadId=" + id, xml + "</CompleteMultipartUpload>");
}

int Main(int argc, char** argv) {
  CLI::App app{"S3 blob store throughput against raw libcurl baselines"};
  size_t mib = 64, part_mib = 8;
  int reps = 3, parallel = 4;
  app.add_option("--mib", mib, "Blob size in MiB")->capture_default_str();
  app.add_option("--part-mib", part_mib, "Part and range size in MiB")->capture_default_str();
  app.add_option("--parallel", parallel, "Transfers at a time")->capture_default_str();
  app.add_option("--reps", reps, "Recorded runs per figure")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  S3TestServer server;
  if (Status s = server.Start(); !s.ok()) Die(s.ToString());
  auto store = S3BlobStore::Open({.endpoint = server.endpoint(),
                                  .bucket = S3TestServer::kBucket,
                                  .access_key_id = S3TestServer::kAccessKey,
                                  .secret_access_key = S3TestServer::kSecretKey,
                                  .part_bytes = part_mib * kMiB,
                                  .parallel = parallel});
  if (!store.ok()) Die(store.status().ToString());
  std::vector<double> put, get, raw_put, raw_get, hash;
  for (int rep = 0; rep <= reps; ++rep) {
    const std::string data = RandomBytes(mib * kMiB, 100 + rep);  // new bytes: no dedup
    std::string key;
    const double t_hash = Seconds([&] { key = BlobKey(data); });
    const double t_put = Seconds([&] {
      if (!(*store)->Put(data).ok()) Die("store put failed");
    });
    const double t_get = Seconds([&] {
      if (!(*store)->Get(key).ok()) Die("store get failed");
    });
    const std::string url = server.endpoint() + "/" + S3TestServer::kBucket + "/raw-" + key;
    const double t_raw_put = Seconds([&] { RawMultipart(url, data, part_mib * kMiB, parallel); });
    const double t_raw_get = Seconds([&] {
      if (Raw("GET", url, "").size() != data.size()) Die("raw get: wrong size");
    });
    if (rep == 0) continue;  // warm-up
    hash.push_back(mib / t_hash);
    put.push_back(mib / t_put);
    get.push_back(mib / t_get);
    raw_put.push_back(mib / t_raw_put);
    raw_get.push_back(mib / t_raw_get);
  }
  std::printf(
      "S3 (s3rver on 127.0.0.1), one %zu MiB blob, parts/ranges of %zu MiB, %d at a time,"
      " median of %d (MiB/s):\n",
      mib, part_mib, parallel, reps);
  std::printf("  put      %8.1f   raw multipart %8.1f   ratio %.2f   (sha256 alone %.1f)\n",
              Median(put), Median(raw_put), Median(put) / Median(raw_put), Median(hash));
  std::printf("  get      %8.1f   raw GET       %8.1f   ratio %.2f\n", Median(get), Median(raw_get),
              Median(get) / Median(raw_get));
  return 0;
}

}  // namespace
}  // namespace nbos::store

int main(int argc, char** argv) { return nbos::store::Main(argc, argv); }
