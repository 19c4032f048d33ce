// End to end: three daemons (three "servers"), one kernel with a real `nbos replica` on each,
// driven through DaemonClient as the gateway would, with a fake gateway the daemons register
// with. Slow (Python starts in each replica), so labelled e2e.
#include "daemon/daemon.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include <filesystem>

#include "daemon/daemon_client.h"
#include "daemon/fake_gateway.h"
#include "daemon/test_util.h"
#include "jupyter/wire.h"

namespace nbos::daemon {
namespace {

using namespace std::chrono_literals;
using testing::Eventually;
using testing::FakeGateway;
using testing::ProcessGone;

constexpr auto kStartTimeout = 120s;  // three Pythons on two cores under sanitizers

int PortOf(const std::string& address) { return std::stoi(address.substr(address.rfind(':') + 1)); }

bool Listening(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  close(fd);
  return ok;
}

// Sends kernel_info_request on the replica's shell socket; returns the reply's msg_type (empty
// on timeout or error).
std::string KernelInfo(const control::ConnectionInfo& c, std::chrono::milliseconds timeout) {
  auto signer = jupyter::Signer::Create(c.key(), c.signature_scheme());
  if (!signer.ok()) return "";
  jupyter::MessageFactory factory("daemon-test", "test");
  jupyter::Message request = factory.Make("kernel_info_request", jupyter::Json::object(), {});
  void* ctx = zmq_ctx_new();
  void* sock = zmq_socket(ctx, ZMQ_DEALER);
  int linger = 0;
  zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
  std::string endpoint = "tcp://" + c.ip() + ":" + std::to_string(c.shell_port());
  zmq_connect(sock, endpoint.c_str());
  std::vector<std::string> frames = jupyter::EncodeFrames(request, *signer);
  for (size_t i = 0; i < frames.size(); ++i) {
    zmq_send(sock, frames[i].data(), frames[i].size(), i + 1 < frames.size() ? ZMQ_SNDMORE : 0);
  }
  std::string type;
  zmq_pollitem_t item{sock, 0, ZMQ_POLLIN, 0};
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (type.empty() && std::chrono::steady_clock::now() < deadline) {
    if (zmq_poll(&item, 1, 100) <= 0) continue;
    std::vector<std::string> reply;
    int more = 1;
    while (more) {
      zmq_msg_t part;
      zmq_msg_init(&part);
      if (zmq_msg_recv(&part, sock, 0) < 0) break;
      reply.emplace_back(static_cast<char*>(zmq_msg_data(&part)), zmq_msg_size(&part));
      more = zmq_msg_more(&part);
      zmq_msg_close(&part);
    }
    auto decoded = jupyter::DecodeFrames(std::move(reply), *signer);
    if (decoded.ok() && decoded->parent_msg_id() == request.msg_id()) type = decoded->msg_type();
  }
  zmq_close(sock);
  zmq_ctx_term(ctx);
  return type;
}

const control::ReplicaStatus* FindReplica(const control::ServerStatus& s, uint32_t id) {
  for (const auto& r : s.replicas()) {
    if (r.replica_id() == id) return &r;
  }
  return nullptr;
}

TEST(DaemonE2eTest, ThreeRealReplicasUnderThreeDaemons) {
  testing::TempDir tmp;
  auto gw = FakeGateway::Start(0, 200);
  ASSERT_TRUE(gw);
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<std::unique_ptr<DaemonClient>> clients;
  for (int i = 0; i < 3; ++i) {
    DaemonOptions o;
    o.server_id = "server-" + std::to_string(i);
    o.gateway_address = gw->address();
    o.state_dir = tmp.path() + "/" + o.server_id;
    o.nbos_binary = NBOS_BINARY;
    o.gpu_source = GpuSource::kVirtual;
    o.virtual_gpus = 1;
    o.millicpus = 2000;
    o.memory_mb = 4096;
    o.restart_delay = 100ms;
    o.stop_grace = 10s;
    auto d = Daemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    clients.push_back(std::make_unique<DaemonClient>((*d)->address()));
    daemons.push_back(std::move(*d));
  }
  ASSERT_TRUE(gw->WaitUntil([&] { return gw->registers() == 3; }, 10s));

  const std::string kernel = "e2e-kernel";
  std::vector<control::PrepareReplicaReply> prepared;
  for (uint32_t id = 1; id <= 3; ++id) {
    control::PrepareReplicaRequest req;
    req.set_kernel_id(kernel);
    req.set_replica_id(id);
    req.set_key("0123456789abcdef");
    req.mutable_resources()->set_gpus(1);
    auto reply = clients[id - 1]->PrepareReplica(req);
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    prepared.push_back(*reply);
  }
  std::vector<pid_t> pids;
  for (uint32_t id = 1; id <= 3; ++id) {
    control::LaunchReplicaRequest req;
    req.set_kernel_id(kernel);
    req.set_replica_id(id);
    req.set_blob_store_url("dir://" + tmp.path() + "/blobs");  // shared by the three servers
    (*req.mutable_env())["NBOS_TEST"] = "1";
    for (uint32_t peer = 1; peer <= 3; ++peer) {
      control::Peer* p = req.add_peers();
      p->set_replica_id(peer);
      p->set_raft_address(prepared[peer - 1].raft_address());
    }
    auto reply = clients[id - 1]->LaunchReplica(req);
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    ASSERT_GT(reply->pid(), 0);
    pids.push_back(reply->pid());
  }

  // Every replica serves Raft (port and port + 1) and its Jupyter shell socket.
  auto serving = [&](uint32_t id) {
    const auto& p = prepared[id - 1];
    int raft = PortOf(p.raft_address());
    return Listening(raft) && Listening(raft + 1) && Listening(p.connection().shell_port());
  };
  for (uint32_t id = 1; id <= 3; ++id) {
    ASSERT_TRUE(Eventually([&] { return serving(id); }, kStartTimeout))
        << "replica " << id << " log:\n"
        << testing::ReadFile(tmp.path() + "/server-" + std::to_string(id - 1) + "/replicas/" +
                             kernel + "-" + std::to_string(id) + "/replica.log");
    auto status = clients[id - 1]->GetStatus();
    ASSERT_TRUE(status.ok());
    const auto* r = FindReplica(*status, id);
    ASSERT_NE(r, nullptr);
    EXPECT_EQ(r->state(), "running");
    EXPECT_EQ(r->pid(), pids[id - 1]);
    EXPECT_FALSE(ProcessGone(pids[id - 1]));
    EXPECT_EQ(KernelInfo(prepared[id - 1].connection(), 60s), "kernel_info_reply");
  }

  // kill -9 replica 2: its daemon restarts it from the same data directory and ports.
  ASSERT_EQ(kill(pids[1], SIGKILL), 0);
  pid_t restarted = 0;
  ASSERT_TRUE(Eventually(
      [&] {
        auto s = clients[1]->GetStatus();
        const auto* r = s.ok() ? FindReplica(*s, 2) : nullptr;
        if (r == nullptr || r->state() != "running" || r->restarts() != 1) return false;
        restarted = r->pid();
        return restarted != pids[1];
      },
      10s));
  EXPECT_TRUE(ProcessGone(pids[1]));
  ASSERT_TRUE(Eventually([&] { return serving(2); }, kStartTimeout));
  EXPECT_FALSE(ProcessGone(restarted));
  // The gateway heard about it in a heartbeat.
  EXPECT_TRUE(gw->WaitUntil(
      [&] {
        auto s = gw->last_status();
        const auto* r = s ? FindReplica(*s, 2) : nullptr;
        return s && s->server_id() == "server-1" && r && r->restarts() == 1;
      },
      10s));

  // GPUs: one per server; a second execution on the same server is refused until release.
  control::GrantRequest grant;
  grant.set_kernel_id(kernel);
  grant.set_replica_id(1);
  grant.set_exec_id("exec-1");
  grant.set_gpus(1);
  auto g1 = clients[0]->Grant(grant);
  ASSERT_TRUE(g1.ok() && g1->granted()) << (g1.ok() ? g1->reason() : g1.status().ToString());
  EXPECT_EQ(g1->device_ids(0), 0);
  grant.set_exec_id("exec-2");
  auto g2 = clients[0]->Grant(grant);
  ASSERT_TRUE(g2.ok());
  EXPECT_FALSE(g2->granted());
  EXPECT_TRUE(*clients[0]->Release(g1->grant_id()));
  auto g3 = clients[0]->Grant(grant);
  ASSERT_TRUE(g3.ok() && g3->granted());

  // StopReplica leaves no process and no directory behind.
  control::StopReplicaRequest stop;
  stop.set_kernel_id(kernel);
  stop.set_replica_id(3);
  ASSERT_TRUE(clients[2]->StopReplica(stop).ok());
  EXPECT_TRUE(ProcessGone(pids[2]));
  EXPECT_FALSE(std::filesystem::exists(tmp.path() + "/server-2/replicas/" + kernel + "-3"));
  EXPECT_EQ(clients[2]->GetStatus()->replicas_size(), 0);

  // Shutting the daemons down leaves no child process (directories are kept, Raft logs kept in
  // RAM are not).
  for (auto& d : daemons) d->Shutdown();
  EXPECT_TRUE(ProcessGone(pids[0]));
  EXPECT_TRUE(ProcessGone(restarted));
  EXPECT_TRUE(
      std::filesystem::exists(tmp.path() + "/server-0/replicas/" + kernel + "-1/connection.json"));
}

}  // namespace
}  // namespace nbos::daemon
