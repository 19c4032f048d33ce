#include "gateway/gateway.h"

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "common/work_queue.h"
#include "gateway/blob_gc.h"
#include "gateway/control_plane.h"
#include "gateway/dashboard.h"
#include "gateway/edge_counters.h"
#include "gateway/host_provider.h"
#include "gateway/http_api.h"
#include "gateway/kernel_manager.h"
#include "gateway/metadata_store.h"
#include "gateway/migrator.h"
#include "gateway/planner.h"
#include "gateway/raft_group.h"
#include "gateway/registry.h"
#include "gateway/replica_ops.h"
#include "http/server.h"
#include "sched/journal.h"

namespace nbos::gateway {
// The gateway's parts, in the order they start (and the reverse of the order they stop).
struct Gateway::Impl {
  explicit Impl(GatewayOptions o) : options(std::move(o)) {}

  static sched::SchedulerOptions SchedulerOptionsFor(const GatewayOptions& options) {
    sched::SchedulerOptions o;
    o.auto_scaling = options.host_provider != nullptr;
    o.scaling.min_hosts = options.min_hosts;
    o.scaling.max_hosts = options.max_hosts;
    o.scaling.gpus_per_host = std::max(1, options.gpus_per_host);
    // The cluster's size is what the operator asked for (min_hosts) plus what the load needs.
    o.scaling.buffer_hosts = 0;
    o.rebalance.enabled = options.rebalance_interval_ms > 0;
    // A waiting cell asks again every replan interval (tens of ms); one not heard of for 2 s was
    // given up (interrupted, failed, its kernel held for a migration) and holds no GPUs back.
    o.gpu_wait_expiry_ms = 2000;
    return o;
  }

  GatewayOptions options;
  std::ofstream journal_file;
  std::unique_ptr<sched::JournalWriter> journal;
  std::unique_ptr<MetadataStore> store;
  std::unique_ptr<Registry> registry;
  std::unique_ptr<Migrator> migrator;
  std::unique_ptr<Planner> planner;
  EdgeCounters counters;
  std::unique_ptr<KernelManager> kernels;
  std::unique_ptr<BlobGc> blob_gc;
  std::unique_ptr<ControlPlane> control;
  std::unique_ptr<auth::GatewayAuthenticator> auth;
  std::unique_ptr<HttpApi> api;
  std::unique_ptr<Dashboard> dashboard;
  http::Server http;

  // A kernel whose lost replica could not be replaced (no majority, no server) tries again after
  // this long.
  static constexpr std::chrono::milliseconds kReplacementRetry{2000};
  static constexpr std::chrono::milliseconds kRevivalInterval{5000};
  // Between checks of a kernel's record of its Raft group that nothing made suspect: one
  // question to each replica, answered without waiting.
  static constexpr std::chrono::milliseconds kGroupCheckInterval{30000};
  // A scale-in whose server could not be emptied in this time is called off.
  static constexpr std::chrono::milliseconds kReleaseGiveUp{120000};

  // The monitor: expires silent servers, moves replicas that must move and, with rebalancing or
  // auto-scaling on, ticks the scheduler and scales the cluster.
  std::thread monitor;
  Mutex monitor_mu;
  CondVar monitor_cv;
  bool stopping GUARDED_BY(monitor_mu) = false;
  std::atomic<uint64_t> monitor_exceptions{0};
  KeyedWorkQueue group_checks{1, "group-checks"};  // CheckGroup, off the monitor thread

  Status OpenJournal() {
    if (options.decision_journal.empty()) return Status::Ok();
    // One journal per gateway run: it starts from an empty core, as its replay does.
    journal_file.open(options.decision_journal, std::ios::trunc);
    if (!journal_file) {
      return Unavailable("cannot write the decision journal " + options.decision_journal);
    }
    journal_file << std::unitbuf;  // a record is on disk as soon as it is decided
    journal = std::make_unique<sched::JournalWriter>(journal_file, SchedulerOptionsFor(options));
    return Status::Ok();
  }

  // How often the scheduler ticks: the scaling interval with auto-scaling, else the rebalancing
  // one; 0: never.
  int TickIntervalMs() const {
    if (options.host_provider) return options.scaling_interval_ms;
    return options.rebalance_interval_ms;
  }

  void MonitorRound(SteadyClock::time_point* next_tick) {
    control->CheckServers();
    for (const MovePlan& r : registry->PlanMoves(kReplacementRetry)) {
      spdlog::warn("kernel {}: moving replica {} from {} to {} ({})", r.kernel_id,
                   r.plan.replica_id, r.plan.from_server_id, r.plan.to_server_id, r.reason);
      migrator->Start(r.kernel_id, r.plan, r.reason);
    }
    for (const Revival& r : registry->PlanRevivals(kRevivalInterval)) Revive(r);
    for (KernelRecord& k : registry->PlanGroupChecks(kRevivalInterval, kGroupCheckInterval)) {
      group_checks.Post(k.meta.kernel_id, [this, k = std::move(k)] { CheckGroup(k); });
    }
    std::optional<sched::ScalingDecision> scaling;
    if (TickIntervalMs() > 0 && SteadyClock::now() >= *next_tick) {
      *next_tick = SteadyClock::now() + std::chrono::milliseconds(TickIntervalMs());
      Registry::TickOutcome tick = registry->Tick();
      for (const sched::RebalancePlan& r : tick.rebalance) {
        spdlog::info("kernel {}: moving idle replica {} from {} to {} ({})", r.kernel_id,
                     r.plan.replica_id, r.plan.from_server_id, r.plan.to_server_id, r.plan.reason);
        migrator->Start(r.kernel_id, r.plan, "rebalancing idle kernels");
      }
      scaling = std::move(tick.scaling);
    }
    if (options.host_provider) Scale(scaling);
    if (options.idle_suspend_ms > 0) {
      kernels->SuspendIdle(std::chrono::milliseconds(options.idle_suspend_ms));
    }
  }

  void Revive(const Revival& r) {
    spdlog::warn(
        "kernel {}: launching replica {} on {} again: its daemon gave up restarting it, and the "
        "kernel has no majority without it",
        r.meta.kernel_id, r.replica_id, r.server_id);
    if (!r.client) return;
    if (auto launched = r.client->LaunchReplica(LaunchRequest(r.meta, r.replica_id, {}));
        !launched.ok()) {
      spdlog::error("kernel {}: launching replica {} on {} again: {}", r.meta.kernel_id,
                    r.replica_id, r.server_id, launched.status().ToString());
    }
  }

  // Corrects the gateway's record of kernel `k`'s Raft group by what its leader proves: a
  // replica recorded as leaving that is still a voter counts again (the kernel may have its
  // majority with it), and one counted as a member that a committed change removed is replaced
  // (counted, it overstates the majority, and changes asked through it never commit).
  void CheckGroup(const KernelRecord& k) {
    const std::string& kernel_id = k.meta.kernel_id;
    // Whatever the outcome, even an exception: until then the kernel's migrations wait.
    struct Checked {
      Registry& registry;
      const std::string& kernel_id;
      ~Checked() { registry.GroupChecked(kernel_id); }
    } checked{*registry, kernel_id};
    const auto group = ProvenGroup(AskRaftGroup(k, std::chrono::seconds(5)));
    if (!group) return;
    const GroupDrift drift = DriftFrom(k, *group);
    for (ReplicaId id : drift.kept) {
      if (auto meta = registry->KeepMember(kernel_id, id)) {
        spdlog::warn(
            "kernel {}: replica {}, recorded as leaving the Raft group, is still a member: "
            "it counts again",
            kernel_id, id);
        StoreKernel(*meta, fmt::format("that replica {} stays", id));
      }
    }
    for (ReplicaId id : drift.gone) {
      if (auto meta = registry->NoteGone(kernel_id, id)) {
        spdlog::warn(
            "kernel {}: replica {} is no longer a member of the Raft group (its leader's "
            "committed configuration holds replicas {}): it is replaced",
            kernel_id, id, fmt::join(*group, ", "));
        k.session->ReplicaLost(id, "it is no longer a member of the kernel's Raft group");
        StoreKernel(*meta, fmt::format("that replica {} left the Raft group", id));
      }
    }
  }

  void StoreKernel(const StoredKernel& meta, const std::string& what) {
    if (Status s = store->Put(meta); !s.ok()) {
      spdlog::error("kernel {}: recording {}: {}", meta.kernel_id, what, s.ToString());
    }
  }

  // Carries out auto-scaling: servers asked for (the tick's add_hosts, or one when something
  // found no server), releases begun for the tick's idle servers, emptied servers removed.
  void Scale(const std::optional<sched::ScalingDecision>& decision) {
    HostProvider& provider = *options.host_provider;
    provider.Poll();
    for (const std::string& id : provider.Pending())
      if (registry->ServerAlive(id)) provider.OnRegistered(id);
    int wanted = decision ? decision->add_hosts : 0;
    std::string reason = decision ? decision->reason : "";
    if (std::string why; registry->TakeScaleOutWanted(&why) && wanted == 0) {
      wanted = 1;
      reason = why;
    }
    if (wanted > 0 && provider.Pending().empty()) {
      if (auto added = provider.AddServers(wanted); added.ok()) {
        spdlog::info("scaling out by {} server(s): {}", added->size(), reason);
        registry->NoteScaleOut(*added, reason);
      } else {
        spdlog::warn("scaling out: {}", added.status().ToString());
      }
    }
    if (decision) {
      for (const std::string& id : decision->release_server_ids)
        if (provider.Owns(id)) (void)registry->BeginRelease(id, decision->reason);
    }
    for (const std::string& id : registry->EmptiedServers(kReleaseGiveUp)) {
      if (!provider.Owns(id)) continue;
      if (Status s = provider.RemoveServer(id); !s.ok()) {
        spdlog::warn("scaling in {}: {}", id, s.ToString());
        continue;
      }
      registry->RemoveServer(id, "scale-in: idle and emptied");
    }
  }

  void Monitor() {
    SteadyClock::time_point next_tick = SteadyClock::now();
    MutexLock lock(&monitor_mu);
    while (!stopping) {
      monitor_cv.WaitFor(&monitor_mu, std::chrono::milliseconds(500));
      if (stopping) break;
      lock.Unlock();
      try {
        MonitorRound(&next_tick);
      } catch (const std::exception& e) {
        ++monitor_exceptions;
        spdlog::error("gateway monitor: {}", e.what());
      }
      lock.Lock();
    }
  }

  uint64_t ExceptionsCaught() const {
    return monitor_exceptions.load() + planner->exceptions_caught();
  }

  Status StartParts() {
    if (Status s = OpenJournal(); !s.ok()) return s;
    auto opened = MetadataStore::Open(options.state_dir + "/gateway.db");
    if (!opened.ok()) return opened.status();
    store = std::move(*opened);
    registry = std::make_unique<Registry>(SchedulerOptionsFor(options), journal.get());
    migrator = std::make_unique<Migrator>(registry.get(), store.get());
    planner = std::make_unique<Planner>(registry.get(), migrator.get(), /*threads=*/8);
    KernelManagerOptions ko;
    ko.replicas = options.replicas;
    ko.default_request = options.default_request;
    ko.limits.max_message_bytes = options.max_message_bytes;
    ko.server_timeout = std::chrono::milliseconds(options.server_timeout_ms);
    ko.kernel_start_timeout = std::chrono::milliseconds(options.kernel_start_timeout_ms);
    ko.max_kernels_per_user = options.max_kernels_per_user;
    ko.max_gpus_per_user = options.max_gpus_per_user;
    kernels =
        std::make_unique<KernelManager>(ko, registry.get(), store.get(), planner.get(), &counters);
    if (Status s = kernels->Restore(); !s.ok()) return s;
    if (!options.credential) {
      spdlog::warn(
          "no cluster credential: the control plane is plaintext and takes calls from "
          "anyone who can reach {} (nbos credential create FILE; --credential FILE)",
          options.control_address);
    }
    registry->SetDaemonClientOptions({.credential = options.credential});
    auto control_plane = ControlPlane::Start(
        {options.control_address, options.heartbeat_interval_ms, options.server_timeout_ms,
         options.credential, counters.refused_control_calls},
        registry.get());
    if (!control_plane.ok()) return control_plane.status();
    control = std::move(*control_plane);
    if (auto& provider = options.host_provider) {
      if (const int missing = options.min_hosts - provider->Count(); missing > 0) {
        auto added = provider->AddServers(missing);
        if (!added.ok()) return added.status();
        registry->NoteScaleOut(*added, "the cluster's first servers", /*scale_out=*/false);
      }
    }
    auto authenticator = auth::GatewayAuthenticator::Create(
        {.token = options.token, .users_file = options.users_file, .hub = options.hub});
    if (!authenticator.ok()) return authenticator.status();
    auth = std::move(*authenticator);
    if (Status s = StartBlobGc(); !s.ok()) return s;
    HttpApiOptions ho;
    ho.auth = auth.get();
    ho.kernelspec_name = options.kernelspec_name;
    ho.display_name = options.display_name;
    for (const std::string& alias : options.kernelspec_aliases)
      if (!alias.empty() && alias != options.kernelspec_name)
        ho.kernelspec_aliases.push_back(alias);
    ho.replicas = options.replicas;
    ho.allowed_env = options.allowed_env;
    ho.workspace_root = options.workspace_root;
    ho.workspace_per_user = !options.users_file.empty() || options.hub.has_value();
    ho.limits = ko.limits;
    if (blob_gc) ho.blob_gc_stats = [gc = blob_gc.get()] { return gc->stats(); };
    api = std::make_unique<HttpApi>(ho, registry.get(), kernels.get(), migrator.get(), &counters,
                                    [this] { return ExceptionsCaught(); });
    api->Install(&http);
    dashboard = std::make_unique<Dashboard>(
        DashboardOptions{}, registry.get(),
        [api = api.get()](const http::Identity& viewer) { return api->ClusterJson(viewer); });
    dashboard->Install(&http);
    dashboard->Start();
    http::ServerOptions so;
    so.address = options.address;
    so.port = options.port;
    so.max_body_bytes = options.max_message_bytes;
    so.max_ws_message_bytes = options.max_message_bytes;
    so.handler_threads = 8;
    if (Status s = http.Start(so); !s.ok()) return s;
    monitor = std::thread([this] { Monitor(); });
    return Status::Ok();
  }

  // Clients first (no new requests), then the daemons' side, then the sessions (they hand their
  // last grants to the planner), then the workers that carry those out.
  Status StartBlobGc() {
    if (options.blob_store_url.empty()) return Status::Ok();
    auto gc = BlobGc::Start(
        {options.blob_store_url, std::chrono::milliseconds(options.blob_gc_interval_ms),
         std::chrono::milliseconds(options.blob_gc_grace_ms)},
        registry.get());
    if (!gc.ok()) return gc.status();
    blob_gc = std::move(*gc);
    return Status::Ok();
  }

  void StopParts() {
    {
      MutexLock lock(&monitor_mu);
      stopping = true;
      monitor_cv.SignalAll();
    }
    if (monitor.joinable()) monitor.join();
    group_checks.Stop();
    blob_gc.reset();  // it asks the kernels' sessions
    if (dashboard) dashboard->Stop();
    http.Stop();
    if (control) control->Stop();
    if (migrator) migrator->Stop();
    if (kernels) kernels->Stop();
    if (planner) planner->Stop();
    if (options.host_provider) options.host_provider->Shutdown();
  }
};

Result<std::unique_ptr<Gateway>> Gateway::Start(GatewayOptions options) {
  if (options.state_dir.empty()) return InvalidArgument("the gateway needs a state directory");
  if (options.token.empty() && options.users_file.empty() && !options.hub &&
      !options.allow_unauthenticated) {
    return InvalidArgument(
        "the gateway needs a token, a users file or JupyterHub (or explicitly allow "
        "unauthenticated use)");
  }
  std::error_code ec;
  std::filesystem::create_directories(options.state_dir, ec);
  if (ec) return Unavailable("creating " + options.state_dir + ": " + ec.message());
  auto impl = std::make_unique<Impl>(std::move(options));
  if (Status s = impl->StartParts(); !s.ok()) {
    impl->StopParts();
    return s;
  }
  return std::unique_ptr<Gateway>(new Gateway(std::move(impl)));
}

Gateway::Gateway(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Gateway::~Gateway() { Stop(); }

uint16_t Gateway::port() const { return impl_->http.port(); }
std::string Gateway::control_address() const { return impl_->control->address(); }
Status Gateway::ReloadUsers() { return impl_->auth->ReloadUsers(); }

void Gateway::Stop() {
  {
    MutexLock lock(&impl_->monitor_mu);
    if (impl_->stopping) return;
  }
  impl_->StopParts();
}

}  // namespace nbos::gateway
