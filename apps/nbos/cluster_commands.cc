#include "cluster_commands.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "common/ids.h"
#include "common/log.h"
#include "common/spawn.h"
#include "control/cluster_credential.h"
#include "daemon/daemon.h"
#include "gateway/gateway.h"
#include "gateway/kubernetes_host_provider.h"
#include "gateway/local_host_provider.h"
#include "jupyter_frontend_config.h"

namespace nbos::app {
namespace {

namespace fs = std::filesystem;

// Blocks SIGINT, SIGTERM and SIGHUP in this thread and every thread it starts, so that
// WaitForSignal receives them.
sigset_t BlockStopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

// The token from the environment, which is then cleared: nothing this process starts (daemons,
// replicas) inherits it.
std::string TakeTokenFromEnvironment() {
  const char* t = std::getenv("NBOS_TOKEN");
  std::string token = t ? t : "";
  unsetenv("NBOS_TOKEN");
  return token;
}

int WaitForSignal(const sigset_t& set) {
  int signal_number = 0;
  sigwait(&set, &signal_number);
  return signal_number;
}

// A TCP port on 127.0.0.1 that was free a moment ago.
int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

std::string DefaultStateDir() {
  if (const char* xdg = std::getenv("XDG_STATE_HOME"); xdg && *xdg)
    return std::string(xdg) + "/nbos";
  if (const char* home = std::getenv("HOME"); home && *home)
    return std::string(home) + "/.local/state/nbos";
  return "/tmp/nbos-" + std::to_string(getuid());
}

struct GatewayArgs {
  gateway::GatewayOptions options;
  std::string credential_file;
  std::string log_level = "info";
  // Auto-scaling with servers started on this machine (local_host_provider.h); 0: off.
  int local_hosts = 0;
  gateway::LocalHostOptions local;
  std::string local_ports;
  // Auto-scaling with daemon Pods on Kubernetes (kubernetes_host_provider.h); 0: off.
  int kubernetes_hosts = 0;
  std::string kubernetes_pod_template;
  std::string kubernetes_namespace;
  double idle_suspend_minutes = 0;
  double blob_gc_interval_s = 600, blob_gc_grace_s = 3600;
  bool hub_auth = false;  // --auth jupyterhub
  auth::HubOptions hub;
};
struct DaemonArgs {
  daemon::DaemonOptions options;
  std::string credential_file;
  std::string log_level = "info";
  bool virtual_gpus_only = false;
  std::string replica_ports;
};
struct UpArgs {
  int hosts = 4;
  int max_hosts = 0;  // 0: --hosts (a fixed cluster)
  int scaling_interval_ms = 15000;
  int gpus_per_host = 2;
  int port = 8889;
  int warm_pool = 1;
  std::string sandbox = "auto";
  std::vector<std::string> sandbox_share;
  std::string raft_log_dir = "auto";
  bool frontend = false;
  int frontend_port = 0;     // 0: any free port
  std::string frontend_dir;  // its notebooks; default: the current directory
  // The workspace kernels run in (gateway and daemons --workspace-root); default: the front
  // end's directory, else the current directory.
  std::string workspace_root;
  std::string state_dir;
  std::string decision_journal;
  std::string blob_store;  // default dir://STATE/blobs
  std::string credential;  // default STATE/cluster.credential, created when missing
  int rebalance_interval_ms = 0;
  double idle_suspend_minutes = 0;
  double blob_gc_interval_s = 600, blob_gc_grace_s = 3600;
  std::string token;
  std::string users_file;
  int max_kernels_per_user = 0;
  int max_gpus_per_user = 0;
  std::string log_level = "info";
};

// With --local-hosts: the gateway starts its servers itself and scales between --local-hosts
// and --max-hosts of them.
Status ConfigureLocalHosts(GatewayArgs& args, const std::string& self_path) {
  if (args.local_hosts <= 0) return Status::Ok();
  gateway::LocalHostOptions& l = args.local;
  if (l.max_hosts < args.local_hosts) l.max_hosts = args.local_hosts;
  if (args.options.control_address.ends_with(":0")) {
    return InvalidArgument("--local-hosts needs a fixed --control-address port");
  }
  if (!args.local_ports.empty()) {
    auto range = daemon::PortRange::Parse(args.local_ports);
    if (!range.ok()) return range.status();
    l.ports = *range;
  }
  l.nbos_binary = self_path;
  l.control_address = args.options.control_address;
  if (l.state_dir.empty()) l.state_dir = args.options.state_dir;
  if (l.blob_store_url.empty()) l.blob_store_url = "dir://" + l.state_dir + "/blobs";
  if (args.options.blob_store_url.empty()) args.options.blob_store_url = l.blob_store_url;
  l.log_level = args.log_level;
  l.credential_file = args.credential_file;
  args.options.min_hosts = args.local_hosts;
  args.options.max_hosts = l.max_hosts;
  args.options.gpus_per_host = l.gpus_per_host;
  args.options.host_provider = std::make_shared<gateway::LocalHostProvider>(l);
  return Status::Ok();
}

// With --kubernetes-hosts: the gateway creates daemon Pods from --kubernetes-pod-template (JSON)
// and scales between --kubernetes-hosts and --max-hosts of them.
Status ConfigureKubernetesHosts(GatewayArgs& args) {
  if (args.kubernetes_hosts <= 0) return Status::Ok();
  if (args.local_hosts > 0)
    return InvalidArgument("--local-hosts and --kubernetes-hosts exclude each other");
  std::ifstream in(args.kubernetes_pod_template);
  const nlohmann::json pod = nlohmann::json::parse(in, nullptr, false);
  if (!in || pod.is_discarded()) {
    return InvalidArgument("--kubernetes-pod-template: cannot read a JSON Pod from '" +
                           args.kubernetes_pod_template + "'");
  }
  gateway::KubernetesHostOptions k;
  k.namespace_name = args.kubernetes_namespace;
  if (k.namespace_name.empty()) {
    std::ifstream ns("/var/run/secrets/kubernetes.io/serviceaccount/namespace");
    std::getline(ns, k.namespace_name);
  }
  k.pod_template = pod;
  k.max_hosts = std::max(args.local.max_hosts, args.kubernetes_hosts);
  auto api = gateway::ConnectKubeApi({});
  if (!api.ok()) return api.status();
  auto provider = gateway::KubernetesHostProvider::Create(k, std::move(*api));
  if (!provider.ok()) return provider.status();
  args.options.min_hosts = args.kubernetes_hosts;
  args.options.max_hosts = k.max_hosts;
  args.options.gpus_per_host = args.local.gpus_per_host;
  args.options.host_provider = std::move(*provider);
  return Status::Ok();
}

// --credential FILE, when given, into `out`; false (said on stderr) when it cannot be read.
bool LoadCredential(const std::string& file, const char* command,
                    std::shared_ptr<const control::ClusterCredential>* out) {
  if (file.empty()) return true;
  auto credential = control::ReadClusterCredential(file);
  if (!credential.ok()) {
    std::cerr << "nbos " << command << ": " << credential.status().message() << "\n";
    return false;
  }
  *out = *credential;
  return true;
}

int RunGateway(GatewayArgs& args, const std::string& self_path) {
  const sigset_t signals = BlockStopSignals();
  InitLogging(STDERR_FILENO, args.log_level, "gateway");
  const std::string env_token = TakeTokenFromEnvironment();
  if (args.options.token.empty()) args.options.token = env_token;
  if (args.hub_auth) {
    if (args.hub.api_url.empty()) {
      if (const char* url = std::getenv("JUPYTERHUB_API_URL")) args.hub.api_url = url;
    }
    args.options.hub = args.hub;
  }
  if (Status s = ConfigureLocalHosts(args, self_path);
      !s.ok() || !(s = ConfigureKubernetesHosts(args)).ok()) {
    std::cerr << "nbos gateway: " << s.message() << "\n";
    return 2;
  }
  args.options.idle_suspend_ms = static_cast<int64_t>(args.idle_suspend_minutes * 60'000);
  args.options.blob_gc_interval_ms = static_cast<int64_t>(args.blob_gc_interval_s * 1000);
  args.options.blob_gc_grace_ms = static_cast<int64_t>(args.blob_gc_grace_s * 1000);
  if (!args.options.workspace_root.empty()) {
    // Lexical only: the gateway need not mount the workspace (its daemons check it).
    args.options.workspace_root = fs::absolute(args.options.workspace_root).lexically_normal();
    if (args.options.workspace_root.ends_with('/')) args.options.workspace_root.pop_back();
    if (args.options.workspace_root.empty()) {
      std::cerr << "nbos gateway: --workspace-root must be a directory other than /\n";
      return 2;
    }
  }
  if (!LoadCredential(args.credential_file, "gateway", &args.options.credential)) return 2;
  auto gw = gateway::Gateway::Start(args.options);
  if (!gw.ok()) {
    std::cerr << "nbos gateway: " << gw.status().message() << "\n";
    return 1;
  }
  std::cout << "gateway: http://" << args.options.address << ":" << (*gw)->port()
            << " control: " << (*gw)->control_address() << std::endl;
  while (WaitForSignal(signals) == SIGHUP) {
    if (Status s = (*gw)->ReloadUsers(); !s.ok()) {
      spdlog::error("users file not reloaded (the users already loaded stay): {}", s.message());
    } else if (!args.options.users_file.empty()) {
      spdlog::info("users file {} reloaded", args.options.users_file);
    }
  }
  (*gw)->Stop();
  return 0;
}

int RunDaemon(DaemonArgs& args, const std::string& self_path) {
  const sigset_t signals = BlockStopSignals();
  InitLogging(STDERR_FILENO, args.log_level, "daemon");
  if (args.options.nbos_binary.empty()) args.options.nbos_binary = self_path;
  if (args.virtual_gpus_only) args.options.gpu_source = daemon::GpuSource::kVirtual;
  if (!args.replica_ports.empty()) {
    auto range = daemon::PortRange::Parse(args.replica_ports);
    if (!range.ok()) {
      std::cerr << "nbos daemon: --replica-ports: " << range.status().message() << "\n";
      return 2;
    }
    args.options.replica_ports = *range;
  }
  if (!LoadCredential(args.credential_file, "daemon", &args.options.credential)) return 2;
  // Replicas run other people's code: the cluster's credential is not theirs to read.
  if (!args.credential_file.empty()) args.options.sandbox_hide.push_back(args.credential_file);
  auto d = daemon::Daemon::Start(args.options);
  if (!d.ok()) {
    std::cerr << "nbos daemon: " << d.status().message() << "\n";
    return 1;
  }
  std::cout << "daemon " << (*d)->server_id() << ": " << (*d)->address() << std::endl;
  while (WaitForSignal(signals) == SIGHUP) {
  }
  (*d)->Shutdown();
  return 0;
}

// ---------- nbos up ----------

struct Child {
  std::string name;
  std::vector<std::string> argv;
  std::map<std::string, std::string> env;  // besides this process's environment
  pid_t pid = -1;
  int restarts = 0;
};

pid_t Spawn(const Child& c, const std::string& log_path) {
  std::vector<std::string> environment = BuildEnvironment({c.env});
  std::vector<char*> envp;
  for (std::string& e : environment) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<char*> argv;
  for (const std::string& a : c.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid != 0) return pid;
  // Child: default signal mask and handlers, output to its log.
  sigset_t none;
  sigemptyset(&none);
  pthread_sigmask(SIG_SETMASK, &none, nullptr);
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  FILE* log = std::fopen(log_path.c_str(), "a");
  if (log != nullptr) {
    dup2(fileno(log), STDOUT_FILENO);
    dup2(fileno(log), STDERR_FILENO);
  }
  execve(argv[0], argv.data(), envp.data());
  _exit(127);
}

// Polls `url`'s /api until it answers or `timeout` passes; uses a plain socket (no client
// library for one GET).
bool GatewayAnswers(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // Something else on the port may accept and never answer.
  const timeval wait{.tv_sec = 1, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof(wait));
  bool ok = false;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = "GET /api HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[64] = {};
      ok =
          read(fd, buf, sizeof(buf) - 1) > 0 && std::string(buf).find(" 200 ") != std::string::npos;
    }
  }
  close(fd);
  return ok;
}

// `nbos up --frontend`: Debian's Jupyter Notebook 6 on the gateway (--gateway-url), so a browser
// is all a user needs. Its token and the gateway's go by environment, not command line.
Child FrontendChild(UpArgs& args) {
  if (args.frontend_port == 0) args.frontend_port = FreePort();
  if (args.frontend_dir.empty()) args.frontend_dir = fs::current_path().string();
  std::error_code ec;
  const std::string config_dir = args.state_dir + "/frontend/config";
  fs::create_directories(config_dir, ec);
  // Notebook 6 reads the first, front ends on jupyter_server the second.
  for (const char* name : {"jupyter_notebook_config.py", "jupyter_server_config.py"})
    std::ofstream(config_dir + "/" + name, std::ios::trunc) << kJupyterFrontendConfig;
  Child c{"frontend",
          {"/usr/bin/python3", "-m", "notebook", "--no-browser", "--ip=127.0.0.1",
           "--port=" + std::to_string(args.frontend_port), "--port-retries=0",
           "--notebook-dir=" + fs::absolute(args.frontend_dir).string()},
          {{"JUPYTER_GATEWAY_URL", "http://127.0.0.1:" + std::to_string(args.port)},
           {"JUPYTER_GATEWAY_AUTH_TOKEN", args.token},
           {"JUPYTER_TOKEN", args.token},
           {"JUPYTER_CONFIG_DIR", config_dir},
           {"JUPYTER_RUNTIME_DIR", args.state_dir + "/frontend/runtime"}}};
  if (geteuid() == 0) c.argv.push_back("--allow-root");
  return c;
}

void StopAll(std::vector<Child>& children, std::chrono::seconds grace) {
  // Daemons first (they stop their replicas), then the gateway.
  for (auto it = children.rbegin(); it != children.rend(); ++it) {
    if (it->pid <= 0) continue;
    kill(it->pid, SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + grace;
    int status;
    while (waitpid(it->pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(it->pid, SIGKILL);
        waitpid(it->pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    it->pid = -1;
  }
  // Orphans (replicas of a daemon that was killed) were re-parented to us as the subreaper.
  for (;;) {
    bool any = false;
    for (const ProcessEntry& p : ListProcesses()) {
      if (p.ppid != getpid()) continue;
      const pid_t pid = p.pid;
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      any = true;
    }
    if (!any) break;
  }
}

// The gateway's arguments that make it start and scale the servers itself.
void AppendLocalHostArgs(const UpArgs& args, std::vector<std::string>* argv) {
  for (std::string a :
       {std::string("--local-hosts"), std::to_string(args.hosts), std::string("--max-hosts"),
        std::to_string(args.max_hosts), std::string("--scaling-interval-ms"),
        std::to_string(args.scaling_interval_ms), std::string("--gpus-per-host"),
        std::to_string(args.gpus_per_host), std::string("--local-hosts-dir"), args.state_dir,
        std::string("--local-warm-pool"), std::to_string(args.warm_pool),
        std::string("--local-blob-store"), args.blob_store, std::string("--local-sandbox"),
        args.sandbox, std::string("--local-raft-log-dir"), args.raft_log_dir}) {
    argv->push_back(std::move(a));
  }
  for (const std::string& dir : args.sandbox_share) {
    argv->push_back("--local-sandbox-share");
    argv->push_back(fs::absolute(dir).string());
  }
  argv->push_back("--local-workspace-root");
  argv->push_back(args.workspace_root);
}

int CreateCredential(const std::string& path) {
  auto created = control::CreateClusterCredential();
  Status s = created.ok() ? control::WriteClusterCredential(path, *created) : created.status();
  if (!s.ok()) {
    std::cerr << "nbos credential create: " << s.message() << "\n";
    return 1;
  }
  std::cout << "cluster credential written to " << path
            << ": give it to the gateway and every daemon (--credential)\n";
  return 0;
}

// The cluster credential of `nbos up`: the one named, or STATE/cluster.credential (made once).
Status EnsureCredential(UpArgs& args) {
  if (args.credential.empty()) {
    args.credential = args.state_dir + "/cluster.credential";
    if (!fs::exists(args.credential)) {
      auto created = control::CreateClusterCredential();
      if (!created.ok()) return created.status();
      if (Status s = control::WriteClusterCredential(args.credential, *created); !s.ok()) return s;
    }
  }
  return control::ReadClusterCredential(args.credential).status();
}

// Checks `nbos up`'s arguments and fills in their defaults: the state directory (created), the
// token, the blob store, the credential and the gateway's port. Returns the exit code to stop
// with, or nullopt to go on.
std::optional<int> PrepareUp(UpArgs& args) {
  if (args.hosts < 3 || args.hosts > 64) {
    std::cerr << "nbos up: --hosts must be 3 to 64 (each kernel has three replicas)\n";
    return 2;
  }
  if (args.max_hosts == 0) args.max_hosts = args.hosts;
  if (args.max_hosts < args.hosts || args.max_hosts > 64) {
    std::cerr << "nbos up: --max-hosts must be --hosts to 64\n";
    return 2;
  }
  if (args.state_dir.empty()) args.state_dir = DefaultStateDir();
  const std::string env_token = TakeTokenFromEnvironment();
  if (args.token.empty()) args.token = env_token;
  if (args.token.empty()) {
    args.token = NewUuid();
    args.token.erase(std::remove(args.token.begin(), args.token.end(), '-'), args.token.end());
  }
  std::error_code ec;
  fs::create_directories(args.state_dir + "/logs", ec);
  if (ec) {
    std::cerr << "nbos up: cannot create " << args.state_dir << ": " << ec.message() << "\n";
    return 1;
  }
  args.state_dir = fs::canonical(args.state_dir).string();
  if (args.blob_store.empty()) args.blob_store = "dir://" + args.state_dir + "/blobs";
  if (Status s = EnsureCredential(args); !s.ok()) {
    std::cerr << "nbos up: " << s.message() << "\n";
    return 1;
  }
  if (args.port == 0) args.port = FreePort();
  if (args.frontend && args.frontend_dir.empty()) args.frontend_dir = fs::current_path().string();
  if (args.workspace_root.empty()) {
    args.workspace_root = args.frontend ? args.frontend_dir : fs::current_path().string();
  }
  args.workspace_root = fs::weakly_canonical(fs::absolute(args.workspace_root), ec).string();
  if (ec || !fs::is_directory(args.workspace_root) || args.workspace_root == "/") {
    std::cerr << "nbos up: the workspace " << args.workspace_root
              << " must be a directory other than / (--workspace-root)\n";
    return 2;
  }
  return std::nullopt;
}

Child GatewayChild(const UpArgs& args, const std::string& self_path, const std::string& control) {
  // The token goes by environment: a command line is readable by every process on the machine.
  Child gateway{"gateway",
                {self_path, "gateway", "--port", std::to_string(args.port), "--control-address",
                 control, "--state-dir", args.state_dir + "/gateway", "--credential",
                 args.credential, "--log-level", args.log_level, "--max-kernels-per-user",
                 std::to_string(args.max_kernels_per_user), "--max-gpus-per-user",
                 std::to_string(args.max_gpus_per_user), "--workspace-root", args.workspace_root},
                {{"NBOS_TOKEN", args.token}}};
  auto add = [&](std::string flag, std::string value) {
    gateway.argv.push_back(std::move(flag));
    gateway.argv.push_back(std::move(value));
  };
  if (!args.users_file.empty()) add("--users", fs::absolute(args.users_file).string());
  if (args.rebalance_interval_ms > 0)
    add("--rebalance-interval-ms", std::to_string(args.rebalance_interval_ms));
  if (args.idle_suspend_minutes > 0)
    add("--idle-suspend-minutes", fmt::format("{}", args.idle_suspend_minutes));
  if (!args.decision_journal.empty())
    add("--decision-journal", fs::absolute(args.decision_journal).string());
  add("--blob-store", args.blob_store);
  add("--blob-gc-interval-s", fmt::format("{}", args.blob_gc_interval_s));
  add("--blob-gc-grace-s", fmt::format("{}", args.blob_gc_grace_s));
  // With auto-scaling the gateway starts and stops the servers itself (LocalHostProvider).
  if (args.max_hosts > args.hosts) AppendLocalHostArgs(args, &gateway.argv);
  return gateway;
}

// The daemons of a fixed cluster, host-1 .. host-N, started as the gateway's LocalHostProvider
// starts them. Daemons on one machine get disjoint replica port ranges: one port probed free by
// two of them would otherwise reach two replicas.
std::vector<Child> DaemonChildren(const UpArgs& args, const std::string& self_path,
                                  const std::string& control) {
  gateway::LocalHostOptions hosts;
  hosts.nbos_binary = self_path;
  hosts.control_address = control;
  hosts.state_dir = args.state_dir;
  hosts.blob_store_url = args.blob_store;
  hosts.credential_file = args.credential;
  hosts.gpus_per_host = args.gpus_per_host;
  hosts.warm_pool = args.warm_pool;
  hosts.sandbox = args.sandbox;
  hosts.raft_log_dir = args.raft_log_dir;
  hosts.workspace_root = args.workspace_root;
  for (const std::string& dir : args.sandbox_share)
    hosts.sandbox_share.push_back(fs::absolute(dir).string());
  hosts.max_hosts = args.hosts;
  hosts.log_level = args.log_level;
  std::vector<Child> daemons;
  for (int i = 1; i <= args.hosts; ++i) {
    daemons.push_back(Child{"host-" + std::to_string(i), gateway::LocalDaemonArgv(hosts, i), {}});
  }
  return daemons;
}

// Starts the gateway (children[0]) and waits up to 30 s for it to answer; false (and the gateway
// stopped) if it exits or does not answer.
bool StartGateway(std::vector<Child>& children, const UpArgs& args, const std::string& log_path) {
  children[0].pid = Spawn(children[0], log_path);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!GatewayAnswers(args.port)) {
    int status;
    if (waitpid(children[0].pid, &status, WNOHANG) == children[0].pid ||
        std::chrono::steady_clock::now() > deadline) {
      std::cerr << "nbos up: the gateway did not start; see " << log_path << "\n";
      children[0].pid = -1;
      StopAll(children, std::chrono::seconds(5));
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return true;
}

// Serves until a stop signal; restarts a child that dies (a restarted gateway finds its kernels
// in its database, a restarted daemon its replicas' directories). Returns the signal.
int ServeUp(std::vector<Child>& children, const sigset_t& signals,
            const std::function<std::string(const Child&)>& log_of) {
  std::atomic<bool> stop{false};
  std::thread reaper([&] {
    while (!stop.load()) {
      int status;
      pid_t pid = waitpid(-1, &status, WNOHANG);
      if (pid <= 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      for (Child& c : children) {
        if (c.pid != pid || stop.load()) continue;
        std::cerr << "nbos up: " << c.name << " exited (status " << status << "); restarting\n";
        ++c.restarts;
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        c.pid = Spawn(c, log_of(c));
      }
    }
  });
  int signal_number;
  while ((signal_number = WaitForSignal(signals)) == SIGHUP) {
    if (children[0].pid > 0) kill(children[0].pid, SIGHUP);  // the gateway re-reads its users
  }
  stop = true;
  reaper.join();
  return signal_number;
}

int RunUp(UpArgs& args, const std::string& self_path) {
  const sigset_t signals = BlockStopSignals();
  const bool any_port = args.port == 0;
  if (std::optional<int> code = PrepareUp(args)) return *code;
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  auto log_of = [&](const Child& c) { return args.state_dir + "/logs/" + c.name + ".log"; };
  std::vector<Child> children;
  // A port found free may be taken before the gateway binds it (FreePort closes its socket):
  // the gateway then exits, and a second try with other ports goes on.
  for (int attempt = 1;; ++attempt) {
    const std::string control = "127.0.0.1:" + std::to_string(FreePort());
    children = {GatewayChild(args, self_path, control)};
    // Without auto-scaling the daemons are this process's children, restarted when they die.
    if (args.max_hosts == args.hosts) {
      for (Child& d : DaemonChildren(args, self_path, control)) children.push_back(std::move(d));
    }
    if (StartGateway(children, args, log_of(children[0]))) break;
    if (attempt == 3) return 1;
    std::cerr << "nbos up: starting the gateway again on "
              << (any_port ? "other ports" : "another control port") << "\n";
    if (any_port) args.port = FreePort();
  }
  if (args.frontend) children.push_back(FrontendChild(args));  // the last one: stopped first
  for (size_t i = 1; i < children.size(); ++i)
    children[i].pid = Spawn(children[i], log_of(children[i]));
  std::cout << "gateway: http://127.0.0.1:" << args.port << " token: " << args.token << std::endl;
  if (args.frontend) {
    std::cout << "frontend: http://127.0.0.1:" << args.frontend_port << "/?token=" << args.token
              << std::endl;
  }
  const int signal_number = ServeUp(children, signals, log_of);
  std::cerr << "nbos up: " << strsignal(signal_number) << ", stopping\n";
  StopAll(children, std::chrono::seconds(15));
  return 0;
}

// `nbos gateway`: serving, users and kernels.
void AddGatewayOptions(CLI::App* gw, GatewayArgs* args) {
  gw->add_option("--address", args->options.address, "HTTP bind address")->capture_default_str();
  gw->add_option("--port", args->options.port, "HTTP port (0: any)")->capture_default_str();
  gw->add_option("--control-address", args->options.control_address,
                 "host:port of the gRPC service daemons register with")
      ->capture_default_str();
  gw->add_option("--token", args->options.token, "Token clients must send (default: $NBOS_TOKEN)");
  gw->add_flag("--allow-unauthenticated", args->options.allow_unauthenticated,
               "Serve without a token");
  gw->add_option("--users", args->options.users_file,
                 "Users file: JSON [{name, token or token_sha256, admin}]; re-read on SIGHUP");
  gw->add_option_function<std::string>(
        "--auth", [args](const std::string& mode) { args->hub_auth = mode == "jupyterhub"; },
        "token (default; the token and users file) or jupyterhub (also JupyterHub API tokens)")
      ->check(CLI::IsMember({"token", "jupyterhub"}));
  gw->add_option("--hub-api-url", args->hub.api_url,
                 "JupyterHub's API URL for --auth jupyterhub (default: $JUPYTERHUB_API_URL)");
  gw->add_option_function<double>(
      "--hub-cache-seconds",
      [args](double s) { args->hub.cache_ms = static_cast<int64_t>(s * 1000); },
      "How long a token JupyterHub vouched for is trusted without asking again (default 60)");
  gw->add_option("--max-kernels-per-user", args->options.max_kernels_per_user,
                 "Kernels a user who is not an admin may have at once (0: no limit)");
  gw->add_option("--max-gpus-per-user", args->options.max_gpus_per_user,
                 "GPUs a user's kernels (not an admin's) may subscribe at once (0: no limit)");
  gw->add_option("--state-dir", args->options.state_dir, "Where gateway.db lives")->required();
  gw->add_option("--replicas", args->options.replicas, "Replicas per kernel")
      ->capture_default_str();
  gw->add_option("--max-message-bytes", args->options.max_message_bytes,
                 "Largest HTTP body or Jupyter message accepted")
      ->capture_default_str();
  gw->add_option("--workspace-root", args->options.workspace_root,
                 "The directory kernels run in (their notebook's directory inside it), mounted at "
                 "the same path on every server (a shared filesystem); with --users or JupyterHub "
                 "a user who is no admin sees only DIR/<user>");
  gw->add_option("--allowed-env", args->options.allowed_env,
                 "Besides KERNEL_*, environment variables passed to kernels");
  gw->add_option("--kernelspec-alias", args->options.kernelspec_aliases,
                 "More kernelspec names the kernel is served under, so that notebooks naming "
                 "them open unchanged (repeatable; replaces the default; \"\" for none)")
      ->capture_default_str();
  gw->add_option("--decision-journal", args->options.decision_journal,
                 "Write every scheduling decision to this file (JSON lines; nbos sim replay)");
  gw->add_option("--blob-store", args->options.blob_store_url,
                 "The servers' blob store (their --blob-store), whose blobs no kernel needs the "
                 "gateway deletes; with --local-hosts, theirs. Unset: nothing is collected");
  gw->add_option("--blob-gc-interval-s", args->blob_gc_interval_s,
                 "Seconds between rounds of blob collection")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  gw->add_option("--blob-gc-grace-s", args->blob_gc_grace_s,
                 "A blob is deleted once no kernel, journal or snapshot has needed it for this "
                 "many seconds")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  gw->add_option("--idle-suspend-minutes", args->idle_suspend_minutes,
                 "Suspend a kernel idle this long: its state checkpointed to the blob store, its "
                 "replicas stopped; its next request resumes it (0: never; fractions allowed)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  gw->add_option("--rebalance-interval-ms", args->options.rebalance_interval_ms,
                 "Move replicas of idle kernels whose servers lack the GPUs of their last cell "
                 "this often (0: off)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
}

// `nbos gateway`: servers it starts and scales, and its credential.
void AddGatewayScalingOptions(CLI::App* gw, GatewayArgs* args) {
  gw->add_option("--local-hosts", args->local_hosts,
                 "Start this many `nbos daemon` servers (virtual GPUs) on this machine and scale "
                 "between it and --max-hosts (0: servers register on their own)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  gw->add_option("--max-hosts", args->local.max_hosts,
                 "Most servers (auto-scaling, local or Kubernetes)")
      ->capture_default_str();
  gw->add_option("--kubernetes-hosts", args->kubernetes_hosts,
                 "Create this many daemon Pods (from --kubernetes-pod-template) and scale "
                 "between it and --max-hosts; the cluster autoscaler adds the nodes")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  gw->add_option("--kubernetes-pod-template", args->kubernetes_pod_template,
                 "The daemon Pod (JSON) for --kubernetes-hosts");
  gw->add_option("--kubernetes-namespace", args->kubernetes_namespace,
                 "Namespace of the daemon Pods (default: the gateway's own)");
  gw->add_option("--scaling-interval-ms", args->options.scaling_interval_ms,
                 "How often auto-scaling decides")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  gw->add_option("--gpus-per-host", args->local.gpus_per_host, "Virtual GPUs of a local server")
      ->capture_default_str();
  gw->add_option("--local-hosts-dir", args->local.state_dir,
                 "Local servers' state, logs and pid files (default: --state-dir)");
  gw->add_option("--local-blob-store", args->local.blob_store_url,
                 "Blob store of local servers (default dir://HOSTS_DIR/blobs)");
  gw->add_option("--local-warm-pool", args->local.warm_pool,
                 "Pre-started replica processes per local server")
      ->capture_default_str();
  gw->add_option("--local-sandbox", args->local.sandbox,
                 "Replica sandboxes of local servers (nbos daemon --sandbox)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "on", "off"}));
  gw->add_option("--local-sandbox-share", args->local.sandbox_share,
                 "A directory every replica of the local servers may write (repeatable)");
  gw->add_option("--local-workspace-root", args->local.workspace_root,
                 "The servers' --workspace-root");
  gw->add_option("--local-raft-log-dir", args->local.raft_log_dir,
                 "Where replicas of local servers keep their Raft logs (nbos daemon "
                 "--raft-log-dir)")
      ->capture_default_str();
  gw->add_option("--local-replica-ports", args->local_ports,
                 "FIRST-LAST: ports split among local servers");
  gw->add_option("--credential", args->credential_file,
                 "Cluster credential (nbos credential create): TLS and a token between gateway "
                 "and daemons. Without it the control plane is plaintext and open");
  gw->add_option("--log-level", args->log_level)->capture_default_str();
}

void AddDaemonOptions(CLI::App* d, DaemonArgs* args) {
  d->add_option("--server-id", args->options.server_id, "Server name (default: host name)");
  d->add_option("--listen", args->options.listen_address, "host:port of the Daemon service")
      ->capture_default_str();
  d->add_option("--gateway", args->options.gateway_address,
                "host:port of the gateway's control service");
  d->add_option("--state-dir", args->options.state_dir, "Replica directories")->required();
  d->add_option("--raft-log-dir", args->options.raft_log_dir,
                "Where replicas keep their Raft logs: auto (RAM: /dev/shm when it is a tmpfs of "
                "1 GiB or more, else state), state (each replica's directory) or a directory")
      ->capture_default_str();
  d->add_option("--gpus", args->options.virtual_gpus,
                "Virtual GPUs when NVML finds none (or with --virtual-gpus)");
  d->add_flag("--virtual-gpus", args->virtual_gpus_only, "Use virtual GPUs even if NVML works");
  d->add_option("--vram-per-gpu", args->options.vram_mb_per_gpu, "MB of each virtual GPU")
      ->capture_default_str();
  d->add_option("--millicpus", args->options.millicpus, "CPU capacity (0: online CPUs)");
  d->add_option("--memory-mb", args->options.memory_mb, "Memory capacity (0: physical)");
  d->add_option("--blob-store", args->options.blob_store_url,
                "Blob store of the replicas: dir:///path (one machine; default "
                "dir://STATE/blobs), redis://host:port/db or s3://bucket/prefix?endpoint=URL");
  d->add_option("--advertise-ip", args->options.advertise_ip)->capture_default_str();
  d->add_option("--credential", args->credential_file,
                "Cluster credential, the gateway's (nbos credential create)");
  d->add_option("--warm-pool", args->options.warm_pool_size,
                "Pre-started replica processes kept ready for launches")
      ->capture_default_str()
      ->check(CLI::Range(0, 64));
  d->add_option("--warm-preload", args->options.warm_preload,
                "Python modules warm replica processes import ahead (e.g. torch)");
  d->add_option("--replica-ports", args->replica_ports,
                "FIRST-LAST: TCP ports replicas bind, outside the ephemeral range (default " +
                    std::to_string(daemon::PortRange{}.first) + "-" +
                    std::to_string(daemon::PortRange{}.last) + ")");
  d->add_option("--log-level", args->log_level)->capture_default_str();
  d->add_option("--sandbox", args->options.sandbox,
                "Replica sandboxes: auto (where bubblewrap works), on (required) or off")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "on", "off"}));
  d->add_option("--sandbox-hide", args->options.sandbox_hide,
                "A file or directory replicas must not see, besides --state-dir (repeatable)");
  d->add_option("--workspace-root", args->options.workspace_root,
                "The gateway's workspace root, mounted here at the same path (kernels run in it)");
  d->add_option("--sandbox-share", args->options.sandbox_share,
                "A directory every replica may write, e.g. a team's scratch space (repeatable; "
                "its permissions decide which kernels' users can)");
  d->add_option("--max-restarts", args->options.max_restarts,
                "Restarts of a replica that died within 5 minutes before its daemon gives up on "
                "it (the gateway then replaces it, or launches it again if its kernel needs it "
                "for a majority)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
}

// `nbos up`: the cluster and its front end.
void AddUpOptions(CLI::App* up, UpArgs* args) {
  up->add_option("--hosts", args->hosts, "Daemons (servers) to start")->capture_default_str();
  up->add_option("--gpus-per-host", args->gpus_per_host, "Virtual GPUs per server")
      ->capture_default_str();
  up->add_option("--max-hosts", args->max_hosts,
                 "Auto-scaling: grow up to this many servers when the load needs them and shrink "
                 "back to --hosts when idle (default: --hosts, a fixed cluster)")
      ->capture_default_str();
  up->add_option("--scaling-interval-ms", args->scaling_interval_ms,
                 "How often auto-scaling decides")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  up->add_option("--port", args->port, "Gateway HTTP port (0: any)")->capture_default_str();
  up->add_flag("--frontend", args->frontend,
               "Also serve Jupyter Notebook (Debian's, on the gateway) for the browser");
  up->add_option("--frontend-port", args->frontend_port, "Its HTTP port (0: any)")
      ->capture_default_str();
  up->add_option("--frontend-dir", args->frontend_dir,
                 "Where its notebooks live (default: the current directory)");
  up->add_option("--workspace-root", args->workspace_root,
                 "The directory kernels run in, their notebook's directory inside it (default: "
                 "--frontend-dir with --frontend, else the current directory)");
  up->add_option("--warm-pool", args->warm_pool, "Pre-started replica processes per server")
      ->capture_default_str()
      ->check(CLI::Range(0, 64));
  up->add_option("--sandbox", args->sandbox,
                 "Replica sandboxes: auto (where bubblewrap works), on (required) or off; the "
                 "whole --state-dir is hidden from replicas")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "on", "off"}));
  up->add_option("--sandbox-share", args->sandbox_share,
                 "A directory every replica may write, e.g. a team's scratch space (repeatable; "
                 "its permissions decide which kernels' users can)");
  up->add_option("--raft-log-dir", args->raft_log_dir,
                 "Where replicas keep their Raft logs (nbos daemon --raft-log-dir): auto (RAM "
                 "where /dev/shm allows), state or a directory")
      ->capture_default_str();
}

// `nbos up`: state, users and what it passes on to the gateway.
void AddUpGatewayOptions(CLI::App* up, UpArgs* args) {
  up->add_option("--state-dir", args->state_dir, "All state (default ~/.local/state/nbos)");
  up->add_option("--blob-store", args->blob_store,
                 "Blob store of the servers: dir:///path (one machine; default "
                 "dir://STATE/blobs), redis://host:port/db or s3://bucket/prefix?endpoint=URL "
                 "(credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)");
  up->add_option("--token", args->token,
                 "The admin's client token (default: $NBOS_TOKEN or random)");
  up->add_option("--users", args->users_file,
                 "Users file for the gateway (nbos gateway --users); SIGHUP re-reads it");
  up->add_option("--max-kernels-per-user", args->max_kernels_per_user,
                 "Kernels a user who is not an admin may have at once (0: no limit)");
  up->add_option("--max-gpus-per-user", args->max_gpus_per_user,
                 "GPUs a user's kernels (not an admin's) may subscribe at once (0: no limit)");
  up->add_option("--credential", args->credential,
                 "Cluster credential of gateway and daemons (default STATE/cluster.credential, "
                 "created when missing)");
  up->add_option("--decision-journal", args->decision_journal,
                 "The gateway's decision journal (see nbos gateway --help)");
  up->add_option("--blob-gc-interval-s", args->blob_gc_interval_s,
                 "The gateway's blob collection (see nbos gateway --help)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  up->add_option("--blob-gc-grace-s", args->blob_gc_grace_s,
                 "The gateway's blob collection (see nbos gateway --help)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  up->add_option("--idle-suspend-minutes", args->idle_suspend_minutes,
                 "The gateway's suspension of idle kernels (see nbos gateway --help)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  up->add_option("--rebalance-interval-ms", args->rebalance_interval_ms,
                 "The gateway's idle-kernel rebalancing (see nbos gateway --help)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  up->add_option("--log-level", args->log_level)->capture_default_str();
}

}  // namespace

std::function<int()> AddClusterCommands(CLI::App& app, std::string self_path) {
  auto gw_args = std::make_shared<GatewayArgs>();
  auto* gw =
      app.add_subcommand("gateway", "Serve the Jupyter Kernel Gateway API (global scheduler)");
  AddGatewayOptions(gw, gw_args.get());
  AddGatewayScalingOptions(gw, gw_args.get());

  auto d_args = std::make_shared<DaemonArgs>();
  auto* d = app.add_subcommand("daemon", "Run the local scheduler of one GPU server");
  AddDaemonOptions(d, d_args.get());

  auto up_args = std::make_shared<UpArgs>();
  auto* up =
      app.add_subcommand("up", "Start a gateway and daemons with virtual GPUs on this machine");
  AddUpOptions(up, up_args.get());
  AddUpGatewayOptions(up, up_args.get());

  auto credential_file = std::make_shared<std::string>();
  auto* cred = app.add_subcommand("credential", "Manage the cluster credential");
  auto* create = cred->add_subcommand(
      "create", "Write a new cluster credential (CA, certificate, key, token) to FILE, mode 0600");
  create->add_option("FILE", *credential_file, "Where to write it")->required();
  cred->require_subcommand(1);

  return [=]() -> int {
    if (*create) return CreateCredential(*credential_file);
    if (*gw) return RunGateway(*gw_args, self_path);
    if (*d) return RunDaemon(*d_args, self_path);
    if (*up) return RunUp(*up_args, self_path);
    return -1;
  };
}

}  // namespace nbos::app
