// The cluster credential: what lets the gateway and the daemons trust each other's gRPC calls.
//
// One credential per cluster (`nbos credential create FILE`; `nbos up` makes one in its state
// directory): a CA certificate, a certificate and key it signed (for the name kClusterName, used
// by every member as server and as client), and a random bearer token. Servers speak TLS with that
// certificate; callers verify it against the CA (so they talk only to members) and send the token
// with every call (so members answer only members). A call without the token, or with another,
// is refused with UNAUTHENTICATED, logged and counted; a caller that does not speak TLS, or trusts
// another CA, fails the TLS handshake.
//
// Without a credential (nullptr below) the control plane is plaintext and open to any caller that
// can reach it: for a development machine only.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace nbos::control {

inline constexpr char kClusterName[] = "nbos-cluster";

struct ClusterCredential {
  std::string ca_cert_pem;
  std::string cert_pem;
  std::string key_pem;
  std::string token;  // 64 hex characters
};

// A new credential: fresh P-256 keys, certificates valid for ten years, a 256-bit token.
Result<ClusterCredential> CreateClusterCredential();
// JSON, written with mode 0600 (the file is a secret); the directory must exist.
Status WriteClusterCredential(const std::string& path, const ClusterCredential& credential);
// InvalidArgument naming the file when it is unreadable or not a credential.
Result<std::shared_ptr<const ClusterCredential>> ReadClusterCredential(const std::string& path);

// TLS with the credential's certificate and a token check, or plaintext without a credential.
// `who` names the server in the log line of each refusal ("gateway", "daemon host-1"); each
// refusal counts in `refused` (may be null).
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(
    const std::shared_ptr<const ClusterCredential>& credential, std::string who,
    std::shared_ptr<std::atomic<uint64_t>> refused);
// TLS trusting only the credential's CA, plus the token on every call; or plaintext.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(
    const std::shared_ptr<const ClusterCredential>& credential);
// With a credential, the name the server's certificate is checked against (members are reached
// by IP address, and their certificate names the cluster, not a host).
void AddChannelArguments(const std::shared_ptr<const ClusterCredential>& credential,
                         grpc::ChannelArguments* args);

}  // namespace nbos::control
