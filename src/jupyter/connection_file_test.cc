#include "jupyter/connection_file.h"

#include <gtest/gtest.h>

namespace nbos::jupyter {
namespace {

constexpr char kFile[] = R"({
  "shell_port": 5001, "iopub_port": 5002, "stdin_port": 5003, "control_port": 5004,
  "hb_port": 5005, "ip": "127.0.0.1", "key": "a0436f6c-1916-498b-8eb9-e81ab9368e84",
  "transport": "tcp", "signature_scheme": "hmac-sha256", "kernel_name": "nbos"
})";

TEST(ConnectionFileTest, ParsesJupyterClientFile) {
  auto info = ParseConnectionInfo(kFile);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->shell_port, 5001);
  EXPECT_EQ(info->hb_port, 5005);
  EXPECT_EQ(info->key, "a0436f6c-1916-498b-8eb9-e81ab9368e84");
  EXPECT_EQ(info->kernel_name, "nbos");
  EXPECT_EQ(info->Endpoint(info->iopub_port), "tcp://127.0.0.1:5002");
}

TEST(ConnectionFileTest, RoundTrip) {
  auto info = *ParseConnectionInfo(kFile);
  auto again = ParseConnectionInfo(ConnectionInfoToJson(info));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->control_port, info.control_port);
  EXPECT_EQ(again->key, info.key);
}

TEST(ConnectionFileTest, IpcEndpointsFollowJupyterClient) {
  ConnectionInfo info;
  info.transport = "ipc";
  info.ip = "/tmp/kernel";
  EXPECT_EQ(info.Endpoint(3), "ipc:///tmp/kernel-3");
}

TEST(ConnectionFileTest, ErrorsNameTheProblem) {
  auto missing = ParseConnectionInfo(R"({"shell_port": 1})");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("iopub_port"), std::string::npos);
  EXPECT_FALSE(ParseConnectionInfo("[]").ok());
  EXPECT_FALSE(ParseConnectionInfo("{").ok());
  EXPECT_FALSE(ParseConnectionInfo(R"({"shell_port":1,"iopub_port":2,"stdin_port":3,
      "control_port":4,"hb_port":99999})")
                   .ok());
  EXPECT_FALSE(ParseConnectionInfo(R"({"shell_port":1,"iopub_port":2,"stdin_port":3,
      "control_port":4,"hb_port":5,"transport":"udp"})")
                   .ok());
  EXPECT_EQ(ReadConnectionFile("/nonexistent/kernel.json").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace nbos::jupyter
