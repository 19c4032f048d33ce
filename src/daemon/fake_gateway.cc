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
  MutexLock lock(&mu_);
  known_.clear();
}

int FakeGateway::registers() const {
  MutexLock lock(&mu_);
  return registers_;
}

int FakeGateway::heartbeats() const {
  MutexLock lock(&mu_);
  return heartbeats_;
}

std::optional<control::RegisterRequest> FakeGateway::last_register() const {
  MutexLock lock(&mu_);
  return last_register_;
}

std::optional<control::ServerStatus> FakeGateway::last_status() const {
  MutexLock lock(&mu_);
  return last_status_;
}

bool FakeGateway::WaitUntil(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  MutexLock lock(&mu_);
  while (true) {
    // `pred` calls the accessors, which take mu_: evaluate it unlocked.
    lock.Unlock();
    if (pred()) return true;
    lock.Lock();
    if (std::chrono::steady_clock::now() >= deadline) {
      lock.Unlock();
      return pred();
    }
    // Short slices: a call that landed between pred() and Lock() is not missed for long.
    cv_.WaitFor(&mu_, std::chrono::milliseconds(20));
  }
}

grpc::Status FakeGateway::Register(grpc::ServerContext*, const control::RegisterRequest* req,
                                   control::RegisterReply* reply) {
  {
    MutexLock lock(&mu_);
    registers_++;
    last_register_ = *req;
    known_.insert(req->server_id());
    reply->set_heartbeat_interval_ms(heartbeat_ms_);
  }
  cv_.SignalAll();
  return grpc::Status::OK;
}

grpc::Status FakeGateway::Heartbeat(grpc::ServerContext*, const control::HeartbeatRequest* req,
                                    control::HeartbeatReply* reply) {
  {
    MutexLock lock(&mu_);
    heartbeats_++;
    last_status_ = req->status();
    reply->set_known(known_.contains(req->status().server_id()));
  }
  cv_.SignalAll();
  return grpc::Status::OK;
}

}  // namespace nbos::daemon::testing
