#include "gateway/replica_ops.h"

#include <spdlog/spdlog.h>

#include "jupyter/connection_file.h"

namespace nbos::gateway {

sched::Resources FromProto(const control::Resources& r) {
  return {r.millicpus(), r.memory_mb(), r.gpus(), r.vram_mb()};
}

control::Resources ToProto(const sched::Resources& r) {
  control::Resources p;
  p.set_millicpus(r.millicpus);
  p.set_memory_mb(r.memory_mb);
  p.set_gpus(r.gpus);
  p.set_vram_mb(r.vram_mb);
  return p;
}

Result<StoredReplica> PrepareReplica(daemon::DaemonClient& client, const StoredKernel& meta,
                                     const sched::Resources& request, const std::string& server_id,
                                     uint32_t replica_id) {
  control::PrepareReplicaRequest req;
  req.set_kernel_id(meta.kernel_id);
  req.set_replica_id(replica_id);
  *req.mutable_resources() = ToProto(request);
  req.set_key(meta.key);
  auto prepared = client.PrepareReplica(req);
  if (!prepared.ok()) {
    return Status(prepared.status().code(), "preparing replica " + std::to_string(replica_id) +
                                                " on " + server_id + ": " +
                                                prepared.status().message());
  }
  jupyter::ConnectionInfo conn;
  const control::ConnectionInfo& c = prepared->connection();
  conn.ip = c.ip();
  conn.transport = c.transport().empty() ? "tcp" : c.transport();
  conn.shell_port = c.shell_port();
  conn.iopub_port = c.iopub_port();
  conn.stdin_port = c.stdin_port();
  conn.control_port = c.control_port();
  conn.hb_port = c.hb_port();
  conn.key = c.key().empty() ? meta.key : c.key();
  conn.signature_scheme = c.signature_scheme().empty() ? "hmac-sha256" : c.signature_scheme();
  conn.kernel_name = meta.kernelspec;
  return StoredReplica{replica_id, server_id, prepared->raft_address(),
                       jupyter::ConnectionInfoToJson(conn)};
}

control::LaunchReplicaRequest LaunchRequest(const StoredKernel& meta, uint32_t replica_id,
                                            const std::vector<control::Peer>& peers) {
  control::LaunchReplicaRequest req;
  req.set_kernel_id(meta.kernel_id);
  req.set_replica_id(replica_id);
  for (const auto& p : peers) *req.add_peers() = p;
  for (const auto& [name, value] : meta.env) (*req.mutable_env())[name] = value;
  (*req.mutable_env())["KERNEL_ID"] = meta.kernel_id;
  if (!meta.checkpoint.empty()) (*req.mutable_env())["NBOS_RESTORE_FROM"] = meta.checkpoint;
  return req;
}

void StopReplica(daemon::DaemonClient& client, const std::string& kernel_id, uint32_t replica_id,
                 const std::string& server_id) {
  control::StopReplicaRequest req;
  req.set_kernel_id(kernel_id);
  req.set_replica_id(replica_id);
  req.set_keep_data(false);
  if (Status s = client.StopReplica(req); !s.ok()) {
    spdlog::warn("kernel {}: stopping replica {} on {}: {}", kernel_id, replica_id, server_id,
                 s.ToString());
  }
}

}  // namespace nbos::gateway
