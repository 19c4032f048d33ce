#include "gateway/output_merger.h"

#include <algorithm>

namespace nbos::gateway {
namespace {

constexpr size_t kRememberedFinished = 4096;

// Replicas' messages are read without trusting their field types: a field of another type
// counts as absent.
bool IsExecutorReply(const jupyter::Message& reply) {
  const auto it = reply.metadata.find("nbos");
  if (it == reply.metadata.end() || !it->is_object()) return false;
  const auto role = it->find("role");
  return role != it->end() && role->is_string() && *role == "executor";
}

std::string ExecutionState(const jupyter::Message& m) {
  if (m.msg_type() != "status") return "";
  const auto state = m.content.find("execution_state");
  return state != m.content.end() && state->is_string() ? state->get<std::string>() : "";
}

}  // namespace

void OutputMerger::Expect(const std::string& msg_id, std::vector<ReplicaId> replicas,
                          bool busy_sent) {
  Request r;
  r.waiting.insert(replicas.begin(), replicas.end());
  r.busy_sent = busy_sent;
  requests_[msg_id] = std::move(r);
}

std::vector<jupyter::Message> OutputMerger::OnReply(ReplicaId replica, jupyter::Message reply) {
  std::vector<jupyter::Message> out;
  const std::string parent = reply.parent_msg_id();
  auto it = requests_.find(parent);
  if (it == requests_.end()) {
    // A reply to a request this merger never saw (sent before a gateway restart) still answers
    // someone; replies to finished requests are the standbys' duplicates.
    if (finished_.count(parent) == 0 && replica == primary_) out.push_back(std::move(reply));
    return out;
  }
  Request& r = it->second;
  r.waiting.erase(replica);
  if (r.answered_by) return out;  // a duplicate from a standby
  if (IsExecutorReply(reply)) {
    Answer(parent, r, replica, std::move(reply), &out);
  } else {
    if (!r.held_reply) {
      r.held_reply = std::move(reply);
      r.held_from = replica;
    }
    if (r.waiting.empty()) {
      jupyter::Message held = std::move(*r.held_reply);
      Answer(parent, r, r.held_from, std::move(held), &out);
    }
  }
  MaybeFinish(parent, r, &out);
  return out;
}

void OutputMerger::Answer(const std::string& msg_id, Request& r, ReplicaId replica,
                          jupyter::Message reply, std::vector<jupyter::Message>* out) {
  r.answered_by = replica;
  answered_[msg_id] = replica;
  if (IsExecutorReply(reply)) primary_ = replica;
  r.held_reply.reset();
  out->push_back(std::move(reply));
}

std::vector<jupyter::Message> OutputMerger::OnIopub(ReplicaId replica, jupyter::Message message) {
  std::vector<jupyter::Message> out;
  const std::string parent = message.parent_msg_id();
  auto it = requests_.find(parent);
  if (it == requests_.end()) {
    if (finished_.count(parent) == 0 && replica == primary_) out.push_back(std::move(message));
    return out;
  }
  Request& r = it->second;
  const std::string state = ExecutionState(message);
  if (state == "busy") {
    if (!r.busy_sent) {
      r.busy_sent = true;
      out.push_back(std::move(message));
    }
    return out;
  }
  if (state == "idle") {
    r.idle.emplace(replica, std::move(message));
    MaybeFinish(parent, r, &out);
    return out;
  }
  out.push_back(std::move(message));
  return out;
}

std::vector<jupyter::Message> OutputMerger::OnReplicaLost(ReplicaId replica) {
  std::vector<jupyter::Message> out;
  lost_.push_back(replica);
  std::vector<std::string> ids;
  for (auto& [id, r] : requests_) ids.push_back(id);
  for (const std::string& id : ids) StopWaiting(id, replica, &out);
  return out;
}

std::vector<jupyter::Message> OutputMerger::Excuse(const std::string& msg_id, ReplicaId replica) {
  std::vector<jupyter::Message> out;
  StopWaiting(msg_id, replica, &out);
  return out;
}

void OutputMerger::StopWaiting(const std::string& id, ReplicaId replica,
                               std::vector<jupyter::Message>* out) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  Request& r = it->second;
  r.waiting.erase(replica);
  if (!r.answered_by && r.waiting.empty() && r.held_reply) {
    jupyter::Message held = std::move(*r.held_reply);
    Answer(id, r, r.held_from, std::move(held), out);
  }
  MaybeFinish(id, r, out);
}

void OutputMerger::MaybeFinish(const std::string& msg_id, Request& r,
                               std::vector<jupyter::Message>* out) {
  if (!r.answered_by) return;
  auto idle = r.idle.find(*r.answered_by);
  if (idle == r.idle.end()) {
    // The answering replica died before it reported idle: close the request with another
    // replica's idle, which carries the same parent.
    if (std::find(lost_.begin(), lost_.end(), *r.answered_by) == lost_.end() || r.idle.empty())
      return;
    idle = r.idle.begin();
  }
  out->push_back(std::move(idle->second));
  Finish(msg_id);
}

void OutputMerger::Finish(const std::string& msg_id) {
  requests_.erase(msg_id);
  if (finished_.insert(msg_id).second) {
    finished_order_.push_back(msg_id);
    if (finished_order_.size() > kRememberedFinished) {
      finished_.erase(finished_order_.front());
      answered_.erase(finished_order_.front());
      finished_order_.pop_front();
    }
  }
}

bool OutputMerger::Abandon(const std::string& msg_id) {
  auto it = requests_.find(msg_id);
  const bool busy_sent = it != requests_.end() && it->second.busy_sent;
  Finish(msg_id);
  return busy_sent;
}

void OutputMerger::OnReplicaBack(ReplicaId replica) {
  lost_.erase(std::remove(lost_.begin(), lost_.end(), replica), lost_.end());
}

std::optional<ReplicaId> OutputMerger::AnsweredBy(const std::string& msg_id) const {
  auto it = answered_.find(msg_id);
  if (it == answered_.end()) return std::nullopt;
  return it->second;
}

}  // namespace nbos::gateway
