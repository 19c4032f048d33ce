// The Daemon over gRPC (through DaemonClient) and its registration loop against a fake gateway;
// replica processes are the stand-in script, so this runs in about a second.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "daemon/daemon.h"
#include "daemon/daemon_client.h"
#include "daemon/fake_gateway.h"
#include "daemon/test_util.h"

namespace nbos::daemon {
namespace {

using namespace std::chrono_literals;
using testing::Eventually;
using testing::FakeGateway;
using testing::ProcessGone;

class DaemonServiceTest : public ::testing::Test {
 protected:
  DaemonOptions Options(const std::string& gateway = "") {
    DaemonOptions o;
    o.server_id = "server-a";
    o.gateway_address = gateway;
    o.state_dir = tmp_.path() + "/state";
    o.nbos_binary = testing::WriteFakeNbos(tmp_.path());
    o.gpu_source = GpuSource::kVirtual;
    o.virtual_gpus = 2;
    o.vram_mb_per_gpu = 1000;
    o.millicpus = 4000;
    o.memory_mb = 8000;
    o.stop_grace = 2s;
    o.restart_delay = 20ms;
    o.register_retry = 50ms;
    return o;
  }

  control::PrepareReplicaRequest PrepareReq(const std::string& kernel, uint32_t id) {
    control::PrepareReplicaRequest req;
    req.set_kernel_id(kernel);
    req.set_replica_id(id);
    req.set_key("k3y");
    req.mutable_resources()->set_millicpus(1000);
    req.mutable_resources()->set_memory_mb(2000);
    req.mutable_resources()->set_gpus(2);
    return req;
  }

  control::GrantRequest GrantReq(const std::string& kernel, uint32_t id, const std::string& exec,
                                 int gpus) {
    control::GrantRequest req;
    req.set_kernel_id(kernel);
    req.set_replica_id(id);
    req.set_exec_id(exec);
    req.set_gpus(gpus);
    return req;
  }

  testing::TempDir tmp_;
};

TEST_F(DaemonServiceTest, RegistersAndHeartbeatsItsLedger) {
  auto gw = FakeGateway::Start(0, 50);
  ASSERT_TRUE(gw);
  auto d = Daemon::Start(Options(gw->address()));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ASSERT_TRUE(gw->WaitUntil([&] { return gw->heartbeats() >= 2; }, 10s));
  auto reg = gw->last_register();
  ASSERT_TRUE(reg);
  EXPECT_EQ(reg->server_id(), "server-a");
  EXPECT_EQ(reg->daemon_address(), (*d)->address());
  EXPECT_EQ(reg->spec().gpus(), 2);
  EXPECT_EQ(reg->spec().vram_mb(), 2000);
  EXPECT_EQ(reg->spec().millicpus(), 4000);
  EXPECT_TRUE(reg->gpus_virtual());
  auto status = gw->last_status();
  ASSERT_TRUE(status);
  EXPECT_EQ(status->server_id(), "server-a");
  EXPECT_EQ(status->ledger().idle_gpu_ids_size(), 2);
  EXPECT_TRUE((*d)->registered());
}

TEST_F(DaemonServiceTest, RegistersAgainWhenTheGatewayForgetsOrGoesAway) {
  // The daemon starts before the gateway: it keeps trying.
  int port = 0;
  {
    auto probe = FakeGateway::Start(0);
    ASSERT_TRUE(probe);
    port = probe->port();
  }
  auto d = Daemon::Start(Options("127.0.0.1:" + std::to_string(port)));
  ASSERT_TRUE(d.ok());
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE((*d)->registered());
  auto gw = FakeGateway::Start(port, 50);
  ASSERT_TRUE(gw);
  ASSERT_TRUE(gw->WaitUntil([&] { return gw->registers() == 1 && gw->heartbeats() >= 1; }, 10s));

  // The gateway forgot the server (say it restarted without its database).
  gw->Forget();
  ASSERT_TRUE(gw->WaitUntil([&] { return gw->registers() == 2; }, 10s));

  // The gateway goes away and comes back on the same address.
  gw->Stop();
  gw.reset();
  // Several heartbeat intervals without a gateway: the daemon notices (and keeps retrying).
  std::this_thread::sleep_for(300ms);
  ASSERT_TRUE(Eventually([&] { return !(*d)->registered(); }, 10s));
  gw = FakeGateway::Start(port, 50);
  ASSERT_TRUE(gw);
  ASSERT_TRUE(gw->WaitUntil([&] { return gw->registers() == 1 && gw->heartbeats() >= 1; }, 10s));
}

TEST_F(DaemonServiceTest, PrepareReservesDistinctPortsAndIsIdempotent) {
  auto d = Daemon::Start(Options());
  ASSERT_TRUE(d.ok());
  DaemonClient client((*d)->address());
  std::set<int> ports;
  for (uint32_t id = 1; id <= 3; ++id) {
    auto reply = client.PrepareReplica(PrepareReq("kernel-1", id));
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    const control::ConnectionInfo& c = reply->connection();
    EXPECT_EQ(c.ip(), "127.0.0.1");
    EXPECT_EQ(c.key(), "k3y");
    EXPECT_EQ(c.transport(), "tcp");
    EXPECT_EQ(c.signature_scheme(), "hmac-sha256");
    int raft = std::stoi(reply->raft_address().substr(reply->raft_address().rfind(':') + 1));
    for (int p : {c.shell_port(), c.iopub_port(), c.stdin_port(), c.control_port(), c.hb_port(),
                  raft, raft + 1}) {
      EXPECT_TRUE(ports.insert(p).second) << "port " << p << " handed out twice";
    }
    auto file = jupyter::ReadConnectionFile(tmp_.path() + "/state/replicas/kernel-1-" +
                                            std::to_string(id) + "/connection.json");
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    EXPECT_EQ(file->shell_port, c.shell_port());
  }
  auto again = client.PrepareReplica(PrepareReq("kernel-1", 2));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(ports.contains(again->connection().shell_port()));
  auto status = client.GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->replicas_size(), 3);
  EXPECT_EQ(status->replicas(0).state(), "prepared");
  EXPECT_EQ(status->ledger().subscribed().gpus(), 6) << "oversubscribed on purpose";
  EXPECT_EQ(status->ledger().subscribed().millicpus(), 3000);
}

TEST_F(DaemonServiceTest, ACallRightAfterAFailedConnectionReachesADaemonThatIsUp) {
  // The channel's first connection attempt fails (nothing listens yet); the daemon then starts
  // on that port. The next call, made while gRPC still holds the failure (its reconnect
  // backoff), reaches the daemon instead of failing with the stale connection error.
  int port = 0;
  {
    auto probe = FakeGateway::Start(0);
    ASSERT_TRUE(probe);
    port = probe->port();
  }
  DaemonClient client("127.0.0.1:" + std::to_string(port));
  auto down = client.GetStatus();
  EXPECT_EQ(down.status().code(), StatusCode::kUnavailable);
  DaemonOptions o = Options();
  o.listen_address = "127.0.0.1:" + std::to_string(port);
  auto d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  auto up = client.PrepareReplica(PrepareReq("kernel-1", 1));
  ASSERT_TRUE(up.ok()) << up.status().ToString();
}

TEST_F(DaemonServiceTest, ErrorsTravelAsStatusCodes) {
  auto d = Daemon::Start(Options());
  ASSERT_TRUE(d.ok());
  DaemonClient client((*d)->address());
  EXPECT_EQ(client.PrepareReplica(PrepareReq("../etc", 1)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(client.PrepareReplica(PrepareReq("k", 0)).status().code(),
            StatusCode::kInvalidArgument);
  auto too_many = PrepareReq("k", 1);
  too_many.mutable_resources()->set_gpus(3);
  EXPECT_EQ(client.PrepareReplica(too_many).status().code(), StatusCode::kInvalidArgument);
  control::LaunchReplicaRequest launch;
  launch.set_kernel_id("k");
  launch.set_replica_id(1);
  EXPECT_EQ(client.LaunchReplica(launch).status().code(), StatusCode::kNotFound);
  control::StopReplicaRequest stop;
  stop.set_kernel_id("k");
  stop.set_replica_id(1);
  EXPECT_EQ(client.StopReplica(stop).code(), StatusCode::kNotFound);

  // A peer list without this replica, or with it at another address, is refused.
  ASSERT_TRUE(client.PrepareReplica(PrepareReq("k", 1)).ok());
  control::Peer* peer = launch.add_peers();
  peer->set_replica_id(2);
  peer->set_raft_address("127.0.0.1:1");
  EXPECT_EQ(client.LaunchReplica(launch).status().code(), StatusCode::kInvalidArgument);
  peer->set_replica_id(1);
  EXPECT_EQ(client.LaunchReplica(launch).status().code(), StatusCode::kInvalidArgument);

  // Nobody listens: Unavailable, quickly.
  DaemonClient nowhere("127.0.0.1:1", {.timeout = 2s});
  EXPECT_EQ(nowhere.GetStatus().status().code(), StatusCode::kUnavailable);
}

TEST_F(DaemonServiceTest, ALaunchInAWorkspaceIsCheckedOnThisServer) {
  const std::string root = tmp_.path() + "/workspace";
  std::filesystem::create_directories(root + "/project");
  for (bool exported : {false, true}) {
    DaemonOptions o = Options();
    if (exported) o.workspace_root = root;
    auto d = Daemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    DaemonClient client((*d)->address());
    ASSERT_TRUE(client.PrepareReplica(PrepareReq("k", 1)).ok());
    control::LaunchReplicaRequest launch;
    launch.set_kernel_id("k");
    launch.set_replica_id(1);
    (*launch.mutable_env())["NBOS_WORKSPACE"] = root;
    (*launch.mutable_env())["KERNEL_WORKING_DIR"] = root + "/not-here";
    auto refused = client.LaunchReplica(launch);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
    // Without a workspace of its own the server says so; with one, that the directory is missing.
    EXPECT_NE(refused.status().message().find(exported ? "mounted" : "exports none"),
              std::string::npos)
        << refused.status().message();
    (*launch.mutable_env())["KERNEL_WORKING_DIR"] = "/etc";
    if (exported) {
      EXPECT_EQ(client.LaunchReplica(launch).status().code(), StatusCode::kInvalidArgument);
      (*launch.mutable_env())["KERNEL_WORKING_DIR"] = root + "/project";
      EXPECT_TRUE(client.LaunchReplica(launch).ok());
    }
  }
}

TEST_F(DaemonServiceTest, GrantAndReleaseOverGrpc) {
  auto d = Daemon::Start(Options());
  ASSERT_TRUE(d.ok());
  DaemonClient client((*d)->address());
  ASSERT_TRUE(client.PrepareReplica(PrepareReq("k", 1)).ok());
  ASSERT_TRUE(client.PrepareReplica(PrepareReq("j", 1)).ok());

  auto refused = client.Grant(GrantReq("nobody", 1, "e0", 1));
  ASSERT_TRUE(refused.ok());
  EXPECT_FALSE(refused->granted());

  auto g1 = client.Grant(GrantReq("k", 1, "e1", 1));
  ASSERT_TRUE(g1.ok());
  ASSERT_TRUE(g1->granted()) << g1->reason();
  EXPECT_EQ(std::vector<int>(g1->device_ids().begin(), g1->device_ids().end()),
            std::vector<int>{0});
  auto g2 = client.Grant(GrantReq("j", 1, "e2", 1));
  ASSERT_TRUE(g2.ok() && g2->granted());
  EXPECT_EQ(g2->device_ids(0), 1);
  EXPECT_NE(g1->grant_id(), g2->grant_id());

  // Out of GPUs: refused with a reason.
  auto g3 = client.Grant(GrantReq("k", 1, "e3", 1));
  ASSERT_TRUE(g3.ok());
  EXPECT_FALSE(g3->granted());
  EXPECT_NE(g3->reason().find("idle"), std::string::npos) << g3->reason();

  // A retried exec id gets its grant back.
  auto retry = client.Grant(GrantReq("k", 1, "e1", 1));
  ASSERT_TRUE(retry.ok() && retry->granted());
  EXPECT_EQ(retry->grant_id(), g1->grant_id());

  auto status = client.GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->ledger().committed().gpus(), 2);
  EXPECT_EQ(status->ledger().committed().millicpus(), 2000);
  EXPECT_EQ(status->ledger().idle_gpu_ids_size(), 0);

  auto released = client.Release(g1->grant_id());
  ASSERT_TRUE(released.ok());
  EXPECT_TRUE(*released);
  EXPECT_FALSE(*client.Release(g1->grant_id()));
  auto g4 = client.Grant(GrantReq("k", 1, "e3", 1));
  ASSERT_TRUE(g4.ok() && g4->granted());
  EXPECT_EQ(g4->device_ids(0), 0);

  // Stopping a replica frees its grant, its ports and its directory.
  control::StopReplicaRequest stop;
  stop.set_kernel_id("k");
  stop.set_replica_id(1);
  ASSERT_TRUE(client.StopReplica(stop).ok());
  EXPECT_FALSE(std::filesystem::exists(tmp_.path() + "/state/replicas/k-1"));
  status = client.GetStatus();
  EXPECT_EQ(status->ledger().committed().gpus(), 1);
  EXPECT_EQ(status->replicas_size(), 1);
}

TEST_F(DaemonServiceTest, RaftLogsLiveInADirectoryOfTheDaemonsOwnThatItEmptiesAndRemoves) {
  namespace fs = std::filesystem;
  const std::string ram = tmp_.path() + "/ram";
  fs::create_directories(ram);
  DaemonOptions options = Options();
  options.raft_log_dir = ram;
  auto roots = [&] {
    std::vector<std::string> found;
    for (const auto& e : fs::directory_iterator(ram)) found.push_back(e.path().string());
    return found;
  };
  std::string root;
  {
    auto d = Daemon::Start(options);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    ASSERT_EQ(roots().size(), 1u);
    root = roots()[0];
    EXPECT_TRUE(fs::path(root).filename().string().starts_with("nbos-raft-")) << root;
    ASSERT_TRUE(DaemonClient((*d)->address()).PrepareReplica(PrepareReq("kernel-1", 1)).ok());
    EXPECT_TRUE(fs::is_directory(root + "/kernel-1-1"));
    EXPECT_FALSE(fs::exists(tmp_.path() + "/state/replicas/kernel-1-1/data"));
    (*d)->Shutdown();
    EXPECT_FALSE(fs::exists(root)) << "a log in RAM goes with its daemon";
    EXPECT_TRUE(fs::exists(tmp_.path() + "/state/replicas/kernel-1-1/connection.json"));
  }
  // One left by a daemon that died: emptied by the next start from the same state directory.
  // Another daemon's root goes too once nobody holds its lock; a live one's stays.
  fs::create_directories(root + "/kernel-9-1");
  fs::create_directories(ram + "/nbos-raft-dead");
  std::ofstream(ram + "/nbos-raft-dead/.lock").put('\n');
  fs::create_directories(ram + "/nbos-raft-alive");
  const int alive = open((ram + "/nbos-raft-alive/.lock").c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_EQ(flock(alive, LOCK_EX | LOCK_NB), 0);
  {
    auto d = Daemon::Start(options);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    std::vector<std::string> expected = {ram + "/nbos-raft-alive", root};
    std::vector<std::string> found = roots();
    std::sort(expected.begin(), expected.end());
    std::sort(found.begin(), found.end());
    EXPECT_EQ(found, expected);
    EXPECT_FALSE(fs::exists(root + "/kernel-9-1"));
  }
  close(alive);
  fs::remove_all(ram + "/nbos-raft-alive");
  options.raft_log_dir = "state";
  {
    auto d = Daemon::Start(options);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    ASSERT_TRUE(DaemonClient((*d)->address()).PrepareReplica(PrepareReq("kernel-2", 1)).ok());
    EXPECT_TRUE(fs::is_directory(tmp_.path() + "/state/replicas/kernel-2-1/data"));
    EXPECT_TRUE(roots().empty());
  }
  options.raft_log_dir = "";
  EXPECT_EQ(Daemon::Start(options).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(DaemonServiceTest, DeadReplicaReleasesItsGrantAndShutdownLeavesNoProcess) {
  auto d = Daemon::Start(Options());
  ASSERT_TRUE(d.ok());
  DaemonClient client((*d)->address());
  std::vector<pid_t> pids;
  for (uint32_t id = 1; id <= 2; ++id) {
    auto prepared = client.PrepareReplica(PrepareReq("k", id));
    ASSERT_TRUE(prepared.ok());
    control::LaunchReplicaRequest launch;
    launch.set_kernel_id("k");
    launch.set_replica_id(id);
    auto* peer = launch.add_peers();
    peer->set_replica_id(id);
    peer->set_raft_address(prepared->raft_address());
    auto launched = client.LaunchReplica(launch);
    ASSERT_TRUE(launched.ok()) << launched.status().ToString();
    pids.push_back(launched->pid());
  }
  auto g = client.Grant(GrantReq("k", 1, "e1", 2));
  ASSERT_TRUE(g.ok() && g->granted());
  ASSERT_EQ(kill(pids[0], SIGKILL), 0);
  ASSERT_TRUE(Eventually([&] {
    auto s = client.GetStatus();
    return s.ok() && s->ledger().committed().gpus() == 0;
  }));
  ASSERT_TRUE(Eventually([&] {
    auto s = client.GetStatus();
    for (const auto& r : s->replicas()) {
      if (r.replica_id() == 1) return r.state() == "running" && r.restarts() == 1;
    }
    return false;
  }));
  pid_t restarted = 0;
  auto after = client.GetStatus();
  ASSERT_TRUE(after.ok());
  for (const auto& r : after->replicas()) {
    if (r.replica_id() == 1) restarted = r.pid();
  }
  EXPECT_FALSE(client.Release(g->grant_id()).value());

  (*d)->Shutdown();
  EXPECT_TRUE(ProcessGone(restarted));
  EXPECT_TRUE(ProcessGone(pids[1]));
  (*d)->Wait();  // returns at once after Shutdown
  EXPECT_EQ(client.GetStatus().status().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace nbos::daemon
