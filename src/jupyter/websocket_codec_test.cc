#include "jupyter/websocket_codec.h"

#include <gtest/gtest.h>

namespace nbos::jupyter {
namespace {

WsMessage Sample() {
  MessageFactory f("s", "u");
  WsMessage m;
  m.channel = Channel::kIopub;
  m.message = f.Make("comm_msg", Json{{"comm_id", "c1"}, {"data", {{"x", 1}}}},
                     Json{{"msg_id", "parent-1"}});
  return m;
}

TEST(WebsocketCodecTest, TextRoundTrip) {
  WsMessage m = Sample();
  bool binary = true;
  std::string frame = EncodeWs(m, &binary);
  EXPECT_FALSE(binary);
  Json j = Json::parse(frame);
  EXPECT_EQ(j["channel"], "iopub");
  EXPECT_EQ(j["msg_type"], "comm_msg");
  EXPECT_EQ(j["msg_id"], m.message.msg_id());
  EXPECT_EQ(j["buffers"], Json::array());
  auto decoded = DecodeWs(frame, false);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(decoded->channel, Channel::kIopub);
  EXPECT_EQ(decoded->message.content, m.message.content);
  EXPECT_EQ(decoded->message.parent_msg_id(), "parent-1");
}

TEST(WebsocketCodecTest, BinaryRoundTripWithBuffers) {
  WsMessage m = Sample();
  m.message.buffers = {std::string("\x00\xff", 2), "", "abc"};
  bool binary = false;
  std::string frame = EncodeWs(m, &binary);
  EXPECT_TRUE(binary);
  // Big-endian count = 1 + number of buffers.
  EXPECT_EQ(frame.substr(0, 4), std::string("\x00\x00\x00\x04", 4));
  auto decoded = DecodeWs(frame, true);
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(decoded->message.buffers, m.message.buffers);
  EXPECT_EQ(decoded->message.content, m.message.content);
}

TEST(WebsocketCodecTest, MissingChannelMeansShell) {
  auto d =
      DecodeWs(R"({"header":{"msg_type":"kernel_info_request","msg_id":"1"},"content":{}})", false);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->channel, Channel::kShell);
}

TEST(WebsocketCodecTest, MalformedFramesAreErrors) {
  EXPECT_FALSE(DecodeWs("", false).ok());
  EXPECT_FALSE(DecodeWs("[]", false).ok());
  EXPECT_FALSE(DecodeWs(R"({"header":{"msg_type":"x"},"channel":"bogus"})", false).ok());
  EXPECT_FALSE(DecodeWs(R"({"header":5})", false).ok());
  EXPECT_FALSE(DecodeWs(R"({"header":{}})", false).ok());
  EXPECT_FALSE(DecodeWs(std::string("\x00\x00\x00\x02\x00\x00\x00\x0c", 8), true).ok());
  EXPECT_FALSE(DecodeWs(std::string("\xff\xff\xff\xff\x00\x00\x00\x08", 8), true).ok());
  // Offsets out of order.
  std::string bad("\x00\x00\x00\x02\x00\x00\x00\x10\x00\x00\x00\x0c{}", 14);
  EXPECT_FALSE(DecodeWs(bad, true).ok());
}

TEST(WebsocketCodecTest, OversizedRejected) {
  WsLimits limits;
  limits.max_message_bytes = 10;
  EXPECT_EQ(DecodeWs(std::string(11, ' '), false, limits).status().code(),
            StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace nbos::jupyter
