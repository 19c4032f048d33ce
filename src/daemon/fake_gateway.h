// Test support: a real gRPC nbos.control.Gateway service that records what daemons send.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "control/control.grpc.pb.h"

namespace nbos::daemon::testing {

class FakeGateway final : public control::Gateway::Service {
 public:
  // Serves on 127.0.0.1:`port` (0: ephemeral); heartbeats are asked every `heartbeat_ms`.
  static std::unique_ptr<FakeGateway> Start(int port = 0, uint32_t heartbeat_ms = 100);
  ~FakeGateway() override;

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }
  void Stop();  // stops serving (the daemon sees an unreachable gateway)

  // Forgets every registered server: their heartbeats get known = false until they register
  // again (as a gateway that restarted without its database). Heartbeats are known only from
  // servers that registered with this instance.
  void Forget();
  int registers() const;
  int heartbeats() const;
  std::optional<control::RegisterRequest> last_register() const;
  std::optional<control::ServerStatus> last_status() const;

  // Waits until `pred` holds, re-checking after each call received; false on timeout.
  bool WaitUntil(const std::function<bool()>& pred, std::chrono::milliseconds timeout);

  grpc::Status Register(grpc::ServerContext*, const control::RegisterRequest* req,
                        control::RegisterReply* reply) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const control::HeartbeatRequest* req,
                         control::HeartbeatReply* reply) override;

 private:
  FakeGateway() = default;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint32_t heartbeat_ms_ = 100;
  std::set<std::string> known_;
  int registers_ = 0;
  int heartbeats_ = 0;
  std::optional<control::RegisterRequest> last_register_;
  std::optional<control::ServerStatus> last_status_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace nbos::daemon::testing
