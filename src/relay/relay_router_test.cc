#include "relay/relay_router.h"

#include <gtest/gtest.h>

namespace nbos::relay {
namespace {

using jupyter::Channel;
using jupyter::Json;
using jupyter::Message;
using jupyter::WsMessage;

Message Request(const std::string& type, const std::string& id, std::string identity) {
  Message m;
  m.identities = {std::move(identity)};
  m.header = Json{{"msg_type", type}, {"msg_id", id}, {"session", "client"}};
  return m;
}

WsMessage FromGateway(Channel channel, const std::string& type, const std::string& parent_id) {
  WsMessage ws;
  ws.channel = channel;
  ws.message.header = Json{{"msg_type", type}, {"msg_id", "k-" + type}, {"session", "ksession"}};
  ws.message.parent_header = Json{{"msg_id", parent_id}};
  return ws;
}

TEST(RelayRouterTest, RepliesGoBackToTheRequesterOnItsSocket) {
  RelayRouter router;
  auto a = router.FromClient(Socket::kShell, Request("execute_request", "e1", "client-a"));
  ASSERT_EQ(a.kind, ClientAction::Kind::kForward);
  EXPECT_EQ(a.forward.channel, Channel::kShell);
  EXPECT_TRUE(a.forward.message.identities.empty());
  EXPECT_EQ(a.forward.message.msg_id(), "e1");
  auto b = router.FromClient(Socket::kControl, Request("kernel_info_request", "k1", "client-b"));
  EXPECT_EQ(b.forward.channel, Channel::kControl);
  EXPECT_EQ(router.pending(), 2u);

  // The reply's socket is the request's, whatever channel the gateway used.
  auto d = router.FromKernel(FromGateway(Channel::kShell, "kernel_info_reply", "k1"));
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->socket, Socket::kControl);
  EXPECT_EQ(d->message.identities, std::vector<std::string>{"client-b"});
  EXPECT_EQ(d->message.msg_type(), "kernel_info_reply");
  // Exactly one reply per request.
  EXPECT_FALSE(router.FromKernel(FromGateway(Channel::kShell, "kernel_info_reply", "k1")));

  d = router.FromKernel(FromGateway(Channel::kShell, "execute_reply", "e1"));
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->socket, Socket::kShell);
  EXPECT_EQ(d->message.identities, std::vector<std::string>{"client-a"});
  EXPECT_EQ(router.pending(), 0u);
}

TEST(RelayRouterTest, InputRequestGoesToTheShellRequesterOnStdin) {
  RelayRouter router;
  router.FromClient(Socket::kShell, Request("execute_request", "e1", "client-a"));
  auto d = router.FromKernel(FromGateway(Channel::kStdin, "input_request", "e1"));
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->socket, Socket::kStdin);
  EXPECT_EQ(d->message.identities, std::vector<std::string>{"client-a"});
  // The execute_request is still waiting for its reply (and maybe another input_request).
  EXPECT_EQ(router.pending(), 1u);

  Message reply = Request("input_reply", "i1", "client-a");
  reply.parent_header = Json{{"msg_id", "k-input_request"}};
  auto a = router.FromClient(Socket::kStdin, reply);
  ASSERT_EQ(a.kind, ClientAction::Kind::kForward);
  EXPECT_EQ(a.forward.channel, Channel::kStdin);
  EXPECT_EQ(router.pending(), 1u);

  EXPECT_FALSE(router.FromKernel(FromGateway(Channel::kStdin, "input_request", "unknown")));
}

TEST(RelayRouterTest, InputReplyWithoutParentGetsTheInputRequestAsParent) {
  RelayRouter router;
  router.FromClient(Socket::kShell, Request("execute_request", "e1", "client-a"));
  auto d = router.FromKernel(FromGateway(Channel::kStdin, "input_request", "e1"));
  ASSERT_TRUE(d.has_value());
  auto a = router.FromClient(Socket::kStdin, Request("input_reply", "i1", "client-a"));
  EXPECT_EQ(a.forward.message.parent_msg_id(), "k-input_request");
  // Only once, and only for that client.
  a = router.FromClient(Socket::kStdin, Request("input_reply", "i2", "client-a"));
  EXPECT_TRUE(a.forward.message.parent_header.empty());
  router.FromKernel(FromGateway(Channel::kStdin, "input_request", "e1"));
  a = router.FromClient(Socket::kStdin, Request("input_reply", "i3", "client-b"));
  EXPECT_TRUE(a.forward.message.parent_header.empty());
}

TEST(RelayRouterTest, IopubIsPublishedWithATopic) {
  RelayRouter router;
  auto d = router.FromKernel(FromGateway(Channel::kIopub, "stream", "anything"));
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->socket, Socket::kIopub);
  EXPECT_EQ(d->message.identities, std::vector<std::string>{"kernel.ksession.stream"});
}

TEST(RelayRouterTest, RepliesNobodyHereAskedForAreDropped) {
  RelayRouter router;
  EXPECT_FALSE(router.FromKernel(FromGateway(Channel::kShell, "kernel_info_reply", "other")));
  EXPECT_FALSE(router.FromKernel(FromGateway(Channel::kControl, "interrupt_reply", "")));
}

TEST(RelayRouterTest, ShutdownIsHandledLocally) {
  RelayRouter router;
  Message m = Request("shutdown_request", "s1", "client-a");
  auto a = router.FromClient(Socket::kControl, m);
  EXPECT_EQ(a.kind, ClientAction::Kind::kShutdown);
  EXPECT_FALSE(a.restart);
  m.content = Json{{"restart", true}};
  a = router.FromClient(Socket::kShell, m);
  EXPECT_EQ(a.kind, ClientAction::Kind::kShutdown);
  EXPECT_TRUE(a.restart);
  EXPECT_EQ(router.pending(), 0u);
}

TEST(RelayRouterTest, InterruptAndCommMessagesAreForwarded) {
  RelayRouter router;
  auto a = router.FromClient(Socket::kControl, Request("interrupt_request", "i1", "c"));
  EXPECT_EQ(a.kind, ClientAction::Kind::kForward);
  EXPECT_EQ(a.forward.channel, Channel::kControl);
  EXPECT_EQ(router.pending(), 1u);
  // No reply comes for comm messages: nothing is remembered.
  a = router.FromClient(Socket::kShell, Request("comm_msg", "c1", "c"));
  EXPECT_EQ(a.kind, ClientAction::Kind::kForward);
  EXPECT_EQ(router.pending(), 1u);
}

TEST(RelayRouterTest, PendingRequestsAreBounded) {
  RelayRouter router(3);
  for (int i = 0; i < 5; ++i) {
    router.FromClient(Socket::kShell,
                      Request("execute_request", "e" + std::to_string(i), "c" + std::to_string(i)));
  }
  EXPECT_EQ(router.pending(), 3u);
  EXPECT_FALSE(router.FromKernel(FromGateway(Channel::kShell, "execute_reply", "e0")));
  EXPECT_FALSE(router.FromKernel(FromGateway(Channel::kShell, "execute_reply", "e1")));
  auto d = router.FromKernel(FromGateway(Channel::kShell, "execute_reply", "e4"));
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->message.identities, std::vector<std::string>{"c4"});
  // A repeated msg_id replaces the older entry instead of leaking it.
  router.FromClient(Socket::kShell, Request("execute_request", "e2", "again"));
  EXPECT_EQ(router.pending(), 2u);
  d = router.FromKernel(FromGateway(Channel::kShell, "execute_reply", "e2"));
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->message.identities, std::vector<std::string>{"again"});
}

}  // namespace
}  // namespace nbos::relay
