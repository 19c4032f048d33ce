#include "relay/relay.h"

#include <pthread.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <ctime>
#include <deque>
#include <iostream>
#include <optional>
#include <thread>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "common/ids.h"
#include "common/log.h"
#include "common/thread_annotations.h"
#include "jupyter/message.h"
#include "jupyter/wire.h"
#include "relay/relay_router.h"

namespace nbos::relay {

namespace {

using jupyter::Json;
using jupyter::Message;
using namespace std::chrono_literals;

// jupyter_client sends SIGTERM 2.5 s after a shutdown_request and SIGKILL at 5 s
// (shutdown_wait_time); the DELETE must fit before the kill.
constexpr auto kDeleteTimeout = 4s;
constexpr int kPollMs = 1000;

void SendFrames(zmq::socket_t& socket, const std::vector<std::string>& frames) {
  for (size_t i = 0; i < frames.size(); ++i) {
    auto flags = i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none;
    socket.send(zmq::buffer(frames[i]), flags);
  }
}

sigset_t RelaySignals() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, s);
  return set;
}

class Relay {
 public:
  Relay(const RelayOptions& options, jupyter::Signer signer)
      : options_(options), signer_(std::move(signer)), factory_(NewUuid(), "nbos"), ctx_(1) {
    limits_.max_message_bytes = options.max_message_bytes;
  }

  int Run();

 private:
  struct Event {
    enum class Kind { kMessage, kInterrupt, kTerminate, kGone };
    Kind kind = Kind::kMessage;
    jupyter::WsMessage message;
    Status status;
  };
  enum class End { kNone, kShutdown, kTerminate, kGone };

  Status Bind() EXCLUDES(wake_mu_);
  // From any thread: queues `e` for the serving thread and wakes it.
  void Post(Event e) EXCLUDES(wake_mu_, events_mu_);
  void WatchSignals();
  std::optional<Message> Receive(zmq::socket_t& socket, const char* channel);
  End HandleClient(Socket socket, Message m);
  End HandleEvents() EXCLUDES(events_mu_);
  Status ConnectGateway();
  End Serve();
  void Deliver(Delivery d);
  zmq::socket_t& SocketFor(Socket s);
  void Cleanup() EXCLUDES(wake_mu_);

  const RelayOptions& options_;
  jupyter::Signer signer_;
  jupyter::DecodeLimits limits_;
  jupyter::MessageFactory factory_;
  RelayRouter router_;

  zmq::context_t ctx_;
  zmq::socket_t shell_, control_, stdin_, iopub_, hb_, wake_rx_;
  Mutex wake_mu_;
  zmq::socket_t wake_tx_ GUARDED_BY(wake_mu_);  // used by the reader and signal threads

  Mutex events_mu_;
  std::deque<Event> events_ GUARDED_BY(events_mu_);

  std::unique_ptr<GatewayLink> link_;
  std::atomic<bool> stopping_{false};
  std::thread hb_thread_, signal_thread_;
  std::vector<std::thread> interrupters_;
  uint64_t rejected_ = 0;
};

Status Relay::Bind() {
  const auto& c = options_.connection;
  MutexLock lock(&wake_mu_);  // for wake_tx_; no other thread runs yet
  try {
    shell_ = zmq::socket_t(ctx_, zmq::socket_type::router);
    control_ = zmq::socket_t(ctx_, zmq::socket_type::router);
    stdin_ = zmq::socket_t(ctx_, zmq::socket_type::router);
    iopub_ = zmq::socket_t(ctx_, zmq::socket_type::pub);
    hb_ = zmq::socket_t(ctx_, zmq::socket_type::router);
    wake_rx_ = zmq::socket_t(ctx_, zmq::socket_type::pair);
    wake_tx_ = zmq::socket_t(ctx_, zmq::socket_type::pair);
    // A slow subscriber must not silently lose cell output.
    iopub_.set(zmq::sockopt::sndhwm, 100000);
    for (auto [socket, port] : {std::pair{&shell_, c.shell_port},
                                {&control_, c.control_port},
                                {&stdin_, c.stdin_port},
                                {&iopub_, c.iopub_port},
                                {&hb_, c.hb_port}}) {
      socket->bind(c.Endpoint(port));
    }
    std::string wake = "inproc://relay-wake-" + factory_.session();
    wake_rx_.bind(wake);
    wake_tx_.connect(wake);
  } catch (const zmq::error_t& e) {
    return Unavailable(std::string("cannot bind kernel sockets: ") + e.what());
  }
  return Status::Ok();
}

void Relay::Post(Event e) {
  {
    MutexLock lock(&events_mu_);
    events_.push_back(std::move(e));
  }
  MutexLock lock(&wake_mu_);
  if (stopping_) return;
  // A full pipe already means a pending wake-up.
  (void)wake_tx_.send(zmq::str_buffer("w"), zmq::send_flags::dontwait);
}

void Relay::WatchSignals() {
  const sigset_t set = RelaySignals();
  while (!stopping_) {
    timespec wait{0, 200 * 1000 * 1000};
    siginfo_t info;
    int sig = sigtimedwait(&set, &info, &wait);
    if (sig < 0) continue;  // timeout or EINTR
    Event e;
    e.kind = sig == SIGINT ? Event::Kind::kInterrupt : Event::Kind::kTerminate;
    Post(std::move(e));
  }
}

std::optional<Message> Relay::Receive(zmq::socket_t& socket, const char* channel) {
  std::vector<zmq::message_t> parts;
  auto n = zmq::recv_multipart(socket, std::back_inserter(parts), zmq::recv_flags::dontwait);
  if (!n) return std::nullopt;
  std::vector<std::string> frames;
  frames.reserve(parts.size());
  for (auto& p : parts) frames.emplace_back(p.to_string());
  auto decoded = jupyter::DecodeFrames(std::move(frames), signer_, limits_);
  if (!decoded.ok()) {
    // Jupyter clients sign with the connection file's key; anything else is not from them.
    ++rejected_;
    spdlog::warn("dropped a {} message: {} (total dropped {})", channel,
                 decoded.status().ToString(), rejected_);
    return Message{};  // an empty header marks it dropped; the caller keeps draining
  }
  return std::move(*decoded);
}

zmq::socket_t& Relay::SocketFor(Socket s) {
  switch (s) {
    case Socket::kShell:
      return shell_;
    case Socket::kControl:
      return control_;
    case Socket::kStdin:
      return stdin_;
    case Socket::kIopub:
      return iopub_;
  }
  return iopub_;
}

void Relay::Deliver(Delivery d) {
  SendFrames(SocketFor(d.socket), jupyter::EncodeFrames(d.message, signer_));
}

Relay::End Relay::HandleClient(Socket socket, Message m) {
  if (m.header.empty()) return End::kNone;  // dropped by Receive
  spdlog::debug("client -> gateway: {} {}", static_cast<int>(socket), m.msg_type());
  ClientAction action = router_.FromClient(socket, m);
  if (action.kind == ClientAction::Kind::kForward) {
    link_->Send(action.forward);
    return End::kNone;
  }
  // shutdown_request: the reply is the relay's own; the gateway kernel is deleted afterwards.
  Message reply = factory_.Make("shutdown_reply",
                                Json{{"status", "ok"}, {"restart", action.restart}}, m.header);
  reply.identities = m.identities;
  Deliver({socket, reply});
  reply.identities = {"kernel." + factory_.session() + ".shutdown_reply"};
  Deliver({Socket::kIopub, reply});
  spdlog::info("shutdown_request (restart={}): ending gateway kernel {}", action.restart,
               link_->kernel_id());
  return End::kShutdown;
}

Relay::End Relay::HandleEvents() {
  while (true) {
    zmq::message_t byte;
    if (!wake_rx_.recv(byte, zmq::recv_flags::dontwait)) break;
  }
  std::deque<Event> events;
  {
    MutexLock lock(&events_mu_);
    events.swap(events_);
  }
  for (Event& e : events) {
    switch (e.kind) {
      case Event::Kind::kMessage: {
        spdlog::debug("gateway -> client: {} {}", jupyter::ChannelName(e.message.channel),
                      e.message.message.msg_type());
        auto d = router_.FromKernel(std::move(e.message));
        if (d) {
          Deliver(std::move(*d));
        } else {
          spdlog::debug("no client waits for it");
        }
        break;
      }
      case Event::Kind::kInterrupt:
        // Off the main thread: the POST must not hold up messages.
        interrupters_.emplace_back([link = link_.get()] {
          if (Status s = link->Interrupt(); !s.ok()) spdlog::warn("{}", s.ToString());
        });
        break;
      case Event::Kind::kTerminate:
        spdlog::info("terminating: ending gateway kernel {}", link_->kernel_id());
        return End::kTerminate;
      case Event::Kind::kGone:
        std::cerr << "nbos relay: " << e.status.message() << "\n";
        return End::kGone;
    }
  }
  return End::kNone;
}

int Relay::Run() {
  if (Status s = Bind(); !s.ok()) {
    std::cerr << "nbos relay: " << s.message() << "\n";
    return 2;
  }
  hb_thread_ = std::thread([this] {
    try {
      // A ROUTER proxied onto itself echoes every ping back to its sender.
      zmq::proxy(hb_, hb_);
    } catch (const zmq::error_t&) {
      // ETERM at shutdown
    }
  });
  signal_thread_ = std::thread([this] { WatchSignals(); });
  if (Status s = ConnectGateway(); !s.ok()) {
    std::cerr << "nbos relay: " << s.message() << "\n";
    Cleanup();
    return 1;
  }
  const End end = Serve();
  // Close the WebSocket first, so the gateway's teardown is not mistaken for a drop.
  link_->Stop();
  int code = 0;
  if (end == End::kGone) {
    code = 1;
  } else if (Status s = link_->Delete(kDeleteTimeout); !s.ok()) {
    spdlog::warn("{}", s.ToString());
  }
  Cleanup();
  return code;
}

// Starts the gateway kernel and its WebSocket; its messages and its loss become events.
Status Relay::ConnectGateway() {
  auto link = GatewayLink::Start(
      options_.gateway,
      [this](jupyter::WsMessage m) {
        Event e;
        e.message = std::move(m);
        Post(std::move(e));
      },
      [this](const Status& why) {
        Event e;
        e.kind = Event::Kind::kGone;
        e.status = why;
        Post(std::move(e));
      });
  if (!link.ok()) return link.status();
  link_ = std::move(*link);
  return Status::Ok();
}

// Relays client messages and events until one of them, the parent's exit or a failed poll ends
// the session.
Relay::End Relay::Serve() {
  pid_t parent = 0;
  if (const char* ppid = std::getenv("JPY_PARENT_PID"); ppid != nullptr) {
    parent = static_cast<pid_t>(std::atoi(ppid));
    // Only a direct parent can be watched by getppid().
    if (parent != getppid()) parent = 0;
  }
  zmq::pollitem_t items[] = {{shell_.handle(), 0, ZMQ_POLLIN, 0},
                             {control_.handle(), 0, ZMQ_POLLIN, 0},
                             {stdin_.handle(), 0, ZMQ_POLLIN, 0},
                             {wake_rx_.handle(), 0, ZMQ_POLLIN, 0}};
  const std::pair<Socket, const char*> sockets[] = {
      {Socket::kShell, "shell"}, {Socket::kControl, "control"}, {Socket::kStdin, "stdin"}};
  End end = End::kNone;
  while (end == End::kNone) {
    int ready = zmq_poll(items, 4, kPollMs);
    if (ready < 0) {
      if (zmq_errno() == EINTR) continue;
      spdlog::error("poll failed: {}", zmq_strerror(zmq_errno()));
      return End::kTerminate;
    }
    if (parent != 0 && getppid() != parent) {
      spdlog::info("parent process {} exited", parent);
      return End::kTerminate;
    }
    // Control first: it must not queue behind shell traffic.
    for (int i : {1, 0, 2}) {
      if (!(items[i].revents & ZMQ_POLLIN)) continue;
      auto [socket, name] = sockets[i];
      while (end == End::kNone) {
        auto m = Receive(SocketFor(socket), name);
        if (!m) break;
        end = HandleClient(socket, std::move(*m));
      }
    }
    if (end == End::kNone && (items[3].revents & ZMQ_POLLIN)) end = HandleEvents();
  }
  return end;
}

void Relay::Cleanup() {
  {
    MutexLock lock(&wake_mu_);
    stopping_ = true;
  }
  if (signal_thread_.joinable()) signal_thread_.join();
  for (auto& t : interrupters_) t.join();
  // The other threads that used sockets (reader, signals) are done; the heartbeat proxy ends
  // with the context.
  for (zmq::socket_t* s : {&shell_, &control_, &stdin_, &wake_rx_, &wake_tx_}) {
    if (*s) {
      s->set(zmq::sockopt::linger, 0);
      s->close();
    }
  }
  // Let a last shutdown_reply on iopub reach subscribers.
  if (iopub_) {
    iopub_.set(zmq::sockopt::linger, 500);
    iopub_.close();
  }
  ctx_.shutdown();
  if (hb_thread_.joinable()) hb_thread_.join();
  hb_.close();  // no setsockopt here: the context is shut down, it would throw ETERM
  ctx_.close();
  if (rejected_ > 0) spdlog::warn("dropped {} messages that did not verify", rejected_);
}

}  // namespace

int RunRelay(const RelayOptions& options) {
  InitLogging(2, options.log_level, "nbos-relay");
  auto signer =
      jupyter::Signer::Create(options.connection.key, options.connection.signature_scheme);
  if (!signer.ok()) {
    std::cerr << "nbos relay: " << signer.status().message() << "\n";
    return 2;
  }
  if (!signer->enabled()) {
    spdlog::warn("connection file has an empty key: messages are not authenticated");
  }
  // Every thread inherits the mask; the signal thread takes them with sigtimedwait.
  const sigset_t set = RelaySignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  Relay relay(options, *signer);
  return relay.Run();
}

}  // namespace nbos::relay
