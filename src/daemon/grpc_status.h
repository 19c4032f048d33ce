// Conversions between nbos::Status and grpc::Status for the control plane's edges (the daemon's
// service, DaemonClient, and the gateway's service if it wants them).
#pragma once

#include <grpcpp/support/status.h>

#include <string_view>

#include "common/status.h"

namespace nbos::daemon {

grpc::Status ToGrpcStatus(const Status& status);

// `what` names the call for the message: "PrepareReplica on 10.0.0.2:7000: <grpc message>".
// UNAVAILABLE and DEADLINE_EXCEEDED become Unavailable (the peer cannot be reached now).
Status FromGrpcStatus(const grpc::Status& status, std::string_view what);

}  // namespace nbos::daemon
