#include "daemon/daemon_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "control/control.grpc.pb.h"
#include "daemon/grpc_status.h"

namespace nbos::daemon {

struct DaemonClient::Impl {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<control::Daemon::Stub> stub;

  // One unary call with a deadline; `what` names it in errors.
  template <typename Req, typename Reply, typename Method>
  Result<Reply> Call(Method method, const Req& req, std::chrono::milliseconds timeout,
                     const std::string& what) {
    const auto deadline = std::chrono::system_clock::now() + timeout;
    grpc::Status s;
    Reply reply;
    for (int attempt = 0; attempt < 2; ++attempt) {
      grpc::ClientContext ctx;
      ctx.set_deadline(deadline);
      s = (stub.get()->*method)(&ctx, req, &reply);
      if (s.ok()) return reply;
      if (!NeverSent(s)) break;
      // One failed connection attempt fails every call until the next one (fail-fast): a
      // daemon that is up gets one more try once the channel reconnects, bounded so that a
      // daemon that is down still fails the call within half a second.
      const auto wait_until = std::min(deadline, std::chrono::system_clock::now() + kReconnectWait);
      if (!channel->WaitForConnected(wait_until)) break;
    }
    return FromGrpcStatus(s, what);
  }

  // Whether the call failed before it left this process: no connection could be picked, so the
  // daemon never saw it and sending it again cannot run it twice.
  static bool NeverSent(const grpc::Status& s) {
    return s.error_code() == grpc::StatusCode::UNAVAILABLE &&
           s.error_message().starts_with("failed to connect to all addresses");
  }

  static constexpr std::chrono::milliseconds kReconnectWait{500};
};

DaemonClient::DaemonClient(std::string address, DaemonClientOptions options)
    : address_(std::move(address)), options_(options), impl_(std::make_unique<Impl>()) {
  // A daemon that restarts should be reachable again within a couple of seconds, not after
  // gRPC's default backoff (up to 120 s).
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  // gRPC reads "min reconnect backoff" as the minimum time a connection attempt (TCP connect and
  // HTTP/2 handshake) is given before it is abandoned: 100 ms failed every first call on a
  // loaded machine. 5 s, the calls' own deadline.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 5000);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  control::AddChannelArguments(options_.credential, &args);
  impl_->channel =
      grpc::CreateCustomChannel(address_, control::ChannelCredentials(options_.credential), args);
  impl_->stub = control::Daemon::NewStub(impl_->channel);
}

DaemonClient::~DaemonClient() = default;

Result<control::PrepareReplicaReply> DaemonClient::PrepareReplica(
    const control::PrepareReplicaRequest& req) {
  return impl_->Call<control::PrepareReplicaRequest, control::PrepareReplicaReply>(
      &control::Daemon::Stub::PrepareReplica, req, options_.timeout,
      "PrepareReplica on " + address_);
}

Result<control::LaunchReplicaReply> DaemonClient::LaunchReplica(
    const control::LaunchReplicaRequest& req) {
  return impl_->Call<control::LaunchReplicaRequest, control::LaunchReplicaReply>(
      &control::Daemon::Stub::LaunchReplica, req, options_.launch_timeout,
      "LaunchReplica on " + address_);
}

Status DaemonClient::StopReplica(const control::StopReplicaRequest& req) {
  return impl_
      ->Call<control::StopReplicaRequest, control::StopReplicaReply>(
          &control::Daemon::Stub::StopReplica, req, options_.stop_timeout,
          "StopReplica on " + address_)
      .status();
}

Result<control::GrantReply> DaemonClient::Grant(const control::GrantRequest& req) {
  return impl_->Call<control::GrantRequest, control::GrantReply>(
      &control::Daemon::Stub::Grant, req, options_.timeout, "Grant on " + address_);
}

Result<bool> DaemonClient::Release(const std::string& grant_id) {
  control::ReleaseRequest req;
  req.set_grant_id(grant_id);
  auto reply = impl_->Call<control::ReleaseRequest, control::ReleaseReply>(
      &control::Daemon::Stub::Release, req, options_.timeout, "Release on " + address_);
  if (!reply.ok()) return reply.status();
  return reply->released();
}

Result<control::ServerStatus> DaemonClient::GetStatus() {
  return impl_->Call<control::StatusRequest, control::ServerStatus>(
      &control::Daemon::Stub::Status, control::StatusRequest{}, options_.timeout,
      "Status on " + address_);
}

}  // namespace nbos::daemon
