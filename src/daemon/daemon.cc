#include "daemon/daemon.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <grpcpp/grpcpp.h>
#include <linux/magic.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/ids.h"
#include "common/spawn.h"
#include "control/control.grpc.pb.h"
#include "daemon/grpc_status.h"
#include "daemon/sandbox.h"
#include "workspace/workspace.h"

namespace nbos::daemon {
namespace {

bool IsLoopback(std::string_view host) {
  return host.starts_with("127.") || host == "localhost" || host == "::1" || host == "[::1]";
}

// A directory store is one machine's: replicas on other machines cannot read its blobs, so
// catch-up and migration there would fail. Said once at start, where an operator looks.
void WarnOfAMachineLocalStore(const DaemonOptions& options) {
  const std::string& url = options.blob_store_url;
  if (!url.starts_with("dir:") && !url.starts_with("/")) return;
  const std::string_view gateway(options.gateway_address);
  const std::string_view gateway_host = gateway.substr(0, gateway.rfind(':'));
  if (IsLoopback(options.advertise_ip) && IsLoopback(gateway_host)) return;
  spdlog::warn(
      "blob store {} is a directory on this machine: replicas on other machines cannot read its "
      "blobs. Across machines use redis://host:port/db or s3://bucket/prefix?endpoint=URL (every "
      "server the same), unless every server mounts this directory",
      url);
}

namespace fs = std::filesystem;

// In-flight RPCs get this long after Shutdown() before they are cancelled.
constexpr auto kServerShutdownGrace = std::chrono::seconds(2);

ResourceVector FromProto(const control::Resources& r) {
  return {r.millicpus(), r.memory_mb(), r.gpus(), r.vram_mb()};
}

void ToProto(const ResourceVector& r, control::Resources* out) {
  out->set_millicpus(r.millicpus);
  out->set_memory_mb(r.memory_mb);
  out->set_gpus(r.gpus);
  out->set_vram_mb(r.vram_mb);
}

// Kernel ids name directories, so they are restricted to a safe alphabet (UUIDs fit).
bool ValidKernelId(const std::string& id) {
  if (id.empty() || id.size() > 128 || id == "." || id == "..") return false;
  for (char c : id) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.';
    if (!ok) return false;
  }
  return true;
}

Status ValidateKey(const std::string& kernel_id, uint32_t replica_id) {
  if (!ValidKernelId(kernel_id)) {
    return InvalidArgument("kernel id '" + kernel_id + "' is not [A-Za-z0-9._-]{1,128}");
  }
  if (replica_id == 0) return InvalidArgument("replica ids are positive");
  return Status::Ok();
}

control::PrepareReplicaReply PrepareReply(const jupyter::ConnectionInfo& c,
                                          const std::string& raft_address) {
  control::PrepareReplicaReply reply;
  control::ConnectionInfo* out = reply.mutable_connection();
  out->set_ip(c.ip);
  out->set_shell_port(c.shell_port);
  out->set_iopub_port(c.iopub_port);
  out->set_stdin_port(c.stdin_port);
  out->set_control_port(c.control_port);
  out->set_hb_port(c.hb_port);
  out->set_key(c.key);
  out->set_signature_scheme(c.signature_scheme);
  out->set_transport(c.transport);
  reply.set_raft_address(raft_address);
  return reply;
}

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

// "host:port" split at the last colon; the host keeps IPv6 brackets.
std::pair<std::string, std::string> SplitHostPort(const std::string& address) {
  size_t colon = address.rfind(':');
  if (colon == std::string::npos) return {address, ""};
  return {address.substr(0, colon), address.substr(colon + 1)};
}

SupervisorOptions SupervisorOptionsFor(const DaemonOptions& options) {
  SupervisorOptions sup;
  sup.nbos_binary = options.nbos_binary;
  sup.log_level = options.replica_log_level;
  sup.max_restarts = options.max_restarts;
  sup.restart_window = options.restart_window;
  sup.restart_delay = options.restart_delay;
  sup.stop_grace = options.stop_grace;
  sup.warm_pool_size = options.warm_pool_size;
  sup.warm_dir = options.state_dir + "/warm";
  sup.warm_preload = options.warm_preload;
  sup.workspace_root = options.workspace_root;
  return sup;
}

// "auto" puts Raft logs in RAM only where there is room for a server's replicas (about 25 MB
// each: libraft keeps three 8 MB segments ready).
constexpr uint64_t kAutoRaftLogMinBytes = uint64_t{1} << 30;

bool IsRoomyTmpfs(const std::string& dir, uint64_t min_bytes) {
  struct statfs fs_info {};
  if (statfs(dir.c_str(), &fs_info) != 0 || fs_info.f_type != TMPFS_MAGIC) return false;
  return static_cast<uint64_t>(fs_info.f_blocks) * fs_info.f_bsize >= min_bytes;
}

constexpr std::string_view kRaftLogRootPrefix = "nbos-raft-";

// A daemon killed outright leaves its Raft log directory, and the RAM it holds, behind. Each
// live daemon holds an flock on ROOT/.lock, so a root whose lock can be taken has no owner.
// The lock file appears under that name only once locked (renamed into place), so a daemon
// still creating its root is never taken for a dead one.
void RemoveUnownedRaftLogRoots(const std::string& base) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(base, ec)) {
    if (!entry.path().filename().string().starts_with(kRaftLogRootPrefix)) continue;
    const int fd = open((entry.path() / ".lock").c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
      spdlog::info("removing {}, left by a daemon that stopped without removing it",
                   entry.path().string());
      fs::remove_all(entry.path(), ec);
    }
    close(fd);
  }
}

// Takes ROOT/.lock for as long as the returned descriptor stays open.
Result<int> LockRaftLogRoot(const std::string& root) {
  const std::string pending = root + "/.lock.new";
  const int fd = open(pending.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return Internal("cannot create " + pending + ": " + std::strerror(errno));
  if (flock(fd, LOCK_EX | LOCK_NB) != 0 || rename(pending.c_str(), (root + "/.lock").c_str())) {
    close(fd);
    return Internal("cannot lock " + root + ": " + std::strerror(errno));
  }
  return fd;
}

// The directory this daemon keeps replicas' Raft logs in (DaemonOptions::raft_log_dir), emptied
// and created; "" for each replica's own directory.
Result<std::string> MakeRaftLogRoot(const DaemonOptions& options) {
  std::string base = options.raft_log_dir;
  if (base == "state") return std::string();
  if (base == "auto") {
    if (!IsRoomyTmpfs("/dev/shm", kAutoRaftLogMinBytes)) {
      spdlog::info(
          "replicas keep their Raft logs in their directories (no tmpfs of 1 GiB or "
          "more at /dev/shm)");
      return std::string();
    }
    base = "/dev/shm";
  }
  if (base.empty()) return InvalidArgument("--raft-log-dir is auto, state or a directory");
  base = fs::absolute(base).string();
  RemoveUnownedRaftLogRoots(base);
  const std::string root = fmt::format("{}/{}{:016x}", base, kRaftLogRootPrefix,
                                       std::hash<std::string>{}(options.state_dir));
  std::error_code ec;
  fs::remove_all(root, ec);  // left by an earlier run of this daemon: never replayed
  fs::create_directories(root, ec);
  if (ec) return Internal("cannot create " + root + ": " + ec.message());
  fs::permissions(root, fs::perms::owner_all, fs::perm_options::replace, ec);
  spdlog::info("replicas keep their Raft logs in {}", root);
  return root;
}

SandboxPolicy BaseSandboxPolicy(const DaemonOptions& options, const std::string& replicas_dir) {
  SandboxPolicy policy;
  policy.bwrap = FindExecutable(options.bwrap);
  std::vector<std::string> hidden = {options.state_dir};
  for (const std::string& p : options.sandbox_hide) hidden.push_back(fs::absolute(p).string());
  for (const std::string& path : hidden) {
    std::error_code ec;
    if (fs::is_directory(path, ec)) {
      policy.hidden.push_back(path);
    } else if (fs::exists(path, ec)) {
      policy.hidden_files.push_back(path);
    }
  }
  // Replicas run the daemon's nbos, wherever it lies (a build tree under /tmp, say).
  policy.readable.push_back(fs::absolute(options.nbos_binary).string());
  policy.writable.push_back(replicas_dir);
  // Each replica narrows it to its kernel's part once it knows its kernel (workspace_mount.h).
  if (!options.workspace_root.empty()) policy.writable.push_back(options.workspace_root);
  std::error_code ec;
  for (const std::string& p : options.sandbox_share) {
    fs::create_directories(p, ec);
    policy.writable.push_back(fs::absolute(p).string());
  }
  if (options.blob_store_url.starts_with("dir://")) {
    // Bound into every sandbox, so it must exist before the first replica writes to it.
    fs::create_directories(options.blob_store_url.substr(6), ec);
    policy.writable.push_back(options.blob_store_url.substr(6));
  }
  for (const auto& entry : fs::directory_iterator("/dev", ec)) {
    if (entry.path().filename().string().starts_with("nvidia")) {
      policy.devices.push_back(entry.path().string());
    }
  }
  policy.env_passed = DefaultPassedEnvironment("");
  SanitizerPaths sanitizer = SanitizerPathsIn(BuildEnvironment({}));
  for (std::string& p : sanitizer.writable) {
    fs::create_directories(p, ec);
    policy.writable.push_back(std::move(p));
  }
  for (std::string& p : sanitizer.readable) policy.readable.push_back(std::move(p));
  return policy;
}

// Per-kernel user ids and cgroups need root; without them kernels are apart only by namespaces.
void AddPrivilegedSandbox(const DaemonOptions& options, SupervisorOptions* sup) {
  if (geteuid() != 0) {
    spdlog::warn(
        "the daemon is not root: replicas of all kernels share its user id, and nothing "
        "limits their memory (run the daemon as root for per-kernel users and cgroups)");
    return;
  }
  sup->sandbox_users = true;
  std::ifstream in("/proc/self/cgroup");
  std::stringstream text;
  text << in.rdbuf();
  // The state directory names the group, as it names the Raft log root: two daemons on one
  // machine (two clusters, or tests run side by side) may share a server id, and one's start-up
  // sweep or shutdown must not remove the other's cgroups while it fills them.
  const std::string group = fmt::format("nbos-{}-{:016x}", options.server_id,
                                        std::hash<std::string>{}(options.state_dir));
  auto cgroups = ReplicaCgroups::Open("/sys/fs/cgroup", text.str(), group);
  if (!cgroups.ok()) {
    spdlog::warn("no per-replica memory limits: {}", cgroups.status().message());
    return;
  }
  sup->cgroups = std::make_shared<ReplicaCgroups>(std::move(*cgroups));
  sup->cgroups->RemoveStale();
  for (const std::string& dir : sup->cgroups->group_dirs())
    sup->sandbox_policy.writable.push_back(dir);  // a replica joins its cgroup from inside
}

Status ConfigureSandbox(const DaemonOptions& options, const std::string& replicas_dir,
                        SupervisorOptions* sup) {
  if (options.sandbox == "off") {
    spdlog::warn(
        "replicas are not sandboxed (--sandbox off): every cell can read this server's "
        "replica directories and signal its processes");
    return Status::Ok();
  }
  if (options.sandbox != "auto" && options.sandbox != "on") {
    return InvalidArgument("--sandbox is auto, on or off, not '" + options.sandbox + "'");
  }
  sup->sandbox_policy = BaseSandboxPolicy(options, replicas_dir);
  if (!sup->raft_log_root.empty()) sup->sandbox_policy.writable.push_back(sup->raft_log_root);
  // The probe also shows that the replicas' binary can be run in there.
  const std::vector<std::string> probe_argv = {"/bin/sh", "-c", "test -x \"$0\"",
                                               sup->sandbox_policy.readable.front()};
  if (Status probe = ProbeSandbox(sup->sandbox_policy, probe_argv); !probe.ok()) {
    if (options.sandbox == "on") return probe;
    spdlog::warn("replicas are not sandboxed: {}", probe.message());
    return Status::Ok();
  }
  sup->sandbox = true;
  AddPrivilegedSandbox(options, sup);
  if (sup->sandbox_users) {
    std::error_code ec;
    for (const std::string& dir : {replicas_dir, sup->raft_log_root}) {
      if (dir.empty()) continue;
      fs::permissions(dir, fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec,
                      fs::perm_options::replace, ec);
    }
    if (options.blob_store_url.starts_with("dir://")) {
      if (Status s = PrepareSharedBlobDirectory(options.blob_store_url.substr(6)); !s.ok())
        return s;
    }
  }
  spdlog::info("replicas are sandboxed ({}{}{})", options.bwrap,
               sup->sandbox_users ? ", a user id per kernel" : "",
               sup->cgroups ? ", memory and CPU by cgroup" : "");
  return Status::Ok();
}

}  // namespace

// The gRPC face of the Daemon: converts and delegates.
class Daemon::Service final : public control::Daemon::Service {
 public:
  explicit Service(nbos::daemon::Daemon* daemon) : daemon_(daemon) {}

  grpc::Status PrepareReplica(grpc::ServerContext*, const control::PrepareReplicaRequest* req,
                              control::PrepareReplicaReply* reply) override {
    auto r = daemon_->PrepareReplica(*req);
    if (!r.ok()) return ToGrpcStatus(r.status());
    *reply = std::move(*r);
    return grpc::Status::OK;
  }
  grpc::Status LaunchReplica(grpc::ServerContext*, const control::LaunchReplicaRequest* req,
                             control::LaunchReplicaReply* reply) override {
    auto r = daemon_->LaunchReplica(*req);
    if (!r.ok()) return ToGrpcStatus(r.status());
    *reply = std::move(*r);
    return grpc::Status::OK;
  }
  grpc::Status StopReplica(grpc::ServerContext*, const control::StopReplicaRequest* req,
                           control::StopReplicaReply*) override {
    return ToGrpcStatus(daemon_->StopReplica(*req));
  }
  grpc::Status Grant(grpc::ServerContext*, const control::GrantRequest* req,
                     control::GrantReply* reply) override {
    *reply = daemon_->Grant(*req);
    return grpc::Status::OK;
  }
  grpc::Status Release(grpc::ServerContext*, const control::ReleaseRequest* req,
                       control::ReleaseReply* reply) override {
    *reply = daemon_->Release(*req);
    return grpc::Status::OK;
  }
  grpc::Status Status(grpc::ServerContext*, const control::StatusRequest*,
                      control::ServerStatus* reply) override {
    *reply = daemon_->GetStatus();
    return grpc::Status::OK;
  }

 private:
  nbos::daemon::Daemon* daemon_;
};

Daemon::Daemon(DaemonOptions options, GpuInventory gpus)
    : options_(std::move(options)),
      gpus_(std::move(gpus)),
      ledger_(ResourceVector{options_.millicpus, options_.memory_mb, 0, 0}, gpus_.devices),
      // Daemons sharing a machine and a port range start at different places in it.
      port_allocator_("0.0.0.0", options_.replica_ports,
                      std::hash<std::string>{}(options_.server_id) ^
                          static_cast<uint64_t>(getpid()) * 0x9E3779B97F4A7C15ull) {}

namespace {

// Fills in the defaults of `options` (server id, capacity, blob store) and makes its state
// directory.
Status CompleteOptions(DaemonOptions& options) {
  if (options.state_dir.empty()) return InvalidArgument("daemon needs a state directory");
  if (options.nbos_binary.empty()) return InvalidArgument("daemon needs the nbos binary's path");
  if (options.server_id.empty()) options.server_id = HostName();
  if (options.millicpus <= 0) {
    options.millicpus =
        1000 * static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  }
  if (options.memory_mb <= 0) {
    options.memory_mb =
        static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE) / (1024 * 1024);
  }
  std::error_code ec;
  fs::create_directories(options.state_dir, ec);
  if (ec) return Internal("cannot create " + options.state_dir + ": " + ec.message());
  options.state_dir = fs::absolute(options.state_dir).string();
  if (options.blob_store_url.empty()) {
    options.blob_store_url = "dir://" + options.state_dir + "/blobs";
  }
  WarnOfAMachineLocalStore(options);
  if (!options.workspace_root.empty()) {
    auto root = workspace::NormalPath(fs::absolute(options.workspace_root).string());
    if (!root.ok() || *root == "/") {
      return InvalidArgument("--workspace-root must be a directory other than /");
    }
    options.workspace_root = *root;
    if (!fs::is_directory(options.workspace_root, ec)) {
      // Not fatal: a shared filesystem may be mounted later; kernel starts say so meanwhile.
      spdlog::error("the workspace root {} is not a directory here: is it mounted?",
                    options.workspace_root);
    }
  }
  if (!options.credential) {
    spdlog::warn(
        "no cluster credential: the Daemon service on {} is plaintext and starts "
        "processes for anyone who can reach it (--credential FILE)",
        options.listen_address);
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& given) {
  DaemonOptions options = given;
  if (Status s = CompleteOptions(options); !s.ok()) return s;
  std::error_code ec;

  Result<GpuInventory> gpus =
      DiscoverGpus({options.gpu_source, options.virtual_gpus, options.vram_mb_per_gpu});
  if (!gpus.ok()) return gpus.status();

  std::unique_ptr<Daemon> d(new Daemon(options, std::move(*gpus)));
  d->replicas_dir_ = options.state_dir + "/replicas";
  fs::create_directories(d->replicas_dir_, ec);
  if (ec) return Internal("cannot create " + d->replicas_dir_ + ": " + ec.message());

  Result<std::string> raft_log_root = MakeRaftLogRoot(options);
  if (!raft_log_root.ok()) return raft_log_root.status();
  d->raft_log_root_ = *raft_log_root;
  if (!d->raft_log_root_.empty()) {
    Result<int> lock = LockRaftLogRoot(d->raft_log_root_);
    if (!lock.ok()) return lock.status();
    d->raft_log_lock_fd_ = *lock;
  }
  SupervisorOptions sup = SupervisorOptionsFor(options);
  sup.raft_log_root = d->raft_log_root_;
  if (options.warm_pool_size > 0) {
    fs::create_directories(sup.warm_dir, ec);
    if (ec) return Internal("cannot create " + sup.warm_dir + ": " + ec.message());
  }
  if (Status s = ConfigureSandbox(options, d->replicas_dir_, &sup); !s.ok()) return s;
  Daemon* raw = d.get();
  sup.on_exit = [raw](const ReplicaKey& key, int code, bool restarting) {
    raw->OnReplicaExit(key, code, restarting);
  };
  d->supervisor_ = std::make_unique<Supervisor>(std::move(sup));

  d->service_ = std::make_unique<Service>(raw);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(
      options.listen_address,
      control::ServerCredentials(options.credential, "daemon " + options.server_id,
                                 d->refused_calls_),
      &port);
  builder.RegisterService(d->service_.get());
  d->server_ = builder.BuildAndStart();
  if (!d->server_ || port == 0) {
    d->server_.reset();
    return Unavailable("cannot listen on " + options.listen_address);
  }
  auto [host, unused] = SplitHostPort(options.listen_address);
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::") {
    host = options.advertise_ip;
  }
  d->address_ = fmt::format("{}:{}", host, port);

  spdlog::info("daemon {} serving on {}: {} GPUs ({}), {} millicpus, {} MB", options.server_id,
               d->address_, d->gpus_.devices.size(), d->gpus_.source, options.millicpus,
               options.memory_mb);
  if (!options.gateway_address.empty()) {
    d->registration_ = std::thread([raw] { raw->RegistrationLoop(); });
  }
  return d;
}

Daemon::~Daemon() { Shutdown(); }

bool Daemon::registered() const {
  MutexLock lock(&reg_mu_);
  return registered_;
}

void Daemon::Wait() {
  MutexLock lock(&reg_mu_);
  while (!shut_down_) reg_cv_.Wait(&reg_mu_);
}

void Daemon::Shutdown() {
  std::call_once(shutdown_once_, [&] {
    {
      MutexLock lock(&reg_mu_);
      stopping_ = true;
    }
    reg_cv_.SignalAll();
    if (registration_.joinable()) registration_.join();
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + kServerShutdownGrace);
    // Replica directories (logs, homes) are kept to look at afterwards. No later daemon replays
    // their Raft logs (PrepareReplica), so logs kept in RAM go.
    if (supervisor_) supervisor_->StopAll(/*keep_data=*/true);
    if (!raft_log_root_.empty()) {
      std::error_code ec;
      fs::remove_all(raft_log_root_, ec);
    }
    if (raft_log_lock_fd_ >= 0) close(raft_log_lock_fd_);
    spdlog::info("daemon {} stopped", options_.server_id);
    {
      MutexLock lock(&reg_mu_);
      shut_down_ = true;
    }
    reg_cv_.SignalAll();
  });
}

Result<control::PrepareReplicaReply> Daemon::PrepareReplica(
    const control::PrepareReplicaRequest& req) {
  if (Status s = ValidateKey(req.kernel_id(), req.replica_id()); !s.ok()) return s;
  ReplicaKey key{req.kernel_id(), req.replica_id()};
  MutexLock lock(&mu_);
  if (auto existing = supervisor_->Get(key)) {
    // A retry whose reply was lost: same ports, same everything.
    if (existing->connection.key != req.key()) {
      return InvalidArgument("replica " + key.ToString() + " is prepared with another key");
    }
    return PrepareReply(existing->connection, existing->raft_address);
  }
  if (Status s = ledger_.Subscribe(key, FromProto(req.resources())); !s.ok()) return s;
  auto jupyter_ports = port_allocator_.Reserve(5);
  if (!jupyter_ports.ok()) {
    ledger_.Unsubscribe(key);
    return jupyter_ports.status();
  }
  auto raft_port = port_allocator_.ReservePair();
  if (!raft_port.ok()) {
    port_allocator_.Release(*jupyter_ports);
    ledger_.Unsubscribe(key);
    return raft_port.status();
  }
  std::vector<int> ports = *jupyter_ports;
  ports.push_back(*raft_port);
  ports.push_back(*raft_port + 1);

  jupyter::ConnectionInfo c;
  c.transport = "tcp";
  c.ip = options_.advertise_ip;
  c.shell_port = ports[0];
  c.iopub_port = ports[1];
  c.stdin_port = ports[2];
  c.control_port = ports[3];
  c.hb_port = ports[4];
  c.key = req.key();
  c.signature_scheme = "hmac-sha256";
  c.kernel_name = "nbos";
  std::string raft_address = fmt::format("{}:{}", options_.advertise_ip, *raft_port);
  std::string dir = fmt::format("{}/{}-{}", replicas_dir_, key.kernel_id, key.replica_id);

  // A directory without a prepared replica is left by an earlier daemon. A new preparation is
  // a new Raft member (new address), so its old log must not be replayed.
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    spdlog::warn("replica {}: removing stale directory {}", key.ToString(), dir);
    fs::remove_all(dir, ec);
  }
  const ResourceVector wanted = FromProto(req.resources());
  if (Status s = supervisor_->Prepare(key, dir, c, raft_address,
                                      ReplicaLimits{wanted.memory_mb, wanted.millicpus});
      !s.ok()) {
    port_allocator_.Release(ports);
    ledger_.Unsubscribe(key);
    return s;
  }
  ports_[key] = ports;
  spdlog::info("replica {} prepared: shell {}, raft {}", key.ToString(), c.shell_port,
               raft_address);

  return PrepareReply(c, raft_address);
}

Result<control::LaunchReplicaReply> Daemon::LaunchReplica(
    const control::LaunchReplicaRequest& req) {
  if (Status s = ValidateKey(req.kernel_id(), req.replica_id()); !s.ok()) return s;
  ReplicaKey key{req.kernel_id(), req.replica_id()};
  auto prepared = supervisor_->Get(key);
  if (!prepared) return NotFound("replica " + key.ToString() + " is not prepared here");
  std::vector<std::pair<uint32_t, std::string>> peers;
  bool self_listed = false;
  for (const control::Peer& p : req.peers()) {
    if (p.replica_id() == 0 || p.raft_address().empty()) {
      return InvalidArgument("peers need a positive replica id and a Raft address");
    }
    if (p.replica_id() == key.replica_id) {
      if (p.raft_address() != prepared->raft_address) {
        return InvalidArgument(fmt::format("replica {} was prepared at {}, not {}", key.ToString(),
                                           prepared->raft_address, p.raft_address()));
      }
      self_listed = true;
    }
    peers.emplace_back(p.replica_id(), p.raft_address());
  }
  if (!peers.empty() && !self_listed) {
    return InvalidArgument("the peer list must include replica " + key.ToString());
  }
  std::string blob_store =
      req.blob_store_url().empty() ? options_.blob_store_url : req.blob_store_url();
  std::map<std::string, std::string> env(req.env().begin(), req.env().end());
  auto workspace = LaunchWorkspace(env, blob_store);
  if (!workspace.ok()) return workspace.status();
  auto pid = supervisor_->Launch(key, peers, blob_store, env, *workspace);
  if (!pid.ok()) return pid.status();
  control::LaunchReplicaReply reply;
  reply.set_pid(*pid);
  NudgeHeartbeat();
  return reply;
}

Result<std::optional<workspace::KernelWorkspace>> Daemon::LaunchWorkspace(
    const std::map<std::string, std::string>& env, const std::string& blob_store) const {
  auto visible = env.find(workspace::kVisibleEnv);
  if (visible == env.end()) return std::optional<workspace::KernelWorkspace>();
  if (options_.workspace_root.empty()) {
    return Unavailable(
        fmt::format("the kernel runs in the workspace {}, but server {} exports none (nbos daemon "
                    "--workspace-root)",
                    visible->second, options_.server_id));
  }
  auto working = env.find(workspace::kWorkingDirEnv);
  workspace::KernelWorkspace asked{visible->second,
                                   working == env.end() ? visible->second : working->second};
  std::vector<std::string> state = {options_.state_dir, replicas_dir_};
  if (!raft_log_root_.empty()) state.push_back(raft_log_root_);
  if (blob_store.starts_with("dir://")) state.push_back(blob_store.substr(6));
  auto checked = workspace::CheckOnServer(options_.workspace_root, asked, state);
  if (!checked.ok()) {
    return Status(checked.status().code(),
                  "server " + options_.server_id + ": " + checked.status().message());
  }
  return std::optional<workspace::KernelWorkspace>(*checked);
}

Status Daemon::StopReplica(const control::StopReplicaRequest& req) {
  if (Status s = ValidateKey(req.kernel_id(), req.replica_id()); !s.ok()) return s;
  ReplicaKey key{req.kernel_id(), req.replica_id()};
  // Without mu_: this waits out the grace period, and grants for other replicas go on.
  Status stopped = supervisor_->Stop(key, req.keep_data());
  bool known = false;
  {
    MutexLock lock(&mu_);
    known = ledger_.IsSubscribed(key);
    for (const std::string& id : ledger_.Unsubscribe(key)) {
      spdlog::info("replica {} stopped holding grant {}; released", key.ToString(), id);
    }
    auto it = ports_.find(key);
    if (it != ports_.end()) {
      port_allocator_.Release(it->second);
      ports_.erase(it);
    }
  }
  NudgeHeartbeat();
  if (stopped.code() == StatusCode::kNotFound && known) return Status::Ok();
  return stopped;
}

control::GrantReply Daemon::Grant(const control::GrantRequest& req) {
  control::GrantReply reply;
  if (Status s = ValidateKey(req.kernel_id(), req.replica_id()); !s.ok()) {
    reply.set_reason(s.message());
    return reply;
  }
  if (req.exec_id().empty()) {
    reply.set_reason("a grant needs an exec id");
    return reply;
  }
  ReplicaKey key{req.kernel_id(), req.replica_id()};
  GrantDecision d;
  {
    MutexLock lock(&mu_);
    d = ledger_.Grant(key, req.exec_id(), req.gpus(), req.vram_mb(), NewUuid());
  }
  reply.set_granted(d.granted);
  if (d.granted) {
    reply.set_grant_id(d.grant.grant_id);
    for (int id : d.grant.device_ids) reply.add_device_ids(id);
    if (!d.repeated) {
      spdlog::info("grant {}: GPUs [{}] to {} for {}", d.grant.grant_id,
                   fmt::join(d.grant.device_ids, ","), key.ToString(), req.exec_id());
    }
  } else {
    reply.set_reason(d.reason);
    spdlog::info("grant refused to {} for {}: {}", key.ToString(), req.exec_id(), d.reason);
  }
  return reply;
}

control::ReleaseReply Daemon::Release(const control::ReleaseRequest& req) {
  control::ReleaseReply reply;
  MutexLock lock(&mu_);
  reply.set_released(ledger_.Release(req.grant_id()));
  if (reply.released()) spdlog::debug("grant {} released", req.grant_id());
  return reply;
}

control::ServerStatus Daemon::GetStatus() const {
  control::ServerStatus status;
  status.set_server_id(options_.server_id);
  status.set_gpus_virtual(gpus_.is_virtual);
  {
    MutexLock lock(&mu_);
    control::Ledger* l = status.mutable_ledger();
    ToProto(ledger_.spec(), l->mutable_spec());
    ToProto(ledger_.subscribed(), l->mutable_subscribed());
    ToProto(ledger_.committed(), l->mutable_committed());
    for (int id : ledger_.idle_device_ids()) l->add_idle_gpu_ids(id);
  }
  for (const ReplicaProcess& p : supervisor_->List()) {
    control::ReplicaStatus* r = status.add_replicas();
    r->set_kernel_id(p.key.kernel_id);
    r->set_replica_id(p.key.replica_id);
    r->set_pid(p.pid);
    r->set_state(std::string(ReplicaStateName(p.state)));
    r->set_exit_code(p.exit_code);
    r->set_exit_reason(p.exit_reason);
    r->set_restarts(p.restarts);
  }
  const WarmPoolStats warm = supervisor_->warm_pool();
  control::WarmPool* w = status.mutable_warm_pool();
  w->set_ready(warm.ready);
  w->set_starting(warm.starting);
  w->set_target(options_.warm_pool_size);
  w->set_promoted(warm.promoted);
  w->set_cold(warm.cold);
  w->set_disabled(warm.disabled);
  return status;
}

void Daemon::OnReplicaExit(const ReplicaKey& key, int exit_code, bool restarting) {
  {
    // A dead process holds no GPU: whatever it was granted is free again.
    MutexLock lock(&mu_);
    for (const std::string& id : ledger_.ReleaseAll(key)) {
      spdlog::warn("replica {} exited ({}) holding grant {}; released", key.ToString(), exit_code,
                   id);
    }
  }
  (void)restarting;
  NudgeHeartbeat();
}

void Daemon::NudgeHeartbeat() {
  // Notified under the lock: Shutdown takes it after the last RPC handler returned, so the
  // condition variable is never destroyed while a handler still signals it.
  MutexLock lock(&reg_mu_);
  heartbeat_now_ = true;
  reg_cv_.SignalAll();
}

struct Daemon::GatewayLink {
  std::unique_ptr<control::Gateway::Stub> stub;
  std::chrono::milliseconds interval;  // between heartbeats, as the gateway asked
  bool registered = false;
  bool warned = false;  // one warning per unreachable streak, not one per retry
};

void Daemon::RegistrationLoop() {
  // gRPC's default reconnect backoff starts at 1 s and grows to 120 s; a gateway that restarts
  // should see its servers again within a couple of seconds.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  // gRPC reads "min reconnect backoff" as the minimum time a connection attempt (TCP connect and
  // HTTP/2 handshake) is given before it is abandoned: 100 ms failed every first call on a
  // loaded machine. 5 s, the calls' own deadline.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 5000);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  control::AddChannelArguments(options_.credential, &args);
  auto channel = grpc::CreateCustomChannel(options_.gateway_address,
                                           control::ChannelCredentials(options_.credential), args);
  GatewayLink link{control::Gateway::NewStub(channel), options_.default_heartbeat_interval};
  MutexLock lock(&reg_mu_);
  while (!stopping_) {
    heartbeat_now_ = false;
    lock.Unlock();
    const std::chrono::milliseconds wait =
        link.registered ? HeartbeatOnce(link) : RegisterOnce(link);
    lock.Lock();
    registered_ = link.registered;
    // A nudge (a replica exited or changed) sends the next heartbeat early; it does not make
    // registration retries any faster.
    const auto deadline = std::chrono::steady_clock::now() + wait;
    while (!stopping_ && !(link.registered && heartbeat_now_) &&
           reg_cv_.WaitUntil(&reg_mu_, deadline)) {
    }
  }
}

std::chrono::milliseconds Daemon::RegisterOnce(GatewayLink& link) {
  control::RegisterRequest req;
  req.set_server_id(options_.server_id);
  req.set_daemon_address(address_);
  {
    MutexLock ledger_lock(&mu_);
    ToProto(ledger_.spec(), req.mutable_spec());
  }
  req.set_gpus_virtual(gpus_.is_virtual);
  control::RegisterReply reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + options_.gateway_rpc_timeout);
  grpc::Status s = link.stub->Register(&ctx, req, &reply);
  if (!s.ok()) {
    if (!link.warned) {
      spdlog::warn("daemon {}: cannot register with gateway {}: {}", options_.server_id,
                   options_.gateway_address, s.error_message());
      link.warned = true;
    }
    return options_.register_retry;
  }
  link.registered = true;
  link.warned = false;
  if (reply.heartbeat_interval_ms() > 0) {
    link.interval = std::chrono::milliseconds(reply.heartbeat_interval_ms());
  }
  spdlog::info("daemon {} registered with gateway {} (heartbeat every {} ms)", options_.server_id,
               options_.gateway_address, link.interval.count());
  return std::chrono::milliseconds(0);  // the gateway wants the ledger right away
}

std::chrono::milliseconds Daemon::HeartbeatOnce(GatewayLink& link) {
  control::HeartbeatRequest req;
  *req.mutable_status() = GetStatus();
  control::HeartbeatReply reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + options_.gateway_rpc_timeout);
  grpc::Status s = link.stub->Heartbeat(&ctx, req, &reply);
  if (!s.ok()) {
    // The gateway may have restarted and lost us; register again when it is back.
    spdlog::warn("daemon {}: heartbeat to {} failed: {}", options_.server_id,
                 options_.gateway_address, s.error_message());
    link.registered = false;
    link.warned = true;
    return options_.register_retry;
  }
  if (!reply.known()) {
    spdlog::info("daemon {}: gateway does not know this server; registering again",
                 options_.server_id);
    link.registered = false;
    return std::chrono::milliseconds(0);
  }
  return link.interval;
}

}  // namespace nbos::daemon
