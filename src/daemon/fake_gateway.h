// Test support: a real gRPC nbos.control.Gateway service that records what daemons send.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "common/thread_annotations.h"
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
  void Forget() EXCLUDES(mu_);
  int registers() const EXCLUDES(mu_);
  int heartbeats() const EXCLUDES(mu_);
  std::optional<control::RegisterRequest> last_register() const EXCLUDES(mu_);
  std::optional<control::ServerStatus> last_status() const EXCLUDES(mu_);

  // Waits until `pred` holds, re-checking after each call received; false on timeout. `pred` is
  // called without mu_ (it may call the accessors).
  bool WaitUntil(const std::function<bool()>& pred, std::chrono::milliseconds timeout)
      EXCLUDES(mu_);

  grpc::Status Register(grpc::ServerContext*, const control::RegisterRequest* req,
                        control::RegisterReply* reply) EXCLUDES(mu_) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const control::HeartbeatRequest* req,
                         control::HeartbeatReply* reply) EXCLUDES(mu_) override;

 private:
  FakeGateway() = default;

  mutable Mutex mu_;
  CondVar cv_;                   // signalled after each call received
  uint32_t heartbeat_ms_ = 100;  // set before serving
  std::set<std::string> known_ GUARDED_BY(mu_);
  int registers_ GUARDED_BY(mu_) = 0;
  int heartbeats_ GUARDED_BY(mu_) = 0;
  std::optional<control::RegisterRequest> last_register_ GUARDED_BY(mu_);
  std::optional<control::ServerStatus> last_status_ GUARDED_BY(mu_);
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace nbos::daemon::testing
