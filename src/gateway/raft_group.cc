#include "gateway/raft_group.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace nbos::gateway {

using jupyter::Json;

Status ChangeRaftGroup(KernelSession& session, ReplicaId via, Json request,
                       std::chrono::milliseconds timeout) {
  const std::string what = request.dump();
  // A replica that is still waiting when the gateway stops would hold its control channel (and
  // the next change asked of it) for its own, longer default.
  const auto margin = std::min<std::chrono::milliseconds>(timeout / 10, std::chrono::seconds(2));
  request["timeout_ms"] = std::max<int64_t>(1, (timeout - margin).count());
  auto reply = session.CallControl(via, "nbos_membership_request", std::move(request), timeout);
  if (!reply.ok()) return reply.status();
  const auto status = reply->find("status");
  if (status == reply->end() || *status != "ok") {
    const auto evalue = reply->find("evalue");
    return Unavailable("membership change " + what + " refused: " +
                       (evalue != reply->end() && evalue->is_string()
                            ? evalue->get<std::string>()
                            : reply->dump(-1, ' ', false, Json::error_handler_t::replace)));
  }
  return Status::Ok();
}

namespace {
// The replicas of `k` the gateway counts live, but `except`, in the kernel's order.
std::vector<ReplicaId> LiveReplicasBut(const KernelRecord& k, ReplicaId except) {
  std::vector<ReplicaId> ids;
  for (const StoredReplica& r : k.meta.replicas) {
    auto live = k.replica_live.find(r.replica_id);
    if (r.replica_id != except && live != k.replica_live.end() && live->second) {
      ids.push_back(r.replica_id);
    }
  }
  return ids;
}
}  // namespace

Status RemoveFromRaftGroup(const KernelRecord& k, ReplicaId replica_id,
                           std::chrono::milliseconds each) {
  if (!k.session) return Unavailable("the kernel has no session");
  Status last = Unavailable("no live replica of the kernel to change its Raft group through");
  for (ReplicaId via : LiveReplicasBut(k, replica_id)) {
    last =
        ChangeRaftGroup(*k.session, via, Json{{"op", "remove"}, {"replica_id", replica_id}}, each);
    if (last.ok()) return last;
    spdlog::warn("kernel {}: removing replica {} from the Raft group through replica {}: {}",
                 k.meta.kernel_id, replica_id, via, last.ToString());
  }
  return last;
}

namespace {
// Nothing when `reply` is no answer to {"op": "members"} (an error, or a replica that knows no
// group).
std::optional<GroupAnswer> ReadGroupAnswer(ReplicaId from, const Json& reply) {
  const auto members = reply.find("members");
  if (reply.value("status", "") != "ok" || members == reply.end() || !members->is_array() ||
      members->empty()) {
    return std::nullopt;
  }
  GroupAnswer answer{from, {}, false, false, 0};
  for (const Json& id : *members) {
    if (!id.is_number_unsigned() || id.get<uint64_t>() > UINT32_MAX) return std::nullopt;
    answer.members.insert(static_cast<ReplicaId>(id.get<uint64_t>()));
  }
  const auto flag = [&](const char* name) {
    const auto it = reply.find(name);
    return it != reply.end() && it->is_boolean() && it->get<bool>();
  };
  answer.committed = flag("committed");
  answer.leading = flag("leading");
  const auto term = reply.find("term");
  if (term != reply.end() && term->is_number_unsigned()) answer.term = term->get<uint64_t>();
  return answer;
}
}  // namespace

std::vector<GroupAnswer> AskRaftGroup(const KernelRecord& k, std::chrono::milliseconds each) {
  std::vector<GroupAnswer> answers;
  if (!k.session) return answers;
  for (ReplicaId via : LiveReplicasBut(k, 0)) {
    auto reply =
        k.session->CallControl(via, "nbos_membership_request", Json{{"op", "members"}}, each);
    if (!reply.ok()) continue;
    if (auto answer = ReadGroupAnswer(via, *reply)) answers.push_back(std::move(*answer));
  }
  return answers;
}

std::optional<std::set<ReplicaId>> ProvenGroup(const std::vector<GroupAnswer>& answers) {
  const GroupAnswer* leader = nullptr;
  uint64_t latest_term = 0;
  for (const GroupAnswer& a : answers) {
    latest_term = std::max(latest_term, a.term);
    if (a.leading && (leader == nullptr || a.term > leader->term)) leader = &a;
  }
  if (leader == nullptr || !leader->committed || leader->term < latest_term) return std::nullopt;
  return leader->members;
}

GroupDrift DriftFrom(const KernelRecord& k, const std::set<ReplicaId>& group) {
  GroupDrift drift;
  for (const StoredReplica& r : k.meta.replicas) {
    if (k.left_confirmed.count(r.replica_id)) continue;
    if (!group.count(r.replica_id)) {
      drift.gone.push_back(r.replica_id);
    } else if (k.left_group.count(r.replica_id)) {
      drift.kept.push_back(r.replica_id);
    }
  }
  return drift;
}

}  // namespace nbos::gateway
