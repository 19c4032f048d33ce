#include "gateway/kernel_session.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <variant>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "common/ids.h"
#include "jupyter/wire.h"

namespace nbos::gateway {
namespace {

using jupyter::Channel;
using jupyter::Json;
using jupyter::Message;
using Clock = std::chrono::system_clock;

int64_t NowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch())
      .count();
}

// How often a request that waits for GPUs is planned again.
constexpr int kReplanIntervalMs = 20;

}  // namespace

std::string ExecutionId(const std::string& kernel_id, uint64_t sequence) {
  return kernel_id + ":" + std::to_string(sequence);
}

struct KernelSession::Impl {
  struct Link {
    ReplicaEndpoint endpoint;
    zmq::socket_t shell, control, stdin_socket, iopub;
    bool live = true;
  };
  struct Queued {
    ClientId client;
    Message request;
    int64_t received_us;
  };
  struct InFlight {
    std::string msg_id;
    std::string exec_id;
    Json header;
    ExecutionPlan plan;
    int64_t received_us = 0;
    int64_t planned_us = 0;
    int64_t sent_us = 0;
    bool stop_on_error = true;
  };
  // Membership changes and control calls, with what the caller waits on.
  struct LinkChange {
    std::optional<ReplicaEndpoint> add;  // else remove
    ReplicaId remove = 0;
    std::shared_ptr<std::promise<Status>> done;
  };
  struct ControlCall {
    ReplicaId to = 0;
    Message request;
    std::shared_ptr<std::promise<Json>> reply;
  };
  using Command = std::variant<std::pair<ClientId, ClientSink>,          // attach
                               ClientId,                                 // detach
                               std::pair<ClientId, jupyter::WsMessage>,  // send
                               std::monostate,                           // interrupt
                               std::pair<ReplicaId, bool>,               // lost (false) / back
                               std::vector<ReplicaId>,                   // probe
                               LinkChange, ControlCall>;

  KernelSessionOptions options;
  jupyter::Signer signer;
  jupyter::MessageFactory factory;
  zmq::context_t context{1};
  std::vector<Link> links;
  int wake_fd = -1;
  std::thread thread;
  std::atomic<bool> stopping{false};
  std::atomic<bool> executions_held{false};
  std::atomic<ClientId> next_client{1};

  mutable std::mutex mu;
  std::deque<Command> commands;  // guarded by mu
  std::string state = "idle";    // guarded by mu
  std::string last_activity;     // guarded by mu
  int connections = 0;           // guarded by mu
  ReplicaId executor = 0;        // guarded by mu
  ReplicaId executing = 0;       // guarded by mu: the in-flight execution's target, 0 if none
  Stats stats;                   // guarded by mu

  // Session thread only.
  std::map<ClientId, ClientSink> clients;
  std::deque<Queued> shell_queue;
  std::optional<InFlight> in_flight;
  bool waiting_logged = false;
  std::map<std::string, ClientId> reply_to;      // request msg_id -> client
  std::map<std::string, ReplicaId> input_asker;  // input_request msg_id -> replica
  std::map<std::string, ReplicaId> probes;       // kernel_info probes not yet answered
  std::map<std::string, std::shared_ptr<std::promise<Json>>> control_calls;  // by request id
  bool links_changed = false;          // the poll set must be rebuilt
  std::set<ReplicaId> answered_probe;  // guarded by mu
  std::condition_variable probe_cv;
  bool shut_down = false;  // guarded by mu
  OutputMerger merger;
  uint64_t sequence = 0;

  explicit Impl(KernelSessionOptions o)
      : options(std::move(o)), factory(options.session_id, "nbos") {}

  Link* FindLink(ReplicaId id) {
    for (Link& l : links)
      if (l.endpoint.replica_id == id) return &l;
    return nullptr;
  }
  std::set<ReplicaId> Live() const {
    std::set<ReplicaId> live;
    for (const Link& l : links)
      if (l.live) live.insert(l.endpoint.replica_id);
    return live;
  }

  // Callers on other threads may hold the session after Shutdown closed wake_fd; a write to the
  // closed number would land in whatever reused it (a ZeroMQ context's signaler, which then
  // aborts), so the fd is only written under mu while it is open.
  void Wake() {
    std::lock_guard lock(mu);
    if (wake_fd < 0) return;
    uint64_t one = 1;
    (void)!write(wake_fd, &one, sizeof(one));
  }
  void Post(Command c) {
    {
      std::lock_guard lock(mu);
      commands.push_back(std::move(c));
    }
    Wake();
  }
  void Touch() {
    {
      std::lock_guard lock(mu);
      last_activity = FormatIsoUtc(Clock::now());
      state = in_flight || !shell_queue.empty() ? "busy" : "idle";
    }
    if (options.hooks.changed) options.hooks.changed();
  }

  // ---- to replicas ----
  void SendTo(zmq::socket_t& socket, const Message& m) {
    std::vector<std::string> frames = jupyter::EncodeFrames(m, signer);
    for (size_t i = 0; i < frames.size(); ++i) {
      socket.send(zmq::buffer(frames[i]),
                  i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  }

  // ---- to clients ----
  void Deliver(ClientId client, Channel channel, Message m) {
    auto it = clients.find(client);
    if (it == clients.end()) return;
    m.header["session"] = options.session_id;
    it->second.deliver(jupyter::WsMessage{channel, std::move(m)});
  }
  void Broadcast(Channel channel, Message m) {
    m.header["session"] = options.session_id;
    jupyter::WsMessage ws{channel, std::move(m)};
    for (auto& [id, sink] : clients) sink.deliver(ws);
  }
  void ForwardReply(Channel channel, Message reply) {
    const std::string parent = reply.parent_msg_id();
    if (auto call = control_calls.find(parent); call != control_calls.end()) {
      call->second->set_value(std::move(reply.content));
      control_calls.erase(call);
      return;
    }
    if (auto probe = probes.find(parent); probe != probes.end()) {
      {
        std::lock_guard lock(mu);
        answered_probe.insert(probe->second);
      }
      probes.erase(probe);
      probe_cv.notify_all();
      return;
    }
    if (in_flight && parent == in_flight->msg_id) FinishExecution(&reply);
    auto it = reply_to.find(parent);
    if (it == reply_to.end()) return;
    const ClientId client = it->second;
    reply_to.erase(it);
    Deliver(client, channel, std::move(reply));
  }
  void ForwardIopub(std::vector<Message> messages) {
    for (Message& m : messages) Broadcast(Channel::kIopub, std::move(m));
  }

  // ---- executions ----
  void FinishExecution(Message* reply) {
    InFlight done = std::move(*in_flight);
    in_flight.reset();
    {
      std::lock_guard lock(mu);
      executing = 0;
    }
    const int64_t releasing_us = NowUs();
    if (!done.plan.grant_id.empty() && options.hooks.release) options.hooks.release(done.plan);
    Json& nbos = reply->metadata["nbos"];
    if (!nbos.is_object()) nbos = Json::object();
    nbos["server"] = done.plan.server_id;
    nbos["gpu_ids"] = done.plan.device_ids;
    nbos["target_replica"] = done.plan.target_replica;
    // Per-hop times (µs since the epoch): request in, GPUs granted, sent to the replicas, grant
    // being released, reply out.
    nbos["gateway_us"] = Json{{"received", done.received_us},
                              {"planned", done.planned_us},
                              {"sent", done.sent_us},
                              {"releasing", releasing_us},
                              {"replied", NowUs()}};
    if (nbos.contains("executor") && nbos["executor"].is_number_unsigned()) {
      std::lock_guard lock(mu);
      executor = nbos["executor"].get<ReplicaId>();
    }
    const bool failed = reply->content.value("status", "ok") == "error";
    if (failed && done.stop_on_error) AbortQueuedExecutions();
  }

  // Like a kernel with stop_on_error: executions queued behind a failed cell are answered
  // "aborted" instead of running against the state the failure left behind.
  void AbortQueuedExecutions() {
    std::deque<Queued> kept;
    for (Queued& q : shell_queue) {
      if (q.request.msg_type() != "execute_request") {
        kept.push_back(std::move(q));
        continue;
      }
      reply_to.erase(q.request.msg_id());
      Broadcast(Channel::kIopub,
                factory.Make("status", Json{{"execution_state", "busy"}}, q.request.header));
      Message reply = factory.Make("execute_reply", Json{{"status", "aborted"}}, q.request.header);
      reply.metadata = Json{{"status", "aborted"}};
      Deliver(q.client, Channel::kShell, std::move(reply));
      Broadcast(Channel::kIopub,
                factory.Make("status", Json{{"execution_state", "idle"}}, q.request.header));
    }
    shell_queue = std::move(kept);
  }

  // Sends queued shell requests as far as order and GPUs allow.
  void PumpShell() {
    while (!shell_queue.empty()) {
      Queued& head = shell_queue.front();
      const std::set<ReplicaId> live = Live();
      if (live.empty()) return;
      if (head.request.msg_type() != "execute_request") {
        const ReplicaId to = live.count(merger.primary()) ? merger.primary() : *live.begin();
        merger.Expect(head.request.msg_id(), {to});
        SendTo(FindLink(to)->shell, head.request);
        shell_queue.pop_front();
        continue;
      }
      if (in_flight || executions_held.load()) return;
      Json& meta = head.request.metadata;
      Json nbos = meta.value("nbos", Json::object());
      if (!nbos.is_object()) nbos = Json::object();
      int gpus = options.gpus;
      if (nbos.contains("gpus") && nbos["gpus"].is_number_integer()) gpus = nbos["gpus"].get<int>();
      ReplicaId requested = 0;
      if (nbos.contains("target_replica") && nbos["target_replica"].is_number_unsigned())
        requested = nbos["target_replica"].get<ReplicaId>();
      const std::string exec_id = ExecutionId(options.kernel_id, sequence + 1);
      std::optional<ExecutionPlan> plan;
      if (options.hooks.plan) {
        plan = options.hooks.plan(exec_id, gpus, requested, live);
      } else {
        plan = ExecutionPlan{requested ? requested : *live.begin(), "", "", {}};
      }
      if (!plan) {
        if (!waiting_logged) {
          waiting_logged = true;
          std::lock_guard lock(mu);
          ++stats.waited_for_gpus;
          spdlog::info("kernel {}: execution {} waits for {} GPU(s)", options.kernel_id, exec_id,
                       gpus);
        }
        return;
      }
      const int64_t planned_us = NowUs();
      waiting_logged = false;
      ++sequence;
      nbos["exec_id"] = exec_id;
      nbos["target_replica"] = plan->target_replica;
      nbos["gpu_ids"] = plan->device_ids;
      meta["nbos"] = nbos;
      InFlight f;
      f.msg_id = head.request.msg_id();
      f.exec_id = exec_id;
      f.header = head.request.header;
      f.plan = std::move(*plan);
      f.received_us = head.received_us;
      f.planned_us = planned_us;
      f.stop_on_error = head.request.content.value("stop_on_error", true);
      std::vector<ReplicaId> to(live.begin(), live.end());
      merger.Expect(f.msg_id, to);
      f.sent_us = NowUs();
      for (ReplicaId r : to) SendTo(FindLink(r)->shell, head.request);
      in_flight = std::move(f);
      {
        std::lock_guard lock(mu);
        ++stats.executions;
        executing = in_flight->plan.target_replica;
      }
      shell_queue.pop_front();
    }
  }

  void HandleClient(ClientId client, jupyter::WsMessage ws) {
    Message& m = ws.message;
    const std::string type = m.msg_type();
    switch (ws.channel) {
      case Channel::kShell:
        if (type == "shutdown_request") {
          HandleShutdown(client, Channel::kShell, m);
          return;
        }
        reply_to[m.msg_id()] = client;
        shell_queue.push_back({client, std::move(m), NowUs()});
        PumpShell();
        return;
      case Channel::kControl: {
        if (type == "shutdown_request") {
          HandleShutdown(client, Channel::kControl, m);
          return;
        }
        const std::set<ReplicaId> live = Live();
        if (live.empty()) return;
        ReplicaId to = in_flight ? in_flight->plan.target_replica : merger.primary();
        if (!live.count(to)) to = *live.begin();
        reply_to[m.msg_id()] = client;
        merger.Expect(m.msg_id(), {to});
        SendTo(FindLink(to)->control, m);
        return;
      }
      case Channel::kStdin: {
        // input_reply answers the replica that asked.
        const std::string asked = m.parent_msg_id();
        auto it = input_asker.find(asked);
        // jupyter_client's input() replies with an empty parent header; with one prompt
        // outstanding there is no doubt whom it answers.
        if (it == input_asker.end() && input_asker.size() == 1) it = input_asker.begin();
        if (it == input_asker.end()) return;
        Link* link = FindLink(it->second);
        input_asker.erase(it);
        if (link != nullptr && link->live) SendTo(link->stdin_socket, m);
        return;
      }
      case Channel::kIopub:
        return;  // clients do not publish
    }
  }

  void HandleShutdown(ClientId client, Channel channel, const Message& request) {
    const bool restart = request.content.value("restart", false);
    Message reply = factory.Make("shutdown_reply", Json{{"status", "ok"}, {"restart", restart}},
                                 request.header);
    Deliver(client, channel, std::move(reply));
    if (options.hooks.shutdown_requested) options.hooks.shutdown_requested(restart);
  }

  void SendInterrupt() {
    const std::set<ReplicaId> live = Live();
    if (live.empty()) return;
    ReplicaId to = in_flight ? in_flight->plan.target_replica : merger.primary();
    if (!live.count(to)) to = *live.begin();
    Message m = factory.Make("interrupt_request", Json::object(), Json::object());
    // The reply has no client; the merger forwards nothing for it.
    merger.Expect(m.msg_id(), {to});
    SendTo(FindLink(to)->control, m);
  }

  void SetLive(ReplicaId r, bool alive) {
    Link* link = FindLink(r);
    if (link == nullptr || link->live == alive) return;
    link->live = alive;
    spdlog::info("kernel {}: replica {} {}", options.kernel_id, r, alive ? "back" : "lost");
    if (alive) {
      merger.OnReplicaBack(r);
      return;
    }
    for (auto& [id, asker] : input_asker)
      if (asker == r) asker = 0;
    for (Message& m : merger.OnReplicaLost(r)) Route(r, std::move(m));
    if (!in_flight || in_flight->plan.target_replica != r) return;
    const std::set<ReplicaId> live = Live();
    if (live.empty()) {
      FailInFlight("every replica of this kernel was lost while the cell ran");
      return;
    }
    // The standbys wait for the executor's effects; tell them it is gone so they answer
    // (ExecutorLost) with the state of the last completed cell.
    Message cancel =
        factory.Make("nbos_cancel_request", Json{{"exec_id", in_flight->exec_id}}, Json::object());
    merger.Expect(cancel.msg_id(), {live.begin(), live.end()});
    for (ReplicaId to : live) SendTo(FindLink(to)->control, cancel);
  }

  // Answers the in-flight execution on the replicas' behalf when none of them can.
  void FailInFlight(const std::string& why) {
    Message request;
    request.header = in_flight->header;
    auto it = reply_to.find(in_flight->msg_id);
    Message reply = factory.Make("execute_reply",
                                 Json{{"status", "error"},
                                      {"ename", "ExecutorLost"},
                                      {"evalue", why},
                                      {"traceback", Json::array({"ExecutorLost: " + why})}},
                                 in_flight->header);
    Message idle = factory.Make("status", Json{{"execution_state", "idle"}}, in_flight->header);
    ForwardReply(Channel::kShell, std::move(reply));
    (void)it;
    Broadcast(Channel::kIopub, std::move(idle));
  }

  // A message the merger let through: replies to their client, the rest to everyone.
  void Route(ReplicaId from, Message m) {
    const std::string type = m.msg_type();
    if (type.size() > 6 && type.compare(type.size() - 6, 6, "_reply") == 0) {
      ForwardReply(type == "interrupt_reply" || type == "shutdown_reply" ? Channel::kControl
                                                                         : Channel::kShell,
                   std::move(m));
    } else {
      (void)from;
      Broadcast(Channel::kIopub, std::move(m));
    }
  }

  void RunCommands() {
    std::deque<Command> batch;
    {
      std::lock_guard lock(mu);
      batch.swap(commands);
    }
    for (Command& c : batch) {
      if (auto* attach = std::get_if<0>(&c)) {
        clients[attach->first] = std::move(attach->second);
      } else if (auto* detach = std::get_if<1>(&c)) {
        clients.erase(*detach);
      } else if (auto* send = std::get_if<2>(&c)) {
        HandleClient(send->first, std::move(send->second));
      } else if (std::holds_alternative<std::monostate>(c)) {
        SendInterrupt();
      } else if (auto* liveness = std::get_if<4>(&c)) {
        SetLive(liveness->first, liveness->second);
      } else if (auto* change = std::get_if<6>(&c)) {
        change->done->set_value(ApplyLinkChange(*change));
      } else if (auto* call = std::get_if<7>(&c)) {
        Link* link = FindLink(call->to);
        if (link == nullptr || !link->live) {
          call->reply->set_exception(std::make_exception_ptr(std::runtime_error("not live")));
          continue;
        }
        control_calls[call->request.msg_id()] = call->reply;
        merger.Expect(call->request.msg_id(), {call->to});
        SendTo(link->control, call->request);
      } else if (auto* probe = std::get_if<5>(&c)) {
        for (ReplicaId r : *probe) {
          Link* link = FindLink(r);
          if (link == nullptr) continue;
          Message m = factory.Make("kernel_info_request", Json::object(), Json::object());
          probes[m.msg_id()] = r;
          merger.Expect(m.msg_id(), {r});
          SendTo(link->shell, m);
        }
      }
    }
    {
      std::lock_guard lock(mu);
      connections = static_cast<int>(clients.size());
    }
  }

  Status ApplyLinkChange(const LinkChange& change) {
    if (!change.add) {
      SetLive(change.remove, false);
      std::erase_if(links, [&](const Link& l) { return l.endpoint.replica_id == change.remove; });
      links_changed = true;
      return Status::Ok();
    }
    if (FindLink(change.add->replica_id) != nullptr) {
      return InvalidArgument("replica " + std::to_string(change.add->replica_id) +
                             " is already linked");
    }
    try {
      links.push_back(Connect(*change.add));
    } catch (const zmq::error_t& e) {
      return Unavailable(std::string("connecting to the new replica: ") + e.what());
    }
    merger.OnReplicaBack(change.add->replica_id);
    links_changed = true;
    return Status::Ok();
  }

  // Sockets to one replica (throws zmq::error_t).
  Link Connect(const ReplicaEndpoint& ep) {
    Link l;
    l.endpoint = ep;
    const std::string identity = "nbos-gateway-" + options.kernel_id;
    l.shell = zmq::socket_t(context, zmq::socket_type::dealer);
    l.control = zmq::socket_t(context, zmq::socket_type::dealer);
    l.stdin_socket = zmq::socket_t(context, zmq::socket_type::dealer);
    l.iopub = zmq::socket_t(context, zmq::socket_type::sub);
    // The shell and stdin identities must match: a kernel sends input_request to the stdin
    // identity of the shell requester.
    l.shell.set(zmq::sockopt::routing_id, identity);
    l.stdin_socket.set(zmq::sockopt::routing_id, identity);
    l.iopub.set(zmq::sockopt::subscribe, "");
    for (zmq::socket_t* s : {&l.shell, &l.control, &l.stdin_socket, &l.iopub}) {
      s->set(zmq::sockopt::linger, 0);
      s->set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(options.max_message_bytes));
    }
    l.shell.connect(ep.connection.Endpoint(ep.connection.shell_port));
    l.control.connect(ep.connection.Endpoint(ep.connection.control_port));
    l.stdin_socket.connect(ep.connection.Endpoint(ep.connection.stdin_port));
    l.iopub.connect(ep.connection.Endpoint(ep.connection.iopub_port));
    return l;
  }

  std::optional<Message> Receive(zmq::socket_t& socket, const char* what, ReplicaId r) {
    std::vector<zmq::message_t> parts;
    if (!zmq::recv_multipart(socket, std::back_inserter(parts), zmq::recv_flags::dontwait))
      return std::nullopt;
    std::vector<std::string> frames;
    frames.reserve(parts.size());
    for (auto& p : parts) frames.emplace_back(p.to_string());
    auto m = jupyter::DecodeFrames(std::move(frames), signer,
                                   {.max_message_bytes = options.max_message_bytes});
    if (!m.ok()) {
      spdlog::warn("kernel {}: dropping a {} message of replica {}: {}", options.kernel_id, what, r,
                   m.status().ToString());
      return std::nullopt;
    }
    return std::move(*m);
  }

  std::vector<zmq::pollitem_t> PollItems() {
    std::vector<zmq::pollitem_t> items;
    for (Link& l : links) {
      for (zmq::socket_t* s : {&l.shell, &l.control, &l.stdin_socket, &l.iopub})
        items.push_back({s->handle(), 0, ZMQ_POLLIN, 0});
    }
    items.push_back({nullptr, wake_fd, ZMQ_POLLIN, 0});
    return items;
  }

  void Run() {
    std::vector<zmq::pollitem_t> items = PollItems();
    while (!stopping.load()) {
      if (links_changed) {
        items = PollItems();
        links_changed = false;
      }
      const bool waiting = !shell_queue.empty() && !in_flight;
      const int ready = zmq::poll(items.data(), items.size(),
                                  std::chrono::milliseconds(waiting ? kReplanIntervalMs : 500));
      if (items.back().revents & ZMQ_POLLIN) {
        uint64_t n;
        (void)!read(wake_fd, &n, sizeof(n));
        RunCommands();
        if (links_changed) continue;  // the poll results no longer match the links
      }
      for (size_t i = 0; i < links.size(); ++i) {
        Link& l = links[i];
        const ReplicaId r = l.endpoint.replica_id;
        if (items[4 * i].revents & ZMQ_POLLIN) {
          while (auto m = Receive(l.shell, "shell", r))
            for (Message& out : merger.OnReply(r, std::move(*m))) Route(r, std::move(out));
        }
        if (items[4 * i + 1].revents & ZMQ_POLLIN) {
          while (auto m = Receive(l.control, "control", r))
            for (Message& out : merger.OnReply(r, std::move(*m))) Route(r, std::move(out));
        }
        if (items[4 * i + 2].revents & ZMQ_POLLIN) {
          while (auto m = Receive(l.stdin_socket, "stdin", r)) {
            auto it = reply_to.find(m->parent_msg_id());
            if (it == reply_to.end()) continue;
            input_asker[m->msg_id()] = r;
            Deliver(it->second, Channel::kStdin, std::move(*m));
          }
        }
        if (items[4 * i + 3].revents & ZMQ_POLLIN) {
          while (auto m = Receive(l.iopub, "iopub", r))
            ForwardIopub(merger.OnIopub(r, std::move(*m)));
        }
      }
      const bool was_waiting = waiting;
      PumpShell();
      if (ready > 0 || (was_waiting && in_flight)) Touch();
    }
  }
};

Result<std::unique_ptr<KernelSession>> KernelSession::Start(KernelSessionOptions options) {
  if (options.replicas.empty()) return InvalidArgument("a kernel needs at least one replica");
  auto impl = std::make_unique<Impl>(std::move(options));
  auto signer = jupyter::Signer::Create(impl->options.replicas.front().connection.key,
                                        impl->options.replicas.front().connection.signature_scheme);
  if (!signer.ok()) return signer.status();
  impl->signer = *signer;
  impl->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl->wake_fd < 0) return Internal("eventfd failed");
  try {
    for (const ReplicaEndpoint& ep : impl->options.replicas)
      impl->links.push_back(impl->Connect(ep));
  } catch (const zmq::error_t& e) {
    return Unavailable(std::string("connecting to the kernel's replicas: ") + e.what());
  }
  impl->merger.SetPrimary(impl->options.replicas.front().replica_id);
  impl->last_activity = FormatIsoUtc(Clock::now());
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Run(); });
  return std::unique_ptr<KernelSession>(new KernelSession(std::move(impl)));
}

KernelSession::KernelSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

KernelSession::~KernelSession() { Shutdown(); }

void KernelSession::Shutdown() {
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->shut_down) return;
    impl_->shut_down = true;
  }
  impl_->stopping = true;
  impl_->Wake();
  if (impl_->thread.joinable()) impl_->thread.join();
  impl_->probe_cv.notify_all();
  for (auto& [id, sink] : impl_->clients)
    if (sink.closed) sink.closed();
  impl_->clients.clear();
  if (impl_->in_flight && !impl_->in_flight->plan.grant_id.empty() &&
      impl_->options.hooks.release) {
    impl_->options.hooks.release(impl_->in_flight->plan);
  }
  impl_->in_flight.reset();
  std::lock_guard lock(impl_->mu);
  close(impl_->wake_fd);
  impl_->wake_fd = -1;
}

Status KernelSession::AwaitReplicas(std::chrono::milliseconds timeout,
                                    const std::function<Status()>& check) {
  std::vector<ReplicaId> all;
  for (const auto& ep : impl_->options.replicas) all.push_back(ep.replica_id);
  return AwaitSome(all, timeout, check);
}

Status KernelSession::AwaitReplicas(const std::vector<ReplicaId>& replicas,
                                    std::chrono::milliseconds timeout) {
  return AwaitSome(replicas, timeout, nullptr);
}

Status KernelSession::ChangeLinks(std::optional<ReplicaEndpoint> add, ReplicaId remove) {
  auto done = std::make_shared<std::promise<Status>>();
  auto result = done->get_future();
  impl_->Post(Impl::LinkChange{std::move(add), remove, done});
  // The session thread answers within one poll round unless it stopped.
  while (result.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready) {
    std::lock_guard lock(impl_->mu);
    if (impl_->shut_down) {
      return Unavailable("kernel " + impl_->options.kernel_id + " is shutting down");
    }
  }
  return result.get();
}

Status KernelSession::AddReplica(const ReplicaEndpoint& replica) { return ChangeLinks(replica, 0); }

void KernelSession::RemoveReplica(ReplicaId replica) { (void)ChangeLinks(std::nullopt, replica); }

void KernelSession::HoldExecutions(bool hold) {
  impl_->executions_held = hold;
  if (!hold) impl_->Wake();  // a waiting execution may start now
}

Result<jupyter::Json> KernelSession::CallControl(ReplicaId to, const std::string& msg_type,
                                                 jupyter::Json content,
                                                 std::chrono::milliseconds timeout) {
  auto reply = std::make_shared<std::promise<Json>>();
  auto result = reply->get_future();
  impl_->Post(Impl::ControlCall{
      to, impl_->factory.Make(msg_type, std::move(content), Json::object()), reply});
  if (result.wait_for(timeout) != std::future_status::ready) {
    return Unavailable("replica " + std::to_string(to) + " did not answer " + msg_type + " in " +
                       std::to_string(timeout.count()) + " ms");
  }
  try {
    return result.get();
  } catch (const std::future_error&) {
    return Unavailable("kernel " + impl_->options.kernel_id + " is shutting down");
  } catch (const std::runtime_error&) {
    return NotFound("replica " + std::to_string(to) + " is not a live replica of kernel " +
                    impl_->options.kernel_id);
  }
}

Status KernelSession::AwaitSome(const std::vector<ReplicaId>& all,
                                std::chrono::milliseconds timeout,
                                const std::function<Status()>& check) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock lock(impl_->mu);
  impl_->answered_probe.clear();
  // A replica still starting may miss a probe that reached its socket before it bound (ZeroMQ
  // then delivers it), but a restarted one loses it: probe again every second.
  while (!impl_->shut_down) {
    std::vector<ReplicaId> missing;
    for (ReplicaId r : all)
      if (!impl_->answered_probe.count(r)) missing.push_back(r);
    if (missing.empty()) return Status::Ok();
    if (check) {
      lock.unlock();
      Status s = check();
      lock.lock();
      if (!s.ok()) return s;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string names;
      for (ReplicaId r : missing) names += (names.empty() ? "" : ", ") + std::to_string(r);
      return Unavailable("replica(s) " + names + " of kernel " + impl_->options.kernel_id +
                         " did not answer kernel_info in time");
    }
    impl_->commands.push_back(missing);
    lock.unlock();
    impl_->Wake();
    lock.lock();
    impl_->probe_cv.wait_until(
        lock, std::min(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(1)));
  }
  return Unavailable("kernel " + impl_->options.kernel_id + " is shutting down");
}

KernelSession::ClientId KernelSession::Attach(ClientSink sink) {
  const ClientId id = impl_->next_client++;
  impl_->Post(std::make_pair(id, std::move(sink)));
  return id;
}
void KernelSession::Detach(ClientId client) { impl_->Post(client); }

Status KernelSession::Send(ClientId client, jupyter::WsMessage message) {
  if (message.message.msg_id().empty() || message.message.msg_type().empty()) {
    return InvalidArgument("a message needs header.msg_id and header.msg_type");
  }
  impl_->Post(std::make_pair(client, std::move(message)));
  return Status::Ok();
}
void KernelSession::Interrupt() { impl_->Post(std::monostate{}); }
void KernelSession::ReplicaLost(ReplicaId r) { impl_->Post(std::make_pair(r, false)); }
void KernelSession::ReplicaBack(ReplicaId r) { impl_->Post(std::make_pair(r, true)); }

std::string KernelSession::execution_state() const {
  std::lock_guard lock(impl_->mu);
  return impl_->state;
}
std::string KernelSession::last_activity() const {
  std::lock_guard lock(impl_->mu);
  return impl_->last_activity;
}
int KernelSession::connections() const {
  std::lock_guard lock(impl_->mu);
  return impl_->connections;
}
ReplicaId KernelSession::current_executor() const {
  std::lock_guard lock(impl_->mu);
  return impl_->executor;
}
ReplicaId KernelSession::executing_replica() const {
  std::lock_guard lock(impl_->mu);
  return impl_->executing;
}
KernelSession::Stats KernelSession::stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stats;
}

}  // namespace nbos::gateway
