// libFuzzer target: a kernel's router and the validation of client input at the gateway's edge.
// The input drives a sequence of router events. Client messages are built structurally: a
// message type and channel (valid ones most of the time), a content that starts from what that
// type should carry and then has fields replaced by values of any JSON type, removed, or nested
// deeply; also raw and binary frames. Replicas answer with replies, outputs and stdin prompts
// whose parents are the requests in flight; plans, timers, replica loss, links, holds, probes and
// control calls come in between. Besides "no crash, no exception", it checks after every event:
// - every message to a client carries the kernel's session id and encodes;
// - every message to a replica encodes and signs;
// - a grant is released at most once, and every grant handed to the router is released by the
//   time it closed.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "gateway/kernel_router.h"
#include "jupyter/websocket_codec.h"
#include "jupyter/wire.h"

namespace {

using nbos::gateway::ReplicaId;
using nbos::jupyter::Channel;
using nbos::jupyter::Json;
namespace gw = nbos::gateway;

const char* const kClientTypes[] = {"execute_request",
                                    "kernel_info_request",
                                    "complete_request",
                                    "inspect_request",
                                    "history_request",
                                    "is_complete_request",
                                    "comm_info_request",
                                    "comm_open",
                                    "comm_msg",
                                    "comm_close",
                                    "shutdown_request",
                                    "interrupt_request",
                                    "input_reply",
                                    "nbos_namespace_request",
                                    "nbos_membership_request",
                                    "nbos_cancel_request",
                                    "debug_request",
                                    "status",
                                    "x_request"};
const char* const kReplicaTypes[] = {"execute_reply",
                                     "status",
                                     "stream",
                                     "kernel_info_reply",
                                     "input_request",
                                     "interrupt_reply",
                                     "comm_msg",
                                     "nbos_membership_reply",
                                     "error",
                                     "display_data",
                                     "complete_reply",
                                     "nbos_cancel_reply",
                                     "nbos_execution_reply"};
const char* const kFields[] = {
    "code",        "execution",     "silent",          "store_history", "user_expressions",
    "allow_stdin", "stop_on_error", "cursor_pos",      "detail_level",  "hist_access_type",
    "n",           "comm_id",       "target_name",     "data",          "restart",
    "value",       "status",        "execution_state", "name",          "text",
    "prompt",      "cancelled"};
const Channel kChannels[] = {Channel::kShell, Channel::kControl, Channel::kStdin, Channel::kIopub};

struct Fuzz {
  explicit Fuzz(const uint8_t* data, size_t size) : in(data, size) {}

  FuzzedDataProvider in;
  int64_t now_us = 1'700'000'000'000'000;
  std::vector<std::string> ids;  // request ids seen, to use as parents
  uint64_t last_plan = 0, last_timer = 0, grants_made = 0;
  std::set<std::string> granted, released;
  const nbos::jupyter::Signer signer = *nbos::jupyter::Signer::Create("key");

  Json Value(int depth) {
    switch (in.ConsumeIntegralInRange<int>(0, depth > 3 ? 5 : 8)) {
      case 0:
        return nullptr;
      case 1:
        return in.ConsumeBool();
      case 2:
        return in.ConsumeIntegral<int64_t>();
      case 3:
        return in.ConsumeFloatingPoint<double>();
      case 4:
        return in.ConsumeRandomLengthString(24);
      case 5:
        return in.ConsumeIntegralInRange<uint64_t>(0, 8);
      case 6: {
        Json a = Json::array();
        for (int i = in.ConsumeIntegralInRange<int>(0, 3); i > 0; --i)
          a.push_back(Value(depth + 1));
        return a;
      }
      case 7: {
        Json o = Json::object();
        for (int i = in.ConsumeIntegralInRange<int>(0, 3); i > 0; --i)
          o[in.PickValueInArray(kFields)] = Value(depth + 1);
        return o;
      }
      default: {
        Json deep = Json::array();  // nesting past the limit, sometimes
        for (int i = in.ConsumeIntegralInRange<int>(0, 150); i > 0; --i) {
          Json outer = Json::array();
          outer.push_back(std::move(deep));
          deep = std::move(outer);
        }
        return deep;
      }
    }
  }

  // What a message of `type` should carry, before mutation.
  static Json Template(const std::string& type) {
    if (type == "execute_request")
      return {{"code", "1"},           {"silent", false},
              {"store_history", true}, {"user_expressions", Json::object()},
              {"allow_stdin", true},   {"stop_on_error", true}};
    if (type == "complete_request" || type == "inspect_request")
      return {{"code", "x"}, {"cursor_pos", 1}};
    if (type == "history_request") return {{"hist_access_type", "tail"}, {"n", 10}};
    if (type == "comm_open")
      return {{"comm_id", "c"}, {"target_name", "t"}, {"data", Json::object()}};
    if (type == "comm_msg" || type == "comm_close")
      return {{"comm_id", "c"}, {"data", Json::object()}};
    if (type == "input_reply") return {{"value", "v"}};
    if (type == "shutdown_request") return {{"restart", false}};
    if (type == "execute_reply") return {{"status", "ok"}, {"execution_count", 1}};
    if (type == "status") return {{"execution_state", "idle"}};
    if (type == "stream") return {{"name", "stdout"}, {"text", "x"}};
    if (type == "input_request") return {{"prompt", "?"}, {"password", false}};
    if (type == "nbos_cancel_reply") return {{"status", "ok"}, {"cancelled", true}};
    if (type == "nbos_execution_reply") {
      return {{"status", "ok"},
              {"execution",
               {{"header", {{"msg_id", "e0"}, {"msg_type", "execute_request"}}},
                {"state", "done"},
                {"content", {{"status", "ok"}}},
                {"done_ms_ago", 5}}}};
    }
    return Json::object();
  }

  Json Mutated(Json content) {
    for (int i = in.ConsumeIntegralInRange<int>(0, 3); i > 0; --i) {
      const char* field = in.PickValueInArray(kFields);
      if (in.ConsumeBool()) {
        content.erase(field);
      } else {
        content[field] = Value(0);
      }
    }
    return content;
  }

  std::string Parent() {
    if (ids.empty() || in.ConsumeIntegralInRange<int>(0, 9) == 0) {
      return "sess_" + std::to_string(in.ConsumeIntegralInRange<int>(1, 40));
    }
    return ids[in.ConsumeIntegralInRange<size_t>(0, ids.size() - 1)];
  }

  Json NbosMetadata() {
    Json nbos = Json::object();
    if (in.ConsumeBool())
      nbos["gpus"] = in.ConsumeBool() ? Value(0) : Json(in.ConsumeIntegralInRange<int>(0, 4));
    if (in.ConsumeBool())
      nbos["target_replica"] =
          in.ConsumeBool() ? Value(0) : Json(in.ConsumeIntegralInRange<int>(0, 5));
    if (in.ConsumeBool()) nbos["role"] = in.ConsumeBool() ? Json("executor") : Value(0);
    if (in.ConsumeBool())
      nbos["executor"] = in.ConsumeBool() ? Json(in.ConsumeIntegralInRange<int>(0, 5)) : Value(0);
    return nbos;
  }

  gw::RouterEvent ClientEvent() {
    const gw::ClientId client = in.ConsumeIntegralInRange<gw::ClientId>(1, 3);
    const int form = in.ConsumeIntegralInRange<int>(0, 9);
    if (form == 0)
      return gw::ClientFrame{client, in.ConsumeRandomLengthString(256), in.ConsumeBool()};
    const std::string type = in.PickValueInArray(kClientTypes);
    const std::string id =
        in.ConsumeBool() || ids.empty() ? "c" + std::to_string(ids.size()) : Parent();
    ids.push_back(id);
    Json header{{"msg_id", id}, {"msg_type", type}, {"session", "client"}};
    if (form == 1) header[in.PickValueInArray(kFields)] = Value(0);
    if (form == 2) header["msg_id"] = Value(0);
    Json frame{{"header", header}, {"content", Mutated(Template(type))}};
    if (in.ConsumeBool())
      frame["channel"] = nbos::jupyter::ChannelName(in.PickValueInArray(kChannels));
    if (form == 3) frame["channel"] = Value(0);
    if (in.ConsumeBool()) frame["metadata"] = Json{{"nbos", NbosMetadata()}};
    if (form == 4) frame["metadata"] = Value(0);
    if (in.ConsumeBool()) frame["parent_header"] = Json{{"msg_id", Parent()}};
    std::string text = frame.dump(-1, ' ', false, Json::error_handler_t::replace);
    if (form != 5) return gw::ClientFrame{client, text, false};
    // The binary framing, with its offsets sometimes wrong.
    std::string out;
    const uint32_t n = in.ConsumeIntegralInRange<uint32_t>(0, 3);
    auto u32 = [&](uint32_t v) {
      for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<char>(v >> s));
    };
    u32(n);
    uint32_t offset = 4 + 4 * n;
    for (uint32_t i = 0; i < n; ++i) {
      u32(in.ConsumeBool() ? offset : in.ConsumeIntegral<uint32_t>());
      offset += i == 0 ? static_cast<uint32_t>(text.size()) : 2;
    }
    out += text + std::string(2 * (n > 0 ? n - 1 : 0), 'b');
    return gw::ClientFrame{client, out, true};
  }

  gw::RouterEvent ReplicaEvent() {
    nbos::jupyter::Message m;
    const std::string type = in.PickValueInArray(kReplicaTypes);
    m.header = Json{{"msg_id", "r" + std::to_string(ids.size())}, {"msg_type", type}};
    ids.push_back(m.header["msg_id"]);
    m.parent_header = in.ConsumeBool() ? Json{{"msg_id", Parent()}} : Json::object();
    m.content = Mutated(Template(type));
    if (in.ConsumeBool()) m.metadata = Json{{"nbos", NbosMetadata()}};
    return gw::ReplicaMessage{in.ConsumeIntegralInRange<ReplicaId>(1, 5),
                              in.PickValueInArray(kChannels), std::move(m)};
  }

  gw::RouterEvent PlanEvent() {
    gw::PlanDone done{in.ConsumeBool() ? last_plan : in.ConsumeIntegralInRange<uint64_t>(0, 9)};
    switch (in.ConsumeIntegralInRange<int>(0, 3)) {
      case 0:
        done.plan = std::optional<gw::ExecutionPlan>();
        break;
      case 1:
        done.plan = nbos::Unavailable("no");
        break;
      default: {
        gw::ExecutionPlan p{in.ConsumeIntegralInRange<ReplicaId>(0, 5), "host", "", {0}};
        if (in.ConsumeBool()) {
          p.grant_id = "g" + std::to_string(++grants_made);
          granted.insert(p.grant_id);
        }
        done.plan = std::optional<gw::ExecutionPlan>(p);
      }
    }
    return done;
  }

  gw::RouterEvent Next() {
    const ReplicaId r = in.ConsumeIntegralInRange<ReplicaId>(1, 5);
    switch (in.ConsumeIntegralInRange<int>(0, 15)) {
      case 0:
      case 1:
      case 2:
      case 3:
        return ClientEvent();
      case 4:
      case 5:
      case 6:
        return ReplicaEvent();
      case 7:
      case 8:
        return PlanEvent();
      case 9:
        return gw::TimerFired{in.ConsumeBool() ? last_timer : 1};
      case 10:
        switch (in.ConsumeIntegralInRange<int>(0, 2)) {
          case 0:
            return gw::ReplicaLost{r};
          case 1:
            return gw::ReplicaBack{r};
          default:
            return gw::ReplicaReachable{r, in.ConsumeBool()};
        }
      case 11:
        return in.ConsumeBool() ? gw::RouterEvent(gw::ReplicaLinked{r}) : gw::ReplicaUnlinked{r};
      case 12:
        return in.ConsumeBool() ? gw::RouterEvent(gw::InterruptRequested{})
                                : gw::ExecutionsHeld{in.ConsumeBool()};
      case 13:
        return in.ConsumeBool()
                   ? gw::RouterEvent(gw::ProbeRequested{{r}})
                   : gw::ControlCallRequested{1, r, "nbos_membership_request", Json::object()};
      case 14: {
        const gw::ClientId c = in.ConsumeIntegralInRange<gw::ClientId>(1, 3);
        return in.ConsumeBool() ? gw::RouterEvent(gw::ClientAttached{c}) : gw::ClientDetached{c};
      }
      default:
        switch (in.ConsumeIntegralInRange<int>(0, 7)) {
          case 0:
            return gw::RouterClosing{};
          case 1:
            return gw::RecoverExecution{};
          case 2:
            return gw::SuspendChanged{in.ConsumeBool()};
          default:
            return ClientEvent();
        }
    }
  }

  void Check(const gw::RouterEffect& effect) {
    if (auto* e = std::get_if<gw::SendToClient>(&effect)) {
      if (e->message.message.header.value("session", "") != "sess") __builtin_trap();
      bool binary;
      (void)nbos::jupyter::EncodeWs(e->message, &binary);
    } else if (auto* e = std::get_if<gw::SendToAllClients>(&effect)) {
      if (e->message.message.header.value("session", "") != "sess") __builtin_trap();
      bool binary;
      (void)nbos::jupyter::EncodeWs(e->message, &binary);
    } else if (auto* e = std::get_if<gw::SendToReplicas>(&effect)) {
      (void)nbos::jupyter::EncodeFrames(e->message, signer);
    } else if (auto* e = std::get_if<gw::PlanWanted>(&effect)) {
      last_plan = e->plan_id;
    } else if (auto* e = std::get_if<gw::TimerWanted>(&effect)) {
      last_timer = e->timer_id;
    } else if (auto* e = std::get_if<gw::GrantReleaseWanted>(&effect)) {
      // Released once, and only what was granted.
      if (!granted.count(e->plan.grant_id) || !released.insert(e->plan.grant_id).second)
        __builtin_trap();
    }
  }

  void Run() {
    gw::RouterOptions o;
    o.kernel_id = "k";
    o.session_id = "sess";
    o.replicas = {1, 2, 3};
    o.limits.max_message_bytes = 1 << 16;
    o.max_queued_requests = 8;
    gw::KernelRouter router(o);
    for (int steps = 0; steps < 64 && in.remaining_bytes() > 0; ++steps) {
      now_us += in.ConsumeIntegralInRange<int64_t>(0, 5000);
      for (const gw::RouterEffect& e : router.Apply(now_us, Next())) Check(e);
    }
    for (const gw::RouterEffect& e : router.Apply(now_us, gw::RouterClosing{})) Check(e);
    // Every grant handed to the router was released by the time it closed: none leaks.
    if (released != granted) __builtin_trap();
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fuzz(data, size).Run();
  return 0;
}
