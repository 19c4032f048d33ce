#include "relay/gateway_link.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <nlohmann/json.hpp>
#include <thread>
#include <utility>

#include "common/thread_annotations.h"
#include "http/client.h"

namespace nbos::relay {

namespace {

using jupyter::Json;
using namespace std::chrono_literals;

// Messages queued while the WebSocket is down are bounded: a client that keeps sending to a
// kernel that is unreachable must not exhaust memory. Past this, the oldest are dropped.
constexpr size_t kMaxBacklogBytes = 256u << 20;

std::string TrimSlash(std::string url) {
  while (!url.empty() && url.back() == '/') url.pop_back();
  return url;
}

// The gateway's error body {"message": ...}, or the raw body.
std::string ErrorText(const http::ClientResponse& r) {
  Json body = Json::parse(r.body, nullptr, false);
  if (body.is_object() && body.contains("message") && body["message"].is_string()) {
    return body["message"].get<std::string>();
  }
  std::string text = r.body.substr(0, 300);
  return text.empty() ? "no message" : text;
}

Status HttpFailure(const std::string& what, const http::ClientResponse& r) {
  std::string message =
      what + " failed: HTTP " + std::to_string(r.status) + " (" + ErrorText(r) + ")";
  switch (r.status) {
    case 401:
    case 403:
      return Unauthenticated(message + "; check the token (--token or NBOS_TOKEN)");
    case 404:
      return NotFound(message);
    case 400:
      return InvalidArgument(message);
    default:
      return Unavailable(message);
  }
}

}  // namespace

std::map<std::string, std::string> KernelEnvFrom(char** environ_vars) {
  std::map<std::string, std::string> env;
  for (char** e = environ_vars; e != nullptr && *e != nullptr; ++e) {
    std::string_view kv(*e);
    size_t eq = kv.find('=');
    if (eq == std::string_view::npos || !kv.starts_with("KERNEL_")) continue;
    env.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  return env;
}

struct GatewayLink::Impl {
  GatewayOptions options;
  OnMessage on_message;
  OnGone on_gone;
  std::string base;  // url without trailing slashes
  std::string kernel_id;

  Mutex mu;  // orders sends against reconnects
  std::shared_ptr<http::WsClient> ws GUARDED_BY(mu);
  std::deque<std::pair<std::string, bool>> backlog GUARDED_BY(mu);  // encoded frames, binary?
  size_t backlog_bytes GUARDED_BY(mu) = 0;
  bool gone GUARDED_BY(mu) = false;
  std::atomic<bool> stopping{false};
  Mutex stop_mu;  // with stop_cv, wakes a reconnect backoff at once on Stop
  CondVar stop_cv;
  std::thread reader;

  http::Headers Headers(bool json) const {
    http::Headers h;
    if (!options.token.empty()) h.push_back({"Authorization", "token " + options.token});
    if (json) h.push_back({"Content-Type", "application/json"});
    return h;
  }

  std::string KernelUrl() const { return base + "/api/kernels/" + kernel_id; }

  std::string WsUrl() const {
    std::string url = KernelUrl() + "/channels";
    return url.rfind("http", 0) == 0 ? "ws" + url.substr(4) : url;
  }

  Result<std::shared_ptr<http::WsClient>> Open() {
    auto ws_client = http::WsClient::Connect(WsUrl(), Headers(false), options.connect_timeout);
    if (!ws_client.ok()) return ws_client.status();
    return std::shared_ptr<http::WsClient>(std::move(*ws_client));
  }

  // Sends one encoded frame on `w`; false when the connection failed.
  static bool SendOn(http::WsClient& w, const std::string& frame, bool binary) {
    Status s = binary ? w.SendBinary(frame) : w.SendText(frame);
    return s.ok();
  }

  void Queue(std::string frame, bool binary) REQUIRES(mu) {
    backlog_bytes += frame.size();
    backlog.emplace_back(std::move(frame), binary);
    while (backlog_bytes > kMaxBacklogBytes && !backlog.empty()) {
      backlog_bytes -= backlog.front().first.size();
      backlog.pop_front();
      spdlog::warn("kernel {}: the gateway is unreachable; dropped a queued message", kernel_id);
    }
  }

  // Sends the backlog on `w`; false (the rest kept) when it failed.
  bool Flush(http::WsClient& w) REQUIRES(mu) {
    while (!backlog.empty()) {
      if (!SendOn(w, backlog.front().first, backlog.front().second)) return false;
      backlog_bytes -= backlog.front().first.size();
      backlog.pop_front();
    }
    return true;
  }

  void Deliver(const http::WsFrame& frame) {
    auto m = jupyter::DecodeWs(frame.data, frame.type == http::WsFrame::Type::kBinary);
    if (!m.ok()) {
      spdlog::warn("kernel {}: dropped a malformed message from the gateway: {}", kernel_id,
                   m.status().ToString());
      return;
    }
    on_message(std::move(*m));
  }

  // Waits `d` unless stopping; true when stopping.
  bool Sleep(std::chrono::milliseconds d) EXCLUDES(stop_mu) {
    const auto deadline = std::chrono::steady_clock::now() + d;
    MutexLock lock(&stop_mu);
    while (!stopping.load() && stop_cv.WaitUntil(&stop_mu, deadline)) {
    }
    return stopping.load();
  }

  void GiveUp(const Status& why) EXCLUDES(mu) {
    {
      MutexLock lock(&mu);
      gone = true;
      ws.reset();
      backlog.clear();
      backlog_bytes = 0;
    }
    spdlog::error("kernel {}: {}", kernel_id, why.ToString());
    on_gone(why);
  }

  void ReadLoop(std::shared_ptr<http::WsClient> current) EXCLUDES(mu) {
    while (!stopping) {
      auto frame = current->Receive(200ms);
      if (!frame) continue;
      if (frame->type != http::WsFrame::Type::kClose) {
        Deliver(*frame);
        continue;
      }
      if (stopping) return;
      spdlog::warn("kernel {}: websocket closed ({} {}); reconnecting", kernel_id,
                   frame->close_code, frame->data);
      {
        MutexLock lock(&mu);
        ws.reset();
      }
      current.reset();
      auto next = Reconnect();
      if (!next) return;
      current = std::move(next);
    }
  }

  // Reopens the WebSocket with exponential backoff; nullptr when stopping or given up.
  std::shared_ptr<http::WsClient> Reconnect() EXCLUDES(mu) {
    const auto deadline = std::chrono::steady_clock::now() + options.reconnect_for;
    auto delay = options.backoff_initial;
    while (true) {
      if (Sleep(delay)) return nullptr;
      delay = std::min(delay * 2, options.backoff_max);
      auto opened = Open();
      if (opened.ok()) {
        MutexLock lock(&mu);
        if (!Flush(**opened)) continue;  // broke again at once: try again
        ws = *opened;
        spdlog::info("kernel {}: websocket reopened", kernel_id);
        return *opened;
      }
      const Status& s = opened.status();
      if (s.code() == StatusCode::kNotFound) {
        GiveUp(NotFound("the gateway no longer has kernel " + kernel_id));
        return nullptr;
      }
      if (s.code() == StatusCode::kUnauthenticated) {
        GiveUp(s);
        return nullptr;
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        GiveUp(Unavailable("could not reopen the kernel websocket: " + s.message()));
        return nullptr;
      }
      spdlog::info("kernel {}: reconnect failed: {}", kernel_id, s.ToString());
    }
  }
};

GatewayLink::GatewayLink(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GatewayLink::~GatewayLink() { Stop(); }

Result<std::unique_ptr<GatewayLink>> GatewayLink::Start(GatewayOptions options,
                                                        OnMessage on_message, OnGone on_gone) {
  auto impl = std::make_unique<Impl>();
  impl->base = TrimSlash(options.url);
  impl->options = std::move(options);
  impl->on_message = std::move(on_message);
  impl->on_gone = std::move(on_gone);

  Json body{{"name", impl->options.kernel_name}, {"env", impl->options.env}};
  const std::string what = "starting a kernel on " + impl->base;
  auto r = http::HttpRequest("POST", impl->base + "/api/kernels", impl->Headers(true), body.dump(),
                             impl->options.start_timeout);
  if (!r.ok()) return Unavailable(what + " failed: " + r.status().message());
  if (r->status != 201 && r->status != 200) return HttpFailure(what, *r);
  Json model = Json::parse(r->body, nullptr, false);
  if (!model.is_object() || !model.contains("id") || !model["id"].is_string()) {
    return Unavailable(what + ": the gateway's answer has no kernel id: " + r->body.substr(0, 200));
  }
  impl->kernel_id = model["id"].get<std::string>();
  spdlog::info("started gateway kernel {}", impl->kernel_id);

  auto ws = impl->Open();
  if (!ws.ok()) {
    Status why = ws.status();
    auto del = http::HttpRequest("DELETE", impl->KernelUrl(), impl->Headers(false), "",
                                 impl->options.request_timeout);
    // A kernel left behind holds its replicas' resources on the gateway until someone deletes it.
    if (!del.ok() || (del->status / 100 != 2 && del->status != 404)) {
      spdlog::warn("could not delete gateway kernel {} after its channels failed to open: {}",
                   impl->kernel_id,
                   del.ok() ? "HTTP " + std::to_string(del->status) : del.status().ToString());
    }
    return Status(why.code(), "opening the channels of kernel " + impl->kernel_id +
                                  " failed: " + why.message());
  }
  {
    MutexLock lock(&impl->mu);  // no reader yet
    impl->ws = *ws;
  }
  Impl* p = impl.get();
  impl->reader = std::thread([p, first = *ws] { p->ReadLoop(first); });
  return std::unique_ptr<GatewayLink>(new GatewayLink(std::move(impl)));
}

const std::string& GatewayLink::kernel_id() const { return impl_->kernel_id; }

void GatewayLink::Send(const jupyter::WsMessage& message) {
  bool binary = false;
  std::string frame = jupyter::EncodeWs(message, &binary);
  MutexLock lock(&impl_->mu);
  if (impl_->gone || impl_->stopping) {
    spdlog::warn("kernel {}: dropped a {} message: the kernel is gone", impl_->kernel_id,
                 message.message.msg_type());
    return;
  }
  // Queued messages go first; a failed send is kept for the reconnect.
  if (impl_->ws && impl_->backlog.empty() && Impl::SendOn(*impl_->ws, frame, binary)) return;
  impl_->Queue(std::move(frame), binary);
}

Status GatewayLink::Interrupt() {
  auto r = http::HttpRequest("POST", impl_->KernelUrl() + "/interrupt", impl_->Headers(true), "{}",
                             impl_->options.request_timeout);
  if (!r.ok()) return r.status();
  if (r->status / 100 != 2) return HttpFailure("interrupting kernel " + impl_->kernel_id, *r);
  return Status::Ok();
}

Status GatewayLink::Restart() {
  auto r = http::HttpRequest("POST", impl_->KernelUrl() + "/restart", impl_->Headers(true), "{}",
                             impl_->options.start_timeout);
  if (!r.ok()) return r.status();
  if (r->status / 100 != 2) return HttpFailure("restarting kernel " + impl_->kernel_id, *r);
  return Status::Ok();
}

Status GatewayLink::Delete(std::chrono::milliseconds timeout) {
  auto r = http::HttpRequest("DELETE", impl_->KernelUrl(), impl_->Headers(false), "", timeout);
  if (!r.ok()) return r.status();
  if (r->status / 100 != 2 && r->status != 404) {
    return HttpFailure("deleting kernel " + impl_->kernel_id, *r);
  }
  return Status::Ok();
}

void GatewayLink::Stop() {
  if (!impl_) return;
  {
    MutexLock lock(&impl_->stop_mu);
    if (impl_->stopping.exchange(true)) return;
  }
  impl_->stop_cv.SignalAll();
  std::shared_ptr<http::WsClient> ws;
  {
    MutexLock lock(&impl_->mu);
    ws = impl_->ws;
  }
  if (ws) ws->Close(1000, "");
  if (impl_->reader.joinable()) impl_->reader.join();
  MutexLock lock(&impl_->mu);
  impl_->ws.reset();
}

}  // namespace nbos::relay
