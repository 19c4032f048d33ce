#include "replica/proposal_router.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <future>
#include <map>
#include <mutex>
#include <zmq.hpp>
#include <zmq_addon.hpp>

namespace nbos::replica {

namespace {

using namespace std::chrono_literals;

// How long a member serving a forwarded proposal waits for its commit before answering.
constexpr auto kServeCommitTimeout = 10s;

// Proposes every command (they go out as one batch) and waits for the last one's commit.
Result<uint64_t> ProposeLocally(replication::RaftNode* node, std::vector<std::string> commands,
                                std::chrono::milliseconds timeout) {
  if (commands.empty()) return InvalidArgument("nothing to propose");
  auto promise = std::make_shared<std::promise<Result<uint64_t>>>();
  auto future = promise->get_future();
  // Entries commit in order, so the first failure (or the last success) decides.
  auto failed = std::make_shared<std::atomic<bool>>(false);
  for (size_t i = 0; i < commands.size(); ++i) {
    const bool last = i + 1 == commands.size();
    node->Propose(std::move(commands[i]), [promise, failed, last](Result<uint64_t> r) {
      if (!r.ok()) {
        if (!failed->exchange(true)) promise->set_value(r);
      } else if (last && !failed->load()) {
        promise->set_value(r);
      }
    });
  }
  if (future.wait_for(timeout) != std::future_status::ready) {
    // The callbacks still fire later; the shared promise outlives this call.
    return Unavailable("proposal not committed within " + std::to_string(timeout.count()) + " ms");
  }
  return future.get();
}

}  // namespace

std::string PeerEndpointFor(const std::string& raft_address) {
  size_t colon = raft_address.rfind(':');
  if (colon == std::string::npos || colon + 1 >= raft_address.size()) return {};
  int port = 0;
  try {
    port = std::stoi(raft_address.substr(colon + 1));
  } catch (const std::exception&) {
    return {};
  }
  if (port <= 0 || port >= 65535) return {};
  return "tcp://" + raft_address.substr(0, colon) + ":" + std::to_string(port + 1);
}

struct ProposalRouter::Impl {
  replication::RaftNode* node = nullptr;
  std::string self_address;
  zmq::context_t ctx{1};
  zmq::socket_t server;
  std::thread serve_thread;
  std::mutex client_mu;                          // serialises Propose
  std::map<std::string, zmq::socket_t> clients;  // by peer endpoint
  uint64_t next_seq = 0;
  std::atomic<uint64_t>* served = nullptr;

  void Serve() {
    for (;;) {
      std::vector<zmq::message_t> parts;
      try {
        if (!zmq::recv_multipart(server, std::back_inserter(parts))) continue;
      } catch (const zmq::error_t& e) {
        if (e.num() == EINTR) continue;
        return;  // ETERM: stopping
      }
      // [identity, seq, command...] -> [identity, seq, "ok"|"error", last index|message]
      // [identity, seq, "", "transfer", id] -> [identity, seq, "ok"|"error", message]
      if (parts.size() < 3) continue;
      std::string status, body;
      if (parts.size() == 5 && parts[2].size() == 0 && parts[3].to_string() == "transfer") {
        Status s = TransferLocally(std::strtoull(parts[4].to_string().c_str(), nullptr, 10));
        status = s.ok() ? "ok" : "error";
        body = s.message();
      } else {
        std::vector<std::string> commands;
        for (size_t i = 2; i < parts.size(); ++i) commands.push_back(parts[i].to_string());
        auto result = ProposeLocally(
            node, std::move(commands),
            std::chrono::duration_cast<std::chrono::milliseconds>(kServeCommitTimeout));
        ++*served;
        status = result.ok() ? "ok" : "error";
        body = result.ok() ? std::to_string(*result) : result.status().message();
      }
      std::array<zmq::const_buffer, 4> reply;
      reply = {zmq::buffer(parts[0].data(), parts[0].size()),
               zmq::buffer(parts[1].data(), parts[1].size()), zmq::buffer(status),
               zmq::buffer(body)};
      try {
        zmq::send_multipart(server, reply);
      } catch (const zmq::error_t&) {
        return;
      }
    }
  }

  Status TransferLocally(replication::ServerId to) {
    if (to == 0) return InvalidArgument("no transfer target");
    auto promise = std::make_shared<std::promise<Status>>();
    auto future = promise->get_future();
    node->TransferLeadership(to, [promise](Status s) { promise->set_value(std::move(s)); });
    if (future.wait_for(kServeCommitTimeout) != std::future_status::ready) {
      return Unavailable("leadership transfer did not finish in time");
    }
    return future.get();
  }

  zmq::socket_t& ClientFor(const std::string& endpoint) {
    auto it = clients.find(endpoint);
    if (it == clients.end()) {
      zmq::socket_t s(ctx, zmq::socket_type::dealer);
      s.set(zmq::sockopt::linger, 0);
      s.connect(endpoint);
      it = clients.emplace(endpoint, std::move(s)).first;
    }
    return it->second;
  }
};

ProposalRouter::ProposalRouter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  impl_->served = &served_;
}

Result<std::unique_ptr<ProposalRouter>> ProposalRouter::Start(replication::RaftNode* node,
                                                              const std::string& raft_address) {
  std::string endpoint = PeerEndpointFor(raft_address);
  if (endpoint.empty()) return InvalidArgument("bad raft address '" + raft_address + "'");
  auto impl = std::make_unique<Impl>();
  impl->node = node;
  impl->self_address = raft_address;
  try {
    impl->server = zmq::socket_t(impl->ctx, zmq::socket_type::router);
    impl->server.set(zmq::sockopt::linger, 0);
    impl->server.bind(endpoint);
  } catch (const zmq::error_t& e) {
    return Unavailable("cannot bind peer endpoint " + endpoint + ": " + e.what());
  }
  std::unique_ptr<ProposalRouter> router(new ProposalRouter(std::move(impl)));
  Impl* p = router->impl_.get();
  p->serve_thread = std::thread([p] { p->Serve(); });
  return router;
}

ProposalRouter::~ProposalRouter() {
  impl_->ctx.shutdown();
  if (impl_->serve_thread.joinable()) impl_->serve_thread.join();
  impl_->server.close();
  std::lock_guard lock(impl_->client_mu);
  impl_->clients.clear();
  impl_->ctx.close();
}

Result<uint64_t> ProposalRouter::Propose(std::string command, std::chrono::milliseconds timeout) {
  std::vector<std::string> commands;
  commands.push_back(std::move(command));
  return ProposeAll(std::move(commands), timeout);
}

Result<uint64_t> ProposalRouter::ProposeAll(std::vector<std::string> commands,
                                            std::chrono::milliseconds timeout) {
  std::lock_guard lock(impl_->client_mu);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  Status last = Unavailable("no leader");
  while (std::chrono::steady_clock::now() < deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    replication::Member leader = impl_->node->Leader();
    if (leader.id == 0) {
      std::this_thread::sleep_for(10ms);  // an election is under way
      continue;
    }
    if (leader.address == impl_->self_address) {
      auto r = ProposeLocally(impl_->node, commands, left);
      if (r.ok()) return r;
      last = r.status();
      if (r.status().message().find("not leader") == std::string::npos &&
          r.status().message().find("leadership lost") == std::string::npos) {
        return r;
      }
      continue;
    }
    std::string endpoint = PeerEndpointFor(leader.address);
    zmq::socket_t& client = impl_->ClientFor(endpoint);
    std::string seq = std::to_string(++impl_->next_seq);
    std::vector<zmq::const_buffer> request{zmq::buffer(seq)};
    for (const auto& c : commands) request.push_back(zmq::buffer(c));
    zmq::send_multipart(client, request);
    // Wait for the answer to this seq; stale answers to earlier, timed-out calls are dropped. A
    // leader that just died never answers, so each attempt waits only so long before asking
    // the log again who leads.
    const auto attempt_deadline = std::min(deadline, std::chrono::steady_clock::now() + 1s);
    last = Unavailable("leader " + leader.address + " did not answer");
    for (;;) {
      auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(
          attempt_deadline - std::chrono::steady_clock::now());
      if (wait.count() <= 0) break;
      zmq::pollitem_t item{client.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, wait) <= 0) break;
      std::vector<zmq::message_t> parts;
      if (!zmq::recv_multipart(client, std::back_inserter(parts))) break;
      if (parts.size() != 3 || parts[0].to_string() != seq) continue;
      if (parts[1].to_string() == "ok") return std::stoull(parts[2].to_string());
      last = Unavailable("leader " + leader.address + ": " + parts[2].to_string());
      break;
    }
    // Lost or refused (the leader moved): drop the socket so stale replies cannot confuse the
    // next attempt, and retry against whoever leads now.
    impl_->clients.erase(endpoint);
    std::this_thread::sleep_for(10ms);
  }
  return Unavailable("proposal not committed in time: " + last.message());
}

Status ProposalRouter::RequestLeadership(replication::ServerId self,
                                         std::chrono::milliseconds timeout) {
  std::lock_guard lock(impl_->client_mu);
  replication::Member leader = impl_->node->Leader();
  if (leader.id == self) return Status::Ok();
  if (leader.id == 0) return Unavailable("no leader to hand over leadership");
  const std::string endpoint = PeerEndpointFor(leader.address);
  zmq::socket_t& client = impl_->ClientFor(endpoint);
  const std::string seq = std::to_string(++impl_->next_seq);
  const std::string target = std::to_string(self);
  std::array<zmq::const_buffer, 4> request{zmq::buffer(seq), zmq::const_buffer(nullptr, 0),
                                           zmq::buffer(std::string_view("transfer")),
                                           zmq::buffer(target)};
  zmq::send_multipart(client, request);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    zmq::pollitem_t item{client.handle(), 0, ZMQ_POLLIN, 0};
    if (wait.count() <= 0 || zmq::poll(&item, 1, wait) <= 0) break;
    std::vector<zmq::message_t> parts;
    if (!zmq::recv_multipart(client, std::back_inserter(parts))) break;
    if (parts.size() != 3 || parts[0].to_string() != seq) continue;
    if (parts[1].to_string() == "ok") return Status::Ok();
    return Unavailable("leader " + leader.address + " refused: " + parts[2].to_string());
  }
  impl_->clients.erase(endpoint);
  return Unavailable("leader " + leader.address + " did not answer a leadership request");
}

}  // namespace nbos::replica
