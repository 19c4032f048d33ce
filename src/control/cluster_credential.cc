#include "control/cluster_credential.h"

#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/hex.h"

namespace nbos::control {
namespace {

using Key = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;
using Cert = std::unique_ptr<X509, decltype(&X509_free)>;

std::string RandomHex(size_t bytes) {
  std::string raw(bytes, '\0');
  RAND_bytes(reinterpret_cast<unsigned char*>(raw.data()), static_cast<int>(bytes));
  return HexEncode(reinterpret_cast<const unsigned char*>(raw.data()), raw.size());
}

bool AddExtension(X509* cert, X509* issuer, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
  if (ext == nullptr) return false;
  const bool ok = X509_add_ext(cert, ext, -1) == 1;
  X509_EXTENSION_free(ext);
  return ok;
}

// A certificate for `key`, signed by `issuer_key` (`issuer` null: self-signed, a CA).
Cert NewCertificate(EVP_PKEY* key, X509* issuer, EVP_PKEY* issuer_key, const char* common_name) {
  Cert cert(X509_new(), X509_free);
  X509* x = cert.get();
  BIGNUM* serial = BN_new();
  BN_rand(serial, 120, BN_RAND_TOP_ANY, BN_RAND_BOTTOM_ANY);
  BN_to_ASN1_INTEGER(serial, X509_get_serialNumber(x));
  BN_free(serial);
  X509_set_version(x, 2);
  X509_gmtime_adj(X509_getm_notBefore(x), -3600);
  X509_gmtime_adj(X509_getm_notAfter(x), int64_t{10} * 365 * 24 * 3600);
  X509_set_pubkey(x, key);
  X509_NAME_add_entry_by_txt(X509_get_subject_name(x), "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(common_name), -1, -1, 0);
  X509_set_issuer_name(x, X509_get_subject_name(issuer != nullptr ? issuer : x));
  X509* signer = issuer != nullptr ? issuer : x;
  bool ok = AddExtension(x, signer, NID_subject_key_identifier, "hash");
  if (issuer == nullptr) {
    ok = ok && AddExtension(x, signer, NID_basic_constraints, "critical,CA:TRUE") &&
         AddExtension(x, signer, NID_key_usage, "critical,keyCertSign,cRLSign");
  } else {
    const std::string san = std::string("DNS:") + kClusterName;
    ok = ok && AddExtension(x, signer, NID_basic_constraints, "critical,CA:FALSE") &&
         AddExtension(x, signer, NID_key_usage, "critical,digitalSignature,keyAgreement") &&
         AddExtension(x, signer, NID_ext_key_usage, "serverAuth,clientAuth") &&
         AddExtension(x, signer, NID_subject_alt_name, san.c_str()) &&
         AddExtension(x, signer, NID_authority_key_identifier, "keyid");
  }
  if (!ok || X509_sign(x, issuer_key != nullptr ? issuer_key : key, EVP_sha256()) == 0)
    return Cert(nullptr, X509_free);
  return cert;
}

std::string Pem(const std::function<int(BIO*)>& write) {
  BIO* bio = BIO_new(BIO_s_mem());
  std::string out;
  if (write(bio) == 1) {
    char* data = nullptr;
    const long n = BIO_get_mem_data(bio, &data);
    out.assign(data, static_cast<size_t>(n));
  }
  BIO_free(bio);
  return out;
}

// Token check on every call a TLS server gets. Cheap and non-blocking: runs on gRPC's thread.
class TokenChecker final : public grpc::AuthMetadataProcessor {
 public:
  TokenChecker(std::string token, std::string who, std::shared_ptr<std::atomic<uint64_t>> refused)
      : expected_("Bearer " + std::move(token)),
        who_(std::move(who)),
        refused_(std::move(refused)) {}

  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed, OutputMetadata*) override {
    auto it = metadata.find("authorization");
    if (it != metadata.end() && it->second.size() == expected_.size() &&
        CRYPTO_memcmp(it->second.data(), expected_.data(), expected_.size()) == 0) {
      consumed->insert({std::string(it->first.data(), it->first.size()),
                        std::string(it->second.data(), it->second.size())});
      return grpc::Status::OK;
    }
    const uint64_t n = refused_ ? ++*refused_ : 0;
    std::string peer;
    for (const auto& p : context->FindPropertyValues(GRPC_TRANSPORT_SECURITY_TYPE_PROPERTY_NAME))
      peer = std::string(p.data(), p.size());
    spdlog::warn("{}: refused a control call without the cluster credential ({} {}, {} so far)",
                 who_, it == metadata.end() ? "no token" : "wrong token", "over " + peer, n);
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "this call lacks the cluster credential");
  }

 private:
  const std::string expected_;
  const std::string who_;
  const std::shared_ptr<std::atomic<uint64_t>> refused_;
};

class TokenPlugin final : public grpc::MetadataCredentialsPlugin {
 public:
  explicit TokenPlugin(std::string token) : value_("Bearer " + std::move(token)) {}
  bool IsBlocking() const override { return false; }
  grpc::Status GetMetadata(grpc::string_ref, grpc::string_ref, const grpc::AuthContext&,
                           std::multimap<grpc::string, grpc::string>* metadata) override {
    metadata->insert({"authorization", value_});
    return grpc::Status::OK;
  }

 private:
  const std::string value_;
};

}  // namespace

Result<ClusterCredential> CreateClusterCredential() {
  Key ca_key(EVP_EC_gen("P-256"), EVP_PKEY_free);
  Key key(EVP_EC_gen("P-256"), EVP_PKEY_free);
  if (!ca_key || !key) return Internal("cannot generate P-256 keys");
  Cert ca = NewCertificate(ca_key.get(), nullptr, nullptr, "nbos cluster CA");
  if (!ca) return Internal("cannot create the cluster CA certificate");
  Cert cert = NewCertificate(key.get(), ca.get(), ca_key.get(), kClusterName);
  if (!cert) return Internal("cannot create the cluster certificate");
  ClusterCredential c;
  c.ca_cert_pem = Pem([&](BIO* b) { return PEM_write_bio_X509(b, ca.get()); });
  c.cert_pem = Pem([&](BIO* b) { return PEM_write_bio_X509(b, cert.get()); });
  c.key_pem = Pem([&](BIO* b) {
    return PEM_write_bio_PrivateKey(b, key.get(), nullptr, nullptr, 0, nullptr, nullptr);
  });
  c.token = RandomHex(32);
  return c;
}

Status WriteClusterCredential(const std::string& path, const ClusterCredential& c) {
  const std::string text = nlohmann::json{
      {"ca_cert", c.ca_cert_pem},
      {"cert", c.cert_pem},
      {"key", c.key_pem},
      {"token", c.token}}.dump(2);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Internal("cannot write " + path);
  const bool ok = ::fchmod(fd, 0600) == 0 &&
                  ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  return ok ? Status::Ok() : Internal("cannot write " + path);
}

Result<std::shared_ptr<const ClusterCredential>> ReadClusterCredential(const std::string& path) {
  std::ifstream in(path);
  if (!in) return InvalidArgument("cannot read the cluster credential " + path);
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, false);
  auto field = [&](const char* name) {
    return j.is_object() && j.contains(name) && j[name].is_string() ? j[name].get<std::string>()
                                                                    : std::string();
  };
  auto c = std::make_shared<ClusterCredential>(
      ClusterCredential{field("ca_cert"), field("cert"), field("key"), field("token")});
  if (c->ca_cert_pem.empty() || c->cert_pem.empty() || c->key_pem.empty() || c->token.size() < 32)
    return InvalidArgument(path + " is not an nbos cluster credential (nbos credential create)");
  return std::shared_ptr<const ClusterCredential>(std::move(c));
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(
    const std::shared_ptr<const ClusterCredential>& credential, std::string who,
    std::shared_ptr<std::atomic<uint64_t>> refused) {
  if (!credential) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_root_certs = credential->ca_cert_pem;
  options.pem_key_cert_pairs.push_back({credential->key_pem, credential->cert_pem});
  auto server = grpc::SslServerCredentials(options);
  server->SetAuthMetadataProcessor(
      std::make_shared<TokenChecker>(credential->token, std::move(who), std::move(refused)));
  return server;
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(
    const std::shared_ptr<const ClusterCredential>& credential) {
  if (!credential) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = credential->ca_cert_pem;
  return grpc::CompositeChannelCredentials(
      grpc::SslCredentials(options),
      grpc::MetadataCredentialsFromPlugin(std::make_unique<TokenPlugin>(credential->token)));
}

void AddChannelArguments(const std::shared_ptr<const ClusterCredential>& credential,
                         grpc::ChannelArguments* args) {
  if (credential) args->SetSslTargetNameOverride(kClusterName);
}

}  // namespace nbos::control
