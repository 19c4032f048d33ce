#include "store/s3_blob_store.h"

#include <curl/curl.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstring>
#include <functional>
#include <thread>

namespace nbos::store {
namespace {

std::once_flag curl_once;

size_t AppendBody(char* data, size_t size, size_t n, void* user) {
  static_cast<std::string*>(user)->append(data, size * n);
  return size * n;
}

struct RangeSink {
  char* out = nullptr;
  size_t size = 0;
  size_t written = 0;
};

// A response longer than the range asked for fails the transfer (returning less than given).
size_t WriteRange(char* data, size_t size, size_t n, void* user) {
  auto* sink = static_cast<RangeSink*>(user);
  const size_t len = size * n;
  if (sink->written + len > sink->size) return 0;
  std::memcpy(sink->out + sink->written, data, len);
  sink->written += len;
  return len;
}

struct BodySource {
  std::string_view data;
  size_t offset = 0;
};

size_t ReadBody(char* buffer, size_t size, size_t n, void* user) {
  auto* source = static_cast<BodySource*>(user);
  const size_t len = std::min(size * n, source->data.size() - source->offset);
  std::memcpy(buffer, source->data.data() + source->offset, len);
  source->offset += len;
  return len;
}

size_t OnHeader(char* data, size_t size, size_t n, void* user) {
  const std::string_view line(data, size * n);
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos) return size * n;
  std::string name(line.substr(0, colon));
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  std::string_view value = line.substr(colon + 1);
  while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
  while (!value.empty() && (value.back() == '\r' || value.back() == '\n' || value.back() == ' '))
    value.remove_suffix(1);
  (*static_cast<std::map<std::string, std::string>*>(user))[name] = std::string(value);
  return size * n;
}

// The text of the first <tag>...</tag> in an S3 XML answer ("" when absent). S3's answers are
// flat enough that this is all the XML nbos needs.
std::string XmlField(const std::string& xml, const std::string& tag) {
  const size_t open = xml.find("<" + tag + ">");
  if (open == std::string::npos) return "";
  const size_t start = open + tag.size() + 2;
  const size_t close = xml.find("</" + tag + ">", start);
  return close == std::string::npos ? "" : xml.substr(start, close - start);
}

std::string Escape(std::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      out += fmt::format("%{:02X}", c);
    }
  }
  return out;
}

// The request's method and, for PUT and POST, its body; `source` reads `body` for a PUT and must
// outlive the transfer.
void SetMethod(CURL* curl, const std::string& method, std::string_view body, BodySource* source) {
  if (method == "HEAD") {
    curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
  } else if (method == "PUT") {
    curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(curl, CURLOPT_READFUNCTION, ReadBody);
    curl_easy_setopt(curl, CURLOPT_READDATA, source);
    curl_easy_setopt(curl, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(body.size()));
  } else if (method == "POST") {
    curl_easy_setopt(curl, CURLOPT_POST, 1L);
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body.data());
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
  } else if (method != "GET") {
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, method.c_str());
  }
}

}  // namespace

Result<std::unique_ptr<S3BlobStore>> S3BlobStore::Open(S3BlobStoreOptions options) {
  if (!options.endpoint.starts_with("http://") && !options.endpoint.starts_with("https://"))
    return InvalidArgument("S3 endpoint '" + options.endpoint + "' must start with http(s)://");
  while (options.endpoint.ends_with("/")) options.endpoint.pop_back();
  if (options.bucket.empty() || options.bucket.find('/') != std::string::npos)
    return InvalidArgument("S3 bucket name '" + options.bucket + "' is empty or has a '/'");
  if (options.access_key_id.empty() || options.secret_access_key.empty())
    return InvalidArgument(
        "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for every nbos "
        "process that opens the store");
  if (options.part_bytes < kMinPartBytes || options.part_bytes > kMaxPartBytes)
    return InvalidArgument(fmt::format("S3 part_bytes {} is outside [{}, {}]", options.part_bytes,
                                       kMinPartBytes, kMaxPartBytes));
  if (options.parallel < 1 || options.parallel > 64)
    return InvalidArgument("S3 parallel must be 1-64");
  std::call_once(curl_once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  std::unique_ptr<S3BlobStore> store(new S3BlobStore(std::move(options)));
  if (Status s = store->Probe(); !s.ok()) return s;
  return store;
}

// Reads an object that should not exist: the answer tells a missing bucket and refused
// credentials apart (with S3's error code, which a HEAD would not carry). AccessDenied is
// accepted: a credential may lack the right to list the bucket, which a missing key then needs.
Status S3BlobStore::Probe() {
  auto probe = Send({.method = "GET", .object = ObjectName(std::string(kBlobKeyLength, '0'))});
  if (!probe.ok()) return probe.status();
  const std::string code = XmlField(probe->body, "Code");
  if (code == "NoSuchBucket")
    return Unavailable("S3 at " + Describe() + " has no bucket '" + options_.bucket + "'");
  if (probe->status == 200 || code == "NoSuchKey" || code == "AccessDenied") return Status::Ok();
  return Check(probe, "access to the bucket");
}

S3BlobStore::S3BlobStore(S3BlobStoreOptions options) : options_(std::move(options)) {}

S3BlobStore::~S3BlobStore() {
  for (void* h : idle_handles_) curl_easy_cleanup(static_cast<CURL*>(h));
}

void* S3BlobStore::AcquireHandle() {
  {
    MutexLock lock(&handles_mu_);
    if (!idle_handles_.empty()) {
      void* h = idle_handles_.back();
      idle_handles_.pop_back();
      return h;
    }
  }
  return curl_easy_init();
}

void S3BlobStore::ReleaseHandle(void* handle) {
  MutexLock lock(&handles_mu_);
  idle_handles_.push_back(handle);
}

// One request; the handle (and its kept-alive connection) goes back to the pool.
Result<S3BlobStore::Response> S3BlobStore::Send(const Request& r) {
  constexpr int kTries = 3;
  Result<Response> response = SendOnce(r);
  for (int tried = 1; tried < kTries && r.method != "POST" && response.ok() &&
                      (response->status == 500 || response->status == 503);
       ++tried) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50 << (2 * tried)));  // 200, 800 ms
    response = SendOnce(r);
  }
  return response;
}

Result<S3BlobStore::Response> S3BlobStore::SendOnce(const Request& r) {
  CURL* curl = static_cast<CURL*>(AcquireHandle());
  if (curl == nullptr) return Unavailable("S3: cannot create a libcurl handle");
  curl_easy_reset(curl);
  const std::string url = options_.endpoint + "/" + options_.bucket +
                          (r.object.empty() ? "" : "/" + r.object) +
                          (r.query.empty() ? "" : "?" + r.query);
  const std::string sigv4 = "aws:amz:" + options_.region + ":s3";
  Response response;
  BodySource source{r.body, 0};
  RangeSink sink{r.out, r.range_bytes, 0};
  curl_slist* headers = nullptr;
  // curl 7.88 signs but does not add the payload hash S3 requires; Expect: would cost a round
  // trip per upload.
  headers = curl_slist_append(headers, ("x-amz-content-sha256: " + r.payload_sha256).c_str());
  headers = curl_slist_append(headers, "Expect:");
  if (!options_.session_token.empty())
    headers =
        curl_slist_append(headers, ("x-amz-security-token: " + options_.session_token).c_str());
  std::string range;
  if (r.range_bytes > 0)
    range = fmt::format("{}-{}", r.range_first, r.range_first + r.range_bytes - 1);
  if (!range.empty()) curl_easy_setopt(curl, CURLOPT_RANGE, range.c_str());
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(curl, CURLOPT_AWS_SIGV4, sigv4.c_str());
  curl_easy_setopt(curl, CURLOPT_USERNAME, options_.access_key_id.c_str());
  curl_easy_setopt(curl, CURLOPT_PASSWORD, options_.secret_access_key.c_str());
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS,
                   static_cast<long>(options_.connect_timeout.count()));
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME,
                   std::max(1L, static_cast<long>(options_.stall_timeout.count() / 1000)));
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, OnHeader);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &response.headers);
  if (r.out != nullptr) {
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, WriteRange);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &sink);
  } else {
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, AppendBody);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &response.body);
  }
  SetMethod(curl, r.method, r.body, &source);
  const CURLcode rc = curl_easy_perform(curl);
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &response.status);
  curl_slist_free_all(headers);
  ReleaseHandle(curl);
  if (rc != CURLE_OK) {
    return Unavailable(
        fmt::format("cannot reach S3 at {}: {}", options_.endpoint, curl_easy_strerror(rc)));
  }
  if (r.out != nullptr && response.status == 206 && sink.written != r.range_bytes) {
    return Unavailable(fmt::format("S3 at {} sent {} bytes for a range of {}", options_.endpoint,
                                   sink.written, r.range_bytes));
  }
  return response;
}

Status S3BlobStore::Check(const Result<Response>& r, std::string_view what,
                          std::vector<long> ok) const {
  if (!r.ok()) return r.status();
  // A multipart completion can fail with status 200 and an <Error> body.
  if (std::find(ok.begin(), ok.end(), r->status) != ok.end() &&
      r->body.find("<Error>") == std::string::npos) {
    return Status::Ok();
  }
  const std::string code = XmlField(r->body, "Code");
  const std::string message = XmlField(r->body, "Message");
  return Unavailable(fmt::format("S3 at {} refused {} (HTTP {}{}{})", Describe(), what, r->status,
                                 code.empty() ? "" : ", " + code,
                                 message.empty() ? "" : ": " + message));
}

std::string S3BlobStore::Describe() const {
  return "s3://" + options_.bucket + "/" + options_.prefix + "?endpoint=" + options_.endpoint;
}

Result<std::string> S3BlobStore::Put(std::string_view data) {
  std::string key = BlobKey(data);
  if (Status s = PutWithKey(key, data); !s.ok()) return s;
  return key;
}

Status S3BlobStore::PutWithKey(std::string_view key, std::string_view data) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  if (!BlobKeyMatches(key, data, BlobKey(data)))
    return InvalidArgument("blob key does not match the data");
  auto exists = Contains(key);
  if (!exists.ok()) return exists.status();
  if (*exists) return Status::Ok();
  const std::string object = ObjectName(key);
  if (data.size() > options_.part_bytes) return Upload(object, data).status();
  // Signed with the content's SHA-256 (the key itself for a one-chunk blob): the service checks
  // the bytes it got.
  std::string sha256 = data.size() <= kBlobChunkBytes ? std::string(key) : Sha256Hex(data);
  auto put = Send({.method = "PUT", .object = object, .body = data, .payload_sha256 = sha256});
  return Check(put, "storing blob " + std::string(key));
}

Result<std::string> S3BlobStore::PutPart(std::string_view object, const std::string& upload_id,
                                         int number, std::string_view data) {
  auto put = Send({.method = "PUT",
                   .object = std::string(object),
                   .query = fmt::format("partNumber={}&uploadId={}", number, Escape(upload_id)),
                   .body = data});
  if (Status s = Check(put, fmt::format("part {} of an upload", number)); !s.ok()) return s;
  auto etag = put->headers.find("etag");
  if (etag == put->headers.end()) return Unavailable("S3 at " + Describe() + " sent no ETag");
  return etag->second;
}

// Multipart: parts go up `parallel` at a time; any failure aborts the upload, so no partial
// object ever appears and the service drops the parts.
Result<std::string> S3BlobStore::Upload(std::string_view object, std::string_view data) {
  auto initiated = Send({.method = "POST", .object = std::string(object), .query = "uploads="});
  if (Status s = Check(initiated, "starting an upload"); !s.ok()) return s;
  const std::string upload_id = XmlField(initiated->body, "UploadId");
  if (upload_id.empty()) return Unavailable("S3 at " + Describe() + " sent no UploadId");
  const size_t parts = (data.size() + options_.part_bytes - 1) / options_.part_bytes;
  std::vector<std::string> etags(parts);
  std::atomic<size_t> next{0};
  Mutex mu;  // guards failed and etags, written by the workers
  Status failed = Status::Ok();
  auto work = [&] {
    for (size_t i = next++; i < parts; i = next++) {
      const std::string_view part = data.substr(i * options_.part_bytes, options_.part_bytes);
      auto etag = PutPart(object, upload_id, static_cast<int>(i + 1), part);
      MutexLock lock(&mu);
      if (!etag.ok()) {
        if (failed.ok()) failed = etag.status();
        return;
      }
      if (!failed.ok()) return;
      etags[i] = std::move(*etag);
    }
  };
  RunParallel(parts, work);
  const std::string query = "uploadId=" + Escape(upload_id);
  if (!failed.ok()) {
    (void)Send({.method = "DELETE", .object = std::string(object), .query = query});
    return failed;
  }
  std::string xml = "<CompleteMultipartUpload>";
  for (size_t i = 0; i < parts; ++i)
    xml += fmt::format("<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>", i + 1, etags[i]);
  xml += "</CompleteMultipartUpload>";
  auto done = Send({.method = "POST", .object = std::string(object), .query = query, .body = xml});
  if (Status s = Check(done, "completing an upload"); !s.ok()) {
    (void)Send({.method = "DELETE", .object = std::string(object), .query = query});
    return s;
  }
  return upload_id;
}

// A read that does not hash to its key is tried once more: a service that writes objects in
// place (s3rver, unlike S3) can be caught rewriting the blob for a second upload of the same
// bytes. A mismatch that stays is corruption.
Result<std::string> S3BlobStore::Get(std::string_view key) {
  auto first = ReadOnce(key);
  if (first.ok() || first.status().code() != StatusCode::kInternal) return first;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  return ReadOnce(key);
}

// HEAD tells the size; the bytes come in `part_bytes` ranges, `parallel` at a time.
Result<std::string> S3BlobStore::ReadOnce(std::string_view key) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  const std::string object = ObjectName(key);
  auto head = Send({.method = "HEAD", .object = object});
  if (head.ok() && head->status == 404)
    return NotFound("no blob " + std::string(key) + " in " + Describe());
  if (Status s = Check(head, "reading blob " + std::string(key)); !s.ok()) return s;
  auto length = head->headers.find("content-length");
  size_t size = 0;
  try {
    if (length == head->headers.end()) throw std::invalid_argument("none");
    size = static_cast<size_t>(std::stoull(length->second));
  } catch (const std::exception&) {
    return Unavailable("S3 at " + Describe() + " sent no object size");
  }
  std::string data(size, '\0');
  if (Status s = ReadRanges(object, 0, &data); !s.ok()) {
    return s.code() == StatusCode::kNotFound
               ? NotFound("no blob " + std::string(key) + " in " + Describe())
               : s;
  }
  if (!BlobKeyMatches(key, data, BlobKey(data)))
    return Internal("corrupt blob " + std::string(key) + " in " + Describe() +
                    ": its bytes no longer hash to its key");
  return data;
}

Status S3BlobStore::ReadRanges(std::string_view object, size_t from, std::string* data) {
  const size_t ranges = (data->size() - from + options_.part_bytes - 1) / options_.part_bytes;
  std::atomic<size_t> next{0};
  Mutex mu;  // guards failed, written by the workers
  Status failed = Status::Ok();
  auto work = [&] {
    for (size_t i = next++; i < ranges; i = next++) {
      const size_t first = from + i * options_.part_bytes;
      const size_t bytes = std::min(options_.part_bytes, data->size() - first);
      auto got = Send({.method = "GET",
                       .object = std::string(object),
                       .range_first = first,
                       .range_bytes = bytes,
                       .out = data->data() + first});
      Status s = got.ok() && got->status == 404 ? NotFound("deleted while read")
                                                : Check(got, "reading a range", {206});
      MutexLock lock(&mu);
      if (!s.ok() && failed.ok()) failed = s;
      if (!failed.ok()) return;
    }
  };
  RunParallel(ranges, work);
  return failed;
}

void S3BlobStore::RunParallel(size_t tasks, const std::function<void()>& work) const {
  std::vector<std::thread> helpers;
  for (size_t i = 1; i < std::min<size_t>(tasks, options_.parallel); ++i)
    helpers.emplace_back(work);
  work();
  for (std::thread& t : helpers) t.join();
}

Result<bool> S3BlobStore::Contains(std::string_view key) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  auto head = Send({.method = "HEAD", .object = ObjectName(key)});
  if (head.ok() && head->status == 404) return false;
  if (Status s = Check(head, "looking up blob " + std::string(key)); !s.ok()) return s;
  return true;
}

// ListObjectsV2, a page (up to 1,000 objects) at a time. Objects under the prefix whose rest is
// not a blob key (anything else kept there) are left out; unfinished multipart uploads are not
// objects.
Result<std::vector<StoredBlob>> S3BlobStore::List() {
  std::vector<StoredBlob> blobs;
  std::string token;
  for (;;) {
    // SigV4 signs the query with its parameters in this (sorted) order.
    std::string query = token.empty() ? "" : "continuation-token=" + Escape(token) + "&";
    query += "list-type=2&prefix=" + Escape(options_.prefix);
    auto page = Send({.method = "GET", .query = query});
    if (Status s = Check(page, "listing the bucket"); !s.ok()) return s;
    const std::string& xml = page->body;
    for (size_t at = xml.find("<Contents>"); at != std::string::npos;
         at = xml.find("<Contents>", at + 1)) {
      const size_t end = xml.find("</Contents>", at);
      if (end == std::string::npos) break;
      const std::string contents = xml.substr(at, end - at);
      const std::string name = XmlField(contents, "Key");
      if (name.compare(0, options_.prefix.size(), options_.prefix) != 0) continue;
      const std::string key = name.substr(options_.prefix.size());
      if (!IsValidBlobKey(key)) continue;
      blobs.push_back({key, std::strtoull(XmlField(contents, "Size").c_str(), nullptr, 10)});
    }
    if (XmlField(xml, "IsTruncated") != "true") return blobs;
    token = XmlField(xml, "NextContinuationToken");
    if (token.empty())
      return Unavailable("S3 at " + Describe() + " truncated a listing without a token");
  }
}

Status S3BlobStore::Delete(std::string_view key) {
  if (Status s = CheckBlobKey(key); !s.ok()) return s;
  auto del = Send({.method = "DELETE", .object = ObjectName(key)});
  return Check(del, "deleting blob " + std::string(key), {200, 204, 404});
}

}  // namespace nbos::store
