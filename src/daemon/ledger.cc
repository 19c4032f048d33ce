#include "daemon/ledger.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "common/check.h"

namespace nbos::daemon {

ResourceVector& ResourceVector::operator+=(const ResourceVector& o) {
  millicpus += o.millicpus;
  memory_mb += o.memory_mb;
  gpus += o.gpus;
  vram_mb += o.vram_mb;
  return *this;
}

ResourceVector& ResourceVector::operator-=(const ResourceVector& o) {
  millicpus -= o.millicpus;
  memory_mb -= o.memory_mb;
  gpus -= o.gpus;
  vram_mb -= o.vram_mb;
  return *this;
}

std::string ReplicaKey::ToString() const { return fmt::format("{}/{}", kernel_id, replica_id); }

Ledger::Ledger(ResourceVector spec, std::vector<GpuDevice> devices) : spec_(spec) {
  spec_.gpus = 0;
  spec_.vram_mb = 0;
  for (const GpuDevice& d : devices) {
    const bool inserted = devices_.emplace(d.id, d).second;
    NBOS_CHECK(inserted, "GPU device ids must be distinct");
    spec_.gpus += 1;
    spec_.vram_mb += d.vram_mb;
  }
}

Status Ledger::Subscribe(const ReplicaKey& replica, const ResourceVector& request) {
  if (request.millicpus < 0 || request.memory_mb < 0 || request.gpus < 0 || request.vram_mb < 0) {
    return InvalidArgument("negative resource request for replica " + replica.ToString());
  }
  if (request.gpus > spec_.gpus) {
    // Oversubscription is the point of the design, but a replica that asks more GPUs than the
    // server has could never become an executor here.
    return InvalidArgument(fmt::format("replica {} asks {} GPUs; this server has {}",
                                       replica.ToString(), request.gpus, spec_.gpus));
  }
  subscriptions_[replica] = request;
  return Status::Ok();
}

std::vector<std::string> Ledger::Unsubscribe(const ReplicaKey& replica) {
  std::vector<std::string> released = ReleaseAll(replica);
  subscriptions_.erase(replica);
  CheckInvariants();
  return released;
}

bool Ledger::IsSubscribed(const ReplicaKey& replica) const {
  return subscriptions_.contains(replica);
}

GrantDecision Ledger::Grant(const ReplicaKey& replica, const std::string& exec_id, int gpus,
                            int64_t vram_mb, const std::string& grant_id) {
  GrantDecision d;
  if (gpus < 0 || vram_mb < 0) {
    d.reason = "negative GPU or VRAM request";
    return d;
  }
  if (!subscriptions_.contains(replica)) {
    d.reason = "replica " + replica.ToString() + " is not placed on this server";
    return d;
  }
  auto held = by_exec_.find({replica.kernel_id, exec_id});
  if (held != by_exec_.end()) {
    const GpuGrant& g = grants_.at(held->second);
    if (g.replica != replica) {
      d.reason = fmt::format("execution {} already holds grant {} for replica {}", exec_id,
                             g.grant_id, g.replica.ToString());
      return d;
    }
    // A retry of a request whose reply was lost: hand back what was granted.
    d.granted = true;
    d.repeated = true;
    d.grant = g;
    return d;
  }
  NBOS_CHECK(!grants_.contains(grant_id), "grant ids must be unique");
  std::vector<int> chosen;
  int64_t chosen_vram = 0;
  for (const auto& [id, device] : devices_) {
    if (static_cast<int>(chosen.size()) == gpus) break;
    if (holder_.contains(id)) continue;
    chosen.push_back(id);
    chosen_vram += device.vram_mb;
  }
  if (static_cast<int>(chosen.size()) < gpus) {
    d.reason = fmt::format("{} GPUs asked, {} of {} idle", gpus, devices_.size() - holder_.size(),
                           devices_.size());
    return d;
  }
  if (vram_mb > chosen_vram) {
    d.reason = fmt::format("{} MB of VRAM asked, {} GPUs have {} MB", vram_mb, gpus, chosen_vram);
    return d;
  }
  GpuGrant g{grant_id, replica, exec_id, chosen, vram_mb};
  for (int id : chosen) holder_[id] = grant_id;
  by_exec_[{replica.kernel_id, exec_id}] = grant_id;
  grants_[grant_id] = g;
  d.granted = true;
  d.grant = std::move(g);
  CheckInvariants();
  return d;
}

bool Ledger::Release(const std::string& grant_id) {
  auto it = grants_.find(grant_id);
  if (it == grants_.end()) return false;
  for (int id : it->second.device_ids) {
    auto h = holder_.find(id);
    NBOS_CHECK(h != holder_.end() && h->second == grant_id,
               "a grant's devices are held by that grant");
    holder_.erase(h);
  }
  by_exec_.erase({it->second.replica.kernel_id, it->second.exec_id});
  grants_.erase(it);
  CheckInvariants();
  return true;
}

std::vector<std::string> Ledger::ReleaseAll(const ReplicaKey& replica) {
  std::vector<std::string> ids;
  for (const auto& [id, g] : grants_) {
    if (g.replica == replica) ids.push_back(id);
  }
  for (const std::string& id : ids) Release(id);
  return ids;
}

ResourceVector Ledger::subscribed() const {
  ResourceVector sum;
  for (const auto& [key, r] : subscriptions_) sum += r;
  return sum;
}

ResourceVector Ledger::committed() const {
  ResourceVector sum;
  std::set<ReplicaKey> executing;
  for (const auto& [id, g] : grants_) {
    sum.gpus += static_cast<int32_t>(g.device_ids.size());
    sum.vram_mb += g.vram_mb;
    executing.insert(g.replica);
  }
  // A replica's CPU and memory count once however many grants it holds.
  for (const ReplicaKey& key : executing) {
    const ResourceVector& r = subscriptions_.at(key);
    sum.millicpus += r.millicpus;
    sum.memory_mb += r.memory_mb;
  }
  return sum;
}

std::vector<int> Ledger::idle_device_ids() const {
  std::vector<int> ids;
  for (const auto& [id, device] : devices_) {
    if (!holder_.contains(id)) ids.push_back(id);
  }
  return ids;
}

std::vector<GpuGrant> Ledger::grants() const {
  std::vector<GpuGrant> out;
  out.reserve(grants_.size());
  for (const auto& [id, g] : grants_) out.push_back(g);
  return out;
}

std::optional<GpuGrant> Ledger::FindGrant(const std::string& grant_id) const {
  auto it = grants_.find(grant_id);
  if (it == grants_.end()) return std::nullopt;
  return it->second;
}

// Always on: a few grants and at most a handful of devices per server, so the walk is cheap, and
// a ledger that went on after breaking these would hand the same GPU to two executions.
void Ledger::CheckInvariants() const {
  size_t held = 0;
  for (const auto& [id, g] : grants_) {
    NBOS_CHECK(subscriptions_.contains(g.replica), "every grant belongs to a subscribed replica");
    auto exec = by_exec_.find({g.replica.kernel_id, g.exec_id});
    NBOS_CHECK(exec != by_exec_.end() && exec->second == id,
               "every grant is indexed by its (kernel id, exec id)");
    for (int dev : g.device_ids) {
      NBOS_CHECK(devices_.contains(dev), "a grant holds only this server's devices");
      auto h = holder_.find(dev);
      NBOS_CHECK(h != holder_.end() && h->second == id,
                 "a device is held by the grant that has it");
    }
    held += g.device_ids.size();
  }
  NBOS_CHECK(held == holder_.size(), "a device belongs to at most one grant");
  NBOS_CHECK(by_exec_.size() == grants_.size(), "one grant per (kernel id, exec id)");
}

}  // namespace nbos::daemon
