#include "control/cluster_credential.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>

#include "control/control.grpc.pb.h"

namespace nbos::control {
namespace {

// Status answers with an empty ServerStatus: a call that gets through authentication is OK.
class StatusOnly final : public Daemon::Service {
  grpc::Status Status(grpc::ServerContext*, const StatusRequest*, ServerStatus*) override {
    return grpc::Status::OK;
  }
};

class ClusterCredentialTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto c = CreateClusterCredential();
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    credential_ = std::make_shared<ClusterCredential>(*c);
    refused_ = std::make_shared<std::atomic<uint64_t>>(0);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", ServerCredentials(credential_, "test", refused_),
                             &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_TRUE(server_ != nullptr && port != 0);
    address_ = "127.0.0.1:" + std::to_string(port);
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  grpc::StatusCode Call(std::shared_ptr<grpc::ChannelCredentials> credentials,
                        const grpc::ChannelArguments& args) {
    auto stub = Daemon::NewStub(grpc::CreateCustomChannel(address_, credentials, args));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    StatusRequest request;
    ServerStatus reply;
    return stub->Status(&context, request, &reply).error_code();
  }
  grpc::ChannelArguments Args(const std::shared_ptr<const ClusterCredential>& c) {
    grpc::ChannelArguments args;
    AddChannelArguments(c, &args);
    return args;
  }

  std::shared_ptr<const ClusterCredential> credential_;
  std::shared_ptr<std::atomic<uint64_t>> refused_;
  StatusOnly service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

TEST_F(ClusterCredentialTest, AMemberGetsThrough) {
  EXPECT_EQ(Call(ChannelCredentials(credential_), Args(credential_)), grpc::StatusCode::OK);
  EXPECT_EQ(refused_->load(), 0u);
}

TEST_F(ClusterCredentialTest, TlsWithoutTheTokenIsRefusedAndCounted) {
  grpc::SslCredentialsOptions trusting;
  trusting.pem_root_certs = credential_->ca_cert_pem;
  EXPECT_EQ(Call(grpc::SslCredentials(trusting), Args(credential_)),
            grpc::StatusCode::UNAUTHENTICATED);
  auto wrong_token = std::make_shared<ClusterCredential>(*credential_);
  wrong_token->token = std::string(64, 'a');
  EXPECT_EQ(Call(ChannelCredentials(wrong_token), Args(wrong_token)),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(refused_->load(), 2u);
}

TEST_F(ClusterCredentialTest, PlaintextOrAnotherClustersCredentialCannotConnect) {
  EXPECT_EQ(Call(grpc::InsecureChannelCredentials(), grpc::ChannelArguments()),
            grpc::StatusCode::UNAVAILABLE);
  auto other = CreateClusterCredential();
  ASSERT_TRUE(other.ok());
  auto theirs = std::make_shared<ClusterCredential>(*other);
  // Their CA did not sign this server's certificate: they refuse to talk to it.
  EXPECT_EQ(Call(ChannelCredentials(theirs), Args(theirs)), grpc::StatusCode::UNAVAILABLE);
}

TEST(ClusterCredentialFileTest, RoundTripsThroughASecretFile) {
  auto c = CreateClusterCredential();
  ASSERT_TRUE(c.ok());
  const std::string path = testing::TempDir() + "/cluster.credential";
  ASSERT_TRUE(WriteClusterCredential(path, *c).ok());
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto read = ReadClusterCredential(path);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ((*read)->token, c->token);
  EXPECT_EQ((*read)->cert_pem, c->cert_pem);
  EXPECT_EQ(c->token.size(), 64u);
  std::filesystem::remove(path);
  EXPECT_EQ(ReadClusterCredential(path).status().code(), StatusCode::kInvalidArgument);
  const std::string bogus = testing::TempDir() + "/bogus.credential";
  ASSERT_TRUE(WriteClusterCredential(bogus, {"x", "y", "z", "short"}).ok());
  EXPECT_EQ(ReadClusterCredential(bogus).status().code(), StatusCode::kInvalidArgument);
  std::filesystem::remove(bogus);
}

}  // namespace
}  // namespace nbos::control
