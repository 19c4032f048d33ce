#include "gateway/output_merger.h"

#include <gtest/gtest.h>

namespace nbos::gateway {
namespace {

using jupyter::Json;
using jupyter::Message;

Message Msg(const std::string& type, const std::string& parent, Json content = Json::object(),
            Json metadata = Json::object()) {
  static int n = 0;
  Message m;
  m.header = Json{{"msg_id", "m" + std::to_string(++n)}, {"msg_type", type}};
  m.parent_header = parent.empty() ? Json::object() : Json{{"msg_id", parent}};
  m.content = std::move(content);
  m.metadata = std::move(metadata);
  return m;
}
Message Status(const std::string& parent, const std::string& state) {
  return Msg("status", parent, Json{{"execution_state", state}});
}
Message Reply(const std::string& parent, const std::string& role) {
  return Msg("execute_reply", parent, Json{{"status", "ok"}}, Json{{"nbos", {{"role", role}}}});
}
std::vector<std::string> Types(const std::vector<Message>& ms) {
  std::vector<std::string> out;
  for (const auto& m : ms) {
    out.push_back(m.msg_type() == "status" ? m.content["execution_state"].get<std::string>()
                                           : m.msg_type());
  }
  return out;
}

// Feeds a sequence of (replica, message, is_reply) and collects everything forwarded.
struct Feed {
  OutputMerger merger;
  std::vector<Message> out;
  void Reply(ReplicaId r, Message m) {
    for (auto& x : merger.OnReply(r, std::move(m))) out.push_back(std::move(x));
  }
  void Iopub(ReplicaId r, Message m) {
    for (auto& x : merger.OnIopub(r, std::move(m))) out.push_back(std::move(x));
  }
  void Lost(ReplicaId r) {
    for (auto& x : merger.OnReplicaLost(r)) out.push_back(std::move(x));
  }
};

TEST(OutputMergerTest, ExecuteForwardsTheExecutorsMessagesOnceInOrder) {
  Feed run;
  run.merger.Expect("e1", {1, 2, 3});
  for (ReplicaId r : {1u, 2u, 3u}) run.Iopub(r, Status("e1", "busy"));
  run.Iopub(2, Msg("execute_input", "e1"));
  run.Iopub(2, Msg("stream", "e1"));
  run.Reply(2, Reply("e1", "executor"));
  run.Iopub(1, Status("e1", "idle"));  // a standby's idle before the executor's
  run.Iopub(2, Status("e1", "idle"));
  run.Reply(1, Reply("e1", "standby"));
  run.Reply(3, Reply("e1", "standby"));
  run.Iopub(3, Status("e1", "idle"));
  EXPECT_EQ(Types(run.out),
            (std::vector<std::string>{"busy", "execute_input", "stream", "execute_reply", "idle"}));
  EXPECT_EQ(run.merger.AnsweredBy("e1"), 2u);
  EXPECT_EQ(run.merger.primary(), 2u);
  EXPECT_EQ(run.merger.pending(), 0u);
}

TEST(OutputMergerTest, IdleWaitsForTheAnsweringReplicasReply) {
  Feed run;
  run.merger.Expect("e1", {1, 2, 3});
  run.Iopub(1, Status("e1", "busy"));
  run.Iopub(1, Status("e1", "idle"));  // idle overtook the reply on another socket
  EXPECT_EQ(Types(run.out), (std::vector<std::string>{"busy"}));
  run.Reply(1, Reply("e1", "executor"));
  EXPECT_EQ(Types(run.out), (std::vector<std::string>{"busy", "execute_reply", "idle"}));
}

TEST(OutputMergerTest, WhenNobodyExecutesOneReplyAnswersAfterAllReplied) {
  Feed run;
  run.merger.Expect("e1", {1, 2, 3});
  run.Iopub(1, Status("e1", "busy"));
  run.Reply(1, Reply("e1", "standby"));
  run.Iopub(1, Status("e1", "idle"));
  run.Reply(2, Reply("e1", "standby"));
  EXPECT_EQ(Types(run.out), (std::vector<std::string>{"busy"}));
  run.Reply(3, Reply("e1", "standby"));
  EXPECT_EQ(Types(run.out), (std::vector<std::string>{"busy", "execute_reply", "idle"}));
}

TEST(OutputMergerTest, ExecutorLostMidCellLetsAStandbyAnswer) {
  Feed run;
  run.merger.Expect("e1", {1, 2, 3});
  for (ReplicaId r : {1u, 2u, 3u}) run.Iopub(r, Status("e1", "busy"));
  run.Iopub(3, Msg("stream", "e1"));
  run.Reply(1, Reply("e1", "standby"));  // ExecutorLost error from a standby
  run.Iopub(1, Status("e1", "idle"));
  run.Lost(3);
  run.Reply(2, Reply("e1", "standby"));
  EXPECT_EQ(Types(run.out), (std::vector<std::string>{"busy", "stream", "execute_reply", "idle"}));
}

TEST(OutputMergerTest, AnsweringReplicaLostBeforeIdleClosesWithAnotherIdle) {
  Feed run;
  run.merger.Expect("k1", {1});
  run.Iopub(1, Status("k1", "busy"));
  run.Reply(1, Msg("kernel_info_reply", "k1"));
  run.Lost(1);
  EXPECT_EQ(run.merger.pending(), 1u);  // nothing else will say idle; the gateway times it out
  Feed run2;
  run2.merger.Expect("e1", {1, 2});
  run2.Iopub(2, Status("e1", "busy"));
  run2.Reply(2, Reply("e1", "executor"));
  run2.Iopub(1, Status("e1", "idle"));
  run2.Lost(2);
  EXPECT_EQ(Types(run2.out), (std::vector<std::string>{"busy", "execute_reply", "idle"}));
}

TEST(OutputMergerTest, UnparentedMessagesComeFromThePrimaryOnly) {
  Feed run;
  run.merger.SetPrimary(2);
  run.Iopub(1, Status("", "starting"));
  run.Iopub(2, Status("", "starting"));
  run.Iopub(3, Msg("stream", "old-request"));
  EXPECT_EQ(run.out.size(), 1u);
}

TEST(OutputMergerTest, LateDuplicatesOfFinishedRequestsAreDropped) {
  Feed run;
  run.merger.SetPrimary(1);
  run.merger.Expect("e1", {1, 2});
  run.Iopub(1, Status("e1", "busy"));
  run.Reply(1, Reply("e1", "executor"));
  run.Iopub(1, Status("e1", "idle"));
  const size_t forwarded = run.out.size();
  run.Reply(2, Reply("e1", "standby"));
  run.Iopub(2, Status("e1", "idle"));
  run.Reply(1, Reply("e1", "executor"));
  EXPECT_EQ(run.out.size(), forwarded);
}

}  // namespace
}  // namespace nbos::gateway
