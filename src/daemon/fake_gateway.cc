#include "daemon/fake_gateway.h"

#include <grpcpp/grpcpp.h>

namespace nbos::daemon::testing {

std::unique_ptr<FakeGateway> FakeGateway::Start(int port, uint32_t heartbeat_ms) {
  std::unique_ptr<FakeGateway> g(new FakeGateway());
  g->heartbeat_ms_ = heartbeat_ms;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:" + std::to_string(port), grpc::InsecureServerCredentials(),
                           &g->port_);
  builder.RegisterService(g.get());
  g->server_ = builder.BuildAndStart();
  if (!g->server_ || g->port_ == 0) return nullptr;
  return g;
}

FakeGateway::~FakeGateway() { Stop(); }

void FakeGateway::Stop() {
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
    server_.reset();
  }
}

void FakeGateway::Forget() {
  std::lock_guard lock(mu_);
  known_.clear();
}

int FakeGateway::registers() const {
  std::lock_guard lock(mu_);
  return registers_;
}

int FakeGateway::heartbeats() const {
  std::lock_guard lock(mu_);
  return heartbeats_;
}

std::optional<control::RegisterRequest> FakeGateway::last_register() const {
  std::lock_guard lock(mu_);
  return last_register_;
}

std::optional<control::ServerStatus> FakeGateway::last_status() const {
  std::lock_guard lock(mu_);
  return last_status_;
}

bool FakeGateway::WaitUntil(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock lock(mu_);
  while (true) {
    // `pred` calls the accessors, which take mu_: evaluate it unlocked.
    lock.unlock();
    if (pred()) return true;
    lock.lock();
    if (std::chrono::steady_clock::now() >= deadline) {
      lock.unlock();
      return pred();
    }
    // Short slices: a call that landed between pred() and lock() is not missed for long.
    cv_.wait_for(lock, std::chrono::milliseconds(20));
  }
}

grpc::Status FakeGateway::Register(grpc::ServerContext*, const control::RegisterRequest* req,
                                   control::RegisterReply* reply) {
  {
    std::lock_guard lock(mu_);
    registers_++;
    last_register_ = *req;
    known_.insert(req->server_id());
    reply->set_heartbeat_interval_ms(heartbeat_ms_);
  }
  cv_.notify_all();
  return grpc::Status::OK;
}

grpc::Status FakeGateway::Heartbeat(grpc::ServerContext*, const control::HeartbeatRequest* req,
                                    control::HeartbeatReply* reply) {
  {
    std::lock_guard lock(mu_);
    heartbeats_++;
    last_status_ = req->status();
    reply->set_known(known_.contains(req->status().server_id()));
  }
  cv_.notify_all();
  return grpc::Status::OK;
}

}  // namespace nbos::daemon::testing
