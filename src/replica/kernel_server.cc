#include "replica/kernel_server.h"

#include <pthread.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <thread>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "common/ids.h"
#include "common/log.h"
#include "common/thread_annotations.h"
#include "jupyter/message.h"
#include "jupyter/wire.h"
#include "replica/execution_gate.h"
#include "replica/fd_capture.h"
#include "replica/python_engine.h"
#include "replica/stream_buffer.h"

namespace nbos::replica {

namespace {

using jupyter::Json;
using jupyter::Message;

// Past this much buffered output the flush thread sends it without waiting for the interval,
// which bounds memory when a cell prints in a tight loop.
constexpr size_t kEagerFlushBytes = 1u << 20;

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// Reply content for a failure that is not an exception in user code.
std::string ErrorContent(const std::string& ename, const std::string& evalue) {
  return Dump(Json{{"status", "error"},
                   {"ename", ename},
                   {"evalue", evalue},
                   {"traceback", Json::array({ename + ": " + evalue})},
                   {"execution_count", 0}});
}

std::string UserName() {
  const char* user = std::getenv("USER");
  return user != nullptr && *user != '\0' ? user : "nbos";
}

void SendFrames(zmq::socket_t& socket, std::vector<std::string> frames) {
  for (size_t i = 0; i < frames.size(); ++i) {
    auto flags = i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none;
    socket.send(zmq::buffer(frames[i]), flags);
  }
}

class KernelServer final : public EngineHost {
 public:
  explicit KernelServer(const KernelOptions& options)
      : options_(options), factory_(NewUuid(), UserName()), ctx_(1), main_thread_(pthread_self()) {
    limits_.max_message_bytes = options.max_message_bytes;
  }

  int Run();

  void WriteStream(std::string_view name, std::string_view text) override {
    streams_.Append(name, text);
    if (streams_.buffered_bytes() >= kEagerFlushBytes) flush_cv_.Signal();
  }

  void FlushStreams() EXCLUDES(flush_mu_) override {
    MutexLock lock(&flush_mu_);
    FlushStreamsLocked();
  }

  void Publish(std::string_view msg_type, std::string content_json, std::string metadata_json,
               std::vector<std::string> buffers) EXCLUDES(flush_mu_) override {
    MutexLock lock(&flush_mu_);
    FlushStreamsLocked();
    Message m = NewMessage(msg_type, Json::object(), CurrentParent());
    m.metadata = Json::parse(metadata_json, nullptr, false);
    if (!m.metadata.is_object()) m.metadata = Json::object();
    m.buffers = std::move(buffers);
    SendIopub(std::move(m), std::move(content_json));
  }

  Result<std::string> RequestInput(std::string_view prompt, bool password) override;

 private:
  Status Bind();
  // Stops the threads Run started and closes the sockets; the engine has shut down.
  void TearDown();
  void ServeShell();
  void ServeControl();
  void ServeHeartbeat();
  void FlushLoop();

  void HandleShell(Message request);
  void HandleControl(Message request);
  std::vector<Message> TakeQueuedRequests();
  void AbortQueuedExecutions(std::vector<Message> queued);
  std::string RunInEngine(const Message& request, bool is_execute);
  std::string ExecuteReplicated(const Message& request, Json* metadata);
  // The cell as `decision` has it: run, followed, or answered with why it cannot run here.
  std::string ServeDecision(const ExecutionGate::Decision& decision, const Message& request,
                            Json* timings);
  std::string ExecuteElected(const ExecutionGate::Decision& decision, const Message& request,
                             Json* timings);
  void Interrupt(bool whole_group);
  void RequestStop();

  // Receives one message; nullopt when nothing could be decoded (logged and counted).
  std::optional<Message> Receive(zmq::socket_t& socket, const char* channel,
                                 zmq::recv_flags flags = zmq::recv_flags::none);
  Message NewMessage(std::string_view msg_type, Json content, const Json& parent);
  void SendReply(zmq::socket_t& socket, const Message& request, std::string content_json,
                 Json metadata = Json::object());
  void SendIopub(Message m, std::optional<std::string> content_json = std::nullopt);
  void PublishStatus(const char* state, const Json& parent);
  void ReplyUnknownRequest(zmq::socket_t& socket, const Message& request, const char* channel);
  void FlushStreamsLocked() REQUIRES(flush_mu_);
  std::string KernelInfo() EXCLUDES(info_mu_) {
    MutexLock lock(&info_mu_);
    return kernel_info_;
  }
  Json CurrentParent() EXCLUDES(parent_mu_) {
    MutexLock lock(&parent_mu_);
    return parent_header_;
  }

  KernelOptions options_;
  std::unique_ptr<ExecutionGate> gate_;  // from options_.start_gate; null for `nbos kernel`
  jupyter::Signer signer_;
  jupyter::DecodeLimits limits_;
  Mutex factory_mu_;  // held for factory_.Make (session() is fixed, read without it)
  jupyter::MessageFactory factory_;

  zmq::context_t ctx_;
  zmq::socket_t shell_, control_, stdin_, iopub_, hb_, wake_rx_, wake_tx_;
  // Order sends on iopub_ and wake_tx_ between threads. The sockets are not GUARDED_BY them:
  // Bind makes them before the threads start, and TearDown closes iopub_ once they are joined.
  Mutex iopub_mu_;
  Mutex wake_mu_;

  StreamBuffer streams_;
  Mutex flush_mu_;       // orders stream flushes against other iopub messages
  CondVar flush_cv_;     // wakes FlushLoop: output to flush at once, or stopping
  Mutex flush_wait_mu_;  // FlushLoop's, for flush_cv_

  // The last execute_request this kernel served, for a gateway that restarted while it ran and
  // lost its reply: nbos_execution_request on control answers with it (AnswerLastExecution).
  struct LastExecution {
    Json header;
    bool done = false;
    std::string content;  // the reply's, once done
    Json metadata;
    std::chrono::steady_clock::time_point done_at;
  };
  Mutex last_execution_mu_;
  std::optional<LastExecution> last_execution_ GUARDED_BY(last_execution_mu_);
  void NoteExecutionStarted(const Json& header) EXCLUDES(last_execution_mu_);
  void NoteExecutionDone(const std::string& content, const Json& metadata)
      EXCLUDES(last_execution_mu_);
  std::string AnswerLastExecution() EXCLUDES(last_execution_mu_);
  jupyter::Json AnswerStateRequest(const std::string& type);

  Mutex parent_mu_;
  Json parent_header_ GUARDED_BY(parent_mu_) = Json::object();
  std::vector<std::string> shell_identities_ GUARDED_BY(parent_mu_);

  std::atomic<bool> stopping_{false};
  std::atomic<bool> executing_{false};
  std::atomic<uint64_t> rejected_signatures_{0};
  std::atomic<uint64_t> malformed_messages_{0};
  pthread_t main_thread_;
  pid_t parent_pid_ = 0;

  Mutex info_mu_;
  std::string kernel_info_ GUARDED_BY(info_mu_);  // empty until the engine has started
  std::unique_ptr<FdCapture> capture_;
  std::unique_ptr<PythonEngine> engine_;
  std::thread control_thread_, hb_thread_, flush_thread_;
};

int KernelServer::Run() {
  auto signer =
      jupyter::Signer::Create(options_.connection.key, options_.connection.signature_scheme);
  if (!signer.ok()) {
    InitLogging(2, options_.log_level, "nbos-kernel");
    spdlog::error("{}", signer.status().ToString());
    return 2;
  }
  signer_ = *signer;

  // Only the main thread takes SIGINT: KeyboardInterrupt must land in the thread running user
  // code. Threads started from here on inherit the blocked mask.
  sigset_t sigint;
  sigemptyset(&sigint);
  sigaddset(&sigint, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigint, nullptr);

  auto capture = FdCapture::Start(
      [this](std::string_view name, std::string_view text) { WriteStream(name, text); });
  if (!capture.ok()) {
    InitLogging(2, options_.log_level, "nbos-kernel");
    spdlog::error("{}", capture.status().ToString());
    return 1;
  }
  capture_ = std::move(*capture);
  InitLogging(capture_->original_stderr_fd(), options_.log_level, "nbos-kernel");
  if (!signer_.enabled()) {
    spdlog::warn("connection file has an empty key: messages are not authenticated");
  }
  if (options_.start_gate) gate_ = options_.start_gate();
  if (const char* ppid = std::getenv("JPY_PARENT_PID"); ppid != nullptr) {
    parent_pid_ = static_cast<pid_t>(std::atoi(ppid));
  }

  if (Status s = Bind(); !s.ok()) {
    spdlog::error("{}", s.ToString());
    return 1;
  }
  PublishStatus("starting", Json::object());
  control_thread_ = std::thread([this] { ServeControl(); });
  hb_thread_ = std::thread([this] { ServeHeartbeat(); });
  flush_thread_ = std::thread([this] { FlushLoop(); });
  pthread_sigmask(SIG_UNBLOCK, &sigint, nullptr);

  auto engine = PythonEngine::Start(this, options_.version, options_.connection_file);
  int exit_code = 0;
  if (!engine.ok()) {
    spdlog::error("{}", engine.status().ToString());
    exit_code = 1;
  } else {
    engine_ = std::move(*engine);
    if (gate_ != nullptr) gate_->Attach(engine_.get());
    {
      MutexLock lock(&info_mu_);
      kernel_info_ = engine_->kernel_info_json();
    }
    ServeShell();
    engine_->Shutdown();
  }

  TearDown();
  spdlog::info("kernel exiting");
  spdlog::default_logger()->flush();
  capture_.reset();
  return exit_code;
}

void KernelServer::TearDown() {
  stopping_ = true;
  capture_->Drain();
  FlushStreams();
  flush_cv_.SignalAll();
  flush_thread_.join();
  for (zmq::socket_t* s : {&shell_, &stdin_, &wake_rx_}) {
    s->set(zmq::sockopt::linger, 0);
    s->close();
  }
  ctx_.shutdown();
  control_thread_.join();
  hb_thread_.join();
  iopub_.close();
  control_.close();
  {
    MutexLock lock(&wake_mu_);
    wake_tx_.close();
  }
  ctx_.close();
  uint64_t rejected = rejected_signatures_.load();
  uint64_t malformed = malformed_messages_.load();
  if (rejected + malformed > 0) {
    spdlog::warn("dropped {} messages with invalid signatures and {} malformed messages", rejected,
                 malformed);
  }
}

Status KernelServer::Bind() {
  const auto& c = options_.connection;
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
    iopub_.set(zmq::sockopt::linger, 1000);
    for (auto [socket, port] : {std::pair{&shell_, c.shell_port},
                                {&control_, c.control_port},
                                {&stdin_, c.stdin_port},
                                {&iopub_, c.iopub_port},
                                {&hb_, c.hb_port}}) {
      socket->bind(c.Endpoint(port));
    }
    std::string wake = "inproc://wake-" + factory_.session();
    wake_rx_.bind(wake);
    wake_tx_.connect(wake);
  } catch (const zmq::error_t& e) {
    return Unavailable(std::string("cannot bind kernel sockets: ") + e.what());
  }
  return Status::Ok();
}

Message KernelServer::NewMessage(std::string_view msg_type, Json content, const Json& parent) {
  MutexLock lock(&factory_mu_);
  return factory_.Make(msg_type, std::move(content), parent);
}

void KernelServer::SendReply(zmq::socket_t& socket, const Message& request,
                             std::string content_json, Json metadata) {
  Message reply =
      NewMessage(jupyter::ReplyTypeFor(request.msg_type()), Json::object(), request.header);
  reply.identities = request.identities;
  reply.metadata = std::move(metadata);
  SendFrames(socket, jupyter::EncodeFramesWithContent(reply, std::move(content_json), signer_));
}

void KernelServer::SendIopub(Message m, std::optional<std::string> content_json) {
  m.identities = {"kernel." + factory_.session() + "." + m.msg_type()};
  auto frames = content_json
                    ? jupyter::EncodeFramesWithContent(m, std::move(*content_json), signer_)
                    : jupyter::EncodeFrames(m, signer_);
  MutexLock lock(&iopub_mu_);
  SendFrames(iopub_, std::move(frames));
}

void KernelServer::ReplyUnknownRequest(zmq::socket_t& socket, const Message& request,
                                       const char* channel) {
  // Replying, rather than staying silent, keeps a client from waiting forever.
  spdlog::warn("unknown {} request type '{}'", channel, request.msg_type());
  SendReply(socket, request,
            Dump(Json{{"status", "error"},
                      {"ename", "UnknownMessageType"},
                      {"evalue", "nbos kernel does not handle " + request.msg_type()},
                      {"traceback", Json::array()}}));
}

void KernelServer::PublishStatus(const char* state, const Json& parent) {
  SendIopub(NewMessage("status", Json{{"execution_state", state}}, parent));
}

void KernelServer::FlushStreamsLocked() {
  auto segments = streams_.Take();
  if (segments.empty()) return;
  Json parent = CurrentParent();
  for (auto& seg : segments) {
    SendIopub(
        NewMessage("stream", Json{{"name", seg.name}, {"text", std::move(seg.text)}}, parent));
  }
}

std::optional<Message> KernelServer::Receive(zmq::socket_t& socket, const char* channel,
                                             zmq::recv_flags flags) {
  std::vector<zmq::message_t> parts;
  auto n = zmq::recv_multipart(socket, std::back_inserter(parts), flags);
  if (!n) return std::nullopt;
  std::vector<std::string> frames;
  frames.reserve(parts.size());
  for (auto& p : parts) frames.emplace_back(p.to_string());
  auto decoded = jupyter::DecodeFrames(std::move(frames), signer_, limits_);
  if (!decoded.ok()) {
    if (decoded.status().code() == StatusCode::kUnauthenticated) {
      uint64_t count = ++rejected_signatures_;
      spdlog::warn("dropped {} message with an invalid signature (total {})", channel, count);
    } else {
      uint64_t count = ++malformed_messages_;
      spdlog::warn("dropped malformed {} message: {} (total {})", channel,
                   decoded.status().message(), count);
    }
    return std::nullopt;
  }
  return std::move(*decoded);
}

void KernelServer::ServeShell() {
  zmq::pollitem_t items[] = {{shell_.handle(), 0, ZMQ_POLLIN, 0},
                             {wake_rx_.handle(), 0, ZMQ_POLLIN, 0}};
  while (!stopping_) {
    int ready;
    {
      PythonEngine::Unlocked nogil;
      // A replica also applies what its log delivers between requests.
      ready = zmq_poll(items, 2, gate_ != nullptr ? 50 : -1);
    }
    if (gate_ != nullptr) gate_->Pump();
    if (ready < 0) {
      if (zmq_errno() == EINTR) continue;
      spdlog::error("shell poll failed: {}", zmq_strerror(zmq_errno()));
      return;
    }
    if (items[1].revents & ZMQ_POLLIN) {
      zmq::message_t drop;
      (void)wake_rx_.recv(drop, zmq::recv_flags::dontwait);
      continue;
    }
    if (items[0].revents & ZMQ_POLLIN) {
      try {
        if (auto request = Receive(shell_, "shell", zmq::recv_flags::dontwait)) {
          HandleShell(std::move(*request));
        }
      } catch (const zmq::error_t& e) {
        if (e.num() != EINTR && e.num() != EAGAIN) throw;
      }
    }
  }
}

void KernelServer::HandleShell(Message request) {
  const std::string type = request.msg_type();
  if (type == "shutdown_request") {
    // Deprecated on shell since 5.4 but still sent by some clients.
    HandleControl(std::move(request));
    return;
  }
  FlushStreams();  // output of background threads belongs to the previous request
  {
    MutexLock lock(&parent_mu_);
    parent_header_ = request.header;
    shell_identities_ = request.identities;
  }
  PublishStatus("busy", request.header);
  bool abort_queue = false;
  std::vector<Message> queued;
  if (type == "kernel_info_request") {
    SendReply(shell_, request, engine_->kernel_info_json());
  } else if (PythonEngine::Handles(type)) {
    const bool is_execute = type == "execute_request";
    const std::string started = NowIsoUtc();
    if (is_execute) NoteExecutionStarted(request.header);
    Json metadata = Json::object();
    std::string content = is_execute && gate_ != nullptr ? ExecuteReplicated(request, &metadata)
                                                         : RunInEngine(request, is_execute);
    if (!content.empty()) {
      if (is_execute) {
        Json parsed = Json::parse(content, nullptr, false);
        std::string status = parsed.is_object() ? parsed.value("status", "error") : "error";
        metadata.update(Json{{"started", started},
                             {"dependencies_met", true},
                             {"engine", factory_.session()},
                             {"status", status}});
        // A replicated kernel's gateway applies stop_on_error itself and sends one execution at
        // a time, so what waits here was sent after it saw this failure: a lagging replica (one
        // back from a freeze, finishing a cancelled cell) must not abort it.
        abort_queue =
            gate_ == nullptr && status == "error" && request.content.value("stop_on_error", true);
      }
      // Requests that arrived while the failed cell ran are aborted; ones a client sends after
      // seeing this reply are not, so take them off the socket before replying.
      if (abort_queue) queued = TakeQueuedRequests();
      if (is_execute) NoteExecutionDone(content, metadata);
      SendReply(shell_, request, std::move(content), std::move(metadata));
    }
  } else if (!jupyter::ReplyTypeFor(type).empty()) {
    ReplyUnknownRequest(shell_, request, "shell");
  } else {
    spdlog::warn("ignoring shell message of type '{}'", type);
  }
  capture_->Drain();
  FlushStreams();
  PublishStatus("idle", request.header);
  if (abort_queue) AbortQueuedExecutions(std::move(queued));
}

std::string KernelServer::RunInEngine(const Message& request, bool is_execute) {
  executing_ = is_execute;
  auto reply = engine_->Handle(request);
  executing_ = false;
  capture_->Drain();
  FlushStreams();
  if (reply.ok()) return reply->value_or("");
  // Python raised outside user code, e.g. an interrupt that arrived just as a cell ended.
  const std::string& text = reply.status().message();
  spdlog::warn("{} failed outside user code: {}", request.msg_type(), text);
  return ErrorContent(text.substr(0, text.find(':')), text);
}

namespace {
double MsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

std::string KernelServer::ExecuteReplicated(const Message& request, Json* metadata) {
  const auto received = std::chrono::steady_clock::now();
  auto decision = gate_->Elect(request);
  if (!decision.ok()) {
    return ErrorContent("ExecutorLost",
                        "this replica could not learn in time which replica runs "
                        "the cell (" +
                            std::string(decision.status().message()) +
                            "): whether the cell ran is not known");
  }
  *metadata = gate_->ReplyMetadata(*decision);
  // Per-hop durations, for benchmarks and operators: election, the cell itself, replication.
  Json& timings = (*metadata)["nbos"]["timings_ms"];
  timings["elect"] = MsSince(received);
  std::string content = ServeDecision(*decision, request, &timings);
  // Known only now: a standby that could not apply this cell's effects says so in its reply.
  if (std::string why = gate_->Divergence(); !why.empty()) (*metadata)["nbos"]["diverged"] = why;
  return content;
}

std::string KernelServer::ServeDecision(const ExecutionGate::Decision& decision,
                                        const Message& request, Json* timings) {
  switch (decision.role) {
    case ExecutionGate::Role::kNobody:
      return ErrorContent("NoReplicaCanExecute", "every replica of this kernel yielded execution " +
                                                     decision.exec_id +
                                                     ": none can run the cell now");
    case ExecutionGate::Role::kCancelled:
      return ErrorContent(
          "CellCancelled",
          "the replica chosen to run this cell was lost before it began it, and the kernel's log "
          "cancelled the cell: the cell did not run on any replica, which keep the state of the "
          "last completed cell. nbos is replacing the lost replica: run the cell again");
    case ExecutionGate::Role::kNotRun:
      return ErrorContent(
          "ReplicasUnavailable",
          "this replica, chosen to run the cell, could not get it elected in time (" +
              std::string(decision.refused.message()) +
              "); it did not begin the cell and will not: the cell did not run. Run it again in "
              "a moment");
    case ExecutionGate::Role::kNotKnown:
      return ErrorContent(
          "ExecutorLost",
          "the replica chosen to run this cell was lost, and the kernel's log has not decided "
          "yet whether the cell runs: whether it ran is not known. If it did, its effects reach "
          "every replica through the log. Look at the kernel's state before running it again");
    case ExecutionGate::Role::kStandby: {
      // Another replica runs the cell; this one emits no output and answers once the
      // executor's effects are applied here.
      const auto following = std::chrono::steady_clock::now();
      auto reply = gate_->Follow(decision);
      (*timings)["follow"] = MsSince(following);
      return reply.ok() ? *reply : ErrorContent("ExecutorLost", reply.status().message());
    }
    case ExecutionGate::Role::kExecute:
      return ExecuteElected(decision, request, timings);
  }
  return ErrorContent("ReplicationError",
                      "this replica does not know its election's outcome: whether the cell ran is "
                      "not known");
}

std::string KernelServer::ExecuteElected(const ExecutionGate::Decision& decision,
                                         const Message& request, Json* timings) {
  if (!decision.refused.ok()) {
    std::string content = ErrorContent("ReplicaOutOfSync", decision.refused.message());
    if (Status s = gate_->Commit(decision, request, content); !s.ok()) {
      spdlog::warn("the other replicas were not told that execution {} did not run: {}",
                   decision.exec_id, s.ToString());
    }
    return content;
  }
  const auto running = std::chrono::steady_clock::now();
  std::string content = RunInEngine(request, true);
  (*timings)["run"] = MsSince(running);
  // A reply means the cell's effects are replicated (DESIGN.md §3, step 5).
  const auto committing = std::chrono::steady_clock::now();
  Status committed = gate_->Commit(decision, request, content);
  (*timings)["commit"] = MsSince(committing);
  if (!committed.ok()) {
    return ErrorContent(
        "ReplicationError",
        "the cell ran but its effects were not replicated in time: " + committed.message());
  }
  return content;
}

std::vector<Message> KernelServer::TakeQueuedRequests() {
  std::vector<Message> queued;
  for (;;) {
    try {
      zmq::pollitem_t item{shell_.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq_poll(&item, 1, 0) <= 0) return queued;
      if (auto request = Receive(shell_, "shell", zmq::recv_flags::dontwait)) {
        queued.push_back(std::move(*request));
      }
    } catch (const zmq::error_t&) {
      return queued;
    }
  }
}

void KernelServer::AbortQueuedExecutions(std::vector<Message> queued) {
  // Like ipykernel with stop_on_error: executions queued behind a failed cell are answered
  // "aborted" instead of running against state the failure left behind.
  for (Message& request : queued) {
    if (request.msg_type() != "execute_request") {
      HandleShell(std::move(request));
      continue;
    }
    PublishStatus("busy", request.header);
    SendReply(shell_, request, R"({"status":"aborted"})",
              Json{{"engine", factory_.session()}, {"status", "aborted"}});
    PublishStatus("idle", request.header);
  }
}

Result<std::string> KernelServer::RequestInput(std::string_view prompt, bool password) {
  FlushStreams();
  Message request;
  {
    MutexLock lock(&parent_mu_);
    request = NewMessage("input_request", Json{{"prompt", prompt}, {"password", password}},
                         parent_header_);
    request.identities = shell_identities_;
  }
  SendFrames(stdin_, jupyter::EncodeFrames(request, signer_));
  zmq::pollitem_t item{stdin_.handle(), 0, ZMQ_POLLIN, 0};
  for (;;) {
    int ready;
    {
      PythonEngine::Unlocked nogil;
      ready = zmq_poll(&item, 1, 100);
    }
    if (ready < 0 && zmq_errno() != EINTR) {
      return Internal(std::string("stdin poll failed: ") + zmq_strerror(zmq_errno()));
    }
    if (PythonEngine::RaiseIfSignalled()) return Unavailable("interrupted");
    if (stopping_) return Unavailable("kernel is shutting down");
    if (ready <= 0) continue;
    auto reply = Receive(stdin_, "stdin", zmq::recv_flags::dontwait);
    if (!reply || reply->msg_type() != "input_reply") continue;
    auto value = reply->content.find("value");
    if (value == reply->content.end() || !value->is_string()) return std::string();
    return value->get<std::string>();
  }
}

void KernelServer::ServeControl() {
  while (!stopping_) {
    std::optional<Message> request;
    try {
      request = Receive(control_, "control");
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      return;  // ETERM: the context is shutting down
    }
    if (request) HandleControl(std::move(*request));
  }
}

// The gateway's questions about the replicated state: a checkpoint of it in the blob store
// (suspending an idle kernel), or the blobs it needs (garbage collection).
Json KernelServer::AnswerStateRequest(const std::string& type) {
  const bool checkpoint = type == "nbos_checkpoint_request";
  Json answer{{"status", "ok"}};
  Status failed;
  if (gate_ == nullptr) {
    failed = InvalidArgument("this kernel is not replicated");
  } else if (checkpoint) {
    auto key = gate_->SaveCheckpoint();
    if (key.ok()) answer["key"] = *key;
    failed = key.status();
  } else {
    auto keys = gate_->BlobRefs();
    if (keys.ok()) answer["keys"] = *keys;
    failed = keys.status();
  }
  if (failed.ok()) return answer;
  return Json{{"status", "error"},
              {"ename", checkpoint ? "CheckpointError" : "BlobRefsError"},
              {"evalue", failed.message()},
              {"traceback", Json::array()}};
}

void KernelServer::HandleControl(Message request) {
  const std::string type = request.msg_type();
  // A shutdown_request that came on shell is answered on shell; everything else on control.
  zmq::socket_t& socket = pthread_equal(pthread_self(), main_thread_) ? shell_ : control_;
  PublishStatus("busy", request.header);
  bool stop = false;
  if (type == "kernel_info_request") {
    // Static after start-up, so control can answer without the engine's thread.
    std::string info = KernelInfo();
    if (!info.empty()) SendReply(socket, request, std::move(info));
  } else if (type == "interrupt_request") {
    Interrupt(/*whole_group=*/true);
    SendReply(socket, request, R"({"status":"ok"})");
  } else if (type == "nbos_cancel_request" && gate_ != nullptr) {
    // The executor of this execution is gone, or the kernel lost its majority: stop waiting.
    const Json exec_id =
        request.content.is_object() ? request.content.value("exec_id", Json()) : Json();
    const Json reason =
        request.content.is_object() ? request.content.value("reason", Json()) : Json();
    const Json decide_field =
        request.content.is_object() ? request.content.value("decide", Json()) : Json();
    const bool decide = decide_field.is_boolean() && decide_field.get<bool>();
    const bool cancelled =
        gate_->Cancel(exec_id.is_string() ? exec_id.get<std::string>() : "",
                      reason.is_string() ? reason.get<std::string>() : "", decide);
    SendReply(socket, request, Dump(Json{{"status", "ok"}, {"cancelled", cancelled}}));
  } else if (type == "nbos_checkpoint_request" || type == "nbos_blob_refs_request") {
    SendReply(socket, request, Dump(AnswerStateRequest(type)));
  } else if (type == "nbos_execution_request") {
    SendReply(socket, request, AnswerLastExecution());
  } else if (type == "nbos_membership_request" && request.content.is_object() &&
             request.content.value("op", Json()) == "members") {
    // {"op": "members"}: the group as this replica knows it, without waiting for a change.
    const ExecutionGate::RaftGroupView group =
        gate_ != nullptr ? gate_->RaftGroup() : ExecutionGate::RaftGroupView{};
    Json content{{"status", "ok"},
                 {"members", group.members},
                 {"committed", group.committed},
                 {"leading", group.leading},
                 {"term", group.term}};
    SendReply(socket, request, Dump(content));
  } else if (type == "nbos_membership_request") {
    // Live migration: blocks this channel until the change committed (a new replica's catch-up
    // included); interrupts sent meanwhile wait.
    Status s;
    auto change = ParseMembershipRequest(request.content);
    if (!change.ok()) {
      s = change.status();
    } else if (gate_ == nullptr) {
      s = InvalidArgument("this kernel is not replicated: it has no members to change");
    } else {
      s = gate_->ChangeMembership(*change);
    }
    Json content{{"status", "ok"}};
    if (!s.ok()) {
      spdlog::warn("membership request refused: {}", s.ToString());
      content =
          Json{{"status", "error"},
               {"ename", s.code() == StatusCode::kInvalidArgument ? "ValueError" : "RuntimeError"},
               {"evalue", s.message()},
               {"traceback", Json::array()}};
    }
    SendReply(socket, request, Dump(content));
  } else if (type == "shutdown_request") {
    bool restart = request.content.value("restart", false);
    Json content{{"status", "ok"}, {"restart", restart}};
    SendReply(socket, request, Dump(content));
    // ipykernel also broadcasts the reply, for clients that only listen on iopub.
    SendIopub(NewMessage("shutdown_reply", content, request.header));
    stop = true;
  } else if (!jupyter::ReplyTypeFor(type).empty()) {
    ReplyUnknownRequest(socket, request, "control");
  }
  PublishStatus("idle", request.header);
  if (stop) RequestStop();
}

void KernelServer::NoteExecutionStarted(const Json& header) {
  MutexLock lock(&last_execution_mu_);
  last_execution_ = LastExecution{header, false, "", Json::object(), {}};
}

void KernelServer::NoteExecutionDone(const std::string& content, const Json& metadata) {
  MutexLock lock(&last_execution_mu_);
  if (!last_execution_) return;
  last_execution_->done = true;
  last_execution_->content = content;
  last_execution_->metadata = metadata;
  last_execution_->done_at = std::chrono::steady_clock::now();
}

// {"status": "ok", "execution": null | {"header", "state": "running" | "done", and when done
// "content", "metadata", "done_ms_ago"}}.
std::string KernelServer::AnswerLastExecution() {
  MutexLock lock(&last_execution_mu_);
  Json execution = nullptr;
  if (last_execution_) {
    const LastExecution& e = *last_execution_;
    execution = Json{{"header", e.header}, {"state", e.done ? "done" : "running"}};
    if (e.done) {
      execution["content"] = Json::parse(e.content, nullptr, false);
      execution["metadata"] = e.metadata;
      execution["done_ms_ago"] = std::chrono::duration_cast<std::chrono::milliseconds>(
                                     std::chrono::steady_clock::now() - e.done_at)
                                     .count();
    }
  }
  return Dump(Json{{"status", "ok"}, {"execution", execution}});
}

void KernelServer::Interrupt(bool whole_group) {
  // Like ipykernel: a kernel that leads its process group interrupts the group, so `!cmd`
  // children stop too. Otherwise only the thread running user code is signalled.
  if (whole_group && getpgid(0) == getpid()) {
    killpg(getpid(), SIGINT);
  } else {
    pthread_kill(main_thread_, SIGINT);
  }
}

void KernelServer::RequestStop() {
  if (stopping_.exchange(true)) return;
  if (executing_) Interrupt(/*whole_group=*/false);
  MutexLock lock(&wake_mu_);
  try {
    wake_tx_.send(zmq::str_buffer("stop"), zmq::send_flags::dontwait);
  } catch (const zmq::error_t&) {
    // The main loop is already gone.
  }
  flush_cv_.SignalAll();
}

void KernelServer::ServeHeartbeat() {
  try {
    // A ROUTER proxied onto itself echoes every ping back to its sender.
    zmq::proxy(hb_, hb_);
  } catch (const zmq::error_t&) {
    // ETERM at shutdown
  }
  hb_.close();
}

void KernelServer::FlushLoop() {
  const auto interval = std::chrono::milliseconds(options_.stream_flush_interval_ms);
  MutexLock lock(&flush_wait_mu_);
  while (!stopping_) {
    const auto deadline = std::chrono::steady_clock::now() + interval;
    while (!stopping_.load() && streams_.buffered_bytes() < kEagerFlushBytes &&
           flush_cv_.WaitUntil(&flush_wait_mu_, deadline)) {
    }
    if (streams_.buffered_bytes() > 0) FlushStreams();
    if (parent_pid_ > 0 && kill(parent_pid_, 0) != 0 && errno == ESRCH) {
      spdlog::warn("parent process {} is gone; shutting down", parent_pid_);
      RequestStop();
    }
  }
}

}  // namespace

void RunKernel(const KernelOptions& options) {
  auto server = std::make_unique<KernelServer>(options);
  int exit_code = server->Run();
  std::fflush(nullptr);
  std::_Exit(exit_code);
}

}  // namespace nbos::replica
