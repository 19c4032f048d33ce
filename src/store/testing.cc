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
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  NBOS_CHECK(fd >= 0, "cannot open a socket to pick a port");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  rc = rc == 0 ? ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) : rc;
  ::close(fd);
  NBOS_CHECK(rc == 0, "cannot bind a loopback port");
  return ntohs(addr.sin_port);
}

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
  std::string port_text = std::to_string(port);
  std::vector<std::string> args = {kRedisServerBinary,
                                   "--port",
                                   port_text,
                                   "--bind",
                                   "127.0.0.1",
                                   "--save",
                                   "",
                                   "--appendonly",
                                   "no",
                                   "--daemonize",
                                   "no",
                                   "--loglevel",
                                   "warning",
                                   "--dir",
                                   "/tmp"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  // The server's output goes to an unlinked file, quoted only if start-up fails.
  char log_path[] = "/tmp/nbos-redis-log.XXXXXX";
  int log = ::mkstemp(log_path);
  if (log >= 0) ::unlink(log_path);
  struct LogCloser {
    int fd;
    ~LogCloser() {
      if (fd >= 0) ::close(fd);
    }
  } log_closer{log};
  auto failed = [&](const std::string& why) {
    std::string tail(2048, '\0');
    ssize_t n = log >= 0 ? ::pread(log, tail.data(), tail.size(), 0) : 0;
    tail.resize(n > 0 ? static_cast<size_t>(n) : 0);
    return Unavailable(why + (tail.empty() ? "" : "; its output:\n" + tail));
  };

  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) return Unavailable("fork failed for redis-server");
  if (pid == 0) {
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
  pid_ = pid;
  port_ = port;

  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      pid_ = -1;
      return failed("redis-server exited during start-up on port " + port_text + " (status " +
                    std::to_string(status) + ")");
    }
    if (ServerPid(port) == pid) return Status::Ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  Kill();
  return failed("redis-server did not answer on port " + port_text + " within 10 s");
}

void RedisTestServer::Kill() { Signal(SIGKILL, 0); }

void RedisTestServer::Stop() { Signal(SIGTERM, 5000); }

void RedisTestServer::Signal(int sig, int wait_ms) {
  if (!running()) return;
  ::kill(pid_, sig);
  for (int waited = 0; waited < wait_ms; waited += 5) {
    if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (sig != SIGKILL) ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

}  // namespace nbos::store
