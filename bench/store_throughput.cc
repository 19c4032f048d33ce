// Blob store throughput: put and get of 256 MiB of random data (as 8 x 32 MiB "tensors" and as
// 1 x 256 MiB) through the directory store and the Redis store, each printed beside baselines
// measured in the same run on the same bytes:
//   sha256        plain SHA-256 of each buffer on one thread (the key before hash trees)
//   BlobKey       the key alone, a hash tree on helper threads (every put hashes, every get
//                 verifies); "dir get buffer" is GetBuffer (a verified copy-on-write mapping)
//   raw write()   write(2) of each buffer to a file in the same directory
//   raw read()    read(2) of that file into one std::string of the file's size
//   redis SET/GET plain hiredis SET/GET of each buffer (no hashing, no chunking), own server
// "serial bound" is what hashing and the raw I/O would cost back to back, 1 / (1/hash + 1/io):
// the best a put or get that hashes and then does the I/O can reach.
//
//   build/bin/store_throughput [--dir DIR] [--reps N] [--no-redis]
//
// Each figure is the median of N runs (default 3) after one unrecorded warm-up run. Units: MiB/s.
// Exit status 0 unless set-up fails.
//
// The store's get makes its result buffer resident up front (resident_buffer.h) and
// its Redis backend moves values between socket and buffer without hiredis's copies; the baselines
// are the plain way (read() into a fresh std::string, hiredis SET/GET), so on machines where page
// faults are expensive (VMs) a store operation can beat its baseline.
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "store/blob_store.h"
#include "store/dir_blob_store.h"
#include "store/redis_blob_store.h"
#include "store/testing.h"

namespace nbos::store {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

struct Workload {
  std::string name;
  std::vector<std::string> tensors;
  size_t bytes() const {
    size_t n = 0;
    for (const auto& t : tensors) n += t.size();
    return n;
  }
};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "store_throughput: %s\n", what.c_str());
  std::exit(1);
}

void Check(const Status& s, const char* what) {
  if (!s.ok()) Die(std::string(what) + ": " + s.ToString());
}

std::string FilesystemOf(const std::string& dir) {
  struct statfs fs {};
  if (::statfs(dir.c_str(), &fs) != 0) return "unknown filesystem";
  switch (static_cast<unsigned long>(fs.f_type)) {
    case TMPFS_MAGIC:
      return "tmpfs (memory)";
    case EXT4_SUPER_MAGIC:
      return "ext4 (disk; reads of just-written files come from the page cache)";
    case XFS_SUPER_MAGIC:
      return "xfs (disk; reads of just-written files come from the page cache)";
    case BTRFS_SUPER_MAGIC:
      return "btrfs (disk; reads of just-written files come from the page cache)";
    case OVERLAYFS_SUPER_MAGIC:
      return "overlayfs";
    default: {
      char hex[32];
      std::snprintf(hex, sizeof(hex), "filesystem 0x%lx", static_cast<unsigned long>(fs.f_type));
      return hex;
    }
  }
}

// Seconds `fn` takes.
double Time(const std::function<void()>& fn) {
  auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void RawWrite(const std::string& path, const std::string& data) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) Die("cannot create " + path);
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, std::min(data.size() - done, size_t{1} << 30));
    if (n <= 0) Die("write failed on " + path);
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

std::string RawRead(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) Die("cannot open " + path);
  struct stat st {};
  ::fstat(fd, &st);
  std::string data(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::read(fd, data.data() + done, std::min(data.size() - done, size_t{1} << 30));
    if (n <= 0) Die("read failed on " + path);
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return data;
}

// Plain hiredis, for the Redis baseline.
class RawRedis {
 public:
  explicit RawRedis(int port) {
    timeval tv{5, 0};
    c_ = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (c_ == nullptr || c_->err != 0) Die("cannot connect to the benchmark's redis-server");
    redisSetTimeout(c_, timeval{120, 0});
  }
  ~RawRedis() { redisFree(c_); }
  void Set(const std::string& key, const std::string& value) {
    const char* argv[] = {"SET", key.data(), value.data()};
    size_t lens[] = {3, key.size(), value.size()};
    Free(Run(3, argv, lens));
  }
  std::string Get(const std::string& key) {
    const char* argv[] = {"GET", key.data()};
    size_t lens[] = {3, key.size()};
    redisReply* r = Run(2, argv, lens);
    std::string value(r->str, r->len);
    Free(r);
    return value;
  }
  void Del(const std::string& key) {
    const char* argv[] = {"DEL", key.data()};
    size_t lens[] = {3, key.size()};
    Free(Run(2, argv, lens));
  }

 private:
  redisReply* Run(int argc, const char** argv, const size_t* lens) {
    auto* r = static_cast<redisReply*>(redisCommandArgv(c_, argc, argv, lens));
    if (r == nullptr || r->type == REDIS_REPLY_ERROR) Die("redis baseline command failed");
    return r;
  }
  static void Free(redisReply* r) { freeReplyObject(r); }
  redisContext* c_;
};

struct Row {
  std::string workload, operation, baseline, bound_of;
};

class Table {
 public:
  // Records one run's seconds for `operation` of `workload`.
  void Add(const std::string& workload, const std::string& operation, double seconds) {
    samples_[{workload, operation}].push_back(seconds);
  }
  double MiBps(const std::string& workload, const std::string& operation, size_t bytes) const {
    auto it = samples_.find({workload, operation});
    if (it == samples_.end()) return 0;
    std::vector<double> s = it->second;
    std::sort(s.begin(), s.end());
    return static_cast<double>(bytes) / kMiB / s[s.size() / 2];
  }

 private:
  std::map<std::pair<std::string, std::string>, std::vector<double>> samples_;
};

void Measure(const Workload& w, BlobStore& dir_store, const std::string& dir, RedisBlobStore* redis,
             RawRedis* raw_redis, Table& table) {
  const auto& ts = w.tensors;
  std::vector<std::string> keys(ts.size());
  table.Add(w.name, "sha256", Time([&] {
              for (const auto& t : ts) {
                if (Sha256Hex(t).empty()) Die("no digest");
              }
            }));
  table.Add(w.name, "BlobKey", Time([&] {
              for (size_t i = 0; i < ts.size(); ++i) keys[i] = BlobKey(ts[i]);
            }));

  auto raw_path = [&](size_t i) { return dir + "/raw-" + std::to_string(i); };
  table.Add(w.name, "raw write()", Time([&] {
              for (size_t i = 0; i < ts.size(); ++i) RawWrite(raw_path(i), ts[i]);
            }));
  table.Add(w.name, "raw read()", Time([&] {
              for (size_t i = 0; i < ts.size(); ++i) {
                if (RawRead(raw_path(i)).size() != ts[i].size()) Die("short raw read");
              }
            }));
  for (size_t i = 0; i < ts.size(); ++i) ::unlink(raw_path(i).c_str());

  table.Add(w.name, "dir put (new)", Time([&] {
              for (const auto& t : ts) Check(dir_store.Put(t).status(), "dir put");
            }));
  table.Add(w.name, "dir put (existing)", Time([&] {
              for (const auto& t : ts) Check(dir_store.Put(t).status(), "dir put");
            }));
  table.Add(w.name, "dir get", Time([&] {
              for (size_t i = 0; i < ts.size(); ++i) {
                auto got = dir_store.Get(keys[i]);
                Check(got.status(), "dir get");
                if (got->size() != ts[i].size()) Die("short dir get");
              }
            }));
  table.Add(w.name, "dir get buffer", Time([&] {
              for (size_t i = 0; i < ts.size(); ++i) {
                auto got = dir_store.GetBuffer(keys[i]);
                Check(got.status(), "dir get buffer");
                if ((*got)->size() != ts[i].size()) Die("short dir get buffer");
              }
            }));
  for (const auto& k : keys) Check(dir_store.Delete(k), "dir delete");

  if (redis == nullptr) return;
  table.Add(w.name, "redis SET", Time([&] {
              for (size_t i = 0; i < ts.size(); ++i) raw_redis->Set("bench:" + keys[i], ts[i]);
            }));
  table.Add(w.name, "redis GET", Time([&] {
              for (size_t i = 0; i < ts.size(); ++i) {
                if (raw_redis->Get("bench:" + keys[i]).size() != ts[i].size()) Die("short GET");
              }
            }));
  for (const auto& k : keys) raw_redis->Del("bench:" + k);

  table.Add(w.name, "redis put (new)", Time([&] {
              for (const auto& t : ts) Check(redis->Put(t).status(), "redis put");
            }));
  table.Add(w.name, "redis put (existing)", Time([&] {
              for (const auto& t : ts) Check(redis->Put(t).status(), "redis put");
            }));
  table.Add(w.name, "redis get", Time([&] {
              for (size_t i = 0; i < ts.size(); ++i) {
                auto got = redis->Get(keys[i]);
                Check(got.status(), "redis get");
                if (got->size() != ts[i].size()) Die("short redis get");
              }
            }));
  for (const auto& k : keys) Check(redis->Delete(k), "redis delete");
}

double SerialBound(double a, double b) { return a > 0 && b > 0 ? 1.0 / (1.0 / a + 1.0 / b) : 0; }

int Main(int argc, char** argv) {
  CLI::App app{"Blob store throughput against raw I/O, hashing and plain Redis baselines"};
  const char* tmpdir = std::getenv("TMPDIR");
  std::string base_dir = tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp";
  int reps = 3;
  bool no_redis = false;
  app.add_option("--dir", base_dir, "where the temporary store directory goes");
  app.add_option("--reps", reps, "runs per figure (the median is printed)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--no-redis", no_redis, "skip the Redis measurements");
  CLI11_PARSE(app, argc, argv);

  ScopedTempDir tmp("nbos-store-bench", base_dir);
  const std::string dir = tmp.path().string();
  auto dir_store = DirBlobStore::Open(tmp.path() / "store");
  Check(dir_store.status(), "open dir store");

  RedisTestServer server;
  std::unique_ptr<RedisBlobStore> redis;
  std::unique_ptr<RawRedis> raw_redis;
  std::string redis_note = "skipped (--no-redis)";
  if (!no_redis) {
    if (Status s = server.Start(); !s.ok()) {
      redis_note = "skipped: " + s.message();
    } else {
      auto opened = RedisBlobStore::Open({.port = server.port()});
      Check(opened.status(), "open redis store");
      redis = std::move(*opened);
      raw_redis = std::make_unique<RawRedis>(server.port());
      redis_note = "own redis-server on 127.0.0.1:" + std::to_string(server.port()) +
                   " (loopback TCP), chunk size " +
                   std::to_string(RedisBlobStoreOptions{}.chunk_bytes / kMiB) + " MiB";
    }
  }

  std::vector<Workload> workloads(2);
  workloads[0].name = "8 x 32 MiB";
  for (int i = 0; i < 8; ++i) workloads[0].tensors.push_back(RandomBytes(32 * kMiB, 1000 + i));
  workloads[1].name = "1 x 256 MiB";
  workloads[1].tensors.push_back(RandomBytes(256 * kMiB, 2000));

  // One unrecorded round first: the first touch of memory and files costs extra in a VM.
  Table warm_up, table;
  for (int rep = -1; rep < reps; ++rep) {
    for (const auto& w : workloads) {
      Measure(w, **dir_store, dir, redis.get(), raw_redis.get(), rep < 0 ? warm_up : table);
    }
  }

  std::printf("store_throughput: 256 MiB of random data per workload, median of %d runs, MiB/s\n",
              reps);
  std::printf("directory: %s on %s\n", dir.c_str(), FilesystemOf(dir).c_str());
  std::printf("redis:     %s\n\n", redis_note.c_str());
  std::printf("%-12s %-21s %8s   %-26s %8s %7s\n", "workload", "operation", "MiB/s", "baseline",
              "MiB/s", "ratio");
  for (const auto& w : workloads) {
    const size_t bytes = w.bytes();
    auto rate = [&](const std::string& op) { return table.MiBps(w.name, op, bytes); };
    const double sha = rate("sha256");
    struct Line {
      std::string op, baseline;
      double baseline_rate;
    };
    std::vector<Line> lines = {
        {"sha256", "", 0},
        {"BlobKey", "sha256", sha},
        {"raw write()", "", 0},
        {"raw read()", "", 0},
        {"dir put (new)", "raw write()", rate("raw write()")},
        {"", "serial bound sha+write", SerialBound(sha, rate("raw write()"))},
        {"dir put (existing)", "sha256", sha},
        {"dir get", "raw read()", rate("raw read()")},
        {"dir get buffer", "raw read()", rate("raw read()")},
        {"", "serial bound sha+read", SerialBound(sha, rate("raw read()"))},
    };
    if (redis) {
      std::vector<Line> more = {
          {"redis SET", "", 0},
          {"redis GET", "", 0},
          {"redis put (new)", "redis SET", rate("redis SET")},
          {"", "serial bound sha+SET", SerialBound(sha, rate("redis SET"))},
          {"redis put (existing)", "sha256", sha},
          {"redis get", "redis GET", rate("redis GET")},
          {"", "serial bound sha+GET", SerialBound(sha, rate("redis GET"))},
      };
      lines.insert(lines.end(), more.begin(), more.end());
    }
    std::string last_op;
    for (const auto& line : lines) {
      const std::string& op = line.op.empty() ? last_op : line.op;
      const double r = rate(op);
      if (line.baseline.empty()) {
        std::printf("%-12s %-21s %8.0f\n", w.name.c_str(), op.c_str(), r);
      } else {
        std::printf("%-12s %-21s %8s   %-26s %8.0f %7.2f\n", w.name.c_str(),
                    line.op.empty() ? "" : op.c_str(),
                    line.op.empty() ? "" : std::to_string(static_cast<long>(r + 0.5)).c_str(),
                    line.baseline.c_str(), line.baseline_rate,
                    line.baseline_rate > 0 ? r / line.baseline_rate : 0.0);
      }
      last_op = op;
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace
}  // namespace nbos::store

int main(int argc, char** argv) { return nbos::store::Main(argc, argv); }
