#include "jupyter/message.h"

#include <gtest/gtest.h>

namespace nbos::jupyter {
namespace {

std::chrono::system_clock::time_point FixedTime() {
  return std::chrono::system_clock::time_point{std::chrono::seconds{1704067200}};
}

TEST(MessageTest, HeadersCarrySessionUniqueIdsAndInjectedDate) {
  MessageFactory f("sess", "ada", FixedTime);
  Json a = f.NewHeader("status");
  Json b = f.NewHeader("status");
  EXPECT_NE(a["msg_id"], b["msg_id"]);
  EXPECT_EQ(a["session"], "sess");
  EXPECT_EQ(a["username"], "ada");
  EXPECT_EQ(a["date"], "2024-01-01T00:00:00.000000Z");
  EXPECT_EQ(a["version"], "5.3");
  EXPECT_EQ(a["msg_type"], "status");
}

TEST(MessageTest, ReplyKeepsParentHeaderAndRouting) {
  MessageFactory client("client", "u", FixedTime);
  MessageFactory kernel("kernel", "u", FixedTime);
  Message request = client.Make("complete_request", Json{{"code", "x"}}, Json::object());
  request.identities = {"peer-a", "peer-b"};
  Message reply = kernel.Reply(request, "complete_reply", Json{{"status", "ok"}});
  EXPECT_EQ(reply.parent_header, request.header);
  EXPECT_EQ(reply.identities, request.identities);
  EXPECT_EQ(reply.parent_msg_id(), request.msg_id());
  EXPECT_EQ(reply.header["session"], "kernel");
}

TEST(MessageTest, AccessorsTolerateMissingOrMistypedFields) {
  Message m;
  m.header = Json{{"msg_type", 5}};
  EXPECT_EQ(m.msg_type(), "");
  EXPECT_EQ(m.msg_id(), "");
  m.parent_header = Json::array();
  EXPECT_EQ(m.parent_msg_id(), "");
}

TEST(MessageTest, ChannelNamesRoundTrip) {
  for (Channel c : {Channel::kShell, Channel::kControl, Channel::kIopub, Channel::kStdin}) {
    Channel parsed;
    ASSERT_TRUE(ParseChannel(ChannelName(c), &parsed));
    EXPECT_EQ(parsed, c);
  }
  Channel ignored;
  EXPECT_FALSE(ParseChannel("heartbeat", &ignored));
}

}  // namespace
}  // namespace nbos::jupyter
