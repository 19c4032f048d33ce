#include "gateway/client_validation.h"

#include <gtest/gtest.h>

namespace nbos::gateway {
namespace {

using jupyter::Json;

std::string Frame(const std::string& channel, const std::string& type, Json content,
                  Json metadata = Json::object()) {
  return Json{{"channel", channel},
              {"header",
               {{"msg_id", "m1"},
                {"msg_type", type},
                {"session", "s"},
                {"username", "u"},
                {"version", "5.3"},
                {"date", "2024-01-01T00:00:00.000000Z"}}},
              {"parent_header", Json::object()},
              {"metadata", metadata},
              {"content", content},
              {"buffers", Json::array()}}
      .dump();
}

// nullopt: accepted; else the class of the refusal (frame or message level).
std::optional<RejectClass> Check(const std::string& payload, bool binary = false,
                                 ClientLimits limits = {}) {
  auto decoded = DecodeClientFrame(payload, binary, limits);
  if (auto* bad = std::get_if<FrameRejection>(&decoded)) return bad->rejection.reason;
  const ClientInput& in = std::get<ClientInput>(decoded);
  if (in.rejection) return in.rejection->reason;
  auto r = ValidateClientMessage(in.message, limits);
  return r ? std::optional<RejectClass>(r->reason) : std::nullopt;
}

TEST(ClientValidation, AcceptsWhatJupyterClientsSend) {
  // jupyter_client / JupyterLab / jupyter_server, as they send them.
  EXPECT_EQ(Check(Frame("shell", "execute_request",
                        {{"code", "1"},
                         {"silent", false},
                         {"store_history", true},
                         {"user_expressions", {{"x", "1+1"}}},
                         {"allow_stdin", true},
                         {"stop_on_error", true}},
                        {{"cellId", "abc"}, {"deletedCells", Json::array()}})),
            std::nullopt);
  EXPECT_EQ(Check(Frame("shell", "kernel_info_request", Json::object())), std::nullopt);
  EXPECT_EQ(Check(Frame("control", "kernel_info_request", Json::object())), std::nullopt);
  EXPECT_EQ(Check(Frame("shell", "complete_request", {{"code", "pri"}, {"cursor_pos", 3}})),
            std::nullopt);
  EXPECT_EQ(Check(Frame("shell", "inspect_request",
                        {{"code", "x"}, {"cursor_pos", 1}, {"detail_level", 0}})),
            std::nullopt);
  EXPECT_EQ(
      Check(Frame("shell", "history_request",
                  {{"raw", true}, {"output", false}, {"hist_access_type", "tail"}, {"n", 1000}})),
      std::nullopt);
  EXPECT_EQ(Check(Frame("shell", "is_complete_request", {{"code", "for x in y:"}})), std::nullopt);
  EXPECT_EQ(Check(Frame("shell", "comm_info_request", {{"target_name", "jupyter.widget"}})),
            std::nullopt);
  EXPECT_EQ(Check(Frame("shell", "comm_open",
                        {{"comm_id", "c"},
                         {"target_name", "t"},
                         {"data", Json::object()},
                         {"target_module", nullptr}})),
            std::nullopt);
  EXPECT_EQ(Check(Frame("shell", "comm_msg", {{"comm_id", "c"}, {"data", {{"method", "x"}}}})),
            std::nullopt);
  EXPECT_EQ(Check(Frame("stdin", "input_reply", {{"value", "yes"}})), std::nullopt);
  EXPECT_EQ(Check(Frame("control", "interrupt_request", Json::object())), std::nullopt);
  EXPECT_EQ(Check(Frame("control", "shutdown_request", {{"restart", false}})), std::nullopt);
  EXPECT_EQ(Check(Frame("shell", "execute_request", {{"code", "1"}},
                        {{"nbos", {{"gpus", 2}, {"target_replica", 3}}}})),
            std::nullopt);
  // No channel means shell; msg_id and msg_type at the top level only are accepted too.
  EXPECT_EQ(Check(R"({"msg_id":"a","msg_type":"kernel_info_request","header":{},"content":{}})"),
            std::nullopt);
}

TEST(ClientValidation, RefusesFramesThatAreNoMessage) {
  EXPECT_EQ(Check("not json"), RejectClass::kFrame);
  EXPECT_EQ(Check("[]"), RejectClass::kFrame);
  EXPECT_EQ(Check(R"({"header":{"msg_type":"x"}})"), RejectClass::kFrame);  // no msg_id
  EXPECT_EQ(Check(R"({"header":{"msg_id":"a","msg_type":""}})"), RejectClass::kFrame);
  EXPECT_EQ(Check(R"({"header":[]})"), RejectClass::kFrame);
  EXPECT_EQ(Check(std::string("\x00\x00\x00\x01", 4), true), RejectClass::kFrame);
  ClientLimits small;
  small.max_message_bytes = 100;
  auto decoded = DecodeClientFrame(std::string(101, ' '), false, small);
  ASSERT_TRUE(std::holds_alternative<FrameRejection>(decoded));
  EXPECT_EQ(std::get<FrameRejection>(decoded).close_code, 1009);
  EXPECT_EQ(std::get<FrameRejection>(decoded).rejection.reason, RejectClass::kTooLarge);
  const std::string deep = R"({"header":{"msg_id":"a","msg_type":"b"},"x":)" +
                           std::string(101, '[') + std::string(101, ']') + "}";
  EXPECT_EQ(Check(deep), RejectClass::kTooDeep);
}

TEST(ClientValidation, BinaryFramesCarryTheirBuffers) {
  const std::string json = Frame("shell", "comm_msg", {{"comm_id", "c"}, {"data", Json::object()}});
  std::string frame;
  auto u32 = [&](uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) frame.push_back(static_cast<char>(v >> s));
  };
  u32(3);
  u32(16);
  u32(16 + static_cast<uint32_t>(json.size()));
  u32(16 + static_cast<uint32_t>(json.size()) + 3);
  frame += json + "abc" + "defg";
  auto decoded = DecodeClientFrame(frame, true, {});
  ASSERT_TRUE(std::holds_alternative<ClientInput>(decoded));
  const auto& buffers = std::get<ClientInput>(decoded).message.message.buffers;
  ASSERT_EQ(buffers.size(), 2u);
  EXPECT_EQ(buffers[0], "abc");
  EXPECT_EQ(buffers[1], "defg");
}

TEST(ClientValidation, RefusesWrongFieldsTypesAndChannels) {
  EXPECT_EQ(Check(Frame("shell", "execute_request", {{"code", "1"}, {"stop_on_error", "yes"}})),
            RejectClass::kField);
  EXPECT_EQ(Check(Frame("shell", "execute_request", {{"code", "1"}, {"silent", 1}})),
            RejectClass::kField);
  EXPECT_EQ(Check(Frame("control", "shutdown_request", {{"restart", "true"}})),
            RejectClass::kField);
  EXPECT_EQ(Check(Frame("stdin", "input_reply", {{"value", 42}})), RejectClass::kField);
  EXPECT_EQ(Check(Frame("shell", "comm_open", {{"comm_id", "c"}})), RejectClass::kField);
  EXPECT_EQ(Check(Frame("bogus", "execute_request", {{"code", "1"}})), RejectClass::kChannel);
  EXPECT_EQ(Check(Frame("iopub", "stream", {{"name", "stdout"}})), RejectClass::kMsgType);
  EXPECT_EQ(Check(Frame("shell", "input_reply", {{"value", "x"}})), RejectClass::kChannel);
  EXPECT_EQ(Check(Frame("control", "nbos_membership_request", {{"op", "remove"}})),
            RejectClass::kMsgType);
  EXPECT_EQ(Check(Frame("shell", "execute_request", {{"code", "1"}}, {{"nbos", {{"gpus", 5000}}}})),
            RejectClass::kResources);
  EXPECT_EQ(Check(Frame("shell", "execute_request", {{"code", "1"}}, {{"nbos", {{"gpus", 1.5}}}})),
            RejectClass::kResources);
  EXPECT_EQ(Check(Frame("shell", "execute_request", {{"code", "1"}},
                        {{"nbos", {{"target_replica", "one"}}}})),
            RejectClass::kField);
  EXPECT_EQ(Check(R"({"header":{"msg_id":"a","msg_type":"kernel_info_request","date":1}})"),
            RejectClass::kField);
  EXPECT_EQ(Check(Frame("shell", "execute_request", {{"code", "1"}})
                      .replace(0, 1, R"({"header_extra":1,)")),
            std::nullopt);  // unknown top-level keys are ignored
}

TEST(ClientValidation, EveryRejectClassHasAName) {
  std::set<std::string> names;
  for (RejectClass r : kAllRejectClasses) names.insert(RejectClassName(r));
  EXPECT_EQ(names.size(), std::size(kAllRejectClasses));
}

}  // namespace
}  // namespace nbos::gateway
