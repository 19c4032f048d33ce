// C-Raft's TCP transport with a challenge on every connection: a stream reaches Raft only once
// its connecting end proved it holds the group's peer key (PeerKeyFrom).
//
// After C-Raft's own preamble (protocol, server id, address), the accepting end sends a fresh
// nonce and the connecting end answers PeerMac(key, {"raft", nonce, acceptor id, connector id}).
// The answer names both ends, so it admits one connection, from the id the preamble claimed, to
// the member that asked; a wrong or missing answer (within the handshake timeout) closes the
// stream, and Raft never reads a byte from it. What follows on an admitted stream is not
// authenticated per message: a process that can take over an established TCP connection (root,
// or a machine on the path) is outside what this guards (docs/decisions/0018).
//
// Everything runs on the loop the transport was created on, as C-Raft's transports do.
#pragma once

#include <functional>
#include <memory>
#include <string>

extern "C" {
#include <raft.h>
#include <raft/uv.h>
}
#include <uv.h>

namespace nbos::replication {

struct AuthenticatedTransportOptions {
  std::string peer_key;  // non-empty
  unsigned handshake_timeout_ms = 5000;
  // Called on the loop thread for each refused connection (or failed handshake of our own),
  // with what went wrong and the peer's claimed id and address.
  std::function<void(const std::string& why)> on_refused;
};

class AuthenticatedTransport {
 public:
  // Errors are C-Raft's (raft_uv_tcp_init's).
  static int Create(uv_loop_t* loop, AuthenticatedTransportOptions options,
                    std::unique_ptr<AuthenticatedTransport>* out);
  // Only once the transport was closed (raft_uv_close after raft_close) or never handed to C-Raft.
  ~AuthenticatedTransport();
  AuthenticatedTransport(const AuthenticatedTransport&) = delete;
  AuthenticatedTransport& operator=(const AuthenticatedTransport&) = delete;

  // What to hand to raft_uv_init.
  struct raft_uv_transport* transport();

  struct Impl;

 private:
  explicit AuthenticatedTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace nbos::replication
