#include "replay/replayer.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <thread>

#include "common/ids.h"
#include "common/thread_annotations.h"
#include "http/client.h"
#include "jupyter/message.h"
#include "relay/inbox.h"

namespace nbos::replay {

namespace {

using Clock = std::chrono::steady_clock;
using jupyter::Json;
using jupyter::Message;
using namespace std::chrono_literals;

// Waits are cut into slices this long so that a stop is seen promptly.
constexpr auto kSlice = 200ms;
constexpr auto kStartupTimeout = 120s;
constexpr auto kDeleteTimeout = 30s;
constexpr auto kInterruptGrace = 30s;

// The replay's clock: it starts once the sessions open before the window are up. Thread-safe.
class ReplayClock {
 public:
  ReplayClock(std::atomic<bool>* stop, int64_t waiting_for) : stop_(stop), pending_(waiting_for) {}

  // A session open before the window is ready (or failed); the last one starts the clock.
  void Arrive() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (--pending_ <= 0 && !t0_) t0_ = Clock::now();
    cv_.SignalAll();
  }
  // Blocks until the clock runs; false when the replay was stopped first.
  bool WaitStarted() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    while (!t0_) {
      if (*stop_) return false;
      cv_.WaitFor(&mu_, kSlice);
    }
    return !*stop_;
  }
  // Blocks until the clock reads `at_ms`; false when the replay was stopped.
  bool SleepUntil(int64_t at_ms) EXCLUDES(mu_) {
    if (!WaitStarted()) return false;
    while (!*stop_) {
      const int64_t left_ms = at_ms - NowMs();
      if (left_ms <= 0) return true;
      std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(kSlice, 1ms * left_ms));
    }
    return false;
  }
  int64_t NowMs() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (!t0_) return 0;
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - *t0_).count();
  }
  bool stopped() const { return *stop_; }

 private:
  std::atomic<bool>* stop_;
  Mutex mu_;
  CondVar cv_;
  int64_t pending_ GUARDED_BY(mu_);
  std::optional<Clock::time_point> t0_ GUARDED_BY(mu_);
};

http::Headers AuthHeaders(const relay::GatewayOptions& g) {
  http::Headers h;
  if (!g.token.empty()) h.emplace_back("Authorization", "token " + g.token);
  return h;
}

// GET /api/nbos/cluster as JSON.
Result<Json> FetchCluster(const relay::GatewayOptions& g) {
  auto r =
      http::HttpRequest("GET", g.url + "/api/nbos/cluster", AuthHeaders(g), "", g.request_timeout);
  if (!r.ok()) return Unavailable("gateway " + g.url + ": " + r.status().message());
  if (r->status != 200) {
    return Unavailable(fmt::format("gateway {} answered {} to GET /api/nbos/cluster: {}", g.url,
                                   r->status, r->body.substr(0, 200)));
  }
  Json j = Json::parse(r->body, nullptr, false);
  if (!j.is_object() || !j.contains("servers") || !j["servers"].is_array()) {
    return Unavailable("gateway " + g.url + " sent a cluster view without servers");
  }
  return j;
}

ClusterSample SampleOf(const Json& cluster, int64_t t_ms) {
  ClusterSample s;
  s.t_ms = t_ms;
  for (const Json& server : cluster["servers"]) {
    if (!server.value("alive", false)) continue;
    ++s.servers;
    s.gpus += server.contains("spec") ? server["spec"].value("gpus", 0) : 0;
    s.gpus_committed += server.value("gpus_committed", 0);
  }
  if (cluster.contains("migrations") && cluster["migrations"].is_object()) {
    s.migrations_done = cluster["migrations"].value("done", int64_t{0});
  }
  return s;
}

}  // namespace

std::string CellCode(int64_t duration_ms) {
  return fmt::format(
      "import time as _nbos_replay_time\n"
      "_nbos_replay_t0 = _nbos_replay_time.monotonic()\n"
      "_nbos_replay_time.sleep({:.3f})\n"
      "print('nbos-replay-body-ms', (_nbos_replay_time.monotonic() - _nbos_replay_t0) * 1000)\n",
      static_cast<double>(duration_ms) / 1000.0);
}

int64_t BodyMsFromOutput(const std::string& stdout_text) {
  static constexpr std::string_view kTag = "nbos-replay-body-ms ";
  const size_t at = stdout_text.rfind(kTag);
  if (at == std::string::npos) return -1;
  char* end = nullptr;
  const double ms = std::strtod(stdout_text.c_str() + at + kTag.size(), &end);
  if (end == stdout_text.c_str() + at + kTag.size() || !(ms >= 0)) return -1;
  return static_cast<int64_t>(ms);
}

namespace {

// One session: its kernel and its cells, on its own thread.
class SessionRun {
 public:
  SessionRun(const sim::Session& session, const ReplayOptions& options, ReplayClock* clock,
             CellOutcome* outcomes)
      : session_(session),
        options_(options),
        clock_(clock),
        outcomes_(outcomes),
        factory_(NewUuid(), "nbos-replay") {}

  // False when the kernel could not be started or was lost.
  bool Run();

 private:
  bool StartKernel();
  std::optional<Message> AwaitReply(const std::string& msg_id, Clock::time_point deadline,
                                    std::string* stdout_text = nullptr,
                                    Clock::time_point* reply_at = nullptr);
  void RunCell(const sim::Cell& cell, CellOutcome* out);
  void Log(const std::string& line) const {
    if (options_.log) options_.log("session " + session_.id + ": " + line);
  }

  const sim::Session& session_;
  const ReplayOptions& options_;
  ReplayClock* clock_;
  CellOutcome* outcomes_;
  jupyter::MessageFactory factory_;
  relay::Inbox inbox_;
  std::unique_ptr<relay::GatewayLink> link_;
};

bool SessionRun::StartKernel() {
  relay::GatewayOptions g = options_.gateway;
  g.env["KERNEL_GPUS"] = std::to_string(session_.gpus);
  auto link = relay::GatewayLink::Start(
      g, [this](jupyter::WsMessage m) { inbox_.Push(std::move(m)); },
      [this](const Status& why) { inbox_.Gone(why); });
  if (!link.ok()) {
    Log("kernel not started: " + link.status().message());
    return false;
  }
  link_ = std::move(*link);
  // A just-started kernel may miss the first request (jupyter-protocol.md §2.3 (b)).
  const auto ready_by = Clock::now() + kStartupTimeout;
  while (Clock::now() < ready_by && !inbox_.gone() && !clock_->stopped()) {
    Message m = factory_.Make("kernel_info_request", Json::object(), Json::object());
    link_->Send({jupyter::Channel::kShell, m});
    if (AwaitReply(m.msg_id(), std::min(ready_by, Clock::now() + 1s))) return true;
  }
  Log("kernel " + link_->kernel_id() + " never answered kernel_info_request");
  return false;
}

// The shell reply to `msg_id`. With `stdout_text`, also waits for the request's iopub idle and
// collects its stdout there; the reply's arrival time goes to `reply_at`.
std::optional<Message> SessionRun::AwaitReply(const std::string& msg_id, Clock::time_point deadline,
                                              std::string* stdout_text,
                                              Clock::time_point* reply_at) {
  std::optional<Message> reply;
  bool idle = stdout_text == nullptr;
  while (!(reply && idle) && Clock::now() < deadline && !clock_->stopped()) {
    auto in = inbox_.Pop(std::min(deadline, Clock::now() + kSlice));
    if (!in) {
      if (inbox_.gone()) break;
      continue;
    }
    const Message& m = in->message;
    if (m.parent_msg_id() != msg_id) continue;
    if (in->channel == jupyter::Channel::kShell) {
      reply = std::move(in->message);
      if (reply_at) *reply_at = Clock::now();
    } else if (in->channel == jupyter::Channel::kIopub && stdout_text) {
      const std::string type = m.msg_type();
      if (type == "status" && m.content.value("execution_state", "") == "idle") idle = true;
      if (type == "stream" && m.content.value("name", "") == "stdout") {
        *stdout_text += m.content.value("text", "");
      }
    }
  }
  return reply;
}

void SessionRun::RunCell(const sim::Cell& cell, CellOutcome* out) {
  out->arrival_ms = clock_->NowMs();
  const auto sent = Clock::now();
  Message m = factory_.Make("execute_request",
                            Json{{"code", CellCode(cell.duration_ms)},
                                 {"silent", false},
                                 {"store_history", true},
                                 {"user_expressions", Json::object()},
                                 {"allow_stdin", false},
                                 {"stop_on_error", true}},
                            Json::object());
  m.metadata = Json{{"nbos", {{"gpus", cell.gpus}}}};
  link_->Send({jupyter::Channel::kShell, m});
  std::string stdout_text;
  Clock::time_point reply_at;
  auto reply = AwaitReply(m.msg_id(), sent + 1ms * cell.duration_ms + options_.cell_grace,
                          &stdout_text, &reply_at);
  if (!reply && !inbox_.gone() && !clock_->stopped()) {
    Log(fmt::format("a cell got no reply in {} s; interrupting the kernel",
                    std::chrono::duration_cast<std::chrono::seconds>(1ms * cell.duration_ms +
                                                                     options_.cell_grace)
                        .count()));
    if (Status s = link_->Interrupt(); !s.ok()) Log(s.message());
    AwaitReply(m.msg_id(), Clock::now() + kInterruptGrace);
    return;
  }
  if (!reply) return;
  out->reply_ms = out->arrival_ms +
                  std::chrono::duration_cast<std::chrono::milliseconds>(reply_at - sent).count();
  out->body_ms = BodyMsFromOutput(stdout_text);
  out->ok = reply->content.value("status", "") == "ok" && out->body_ms >= 0;
  if (!out->ok) Log("a cell failed: " + reply->content.value("evalue", stdout_text));
  const Json& nbos = reply->metadata.contains("nbos") ? reply->metadata["nbos"] : Json::object();
  if (nbos.is_object() && nbos.contains("waits") && nbos["waits"].is_array()) {
    for (const Json& w : nbos["waits"]) {
      if (w.is_object()) out->waits.push_back(w.value("for", std::string()));
    }
  }
}

bool SessionRun::Run() {
  const bool open_before = session_.start_ms <= 0;
  if (!open_before && !clock_->SleepUntil(session_.start_ms)) return true;
  bool ok = StartKernel();
  if (open_before) clock_->Arrive();
  for (size_t i = 0; ok && i < session_.cells.size(); ++i) {
    const sim::Cell& cell = session_.cells[i];
    CellOutcome& out = outcomes_[i];
    if (!clock_->SleepUntil(cell.submit_ms)) break;
    RunCell(cell, &out);
    if (auto gone = inbox_.gone()) {
      Log("kernel lost: " + gone->message());
      ok = false;
    }
  }
  if (ok) clock_->SleepUntil(session_.stop_ms);
  if (link_) {
    link_->Stop();
    if (Status s = link_->Delete(kDeleteTimeout); !s.ok()) Log(s.message());
  }
  return ok;
}

}  // namespace

Result<ReplayRun> Replay(const sim::Workload& workload, const ReplayOptions& options,
                         std::atomic<bool>* stop) {
  auto cluster = FetchCluster(options.gateway);
  if (!cluster.ok()) return cluster.status();
  int32_t most_gpus = 0;
  for (const Json& server : (*cluster)["servers"]) {
    if (server.contains("spec")) most_gpus = std::max(most_gpus, server["spec"].value("gpus", 0));
  }
  for (const sim::Session& s : workload.sessions) {
    if (s.gpus > most_gpus) {
      return InvalidArgument(
          fmt::format("session {} wants {} GPUs; the cluster's servers have at "
                      "most {}",
                      s.id, s.gpus, most_gpus));
    }
  }
  ReplayRun run;
  run.initial_servers = SampleOf(*cluster, 0).servers;
  run.gpus_per_server = most_gpus;
  std::vector<size_t> first_cell;
  for (const sim::Session& s : workload.sessions) {
    first_cell.push_back(run.cells.size());
    for (const sim::Cell& c : s.cells) run.cells.push_back({c.gpus, c.duration_ms});
  }
  const auto open_before = std::count_if(workload.sessions.begin(), workload.sessions.end(),
                                         [](const sim::Session& s) { return s.start_ms <= 0; });
  ReplayClock clock(stop, open_before);
  if (open_before == 0) clock.Arrive();
  std::atomic<int64_t> failed{0};
  std::vector<std::thread> threads;
  for (size_t i = 0; i < workload.sessions.size(); ++i) {
    threads.emplace_back([&, i] {
      SessionRun session(workload.sessions[i], options, &clock, &run.cells[first_cell[i]]);
      if (!session.Run()) ++failed;
    });
  }
  std::atomic<bool> sessions_done{false};
  std::thread poller([&] {
    if (!clock.WaitStarted()) return;
    while (!sessions_done && !clock.stopped()) {
      const int64_t t_ms = clock.NowMs();
      if (auto c = FetchCluster(options.gateway); c.ok()) run.samples.push_back(SampleOf(*c, t_ms));
      clock.SleepUntil(t_ms + options.sample_interval.count());
    }
  });
  for (std::thread& t : threads) t.join();
  run.end_ms = clock.NowMs();
  sessions_done = true;
  poller.join();
  run.sessions_failed = failed;
  return run;
}

}  // namespace nbos::replay
