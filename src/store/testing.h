// Support for the store's tests and benchmarks (library nbos_store_testing, not linked into the
// product): a real throwaway redis-server, raw Redis commands, temporary directories and data.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/status.h"

namespace nbos::store {

// `n` pseudo-random bytes (splitmix64), the same for the same seed; fast enough for GBs.
std::string RandomBytes(size_t n, uint64_t seed = 1);

// A fresh directory "<parent>/<prefix>.XXXXXX", removed with everything in it when the object
// goes. An empty `parent` means $TMPDIR, or /tmp.
class ScopedTempDir {
 public:
  explicit ScopedTempDir(std::string_view prefix = "nbos-store", std::string_view parent = "");
  ~ScopedTempDir();
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Runs one command on a fresh connection to 127.0.0.1:`port` (database `db`) and renders the
// reply: strings and statuses as their text, integers in decimal, nil as "(nil)", arrays as their
// rendered elements joined by "\n". Unavailable for an error reply or no connection.
Result<std::string> RedisCall(int port, const std::vector<std::string>& args, int db = 0);

inline constexpr char kRedisServerBinary[] = "/usr/bin/redis-server";

// A TCP port on 127.0.0.1 that nothing listened on a moment ago (common/test_ports.h).
int FreeLocalPort();

// A real redis-server started on 127.0.0.1 with persistence off, killed when the object goes (and
// by the kernel if the thread that started it dies first).
class RedisTestServer {
 public:
  RedisTestServer() = default;
  ~RedisTestServer() { Stop(); }
  RedisTestServer(const RedisTestServer&) = delete;
  RedisTestServer& operator=(const RedisTestServer&) = delete;

  // Starts redis-server on `port` (0: a free one) and waits until it answers as itself (INFO
  // reports our child's pid, not some other server's). Unavailable, saying why, if the binary is
  // missing or the server does not come up within 10 s. Must not be running already.
  Status Start(int port = 0);
  // SIGKILL and reap: the server vanishes as in a crash.
  void Kill();
  // SIGTERM and reap (SIGKILL after 5 s). No-op when not running.
  void Stop();

  bool running() const { return pid_ > 0; }
  // The port of the last Start, still valid after Kill/Stop (for a restart on the same port).
  int port() const { return port_; }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }

 private:
  Status TryStart(int port);
  void Signal(int sig, int wait_ms);

  pid_t pid_ = -1;
  int port_ = 0;
};

// npm's s3rver (an S3-compatible server) on 127.0.0.1 with one bucket, `kBucket`, in a fresh
// directory; stopped when the object goes. Its credentials are kAccessKey/kSecretKey (s3rver
// refuses other access key ids; it does not check the secret).
class S3TestServer {
 public:
  static constexpr char kBucket[] = "nbos";
  static constexpr char kAccessKey[] = "S3RVER";
  static constexpr char kSecretKey[] = "S3RVER";
  // $NBOS_S3RVER, else the copy `make bootstrap` installs under the source tree's .cache/npm.
  static std::string Binary();

  S3TestServer() = default;
  ~S3TestServer() { Stop(); }
  S3TestServer(const S3TestServer&) = delete;
  S3TestServer& operator=(const S3TestServer&) = delete;

  // Starts it on `port` (0: a free one) and waits until it listens; the bucket's contents stay
  // across a Stop and Start. Unavailable, saying why, if s3rver is missing or does not come up
  // within 30 s.
  Status Start(int port = 0);
  void Stop();  // SIGTERM and reap (SIGKILL after 5 s); no-op when not running
  int port() const { return port_; }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  // Where s3rver keeps the bucket's objects ("<key>._S3rver_object" files).
  std::filesystem::path bucket_directory() const { return dir_.path() / kBucket; }
  // Sets AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY to this server's credentials.
  static void ExportCredentials();

 private:
  ScopedTempDir dir_{"nbos-s3rver"};
  pid_t pid_ = -1;
  int port_ = 0;
};

}  // namespace nbos::store
