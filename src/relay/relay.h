// `nbos relay`: a local Jupyter kernel process that forwards everything to a kernel on an nbos
// gateway, so tools that only know kernelspecs and connection files (nbclient, nbconvert,
// papermill, jupyter console, jupyter_kernel_test) use gateway kernels unchanged.
//
// It binds the five channels of the connection file like `nbos kernel` does (ROUTER shell,
// control and stdin, PUB iopub, a ROUTER heartbeat echo answered locally), starts a gateway
// kernel (POST /api/kernels with `env`), and relays: client messages, once their HMAC verifies
// with the connection key (others are dropped and logged), go to the kernel's WebSocket on
// their channel; the kernel's messages are re-signed and sent to the client that asked
// (RelayRouter), iopub ones published.
//
// Lifetime: shutdown_request (control or shell) is answered locally (the reply also published on
// iopub, as ipykernel does), then the gateway kernel is deleted and the process exits 0; with
// restart=true too, since a KernelManager restarts by starting a new relay. SIGTERM or SIGHUP, or
// the death of the parent named by JPY_PARENT_PID: delete the kernel, exit 0. SIGINT (the
// kernelspec's interrupt_mode is "signal"): POST /interrupt. interrupt_request on control is
// forwarded like any request. A dropped WebSocket is reopened (GatewayLink); a kernel the
// gateway has lost ends the relay with exit code 1.
#pragma once

#include <string>

#include "jupyter/connection_file.h"
#include "relay/gateway_link.h"

namespace nbos::relay {

struct RelayOptions {
  jupyter::ConnectionInfo connection;
  GatewayOptions gateway;
  std::string log_level = "warn";
  size_t max_message_bytes = 512u << 20;
};

// Runs until one of the ends above; returns the process exit code: 0 after a shutdown, 1 when
// the gateway kernel could not be started (a one-line reason on stderr, e.g. a refused token)
// or was lost, 2 for a bad connection file key scheme or sockets that cannot be bound. Call from
// the main thread before any other thread exists (it sets the signal mask every thread
// inherits).
int RunRelay(const RelayOptions& options);

}  // namespace nbos::relay
