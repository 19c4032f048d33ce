#include "gateway/kernel_session.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <deque>
#include <future>
#include <map>
#include <set>
#include <thread>
#include <variant>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "common/ids.h"
#include "common/overloaded.h"
#include "common/thread_annotations.h"
#include "gateway/heartbeat_monitor.h"
#include "jupyter/websocket_codec.h"
#include "jupyter/wire.h"

namespace nbos::gateway {
namespace {

using jupyter::Channel;
using jupyter::Json;
using jupyter::Message;
using SteadyClock = std::chrono::steady_clock;

int64_t NowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

constexpr Channel kChannels[] = {Channel::kShell, Channel::kControl, Channel::kStdin,
                                 Channel::kIopub};
constexpr size_t kPollItemsPerLink = 5;  // the four channels, then the heartbeat

// A replica binds its sockets a moment after it starts, while the session connects at once: with
// ZeroMQ's default 100 ms between attempts, every kernel start would wait up to that long for
// its first answer. Retries start at 5 ms and double up to 1 s, so a replica that stays down is
// not hammered.
void SetQuickReconnect(zmq::socket_t& s) {
  s.set(zmq::sockopt::reconnect_ivl, 5);
  s.set(zmq::sockopt::reconnect_ivl_max, 1000);
}

int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             SteadyClock::now().time_since_epoch())
      .count();
}

}  // namespace

struct KernelSession::Impl : std::enable_shared_from_this<KernelSession::Impl> {
  struct Link {
    ReplicaEndpoint endpoint;
    zmq::socket_t sockets[4];  // by kChannels order: shell, control, stdin, iopub
    zmq::socket_t heartbeat;   // to the replica's heartbeat echo
    zmq::socket_t& socket(Channel c) {
      switch (c) {
        case Channel::kShell:
          return sockets[0];
        case Channel::kControl:
          return sockets[1];
        case Channel::kStdin:
          return sockets[2];
        case Channel::kIopub:
          return sockets[3];
      }
      return sockets[0];
    }
  };
  struct AttachClient {
    ClientId client = 0;
    ClientSink sink;
  };
  struct LinkChange {
    std::optional<ReplicaEndpoint> add;  // else remove
    ReplicaId remove = 0;
    std::shared_ptr<std::promise<Status>> done;
  };
  struct ControlCall {
    ControlCallRequested call;
    std::shared_ptr<std::promise<Result<Json>>> reply;
  };
  // An event whose poster waits until it is applied and its effects published.
  struct Synced {
    RouterEvent event;
    std::shared_ptr<std::promise<void>> done;
  };
  using Command = std::variant<RouterEvent, AttachClient, LinkChange, ControlCall, Synced>;

  // What other threads may read, published by the session thread after each round.
  struct Published {
    std::string state = "idle";
    std::string last_activity;
    int connections = 0;
    ReplicaId executor = 0, executing = 0;
    bool cell_waiting = false;
    std::set<ReplicaId> live;
    Stats stats;
  };

  explicit Impl(KernelSessionOptions o)
      : options(std::move(o)),
        router(RouterOptionsFor(options)),
        heartbeats({options.heartbeat_interval_ms, options.heartbeat_timeout_ms}) {}

  static RouterOptions RouterOptionsFor(const KernelSessionOptions& o) {
    RouterOptions r;
    r.kernel_id = o.kernel_id;
    r.session_id = o.session_id;
    r.gpus = o.gpus;
    for (const ReplicaEndpoint& ep : o.replicas) r.replicas.push_back(ep.replica_id);
    r.limits = o.limits;
    r.execution_epoch = NewUuid().substr(0, 8);
    return r;
  }

  const KernelSessionOptions options;
  jupyter::Signer signer;
  std::atomic<bool> stopping{false};
  std::atomic<ClientId> next_client{1};
  std::atomic<uint64_t> next_call{1};
  std::atomic<uint64_t> exceptions_caught{0};
  std::thread thread;

  // The session thread's own (and the Shutdown caller's, once the thread is joined).
  KernelRouter router;
  HeartbeatMonitor heartbeats;
  zmq::context_t context{1};
  std::vector<Link> links;
  bool links_changed = false;
  std::map<ClientId, ClientSink> sinks;
  std::multimap<SteadyClock::time_point, uint64_t> timers;
  std::map<uint64_t, std::shared_ptr<std::promise<Result<Json>>>> calls;
  int64_t published_activity_us = -1;
  const int64_t started_us = std::chrono::duration_cast<std::chrono::microseconds>(
                                 std::chrono::system_clock::now().time_since_epoch())
                                 .count();

  mutable Mutex mu;
  std::deque<Command> inbox GUARDED_BY(mu);
  int wake_fd GUARDED_BY(mu) = -1;
  bool shut_down GUARDED_BY(mu) = false;
  Published published GUARDED_BY(mu);
  std::set<ReplicaId> answered_probe GUARDED_BY(mu);
  CondVar probe_cv;

  Link* FindLink(ReplicaId id) {
    for (Link& l : links)
      if (l.endpoint.replica_id == id) return &l;
    return nullptr;
  }

  // Callers on other threads may hold the session after Shutdown closed wake_fd; a write to the
  // closed number would land in whatever reused it (a ZeroMQ context's signaler, which then
  // aborts), so the fd is only written under mu while it is open.
  void Post(Command c) EXCLUDES(mu) {
    {
      MutexLock lock(&mu);
      if (!shut_down) {
        inbox.push_back(std::move(c));
        uint64_t one = 1;
        (void)!write(wake_fd, &one, sizeof(one));
        return;
      }
    }
    // Too late for the router: what still needs an answer gets it here.
    if (auto* e = std::get_if<RouterEvent>(&c)) {
      if (auto* done = std::get_if<PlanDone>(e); done && done->plan.ok() && *done->plan &&
                                                 !(*done->plan)->grant_id.empty() &&
                                                 options.hooks.release) {
        options.hooks.release(**done->plan);
      }
    } else if (auto* call = std::get_if<ControlCall>(&c)) {
      call->reply->set_value(Unavailable("kernel " + options.kernel_id + " is shutting down"));
    } else if (auto* change = std::get_if<LinkChange>(&c)) {
      change->done->set_value(Unavailable("kernel " + options.kernel_id + " is shutting down"));
    } else if (auto* synced = std::get_if<Synced>(&c)) {
      synced->done->set_value();
    } else if (auto* attach = std::get_if<AttachClient>(&c); attach && attach->sink.close) {
      attach->sink.close(1001, "kernel gone");  // attached as the kernel went away
    }
  }

  // ---- the router's effects ----
  void Execute(std::vector<RouterEffect> effects) {
    for (RouterEffect& effect : effects) {
      std::visit(Overloaded{
                     [&](gateway::SendToReplicas& e) { SendFrames(e); },
                     [&](SendToClient& e) {
                       auto it = sinks.find(e.client);
                       if (it == sinks.end()) return;
                       bool binary = false;
                       std::string frame = jupyter::EncodeWs(e.message, &binary);
                       it->second.deliver(frame, binary);
                     },
                     [&](SendToAllClients& e) {
                       bool binary = false;
                       std::string frame = jupyter::EncodeWs(e.message, &binary);
                       for (auto& [id, sink] : sinks) sink.deliver(frame, binary);
                     },
                     [&](CloseClient& e) {
                       auto it = sinks.find(e.client);
                       if (it == sinks.end()) return;
                       if (it->second.close) it->second.close(e.code, e.reason);
                       sinks.erase(it);
                     },
                     [&](PlanWanted& e) { RequestPlan(e); },
                     [&](GrantReleaseWanted& e) {
                       if (options.hooks.release) options.hooks.release(e.plan);
                     },
                     [&](TimerWanted& e) {
                       timers.emplace(SteadyClock::now() + std::chrono::milliseconds(e.delay_ms),
                                      e.timer_id);
                     },
                     [&](ShutdownWanted& e) {
                       if (options.hooks.shutdown_requested)
                         options.hooks.shutdown_requested(e.restart);
                     },
                     [&](ProbeAnswered& e) {
                       MutexLock lock(&mu);
                       answered_probe.insert(e.replica);
                       probe_cv.SignalAll();
                     },
                     [&](ControlCallAnswered& e) {
                       auto it = calls.find(e.call_id);
                       if (it == calls.end()) return;
                       it->second->set_value(std::move(e.reply));
                       calls.erase(it);
                     },
                     [&](ResumeWanted&) {
                       if (options.hooks.resume_wanted) options.hooks.resume_wanted();
                     },
                     [&](ExecutionStarted& e) {
                       if (options.hooks.execution_started)
                         options.hooks.execution_started(e.delay_us);
                     },
                     [&](ReplicaDiverged& e) {
                       if (options.hooks.replica_diverged)
                         options.hooks.replica_diverged(e.replica, e.why);
                     },
                     [&](InputRejected& e) {
                       spdlog::warn("kernel {}: refused a client message ({}): {}",
                                    options.kernel_id, RejectClassName(e.reason), e.detail);
                       if (options.hooks.rejected) options.hooks.rejected(e.reason);
                     },
                 },
                 effect);
    }
  }

  void SendFrames(const gateway::SendToReplicas& e) {
    const std::vector<std::string> frames = jupyter::EncodeFrames(e.message, signer);
    for (ReplicaId r : e.replicas) {
      Link* link = FindLink(r);
      if (link == nullptr) continue;
      zmq::socket_t& socket = link->socket(e.channel);
      for (size_t i = 0; i < frames.size(); ++i) {
        socket.send(zmq::buffer(frames[i]),
                    i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
      }
    }
  }

  void RequestPlan(const PlanWanted& want) {
    if (!options.hooks.plan) {
      ReplicaId to = want.requested_target && want.live.count(want.requested_target)
                         ? want.requested_target
                         : (want.live.empty() ? 0 : *want.live.begin());
      Apply(PlanDone{want.plan_id, std::optional<ExecutionPlan>(ExecutionPlan{to, "", "", {}})});
      return;
    }
    std::weak_ptr<Impl> weak = weak_from_this();
    auto release = options.hooks.release;
    const uint64_t plan_id = want.plan_id;
    options.hooks.plan(want, [weak, release, plan_id](Result<std::optional<ExecutionPlan>> plan,
                                                      std::string wait) {
      if (auto self = weak.lock()) {
        self->Post(RouterEvent(PlanDone{plan_id, std::move(plan), std::move(wait)}));
      } else if (plan.ok() && *plan && !(*plan)->grant_id.empty() && release) {
        release(**plan);  // the session is gone: nobody will use these GPUs
      }
    });
  }

  // One event through the router and its effects out. What escapes is the router's or a hook's
  // bug, or a third-party library's exception: logged and counted; the session goes on.
  void Apply(RouterEvent event) {
    try {
      Execute(router.Apply(NowUs(), std::move(event)));
    } catch (const std::exception& e) {
      ++exceptions_caught;
      spdlog::error("kernel {}: {} escaped while handling an event; the session goes on",
                    options.kernel_id, e.what());
    }
  }

  void RunCommand(Command& c) {
    std::visit(Overloaded{
                   [&](RouterEvent& e) {
                     if (auto* d = std::get_if<ClientDetached>(&e)) sinks.erase(d->client);
                     Apply(std::move(e));
                   },
                   [&](AttachClient& a) {
                     sinks[a.client] = std::move(a.sink);
                     Apply(ClientAttached{a.client});
                   },
                   [&](LinkChange& change) { change.done->set_value(ApplyLinkChange(change)); },
                   [&](ControlCall& call) {
                     calls[call.call.call_id] = call.reply;
                     Apply(std::move(call.call));
                   },
                   [&](Synced& synced) {
                     Apply(std::move(synced.event));
                     Publish();
                     synced.done->set_value();
                   },
               },
               c);
  }

  Status ApplyLinkChange(const LinkChange& change) {
    if (!change.add) {
      Apply(ReplicaUnlinked{change.remove});
      std::erase_if(links, [&](const Link& l) { return l.endpoint.replica_id == change.remove; });
      heartbeats.Remove(change.remove);
      links_changed = true;
      return Status::Ok();
    }
    if (FindLink(change.add->replica_id) != nullptr) {
      return InvalidArgument("replica " + std::to_string(change.add->replica_id) +
                             " is already linked");
    }
    try {
      links.push_back(Connect(*change.add));
      heartbeats.Add(change.add->replica_id, SteadyMs());
    } catch (const zmq::error_t& e) {
      return Unavailable(std::string("connecting to the new replica: ") + e.what());
    }
    links_changed = true;
    Apply(ReplicaLinked{change.add->replica_id});
    return Status::Ok();
  }

  // Sockets to one replica (throws zmq::error_t).
  Link Connect(const ReplicaEndpoint& ep) {
    Link l;
    l.endpoint = ep;
    // A fresh identity per session: a replica's ROUTER ignores a peer whose identity is still
    // bound to an older connection, which after a gateway crash mid-cell (the replica busy in
    // the cell, the dead connection not yet reaped) would leave the new session unheard.
    static const std::string incarnation = NewUuid().substr(0, 8);
    const std::string identity = "nbos-gateway-" + options.kernel_id + "-" + incarnation;
    const jupyter::ConnectionInfo& c = ep.connection;
    const std::pair<Channel, int> ports[] = {{Channel::kShell, c.shell_port},
                                             {Channel::kControl, c.control_port},
                                             {Channel::kStdin, c.stdin_port},
                                             {Channel::kIopub, c.iopub_port}};
    for (const auto& [channel, port] : ports) {
      zmq::socket_t& s = l.socket(channel);
      s = zmq::socket_t(
          context, channel == Channel::kIopub ? zmq::socket_type::sub : zmq::socket_type::dealer);
      s.set(zmq::sockopt::linger, 0);
      SetQuickReconnect(s);
      s.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(options.limits.max_message_bytes));
      // The shell and stdin identities must match: a kernel sends input_request to the stdin
      // identity of the shell requester.
      if (channel == Channel::kShell || channel == Channel::kStdin) {
        s.set(zmq::sockopt::routing_id, identity);
      }
      if (channel == Channel::kIopub) s.set(zmq::sockopt::subscribe, "");
      s.connect(c.Endpoint(port));
    }
    l.heartbeat = zmq::socket_t(context, zmq::socket_type::dealer);
    l.heartbeat.set(zmq::sockopt::linger, 0);
    SetQuickReconnect(l.heartbeat);
    l.heartbeat.set(zmq::sockopt::sndhwm, 8);  // pings to a frozen replica do not pile up
    l.heartbeat.set(zmq::sockopt::maxmsgsize, int64_t{64});
    l.heartbeat.connect(c.Endpoint(c.hb_port));
    return l;
  }

  // Echoes first, then the verdicts: a session thread that was itself late to look finds the
  // echoes that came meanwhile and blames nobody.
  void Heartbeat() {
    for (Link& l : links) {
      bool echoed = false;
      zmq::message_t echo;
      while (l.heartbeat.recv(echo, zmq::recv_flags::dontwait)) echoed = true;
      if (echoed && heartbeats.Echo(l.endpoint.replica_id)) {
        spdlog::info("kernel {}: replica {} answers heartbeats again", options.kernel_id,
                     l.endpoint.replica_id);
        Apply(ReplicaReachable{l.endpoint.replica_id, true});
        if (links_changed) return;
      }
    }
    const HeartbeatMonitor::Tick tick = heartbeats.Advance(SteadyMs());
    for (ReplicaId r : tick.ping) {
      if (Link* l = FindLink(r))
        (void)l->heartbeat.send(zmq::str_buffer("ping"), zmq::send_flags::dontwait);
    }
    for (const auto& [r, reachable] : tick.reachable) {
      spdlog::warn("kernel {}: replica {} has not answered heartbeats for {} ms", options.kernel_id,
                   r, options.heartbeat_timeout_ms);
      Apply(ReplicaReachable{r, reachable});
      if (links_changed) return;
    }
  }

  void ReceiveAll(Link& link, Channel channel) {
    const ReplicaId r = link.endpoint.replica_id;
    zmq::socket_t& socket = link.socket(channel);
    for (;;) {
      std::vector<zmq::message_t> parts;
      if (!zmq::recv_multipart(socket, std::back_inserter(parts), zmq::recv_flags::dontwait))
        return;
      std::vector<std::string> frames;
      frames.reserve(parts.size());
      for (auto& p : parts) frames.emplace_back(p.to_string());
      auto m = jupyter::DecodeFrames(std::move(frames), signer,
                                     {.max_message_bytes = options.limits.max_message_bytes});
      if (!m.ok()) {
        spdlog::warn("kernel {}: dropping a {} message of replica {}: {}", options.kernel_id,
                     jupyter::ChannelName(channel), r, m.status().ToString());
        continue;
      }
      Apply(ReplicaMessage{r, channel, std::move(*m)});
      if (links_changed) return;  // `link` may be gone
    }
  }

  std::vector<zmq::pollitem_t> PollItems() EXCLUDES(mu) {
    std::vector<zmq::pollitem_t> items;
    for (Link& l : links) {
      for (zmq::socket_t& s : l.sockets) items.push_back({s.handle(), 0, ZMQ_POLLIN, 0});
      items.push_back({l.heartbeat.handle(), 0, ZMQ_POLLIN, 0});
    }
    MutexLock lock(&mu);
    items.push_back({nullptr, wake_fd, ZMQ_POLLIN, 0});
    return items;
  }

  std::chrono::milliseconds PollTimeout() const {
    constexpr std::chrono::milliseconds kIdle{500};
    auto wait = std::chrono::milliseconds(
        std::clamp<int64_t>(heartbeats.next_due_ms() - SteadyMs(), 0, kIdle.count()));
    if (!timers.empty()) {
      wait = std::min(wait, std::chrono::ceil<std::chrono::milliseconds>(timers.begin()->first -
                                                                         SteadyClock::now()));
    }
    return std::clamp(wait, std::chrono::milliseconds(0), kIdle);
  }

  void FireTimers() {
    const auto now = SteadyClock::now();
    while (!timers.empty() && timers.begin()->first <= now) {
      const uint64_t id = timers.begin()->second;
      timers.erase(timers.begin());
      Apply(TimerFired{id});
    }
  }

  void DrainInbox() EXCLUDES(mu) {
    std::deque<Command> batch;
    {
      MutexLock lock(&mu);
      uint64_t n;
      (void)!read(wake_fd, &n, sizeof(n));
      batch.swap(inbox);
    }
    for (Command& c : batch) RunCommand(c);
  }

  void Publish() EXCLUDES(mu) {
    Published p;
    p.state = router.execution_state();
    p.connections = static_cast<int>(router.connections());
    p.executor = router.current_executor();
    p.executing = router.executing_replica();
    p.cell_waiting = router.cell_waiting();
    p.live = router.live_replicas();
    const KernelRouter::Stats& s = router.stats();
    p.stats = {s.executions, s.waited_for_gpus, s.rejected, exceptions_caught.load()};
    MutexLock lock(&mu);
    if (router.last_activity_us() != published_activity_us) {
      published_activity_us = router.last_activity_us();
      published.last_activity = FormatIsoUtc(
          std::chrono::system_clock::time_point(std::chrono::microseconds(published_activity_us)));
    }
    p.last_activity = published.last_activity;
    published = std::move(p);
  }

  void Round(std::vector<zmq::pollitem_t>& items) {
    zmq::poll(items.data(), items.size(), PollTimeout());
    if (items.back().revents & ZMQ_POLLIN) {
      DrainInbox();
      if (links_changed) return;  // the poll results no longer match the links
    }
    FireTimers();
    for (size_t i = 0; i < links.size() && !links_changed; ++i) {
      for (size_t c = 0; c < 4 && !links_changed; ++c) {
        if (items[kPollItemsPerLink * i + c].revents & ZMQ_POLLIN)
          ReceiveAll(links[i], kChannels[c]);
      }
    }
    if (!links_changed) Heartbeat();
  }

  void Run() {
    std::vector<zmq::pollitem_t> items = PollItems();
    while (!stopping.load()) {
      if (links_changed) {
        items = PollItems();
        links_changed = false;
      }
      try {
        Round(items);
      } catch (const std::exception& e) {
        ++exceptions_caught;
        spdlog::error("kernel {}: {} escaped the session loop; the session goes on",
                      options.kernel_id, e.what());
      }
      Publish();
    }
  }
};

Result<std::unique_ptr<KernelSession>> KernelSession::Start(KernelSessionOptions options) {
  if (options.replicas.empty() && options.key.empty()) {
    return InvalidArgument("a kernel session needs a replica or a key");
  }
  auto impl = std::make_shared<Impl>(std::move(options));
  const std::string& key = impl->options.replicas.empty()
                               ? impl->options.key
                               : impl->options.replicas.front().connection.key;
  auto signer = jupyter::Signer::Create(
      key, impl->options.replicas.empty()
               ? "hmac-sha256"
               : impl->options.replicas.front().connection.signature_scheme);
  if (!signer.ok()) return signer.status();
  impl->signer = *signer;
  {
    MutexLock lock(&impl->mu);
    impl->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (impl->wake_fd < 0) return Internal("eventfd failed");
    impl->published.last_activity = NowIsoUtc();
  }
  try {
    for (const ReplicaEndpoint& ep : impl->options.replicas) {
      impl->links.push_back(impl->Connect(ep));
      impl->heartbeats.Add(ep.replica_id, SteadyMs());
    }
  } catch (const zmq::error_t& e) {
    return Unavailable(std::string("connecting to the kernel's replicas: ") + e.what());
  }
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Run(); });
  return std::unique_ptr<KernelSession>(new KernelSession(std::move(impl)));
}

KernelSession::KernelSession(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

KernelSession::~KernelSession() { Shutdown(); }

void KernelSession::Shutdown() {
  Impl& im = *impl_;
  {
    MutexLock lock(&im.mu);
    if (im.shut_down) return;
    im.shut_down = true;
    uint64_t one = 1;
    (void)!write(im.wake_fd, &one, sizeof(one));
  }
  im.stopping = true;
  if (im.thread.joinable()) im.thread.join();
  // The thread is gone: its state is this caller's now. Commands posted before the close are
  // still answered, then the router closes (clients 1001, the grant released, calls failed).
  std::deque<Impl::Command> rest;
  {
    MutexLock lock(&im.mu);
    rest.swap(im.inbox);
    im.probe_cv.SignalAll();
  }
  for (Impl::Command& c : rest) im.RunCommand(c);
  im.Apply(RouterClosing{});
  for (auto& [id, reply] : im.calls) {
    reply->set_value(Unavailable("kernel " + im.options.kernel_id + " is shutting down"));
  }
  im.calls.clear();
  for (auto& [id, sink] : im.sinks)
    if (sink.close) sink.close(1001, "kernel gone");
  im.sinks.clear();
  im.links.clear();
  MutexLock lock(&im.mu);
  close(im.wake_fd);
  im.wake_fd = -1;
}

Status KernelSession::AwaitReplicas(std::chrono::milliseconds timeout,
                                    const std::function<Status()>& check) {
  std::vector<ReplicaId> all;
  for (const auto& ep : impl_->options.replicas) all.push_back(ep.replica_id);
  return AwaitSome(all, timeout, check);
}

Status KernelSession::AwaitReplicas(const std::vector<ReplicaId>& replicas,
                                    std::chrono::milliseconds timeout,
                                    const std::function<Status()>& check) {
  return AwaitSome(replicas, timeout, check);
}

Status KernelSession::AwaitSome(const std::vector<ReplicaId>& all,
                                std::chrono::milliseconds timeout,
                                const std::function<Status()>& check) {
  Impl& im = *impl_;
  const auto deadline = SteadyClock::now() + timeout;
  MutexLock lock(&im.mu);
  im.answered_probe.clear();
  // A replica still starting may miss a probe that reached its socket before it bound (ZeroMQ
  // then delivers it), but a restarted one loses it: probe again every second.
  while (!im.shut_down) {
    std::vector<ReplicaId> missing;
    for (ReplicaId r : all)
      if (!im.answered_probe.count(r)) missing.push_back(r);
    if (missing.empty()) return Status::Ok();
    if (check) {
      lock.Unlock();
      Status s = check();
      lock.Lock();
      if (!s.ok()) return s;
    }
    if (SteadyClock::now() >= deadline) {
      std::string names;
      for (ReplicaId r : missing) names += (names.empty() ? "" : ", ") + std::to_string(r);
      return Unavailable("replica(s) " + names + " of kernel " + im.options.kernel_id +
                         " did not answer kernel_info in time");
    }
    lock.Unlock();
    im.Post(RouterEvent(ProbeRequested{missing}));
    lock.Lock();
    im.probe_cv.WaitUntil(&im.mu, std::min(deadline, SteadyClock::now() + std::chrono::seconds(1)));
  }
  return Unavailable("kernel " + im.options.kernel_id + " is shutting down");
}

KernelSession::ClientId KernelSession::Attach(ClientSink sink) {
  const ClientId id = impl_->next_client++;
  impl_->Post(Impl::AttachClient{id, std::move(sink)});
  return id;
}

void KernelSession::Detach(ClientId client) { impl_->Post(RouterEvent(ClientDetached{client})); }

void KernelSession::Receive(ClientId client, std::string payload, bool binary) {
  impl_->Post(RouterEvent(ClientFrame{client, std::move(payload), binary}));
}

void KernelSession::Interrupt() { impl_->Post(RouterEvent(InterruptRequested{})); }
void KernelSession::ReplicaLost(ReplicaId r, std::string why) {
  impl_->Post(RouterEvent(gateway::ReplicaLost{r, std::move(why)}));
}
void KernelSession::ReplicaBack(ReplicaId r) { impl_->Post(RouterEvent(gateway::ReplicaBack{r})); }

void KernelSession::RecoverExecution() { impl_->Post(RouterEvent(gateway::RecoverExecution{})); }

void KernelSession::SetSuspended(bool suspended) {
  auto done = std::make_shared<std::promise<void>>();
  auto applied = done->get_future();
  impl_->Post(Impl::Synced{SuspendChanged{suspended}, done});
  applied.wait();
}
void KernelSession::SetMajorityLost(std::string why) {
  impl_->Post(RouterEvent(MajorityLost{std::move(why)}));
}
void KernelSession::HoldExecutions(bool hold, std::string why) {
  // Synchronous: once a hold returns, executing_replica() tells whether an execution is still in
  // flight, and none starts after it.
  auto done = std::make_shared<std::promise<void>>();
  auto applied = done->get_future();
  impl_->Post(Impl::Synced{ExecutionsHeld{hold, std::move(why)}, done});
  applied.wait();
}

Status KernelSession::AddReplica(const ReplicaEndpoint& replica) {
  auto done = std::make_shared<std::promise<Status>>();
  auto result = done->get_future();
  impl_->Post(Impl::LinkChange{replica, 0, done});
  return result.get();
}

void KernelSession::RemoveReplica(ReplicaId replica) {
  auto done = std::make_shared<std::promise<Status>>();
  auto result = done->get_future();
  impl_->Post(Impl::LinkChange{std::nullopt, replica, done});
  (void)result.get();
}

Result<jupyter::Json> KernelSession::CallControl(ReplicaId to, const std::string& msg_type,
                                                 jupyter::Json content,
                                                 std::chrono::milliseconds timeout) {
  auto reply = std::make_shared<std::promise<Result<Json>>>();
  auto result = reply->get_future();
  const uint64_t call_id = impl_->next_call++;
  impl_->Post(
      Impl::ControlCall{ControlCallRequested{call_id, to, msg_type, std::move(content)}, reply});
  if (result.wait_for(timeout) != std::future_status::ready) {
    return Unavailable("replica " + std::to_string(to) + " did not answer " + msg_type + " in " +
                       std::to_string(timeout.count()) + " ms");
  }
  return result.get();
}

std::string KernelSession::execution_state() const {
  MutexLock lock(&impl_->mu);
  return impl_->published.state;
}
std::string KernelSession::last_activity() const {
  MutexLock lock(&impl_->mu);
  return impl_->published.last_activity;
}
int64_t KernelSession::last_activity_us() const {
  MutexLock lock(&impl_->mu);
  return std::max(impl_->published_activity_us, impl_->started_us);
}
int KernelSession::connections() const {
  MutexLock lock(&impl_->mu);
  return impl_->published.connections;
}
ReplicaId KernelSession::current_executor() const {
  MutexLock lock(&impl_->mu);
  return impl_->published.executor;
}
ReplicaId KernelSession::executing_replica() const {
  MutexLock lock(&impl_->mu);
  return impl_->published.executing;
}
bool KernelSession::reachable(ReplicaId replica) const {
  MutexLock lock(&impl_->mu);
  return impl_->published.live.count(replica) > 0;
}
bool KernelSession::cell_waiting() const {
  MutexLock lock(&impl_->mu);
  return impl_->published.cell_waiting;
}
KernelSession::Stats KernelSession::stats() const {
  MutexLock lock(&impl_->mu);
  return impl_->published.stats;
}

}  // namespace nbos::gateway
