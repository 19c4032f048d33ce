#include "gateway/kernel_router.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "common/overloaded.h"

namespace nbos::gateway {
namespace {

using jupyter::Channel;
using jupyter::Json;
using jupyter::Message;

// Readers that never throw, whatever the replicas or clients put in a field.
bool BoolField(const Json& obj, const char* key, bool fallback) {
  if (!obj.is_object()) return fallback;
  auto it = obj.find(key);
  return it != obj.end() && it->is_boolean() ? it->get<bool>() : fallback;
}
std::string StringField(const Json& obj, const char* key) {
  if (!obj.is_object()) return {};
  auto it = obj.find(key);
  return it != obj.end() && it->is_string() ? it->get<std::string>() : std::string();
}
std::optional<uint64_t> CountField(const Json& obj, const char* key) {
  if (!obj.is_object()) return std::nullopt;
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_number_unsigned()) return std::nullopt;
  return it->get<uint64_t>();
}
const Json& NbosMetadata(const Message& m) {
  static const Json kEmpty = Json::object();
  auto it = m.metadata.find("nbos");
  return it != m.metadata.end() && it->is_object() ? *it : kEmpty;
}

// A WebSocket close reason must be UTF-8 of at most 123 bytes: keep printable ASCII.
std::string CloseReason(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (out.size() >= 120) break;
    out.push_back(c >= 0x20 && c < 0x7f ? c : '?');
  }
  return out;
}

const char* ErrorName(RejectClass reason) {
  switch (reason) {
    case RejectClass::kMsgType:
      return "UnsupportedRequest";
    case RejectClass::kResources:
      return "ResourceError";
    case RejectClass::kQueueFull:
      return "QueueFull";
    default:
      return "InvalidRequest";
  }
}

bool IsReply(const std::string& type) { return type.ends_with("_reply"); }

}  // namespace

std::string ExecutionId(const std::string& kernel_id, const std::string& epoch, uint64_t sequence) {
  return kernel_id + ":" + (epoch.empty() ? "" : epoch + ".") + std::to_string(sequence);
}

KernelRouter::KernelRouter(RouterOptions options)
    : options_(std::move(options)), factory_(options_.session_id, "nbos", [this] {
        return std::chrono::system_clock::time_point(std::chrono::microseconds(now_us_));
      }) {
  for (ReplicaId r : options_.replicas) replicas_[r] = true;
  if (!options_.replicas.empty()) merger_.SetPrimary(options_.replicas.front());
}

std::vector<RouterEffect> KernelRouter::Apply(int64_t now_us, RouterEvent event) {
  Effects out;
  if (closed_) {
    // A plan answered after the close still holds GPUs: give them back.
    if (auto* done = std::get_if<PlanDone>(&event);
        done && done->plan.ok() && *done->plan && !(*done->plan)->grant_id.empty()) {
      out.push_back(GrantReleaseWanted{**done->plan});
    }
    return out;
  }
  now_us_ = std::max(now_us_, now_us);
  std::visit(Overloaded{
                 [&](ClientAttached& e) {
                   clients_.insert(e.client);
                   if (recovery_.reply) DeliverRecovered(e.client, &out);
                 },
                 [&](ClientDetached& e) {
                   clients_.erase(e.client);
                   std::erase_if(reply_to_, [&](const auto& kv) { return kv.second == e.client; });
                 },
                 [&](ClientFrame& e) { OnFrame(e, &out); },
                 [&](ReplicaMessage& e) { OnReplicaMessage(e, &out); },
                 [&](ReplicaLost& e) { SetLive(e.replica, false, &out, e.why); },
                 [&](ReplicaBack& e) { SetLive(e.replica, true, &out); },
                 [&](ReplicaReachable& e) { SetReachable(e.replica, e.reachable, &out); },
                 [&](ReplicaLinked& e) {
                   if (replicas_.count(e.replica)) return;
                   replicas_[e.replica] = true;
                   merger_.OnReplicaBack(e.replica);
                   Pump(&out);
                 },
                 [&](ReplicaUnlinked& e) { Unlink(e.replica, &out); },
                 [&](PlanDone& e) { OnPlanDone(e, &out); },
                 [&](TimerFired& e) { OnTimer(e, &out); },
                 [&](InterruptRequested&) { OnInterrupt(&out); },
                 [&](ExecutionsHeld& e) {
                   held_ = e.held;
                   held_why_ = e.why;
                   Pump(&out);
                 },
                 [&](ProbeRequested& e) { OnProbe(e, &out); },
                 [&](ControlCallRequested& e) { OnControlCall(e, &out); },
                 [&](RouterClosing&) { OnClosing(&out); },
                 [&](SuspendChanged& e) {
                   suspended_ = e.suspended;
                   resume_wanted_ = false;
                 },
                 [&](MajorityLost& e) { majority_lost_why_ = e.why; },
                 [&](RecoverExecution&) {
                   recovery_ = Recovery{.asking = true, .since_us = now_us_};
                   AskForLastExecution(&out);
                 },
             },
             event);
  // Whatever the event, the queue moves on as far as it can (an answered cell frees the way for
  // the requests behind it; a replica back lets waiting ones through).
  if (!closed_) Pump(&out);
  return out;
}

// ---- client input -----------------------------------------------------------------------------

void KernelRouter::OnFrame(ClientFrame& frame, Effects* out) {
  if (!clients_.count(frame.client)) return;  // detached meanwhile
  auto decoded = DecodeClientFrame(frame.payload, frame.binary, options_.limits);
  if (auto* bad = std::get_if<FrameRejection>(&decoded)) {
    ++stats_.rejected;
    out->push_back(InputRejected{bad->rejection.reason, bad->rejection.message});
    out->push_back(CloseClient{frame.client, bad->close_code, CloseReason(bad->rejection.message)});
    clients_.erase(frame.client);
    return;
  }
  ClientInput& input = std::get<ClientInput>(decoded);
  std::optional<Rejection> rejection = std::move(input.rejection);
  if (!rejection) rejection = ValidateClientMessage(input.message, options_.limits);
  if (rejection) {
    Reject(frame.client, *rejection, &input.message.message, input.message.channel, out);
    return;
  }
  const Message& m = input.message.message;
  if (ExpectsReply(m.msg_type()) && reply_to_.count(m.msg_id())) {
    // The id is taken by a request still in progress: an error with busy/idle and outputs under
    // that parent would land in the other request's cell, so only the reply goes back.
    ++stats_.rejected;
    const std::string why =
        "header.msg_id " + m.msg_id().substr(0, 64) + " is already used by a pending request";
    out->push_back(InputRejected{RejectClass::kField, why});
    const Channel channel =
        input.message.channel == Channel::kControl ? Channel::kControl : Channel::kShell;
    Deliver(frame.client, channel,
            factory_.Make(jupyter::ReplyTypeFor(m.msg_type()),
                          Json{{"status", "error"},
                               {"ename", "InvalidRequest"},
                               {"evalue", why},
                               {"traceback", Json::array({"InvalidRequest: " + why})}},
                          m.header),
            out);
    return;
  }
  OnClientMessage(frame.client, std::move(input.message), out);
}

void KernelRouter::Reject(ClientId client, const Rejection& rejection, const Message* request,
                          Channel channel, Effects* out) {
  ++stats_.rejected;
  out->push_back(InputRejected{rejection.reason, rejection.message});
  if (request == nullptr || !ExpectsReply(request->msg_type())) return;  // nothing to answer
  const Channel reply_channel = channel == Channel::kControl ? Channel::kControl : Channel::kShell;
  AnswerWithError(client, reply_channel, *request, ErrorName(rejection.reason), rejection.message,
                  out);
}

void KernelRouter::AnswerWithError(ClientId client, Channel channel, const Message& request,
                                   const std::string& ename, const std::string& evalue,
                                   Effects* out, bool with_busy) {
  const bool execute = request.msg_type() == "execute_request";
  const std::string reply_type = jupyter::ReplyTypeFor(request.msg_type());
  if (request.msg_id() == busy_sent_for_) {
    with_busy = false;  // sent ahead of its status line
    busy_sent_for_.clear();
  }
  if (with_busy) {
    Broadcast(Channel::kIopub,
              factory_.Make("status", Json{{"execution_state", "busy"}}, request.header), out);
  }
  const Json traceback = Json::array({ename + ": " + evalue});
  if (execute) {
    // Front ends show a cell's errors from iopub, not from the reply.
    Broadcast(
        Channel::kIopub,
        factory_.Make("error", Json{{"ename", ename}, {"evalue", evalue}, {"traceback", traceback}},
                      request.header),
        out);
  }
  Json content{{"status", "error"}, {"ename", ename}, {"evalue", evalue}, {"traceback", traceback}};
  if (execute) content["execution_count"] = nullptr;
  Deliver(client, channel, factory_.Make(reply_type, std::move(content), request.header), out);
  Broadcast(Channel::kIopub,
            factory_.Make("status", Json{{"execution_state", "idle"}}, request.header), out);
}

void KernelRouter::OnClientMessage(ClientId client, jupyter::WsMessage ws, Effects* out) {
  Message& m = ws.message;
  const std::string type = m.msg_type();
  last_activity_us_ = now_us_;
  if (type == "shutdown_request") {
    const bool restart = BoolField(m.content, "restart", false);
    Deliver(client, ws.channel,
            factory_.Make("shutdown_reply", Json{{"status", "ok"}, {"restart", restart}}, m.header),
            out);
    out->push_back(ShutdownWanted{restart});
    return;
  }
  if (suspended_ && AnsweredWhileSuspended(client, ws.channel, m, out)) return;
  switch (ws.channel) {
    case Channel::kShell:
      if (shell_queue_.size() >= options_.max_queued_requests) {
        Reject(
            client,
            {RejectClass::kQueueFull,
             fmt::format("{} requests are already waiting for this kernel", shell_queue_.size())},
            &m, Channel::kShell, out);
        return;
      }
      if (ExpectsReply(type)) reply_to_[m.msg_id()] = client;
      shell_queue_.push_back({client, Channel::kShell, std::move(m), now_us_});
      Pump(out);
      return;
    case Channel::kControl: {
      if (type == "interrupt_request" && !in_flight_ && (planning_.plan_id || planning_.timer_id)) {
        CancelWaitingExecution(out);
        Deliver(client, Channel::kControl,
                factory_.Make("interrupt_reply", Json{{"status", "ok"}}, m.header), out);
        return;
      }
      const ReplicaId to = ControlTarget();
      if (to == 0) {
        AnswerWithError(client, Channel::kControl, m, "KernelUnavailable",
                        "no replica of this kernel is reachable now", out);
        return;
      }
      reply_to_[m.msg_id()] = client;
      merger_.Expect(m.msg_id(), {to});
      SendTo({to}, Channel::kControl, m, out);
      return;
    }
    case Channel::kStdin: {
      // input_reply answers the replica that asked. jupyter_client's input() replies with an
      // empty parent header; with one prompt outstanding there is no doubt whom it answers.
      auto it = input_asker_.find(m.parent_msg_id());
      if (it == input_asker_.end() && input_asker_.size() == 1) it = input_asker_.begin();
      if (it == input_asker_.end()) return;
      const ReplicaId asker = it->second;
      input_asker_.erase(it);
      if (IsLive(asker)) SendTo({asker}, Channel::kStdin, m, out);
      return;
    }
    case Channel::kIopub:
      return;  // refused by validation: clients do not publish
  }
}

// ---- executions -------------------------------------------------------------------------------

void KernelRouter::Pump(Effects* out) {
  if (suspended_) {
    if (!shell_queue_.empty() && !resume_wanted_) {
      resume_wanted_ = true;
      out->push_back(ResumeWanted{});
    }
    if (!shell_queue_.empty()) ShowWait("starting the kernel's replicas again (it was idle)", out);
    return;
  }
  while (!shell_queue_.empty()) {
    Queued& head = shell_queue_.front();
    const std::set<ReplicaId> live = live_replicas();
    const std::string type = head.request.msg_type();
    if (type == "execute_request" && 2 * live.size() <= replicas_.size() && !in_flight_) {
      FailWithoutQuorum(live.size(), out);
      continue;
    }
    if (live.empty()) return;
    if (type != "execute_request") {
      const ReplicaId to = live.count(merger_.primary()) ? merger_.primary() : *live.begin();
      if (ExpectsReply(type)) merger_.Expect(head.request.msg_id(), {to});
      SendTo({to}, Channel::kShell, head.request, out);
      shell_queue_.pop_front();
      continue;
    }
    if (in_flight_) return;
    if (held_) ShowWait(held_why_.empty() ? "the kernel's replicas are changing" : held_why_, out);
    if (recovery_.running) ShowWait("the cell the previous gateway started is still running", out);
    if (held_ || planning_.plan_id || planning_.timer_id) return;
    if (recovery_.asking || recovery_.running) return;
    const Json& nbos = NbosMetadata(head.request);
    PlanWanted want;
    want.plan_id = planning_.plan_id = ++next_plan_id_;
    want.exec_id = ExecutionId(options_.kernel_id, options_.execution_epoch, sequence_ + 1);
    want.gpus = CellGpus(head.request);
    want.requested_target = static_cast<ReplicaId>(CountField(nbos, "target_replica").value_or(0));
    want.live = live;
    if (unreplicated_executor_ != want.requested_target && live.size() > 1) {
      want.live.erase(unreplicated_executor_);
    }
    for (const auto& [r, why] : diverged_) {
      if (r != want.requested_target && want.live.size() > 1) want.live.erase(r);
    }
    out->push_back(std::move(want));
    return;
  }
}

int KernelRouter::CellGpus(const Message& request) const {
  auto gpus = CountField(NbosMetadata(request), "gpus");
  return gpus ? static_cast<int>(std::min<uint64_t>(*gpus, options_.limits.max_cell_gpus))
              : options_.gpus;
}

void KernelRouter::OnPlanDone(PlanDone& done, Effects* out) {
  const bool has_grant = done.plan.ok() && *done.plan && !(*done.plan)->grant_id.empty();
  if (done.plan_id == 0 || done.plan_id != planning_.plan_id) {
    if (has_grant) out->push_back(GrantReleaseWanted{**done.plan});  // nobody waits for it
    return;
  }
  planning_.plan_id = 0;
  if (!done.plan.ok()) {
    Queued head = PopHead(out);
    planning_.logged_wait = false;
    reply_to_.erase(head.request.msg_id());
    AnswerWithError(head.client, Channel::kShell, head.request, "ResourceError",
                    done.plan.status().message(), out);
    if (BoolField(head.request.content, "stop_on_error", true)) AbortQueuedExecutions(out);
    Pump(out);
    return;
  }
  std::optional<ExecutionPlan>& plan = *done.plan;
  if (!plan) {
    if (!planning_.logged_wait) {
      planning_.logged_wait = true;
      ++stats_.waited_for_gpus;
    }
    ShowWait(!done.wait.empty() ? done.wait
             : CellGpus(shell_queue_.front().request) > 0
                 ? "no server of this kernel's replicas has them free"
                 : "the kernel's servers to register",
             out);
    planning_.timer_id = ++next_timer_id_;
    out->push_back(TimerWanted{planning_.timer_id, options_.replan_interval_ms});
    return;
  }
  if (held_ || !IsLive(plan->target_replica) || 2 * live_replicas().size() <= replicas_.size()) {
    // Planned for a replica that is gone, or while a migration holds executions, or the majority
    // was lost meanwhile: plan again (or fail the cell, without a majority).
    if (has_grant) out->push_back(GrantReleaseWanted{*plan});
    Pump(out);
    return;
  }
  StartExecution(*plan, out);
}

void KernelRouter::OnTimer(const TimerFired& timer, Effects* out) {
  if (timer.timer_id != 0 && timer.timer_id == recovery_.timer_id) {
    OnRecoveryTimer(out);
    return;
  }
  if (timer.timer_id == 0 || timer.timer_id != planning_.timer_id) return;
  planning_.timer_id = 0;
  Pump(out);
}

void KernelRouter::StartExecution(const ExecutionPlan& plan, Effects* out) {
  Json waits = Json::array();
  Queued head = PopHead(out, &waits);
  planning_.logged_wait = false;
  ++sequence_;
  recovery_.reply.reset();  // clients attaching from now on follow the new cell
  Json nbos = NbosMetadata(head.request);
  nbos["exec_id"] = ExecutionId(options_.kernel_id, options_.execution_epoch, sequence_);
  nbos["target_replica"] = plan.target_replica;
  nbos["gpu_ids"] = plan.device_ids;
  // The cell answered last, with none abandoned since: its executor, if targeted again, may run
  // this one before its LEAD commits (decision 0012). Only the gateway may say so.
  nbos.erase("previous_exec_id");
  if (!previous_exec_id_.empty()) nbos["previous_exec_id"] = previous_exec_id_;
  // The cells given up on: whichever LEAD wins this cell's election cancels those still open,
  // so none runs after it (a frozen executor that thaws with the request queued).
  nbos.erase("cancels");
  const std::vector<std::string> cancels(cancelled_exec_ids_.begin(), cancelled_exec_ids_.end());
  if (!cancels.empty()) nbos["cancels"] = cancels;
  head.request.metadata["nbos"] = nbos;
  InFlight f;
  f.msg_id = head.request.msg_id();
  f.exec_id = nbos["exec_id"].get<std::string>();
  f.cancels = cancels;
  f.header = head.request.header;
  f.plan = plan;
  f.received_us = head.received_us;
  f.planned_us = f.sent_us = now_us_;
  f.stop_on_error = BoolField(head.request.content, "stop_on_error", true);
  f.waits = std::move(waits);
  const std::set<ReplicaId> live = live_replicas();
  std::vector<ReplicaId> to(live.begin(), live.end());
  merger_.Expect(f.msg_id, to, f.msg_id == busy_sent_for_);
  busy_sent_for_.clear();
  SendTo(to, Channel::kShell, head.request, out);
  out->push_back(ExecutionStarted{f.exec_id, now_us_ - std::max(f.received_us, last_reply_us_)});
  in_flight_ = std::move(f);
  ++stats_.executions;
}

KernelRouter::Queued KernelRouter::PopHead(Effects* out, Json* waits) {
  Queued head = std::move(shell_queue_.front());
  shell_queue_.pop_front();
  if (notice_.msg_id != head.request.msg_id()) return head;
  if (!notice_.text.empty()) {
    EndWaitLine();
    // Only the status line can be among the cell's outputs yet: nothing of it has run.
    Broadcast(Channel::kIopub,
              factory_.Make("clear_output", Json{{"wait", false}}, head.request.header), out);
  }
  if (waits != nullptr) *waits = std::move(notice_.waits);
  notice_ = WaitNotice{};
  return head;
}

void KernelRouter::EndWaitLine() {
  notice_.waits.push_back(Json{{"for", notice_.text}, {"ms", (now_us_ - notice_.since_us) / 1000}});
}

void KernelRouter::ShowWait(const std::string& detail, Effects* out) {
  if (shell_queue_.empty()) return;
  const Message& request = shell_queue_.front().request;
  if (request.msg_type() != "execute_request") return;
  const int gpus = CellGpus(request);
  const std::string text =
      gpus > 0 ? fmt::format("waiting for {} GPU{}: {}", gpus, gpus == 1 ? "" : "s", detail)
               : "waiting: " + detail;
  if (notice_.msg_id != request.msg_id()) notice_ = WaitNotice{.msg_id = request.msg_id()};
  if (notice_.text == text) return;
  const bool first = notice_.text.empty();
  if (!first) {
    EndWaitLine();
  }
  notice_.text = text;
  notice_.since_us = now_us_;
  if (first) {
    // A kernel says busy before anything else of a request; the replicas' busy comes later.
    busy_sent_for_ = request.msg_id();
    Broadcast(Channel::kIopub,
              factory_.Make("status", Json{{"execution_state", "busy"}}, request.header), out);
  }
  Json content{{"data", {{"text/plain", text}}},
               {"metadata", Json::object()},
               {"transient", {{"display_id", "nbos-wait-" + request.msg_id()}}}};
  Broadcast(Channel::kIopub,
            factory_.Make(first ? "display_data" : "update_display_data", content, request.header),
            out);
}

void KernelRouter::FinishExecution(Message* reply, Effects* out) {
  InFlight done = std::move(*in_flight_);
  in_flight_.reset();
  last_reply_us_ = now_us_;
  // A lost executor, or one that could not replicate the cell, may still commit its effects.
  const std::string ename = StringField(reply->content, "ename");
  // One that could not get the cell elected ran nothing, but its LEAD may still commit.
  const bool unsettled =
      ename == "ExecutorLost" || ename == "ReplicationError" || ename == "ReplicasUnavailable";
  previous_exec_id_ = unsettled ? "" : done.exec_id;
  // Its LEAD won, so the log has decided the cells it cancelled: later LEADs need not name them.
  if (StringField(reply->content, "status") == "ok") {
    for (const std::string& id : done.cancels) std::erase(cancelled_exec_ids_, id);
  }
  if (!done.plan.grant_id.empty()) out->push_back(GrantReleaseWanted{done.plan});
  auto nbos_it = reply->metadata.find("nbos");
  if (nbos_it == reply->metadata.end() || !nbos_it->is_object()) {
    reply->metadata["nbos"] = Json::object();
    nbos_it = reply->metadata.find("nbos");
  }
  Json& nbos = *nbos_it;
  // A replica that answered that it cannot run cells ran nothing: stickiness must not pick it.
  if (auto executor = CountField(nbos, "executor");
      executor && replicas_.count(*executor) && ename != "ReplicaOutOfSync") {
    executor_ = static_cast<ReplicaId>(*executor);
  }
  nbos["server"] = done.plan.server_id;
  nbos["gpu_ids"] = done.plan.device_ids;
  nbos["target_replica"] = done.plan.target_replica;
  // Per-hop times (µs since the epoch): request in, executor chosen and GPUs granted, sent to
  // the replicas, release of the grant asked for (it runs after the reply, off its path; the
  // daemon frees the GPUs no earlier), reply out.
  nbos["gateway_us"] = Json{{"received", done.received_us},
                            {"planned", done.planned_us},
                            {"sent", done.sent_us},
                            {"releasing", now_us_},
                            {"replied", now_us_}};
  if (!done.waits.empty()) nbos["waits"] = std::move(done.waits);
  abort_after_reply_ = StringField(reply->content, "status") == "error" && done.stop_on_error;
  // The executor could not replicate the cell (nor, then, its end): the standbys would wait for
  // it until their own timeout, each later request queued behind. A replica that could not
  // apply an earlier cell's effects answers so before it runs a cell, and would for every cell
  // the executor choice, sticky, gave it: the next cell goes to another replica.
  unreplicated_executor_ = 0;
  if (ename == "ReplicationError") {
    CancelEverywhere(done.exec_id, done.plan.target_replica, out);
    unreplicated_executor_ = done.plan.target_replica;
  } else if (ename == "ReplicaOutOfSync" || ename == "ReplicasUnavailable") {
    // It told the others through the log; this ends their wait should that have failed.
    CancelEverywhere(done.exec_id, done.plan.target_replica, out);
  }
}

// Like a kernel with stop_on_error: executions queued behind a failed cell are answered
// "aborted" instead of running against the state the failure left behind.
void KernelRouter::AbortQueuedExecutions(Effects* out) {
  std::deque<Queued> kept;
  for (Queued& q : shell_queue_) {
    if (q.request.msg_type() != "execute_request") {
      kept.push_back(std::move(q));
      continue;
    }
    reply_to_.erase(q.request.msg_id());
    Broadcast(Channel::kIopub,
              factory_.Make("status", Json{{"execution_state", "busy"}}, q.request.header), out);
    Message reply = factory_.Make("execute_reply", Json{{"status", "aborted"}}, q.request.header);
    reply.metadata = Json{{"status", "aborted"}};
    Deliver(q.client, Channel::kShell, std::move(reply), out);
    Broadcast(Channel::kIopub,
              factory_.Make("status", Json{{"execution_state", "idle"}}, q.request.header), out);
  }
  shell_queue_ = std::move(kept);
}

// Without a live majority no replica can commit a cell, so the cell would wait for as long as the
// replicas stay away. It is answered now instead, and the queue goes on (a later cell runs once a
// majority is back or replaced). stop_on_error does not apply: this cell did not run.
void KernelRouter::FailWithoutQuorum(size_t live, Effects* out) {
  planning_ = Planning{};  // a plan or timer still due for this cell is stale (and released)
  Queued head = PopHead(out);
  reply_to_.erase(head.request.msg_id());
  ++stats_.failed_without_quorum;
  AnswerWithError(head.client, Channel::kShell, head.request, "ReplicasUnavailable",
                  replicas_.empty()
                      ? std::string("this kernel was suspended for being idle and its "
                                    "replicas could not be started again (see the "
                                    "gateway's log). The cell did not run: run it "
                                    "again to retry")
                      : NoQuorumMessage(live),
                  out);
}

std::string KernelRouter::NoQuorumMessage(size_t live) const {
  if (!majority_lost_why_.empty()) {
    return fmt::format(
        "{}. A majority of this kernel's replicas cannot form again, so nbos cannot replace "
        "them (a replacement joins through a majority) and the kernel cannot run cells. The "
        "cell did not run. Restart the kernel to go on with an empty namespace",
        majority_lost_why_);
  }
  return fmt::format(
      "{} of {} replicas of this kernel are unreachable, so it cannot run a cell now; nbos is "
      "replacing them (or waiting for their servers to return). The cell did not run: run it "
      "again in a moment",
      replicas_.size() - live, replicas_.size());
}

void KernelRouter::CancelWaitingExecution(Effects* out) {
  if (shell_queue_.empty() || shell_queue_.front().request.msg_type() != "execute_request") return;
  planning_ = Planning{};  // a plan that still arrives is released as stale
  Queued head = PopHead(out);
  reply_to_.erase(head.request.msg_id());
  AnswerWithError(head.client, Channel::kShell, head.request, "KeyboardInterrupt",
                  "interrupted while waiting for an executor", out);
  if (BoolField(head.request.content, "stop_on_error", true)) AbortQueuedExecutions(out);
  Pump(out);
}

void KernelRouter::OnInterrupt(Effects* out) {
  if (!in_flight_ && (planning_.plan_id || planning_.timer_id)) {
    CancelWaitingExecution(out);
    return;
  }
  const ReplicaId to = ControlTarget();
  if (to == 0) return;
  Message m = factory_.Make("interrupt_request", Json::object(), Json::object());
  merger_.Expect(m.msg_id(), {to});  // the reply has no client; the merger settles it
  SendTo({to}, Channel::kControl, m, out);
}

// ---- replicas ---------------------------------------------------------------------------------

void KernelRouter::OnReplicaMessage(ReplicaMessage& m, Effects* out) {
  const ReplicaId r = m.replica;
  if (!replicas_.count(r)) return;  // a late message of an unlinked replica
  const std::string parent = m.message.parent_msg_id();
  if (std::find(internal_calls_.begin(), internal_calls_.end(), parent) == internal_calls_.end()) {
    last_activity_us_ = now_us_;
  }
  switch (m.channel) {
    case Channel::kShell:
    case Channel::kControl:
      if (m.message.msg_type() == "execute_reply") NoteDivergence(r, m.message.metadata, out);
      for (Message& o : merger_.OnReply(r, std::move(m.message)))
        Route(m.channel, std::move(o), out);
      return;
    case Channel::kStdin: {
      auto it = reply_to_.find(m.message.parent_msg_id());
      if (it == reply_to_.end() || m.message.msg_id().empty()) return;
      input_asker_[m.message.msg_id()] = r;
      Deliver(it->second, Channel::kStdin, std::move(m.message), out);
      return;
    }
    case Channel::kIopub:
      for (Message& o : merger_.OnIopub(r, std::move(m.message))) {
        Broadcast(Channel::kIopub, std::move(o), out);
      }
      return;
  }
}

void KernelRouter::NoteDivergence(ReplicaId r, const Json& reply_metadata, Effects* out) {
  const auto nbos = reply_metadata.find("nbos");
  const std::string why = nbos == reply_metadata.end() ? "" : StringField(*nbos, "diverged");
  auto known = diverged_.find(r);
  if (known == diverged_.end() ? why.empty() : known->second == why) return;
  if (why.empty()) {
    diverged_.erase(known);
  } else {
    diverged_[r] = why;
  }
  out->push_back(ReplicaDiverged{r, why});
}

// A message the merger let through: replies to their client, the rest to everyone. A reply the
// merger held comes out later than it arrived; its channel is that of its kind.
void KernelRouter::Route(Channel channel, Message m, Effects* out) {
  const std::string type = m.msg_type();
  if (!IsReply(type)) {
    Broadcast(Channel::kIopub, std::move(m), out);
    return;
  }
  if (channel != Channel::kShell && channel != Channel::kControl) {
    channel =
        type == "interrupt_reply" || type == "shutdown_reply" ? Channel::kControl : Channel::kShell;
  }
  ForwardReply(channel, std::move(m), out);
}

void KernelRouter::ForwardReply(Channel channel, Message reply, Effects* out) {
  const std::string parent = reply.parent_msg_id();
  if (auto call = control_calls_.find(parent); call != control_calls_.end()) {
    out->push_back(ControlCallAnswered{call->second, std::move(reply.content)});
    control_calls_.erase(call);
    control_to_.erase(parent);
    return;
  }
  if (!quorum_cancel_id_.empty() && parent == quorum_cancel_id_) {
    quorum_cancel_id_.clear();
    OnQuorumCancelReply(reply, out);
    return;
  }
  if (auto query = recovery_.queries.find(parent); query != recovery_.queries.end()) {
    recovery_.queries.erase(query);
    OnLastExecution(reply.content, out);
    return;
  }
  if (reply.msg_type() == "kernel_info_reply" && reply.content.is_object() &&
      reply.content.value("status", Json()) == "ok") {
    kernel_info_ = reply.content;
  }
  if (auto probe = probes_.find(parent); probe != probes_.end()) {
    out->push_back(ProbeAnswered{probe->second});
    probes_.erase(probe);
    return;
  }
  const bool finishes = in_flight_ && parent == in_flight_->msg_id;
  if (finishes) FinishExecution(&reply, out);
  if (auto it = reply_to_.find(parent); it != reply_to_.end()) {
    const ClientId client = it->second;
    reply_to_.erase(it);
    Deliver(client, channel, std::move(reply), out);
  }
  // Like ipykernel: the failed cell's reply first, then the aborted ones.
  if (finishes && abort_after_reply_) AbortQueuedExecutions(out);
  abort_after_reply_ = false;
}

void KernelRouter::SetLive(ReplicaId r, bool live, Effects* out, const std::string& why) {
  auto link = replicas_.find(r);
  if (link == replicas_.end() || link->second == live) return;
  link->second = live;
  if (live) {
    merger_.OnReplicaBack(r);
    Pump(out);
    return;
  }
  for (auto& [id, asker] : input_asker_)
    if (asker == r) asker = 0;
  for (auto it = control_to_.begin(); it != control_to_.end();) {
    if (it->second != r) {
      ++it;
      continue;
    }
    out->push_back(ControlCallAnswered{
        control_calls_[it->first],
        Unavailable("replica " + std::to_string(r) + " was lost before it answered")});
    control_calls_.erase(it->first);
    it = control_to_.erase(it);
  }
  for (Message& m : merger_.OnReplicaLost(r)) Route(Channel::kIopub, std::move(m), out);
  if (!in_flight_ || in_flight_->plan.target_replica != r) {
    CancelForQuorum(out);
    return;
  }
  const std::set<ReplicaId> rest = live_replicas();
  if (rest.empty()) {
    FailInFlight("every replica of this kernel was lost while the cell ran" +
                     (why.empty() ? "" : " (" + why + ")") +
                     ". Whether the cell ran is not known: look at the kernel's state before "
                     "running it again",
                 out);
    Pump(out);
    return;
  }
  CancelOnStandbys(why, out);
}

// The standbys wait for the executor's effects; tell them it is gone so they answer
// (ExecutorLost), and why when known. They propose a CANCEL to the kernel's log ("decide"): a
// cell the log cancelled before its LEAD did not run anywhere, one whose LEAD won first may have
// run, and their answers say which.
void KernelRouter::CancelOnStandbys(const std::string& why, Effects* out) {
  std::set<ReplicaId> rest = live_replicas();
  rest.erase(in_flight_->plan.target_replica);
  if (rest.empty()) return;
  Json content{{"exec_id", in_flight_->exec_id}, {"decide", true}};
  if (!why.empty()) content["reason"] = why;
  Message cancel = factory_.Make("nbos_cancel_request", std::move(content), Json::object());
  merger_.Expect(cancel.msg_id(), {rest.begin(), rest.end()});
  SendTo({rest.begin(), rest.end()}, Channel::kControl, cancel, out);
}

void KernelRouter::Unlink(ReplicaId r, Effects* out) {
  if (!replicas_.count(r)) return;
  SetLive(r, false, out);
  replicas_.erase(r);
  unreachable_.erase(r);
  diverged_.erase(r);
  merger_.OnReplicaBack(r);  // forgotten, not lost
  if (merger_.primary() == r) {
    const std::set<ReplicaId> live = live_replicas();
    if (!live.empty()) merger_.SetPrimary(*live.begin());
  }
}

// Heartbeats tell within about a second that a replica stopped answering, long before its
// daemon's loss is declared; a replica that is only slow answers again, and nothing it owes was
// settled meanwhile (its reply still counts).
void KernelRouter::SetReachable(ReplicaId r, bool reachable, Effects* out) {
  if (!replicas_.count(r)) return;
  if (!reachable) {
    if (!unreachable_.insert(r).second) return;
    if (in_flight_ && in_flight_->plan.target_replica == r &&
        2 * live_replicas().size() > replicas_.size()) {
      ExcuseExecutor(r, out);
      return;
    }
    CancelForQuorum(out);
    return;
  }
  if (!unreachable_.erase(r)) return;
  // It may still hold a cell answered as not run in its queue: it must not run it.
  for (const std::string& exec_id : cancelled_exec_ids_) SendCancel(r, exec_id, out);
}

// A frozen or cut-off executor may never answer, and its server is declared lost only after
// several seconds; a slow one that answers after all loses nothing: its standbys' answer says
// that whether the cell ran is not known, and effects it commits after a later cell's LEAD won
// are discarded by the log (KernelStateMachine).
void KernelRouter::ExcuseExecutor(ReplicaId executor, Effects* out) {
  for (Message& m : merger_.Excuse(in_flight_->msg_id, executor))
    Route(Channel::kShell, std::move(m), out);
  CancelOnStandbys(
      "it stopped answering the gateway's heartbeats: its server may be frozen, overloaded or "
      "cut off",
      out);
}

// The majority went while a cell was in flight: no replica can commit it, and the client would
// wait as long as the replicas stay away. Only the executor knows whether it began the cell, so a
// live executor is asked first. An unreachable one cannot be asked: the cell is answered at once,
// saying that whether it ran is not known.
void KernelRouter::CancelForQuorum(Effects* out) {
  if (!in_flight_ || in_flight_->cancel_asked) return;
  if (2 * live_replicas().size() > replicas_.size()) return;
  in_flight_->cancel_asked = true;
  const ReplicaId target = in_flight_->plan.target_replica;
  if (!IsLive(target)) {
    AbandonInFlight("ExecutorLost",
                    fmt::format("{} of {} replicas of this kernel are unreachable, among them the "
                                "one chosen to run this cell; nbos is replacing them (or waiting "
                                "for their servers to return). Whether the cell ran is not known "
                                "yet: look at the kernel's state before running it again",
                                replicas_.size() - live_replicas().size(), replicas_.size()),
                    out);
    return;
  }
  quorum_cancel_id_ = SendCancel(target, in_flight_->exec_id, out);
}

void KernelRouter::OnQuorumCancelReply(const Message& reply, Effects* out) {
  if (!in_flight_ || !in_flight_->cancel_asked || !BoolField(reply.content, "cancelled", false))
    return;  // the executor began the cell (or it is done): its reply will come
  AbandonInFlight("ReplicasUnavailable", NoQuorumMessage(live_replicas().size()), out);
}

// Answers the in-flight cell on the replicas' behalf. Every replica, now or when it comes back, is
// told to cancel it, so one that has not begun it never will; their later messages for it are
// dropped. The replicated state stays the same everywhere either way: a cell that does run
// reaches every replica through the log.
void KernelRouter::AbandonInFlight(const std::string& ename, const std::string& why, Effects* out) {
  InFlight cancelled = std::move(*in_flight_);
  in_flight_.reset();
  previous_exec_id_.clear();  // the cell may still commit its effects, later
  if (!cancelled.plan.grant_id.empty()) out->push_back(GrantReleaseWanted{cancelled.plan});
  CancelEverywhere(cancelled.exec_id, cancelled.plan.target_replica, out);  // the target knows
  const bool busy_sent = merger_.Abandon(cancelled.msg_id);
  Message request;
  request.header = cancelled.header;
  auto client = reply_to_.find(cancelled.msg_id);
  const ClientId to = client == reply_to_.end() ? 0 : client->second;
  if (client != reply_to_.end()) reply_to_.erase(client);
  ++stats_.failed_without_quorum;
  AnswerWithError(to, Channel::kShell, request, ename, why, out, /*with_busy=*/!busy_sent);
}

void KernelRouter::CancelEverywhere(const std::string& exec_id, ReplicaId except, Effects* out) {
  cancelled_exec_ids_.push_back(exec_id);
  if (cancelled_exec_ids_.size() > 8) cancelled_exec_ids_.pop_front();
  for (ReplicaId r : live_replicas())
    if (r != except) SendCancel(r, exec_id, out);
}

std::string KernelRouter::SendCancel(ReplicaId to, const std::string& exec_id, Effects* out) {
  Message cancel = factory_.Make("nbos_cancel_request", Json{{"exec_id", exec_id}}, Json());
  merger_.Expect(cancel.msg_id(), {to});  // the merger settles its reply (unless asked for)
  SendTo({to}, Channel::kControl, cancel, out);
  return cancel.msg_id();
}

// Answers the in-flight execution on the replicas' behalf when none of them can.
void KernelRouter::FailInFlight(const std::string& why, Effects* out) {
  const Json header = in_flight_->header;
  previous_exec_id_.clear();
  Message reply = factory_.Make("execute_reply",
                                Json{{"status", "error"},
                                     {"ename", "ExecutorLost"},
                                     {"evalue", why},
                                     {"traceback", Json::array({"ExecutorLost: " + why})},
                                     {"execution_count", nullptr}},
                                header);
  ForwardReply(Channel::kShell, std::move(reply), out);
  Broadcast(Channel::kIopub, factory_.Make("status", Json{{"execution_state", "idle"}}, header),
            out);
}

// What a suspended kernel answers without its replicas (a client reconnecting asks kernel_info;
// waking the replicas for it would undo every suspension of a kernel with an open notebook).
bool KernelRouter::AnsweredWhileSuspended(ClientId client, Channel channel, const Message& m,
                                          Effects* out) {
  const std::string type = m.msg_type();
  Json content;
  if (channel == Channel::kShell && type == "kernel_info_request" && kernel_info_) {
    content = *kernel_info_;
  } else if (channel == Channel::kControl && type == "interrupt_request") {
    content = Json{{"status", "ok"}};
  } else {
    return false;
  }
  Deliver(client, Channel::kIopub,
          factory_.Make("status", Json{{"execution_state", "busy"}}, m.header), out);
  Deliver(client, channel, factory_.Make(jupyter::ReplyTypeFor(type), content, m.header), out);
  Deliver(client, Channel::kIopub,
          factory_.Make("status", Json{{"execution_state", "idle"}}, m.header), out);
  return true;
}

// ---- recovery after a gateway restart ---------------------------------------------------------

void KernelRouter::AskForLastExecution(Effects* out) {
  recovery_.queries.clear();  // answers to earlier asks are dropped as unknown replies
  for (ReplicaId r : live_replicas()) {
    Message m = factory_.Make("nbos_execution_request", Json::object(), Json::object());
    recovery_.queries[m.msg_id()] = r;
    merger_.Expect(m.msg_id(), {r});
    SendTo({r}, Channel::kControl, m, out);
  }
  recovery_.timer_id = ++next_timer_id_;
  out->push_back(TimerWanted{recovery_.timer_id, 500});
}

void KernelRouter::OnRecoveryTimer(Effects* out) {
  recovery_.timer_id = 0;
  if (!recovery_.asking && !recovery_.running) return;
  if (!recovery_.running && now_us_ - recovery_.since_us > 10'000'000) {
    recovery_.asking = false;  // nobody knows of a cell in flight: go on (Apply's Pump)
    recovery_.queries.clear();
    return;
  }
  AskForLastExecution(out);
}

// `content` is a replica's nbos_execution_reply (see the kernel server's AnswerLastExecution).
void KernelRouter::OnLastExecution(const Json& content, Effects* out) {
  if (!recovery_.asking && !recovery_.running) return;
  const Json none;
  const Json& e = content.is_object() ? content.value("execution", none) : none;
  if (!e.is_object() || !e.value("header", none).is_object()) {
    // This replica served no execute_request (e.g. it replaced a lost one): others may have.
    if (recovery_.queries.empty() && !recovery_.running) recovery_.asking = false;
    return;
  }
  if (e.value("state", "") == "running") {
    recovery_.running = true;
    return;  // asked again when the timer fires
  }
  // Settled: the queue moves on in Apply's Pump.
  recovery_ = Recovery{};
  if (!e.value("content", none).is_object() || e.value("done_ms_ago", int64_t{0}) > 60'000) {
    return;
  }
  Message reply = factory_.Make("execute_reply", e["content"], e["header"]);
  reply.metadata = e.value("metadata", Json::object());
  recovery_.reply = std::move(reply);
  for (ClientId client : clients_) DeliverRecovered(client, out);
}

void KernelRouter::DeliverRecovered(ClientId client, Effects* out) {
  const Message& reply = *recovery_.reply;
  Deliver(client, Channel::kShell, reply, out);
  Deliver(client, Channel::kIopub,
          factory_.Make("status", Json{{"execution_state", "idle"}}, reply.parent_header), out);
}

void KernelRouter::OnProbe(const ProbeRequested& probe, Effects* out) {
  for (ReplicaId r : probe.replicas) {
    if (!replicas_.count(r)) continue;
    Message m = factory_.Make("kernel_info_request", Json::object(), Json::object());
    probes_[m.msg_id()] = r;
    merger_.Expect(m.msg_id(), {r});
    SendTo({r}, Channel::kShell, m, out);
  }
}

void KernelRouter::OnControlCall(ControlCallRequested& call, Effects* out) {
  if (!IsLive(call.to)) {
    out->push_back(ControlCallAnswered{
        call.call_id, NotFound("replica " + std::to_string(call.to) +
                               " is not a live replica of kernel " + options_.kernel_id)});
    return;
  }
  Message m = factory_.Make(call.msg_type, std::move(call.content), Json::object());
  control_calls_[m.msg_id()] = call.call_id;
  control_to_[m.msg_id()] = call.to;
  internal_calls_.push_back(m.msg_id());
  if (internal_calls_.size() > kInternalCallsKept) internal_calls_.pop_front();
  merger_.Expect(m.msg_id(), {call.to});
  SendTo({call.to}, Channel::kControl, m, out);
}

void KernelRouter::OnClosing(Effects* out) {
  for (const auto& [msg_id, call_id] : control_calls_) {
    out->push_back(ControlCallAnswered{
        call_id, Unavailable("kernel " + options_.kernel_id + " is shutting down")});
  }
  control_calls_.clear();
  control_to_.clear();
  if (in_flight_ && !in_flight_->plan.grant_id.empty()) {
    out->push_back(GrantReleaseWanted{in_flight_->plan});
  }
  in_flight_.reset();
  for (ClientId c : clients_) out->push_back(CloseClient{c, 1001, "kernel gone"});
  clients_.clear();
  closed_ = true;
}

// ---- helpers ----------------------------------------------------------------------------------

void KernelRouter::Deliver(ClientId client, Channel channel, Message m, Effects* out) {
  if (!clients_.count(client)) return;
  m.header["session"] = options_.session_id;
  out->push_back(SendToClient{client, jupyter::WsMessage{channel, std::move(m)}});
}

void KernelRouter::Broadcast(Channel channel, Message m, Effects* out) {
  if (clients_.empty()) return;
  m.header["session"] = options_.session_id;
  out->push_back(SendToAllClients{jupyter::WsMessage{channel, std::move(m)}});
}

void KernelRouter::SendTo(std::vector<ReplicaId> replicas, Channel channel, const Message& m,
                          Effects* out) {
  out->push_back(SendToReplicas{std::move(replicas), channel, m});
}

ReplicaId KernelRouter::ControlTarget() const {
  const std::set<ReplicaId> live = live_replicas();
  if (live.empty()) return 0;
  const ReplicaId to = in_flight_ ? in_flight_->plan.target_replica : merger_.primary();
  return live.count(to) ? to : *live.begin();
}

bool KernelRouter::IsLive(ReplicaId replica) const {
  auto it = replicas_.find(replica);
  return it != replicas_.end() && it->second && !unreachable_.count(replica);
}

std::set<ReplicaId> KernelRouter::live_replicas() const {
  std::set<ReplicaId> live;
  for (const auto& [r, is_live] : replicas_)
    if (is_live && !unreachable_.count(r)) live.insert(r);
  return live;
}

ReplicaId KernelRouter::executing_replica() const {
  return in_flight_ ? in_flight_->plan.target_replica : 0;
}

const char* KernelRouter::execution_state() const {
  return in_flight_ || !shell_queue_.empty() ? "busy" : "idle";
}

}  // namespace nbos::gateway
