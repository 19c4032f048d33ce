#include "gateway/raft_group.h"

#include <spdlog/spdlog.h>

#include <algorithm>
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

Result<bool> IsRaftMember(const KernelRecord& k, ReplicaId replica_id,
                          std::chrono::milliseconds each) {
  if (!k.session) return Unavailable("the kernel has no session");
  const std::vector<ReplicaId> asked = LiveReplicasBut(k, replica_id);
  if (asked.empty()) return Unavailable("no live replica of the kernel to ask for its Raft group");
  for (ReplicaId via : asked) {
    auto reply =
        k.session->CallControl(via, "nbos_membership_request", Json{{"op", "members"}}, each);
    if (!reply.ok()) return reply.status();
    const auto members = reply->find("members");
    if (reply->value("status", "") != "ok" || members == reply->end() || !members->is_array() ||
        members->empty()) {
      return Unavailable("replica " + std::to_string(via) + " knows no Raft group");
    }
    if (std::none_of(members->begin(), members->end(), [&](const Json& id) {
          return id.is_number_unsigned() && id.get<uint64_t>() == replica_id;
        })) {
      return false;
    }
  }
  return true;
}

}  // namespace nbos::gateway
