#include "store/testing.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "common/check.h"
#include "common/test_ports.h"
#include "store/resident_buffer.h"

namespace nbos::store {

namespace {

// The pid INFO reports for the server on `port`, or -1 if none answers yet.
long ServerPid(int port) {
  timeval tv{0, 200'000};
  redisContext* c = redisConnectWithTimeout("127.0.0.1", port, tv);
  if (c == nullptr) return -1;
  long pid = -1;
  if (c->err == 0) {
    auto* r = static_cast<redisReply*>(redisCommand(c, "INFO server"));
    if (r != nullptr && r->type == REDIS_REPLY_STRING) {
      std::string_view info(r->str, r->len);
      constexpr std::string_view kField = "process_id:";
      if (size_t at = info.find(kField); at != std::string_view::npos) {
        pid = std::strtol(info.data() + at + kField.size(), nullptr, 10);
      }
    }
    if (r != nullptr) freeReplyObject(r);
  }
  redisFree(c);
  return pid;
}

struct ContextDeleter {
  void operator()(redisContext* c) const { redisFree(c); }
};

std::string Render(const redisReply& r) {
  switch (r.type) {
    case REDIS_REPLY_INTEGER:
      return std::to_string(r.integer);
    case REDIS_REPLY_NIL:
      return "(nil)";
    case REDIS_REPLY_ARRAY: {
      std::string out;
      for (size_t i = 0; i < r.elements; ++i) out += (i ? "\n" : "") + Render(*r.element[i]);
      return out;
    }
    default:
      return std::string(r.str, r.len);
  }
}

}  // namespace

std::string RandomBytes(size_t n, uint64_t seed) {
  std::string out;
  ReserveResident(out, n);
  out.resize(n);
  uint64_t state = seed;
  for (size_t i = 0; i < n; i += 8) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    std::memcpy(out.data() + i, &z, std::min<size_t>(8, n - i));
  }
  return out;
}

ScopedTempDir::ScopedTempDir(std::string_view prefix, std::string_view parent) {
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = !parent.empty()                  ? std::string(parent)
                    : tmp != nullptr && *tmp != '\0' ? std::string(tmp)
                                                     : std::string("/tmp");
  std::string pattern = dir + "/" + std::string(prefix) + ".XXXXXX";
  char* made = ::mkdtemp(pattern.data());
  NBOS_CHECK(made != nullptr, "mkdtemp failed");  // a test in a shared or missing dir means nothing
  path_ = pattern;
}

ScopedTempDir::~ScopedTempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

Result<std::string> RedisCall(int port, const std::vector<std::string>& args, int db) {
  timeval tv{5, 0};
  std::unique_ptr<redisContext, ContextDeleter> c(redisConnectWithTimeout("127.0.0.1", port, tv));
  if (c == nullptr || c->err != 0) {
    return Unavailable("cannot connect to redis on port " + std::to_string(port));
  }
  auto call = [&](const std::vector<std::string>& a) -> Result<std::string> {
    std::vector<const char*> argv;
    std::vector<size_t> lengths;
    for (const auto& s : a) {
      argv.push_back(s.data());
      lengths.push_back(s.size());
    }
    auto* r = static_cast<redisReply*>(
        redisCommandArgv(c.get(), static_cast<int>(a.size()), argv.data(), lengths.data()));
    if (r == nullptr) return Unavailable(std::string("redis: ") + c->errstr);
    std::string text = Render(*r);
    bool error = r->type == REDIS_REPLY_ERROR;
    freeReplyObject(r);
    if (error) return Unavailable(text);
    return text;
  };
  if (db != 0) {
    auto selected = call({"SELECT", std::to_string(db)});
    if (!selected.ok()) return selected;
  }
  return call(args);
}

int FreeLocalPort() {
  const int port = nbos::testing::FreeTestPort();
  NBOS_CHECK(port != 0, "no free loopback port");
  return port;
}

namespace {

// A child's output goes to an unlinked file, quoted only if its start-up fails.
struct ChildLog {
  int fd = -1;
  ChildLog() {
    char path[] = "/tmp/nbos-child-log.XXXXXX";
    fd = ::mkstemp(path);
    if (fd >= 0) ::unlink(path);
  }
  ~ChildLog() {
    if (fd >= 0) ::close(fd);
  }
  Status Failed(const std::string& why) const {
    std::string tail(2048, '\0');
    ssize_t n = fd >= 0 ? ::pread(fd, tail.data(), tail.size(), 0) : 0;
    tail.resize(n > 0 ? static_cast<size_t>(n) : 0);
    return Unavailable(why + (tail.empty() ? "" : "; its output:\n" + tail));
  }
};

// Starts `args` with stdin from /dev/null and output to `log`; the child dies with the thread
// that started it. Returns its pid, or -1.
pid_t Spawn(std::vector<std::string> args, int log) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  // Only async-signal-safe calls between fork and exec.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(127);
  int devnull = ::open("/dev/null", O_RDONLY);
  if (devnull >= 0) ::dup2(devnull, 0);
  if (log >= 0) {
    ::dup2(log, 1);
    ::dup2(log, 2);
  }
  ::execv(argv[0], argv.data());
  ::_exit(127);
}

void SignalAndReap(pid_t* pid, int sig, int wait_ms) {
  if (*pid <= 0) return;
  ::kill(*pid, sig);
  for (int waited = 0; waited < wait_ms; waited += 5) {
    if (::waitpid(*pid, nullptr, WNOHANG) == *pid) {
      *pid = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (sig != SIGKILL) ::kill(*pid, SIGKILL);
  ::waitpid(*pid, nullptr, 0);
  *pid = -1;
}

bool Connectable(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

Status RedisTestServer::Start(int port) {
  assert(!running());
  if (::access(kRedisServerBinary, X_OK) != 0) {
    return Unavailable(std::string(kRedisServerBinary) +
                       " not found: install redis-server (apt-get install redis-server)");
  }
  // A picked port can be taken between picking and binding (parallel tests): pick again.
  Status last;
  for (int attempt = 0; attempt < (port == 0 ? 5 : 1); ++attempt) {
    last = TryStart(port == 0 ? FreeLocalPort() : port);
    if (last.ok()) return last;
  }
  return last;
}

Status RedisTestServer::TryStart(int port) {
  const std::string port_text = std::to_string(port);
  ChildLog log;
  pid_ =
      Spawn({kRedisServerBinary, "--port", port_text, "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning", "--dir", "/tmp"},
            log.fd);
  if (pid_ < 0) return Unavailable("fork failed for redis-server");
  port_ = port;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return log.Failed("redis-server exited during start-up on port " + port_text + " (status " +
                        std::to_string(status) + ")");
    }
    if (ServerPid(port) == pid_) return Status::Ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  Kill();
  return log.Failed("redis-server did not answer on port " + port_text + " within 10 s");
}

void RedisTestServer::Kill() { Signal(SIGKILL, 0); }

void RedisTestServer::Stop() { Signal(SIGTERM, 5000); }

void RedisTestServer::Signal(int sig, int wait_ms) { SignalAndReap(&pid_, sig, wait_ms); }

// ---- s3rver ----

std::string S3TestServer::Binary() {
  const char* configured = std::getenv("NBOS_S3RVER");
  return configured != nullptr
             ? configured
             : std::string(NBOS_SOURCE_DIR) + "/.cache/npm/node_modules/.bin/s3rver";
}

Status S3TestServer::Start(int port) {
  const std::string binary = Binary();
  if (::access(binary.c_str(), X_OK) != 0) {
    return Unavailable(binary + " not found: run `make bootstrap` (it installs npm's s3rver)");
  }
  port_ = port == 0 ? FreeLocalPort() : port;
  ChildLog log;
  pid_ = Spawn({binary, "-d", dir_.path().string(), "-a", "127.0.0.1", "-p", std::to_string(port_),
                "--configure-bucket", kBucket, "--silent"},
               log.fd);
  if (pid_ < 0) return Unavailable("fork failed for s3rver");
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return log.Failed("s3rver exited during start-up (status " + std::to_string(status) + ")");
    }
    if (Connectable(port_)) return Status::Ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  Stop();
  return log.Failed("s3rver did not listen on port " + std::to_string(port_) + " within 30 s");
}

void S3TestServer::Stop() { SignalAndReap(&pid_, SIGTERM, 5000); }

void S3TestServer::ExportCredentials() {
  ::setenv("AWS_ACCESS_KEY_ID", kAccessKey, 1);
  ::setenv("AWS_SECRET_ACCESS_KEY", kSecretKey, 1);
}

}  // namespace nbos::store
