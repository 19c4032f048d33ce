#include "replica/replica_gate.h"

#include <gtest/gtest.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <filesystem>

#include "replication/fixture_cluster.h"

namespace nbos::replica {
namespace {

class ReplicaGateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = std::filesystem::temp_directory_path() /
            ("nbos-gate-" + std::to_string(getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_ / "blobs");
    options_.replica_id = 1;
    options_.raft_address = "127.0.0.1:" + std::to_string(replication::FreeLoopbackPortPair());
    options_.peers = {{1, options_.raft_address}};
    options_.data_dir = (root_ / "data").string();
    options_.blob_store_url = (root_ / "blobs").string();
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  std::filesystem::path root_;
  ReplicaOptions options_;
};

TEST_F(ReplicaGateTest, AGateStartedInTheBackgroundServesOnceStarted) {
  std::unique_ptr<ExecutionGate> gate = ReplicaGate::StartInBackground(options_);
  // The first call waits for the start; the checkpoint lands in the blob store it opened.
  auto key = gate->SaveCheckpoint();
  ASSERT_TRUE(key.ok()) << key.status().ToString();
  EXPECT_FALSE(key->empty());
  EXPECT_TRUE(std::filesystem::exists(options_.data_dir));
  gate.reset();
}

TEST_F(ReplicaGateTest, AGateWhoseBackgroundStartFailedEndsTheProcessSayingWhy) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  options_.blob_store_url = "ftp://nowhere";
  EXPECT_EXIT(
      {
        // The child ran SetUp under its own pid and ends without TearDown; the start fails on
        // the store URL before anything is written.
        std::filesystem::remove_all(root_);
        spdlog::set_default_logger(spdlog::stderr_logger_st("gate-test"));
        std::unique_ptr<ExecutionGate> gate = ReplicaGate::StartInBackground(options_);
        gate->Pump();
      },
      ::testing::ExitedWithCode(1), "unsupported blob store URL");
}

}  // namespace
}  // namespace nbos::replica
