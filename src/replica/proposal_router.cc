#include "replica/proposal_router.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <future>
#include <map>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "common/thread_annotations.h"
#include "replica/membership.h"
#include "replication/peer_auth.h"

namespace nbos::replica {

namespace {

using namespace std::chrono_literals;

// How long a member serving a forwarded proposal waits for its commit before answering.
constexpr auto kServeCommitTimeout = 10s;
// How long the leader works on a forwarded membership change (a promotion waits for C-Raft to
// catch the new member up) before answering kUnavailable; the asking member may then retry.
constexpr auto kServeChangeTimeout = 60s;
// Where membership-change workers hand their answers to the serving thread.
constexpr const char* kChangeResults = "inproc://nbos-membership-results";

// The status word of a membership answer on the wire, and back.
std::string StatusWord(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk:
      return "ok";
    case StatusCode::kInvalidArgument:
      return "invalid";
    case StatusCode::kUnavailable:
      return "unavailable";
    default:
      return "error";
  }
}

Status FromWire(const std::string& word, std::string message) {
  if (word == "ok") return Status::Ok();
  if (word == "invalid") return InvalidArgument(std::move(message));
  if (word == "unavailable") return Unavailable(std::move(message));
  return Internal(std::move(message));
}

const replication::Member* FindMember(const std::vector<replication::Member>& members,
                                      replication::ServerId id) {
  for (const auto& m : members) {
    if (m.id == id) return &m;
  }
  return nullptr;
}

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

constexpr std::string_view kRouterPurpose = "router";

// A request's frames as sent: seq, its MAC, then `rest`. The views point into `seq`, `mac` and
// `rest`, which must outlive the send.
std::vector<zmq::const_buffer> SignedRequest(const std::string& peer_key, const std::string& seq,
                                             const std::vector<std::string_view>& rest,
                                             std::string* mac) {
  std::vector<std::string_view> signed_parts{kRouterPurpose, seq};
  signed_parts.insert(signed_parts.end(), rest.begin(), rest.end());
  *mac = peer_key.empty() ? std::string() : replication::PeerMac(peer_key, signed_parts);
  std::vector<zmq::const_buffer> frames{zmq::buffer(seq), zmq::buffer(*mac)};
  for (std::string_view part : rest) frames.push_back(zmq::buffer(part.data(), part.size()));
  return frames;
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
  ProposalRouterOptions options;
  zmq::context_t ctx{1};
  zmq::socket_t server;
  std::thread serve_thread;
  Mutex client_mu;  // serialises Propose
  uint64_t drops_left GUARDED_BY(client_mu) = 0;
  std::map<std::string, zmq::socket_t> clients GUARDED_BY(client_mu);  // by peer endpoint
  uint64_t next_seq GUARDED_BY(client_mu) = 0;
  std::atomic<uint64_t>* served = nullptr;
  std::atomic<uint64_t>* transfers = nullptr;
  std::atomic<uint64_t>* refused_count = nullptr;

  // Membership changes. Those served for other members run on a worker, one at a time, so the
  // serving loop keeps forwarding proposals meanwhile; answers come back through `results`.
  zmq::socket_t results;  // PULL on kChangeResults, serving thread only
  std::thread change_thread;
  std::atomic<bool> change_busy{false};
  std::atomic<bool> stopping{false};
  Mutex change_mu;         // serialises the changes this member makes as leader
  Mutex change_client_mu;  // serialises AddMember/RemoveMember
  std::map<std::string, zmq::socket_t> change_clients GUARDED_BY(change_client_mu);
  uint64_t next_change_seq GUARDED_BY(change_client_mu) = 0;

  void Serve() {
    for (;;) {
      std::array<zmq::pollitem_t, 2> items{
          {{server.handle(), 0, ZMQ_POLLIN, 0}, {results.handle(), 0, ZMQ_POLLIN, 0}}};
      std::vector<zmq::message_t> parts;
      try {
        zmq::poll(items.data(), items.size(), std::chrono::milliseconds(-1));
        if (items[1].revents & ZMQ_POLLIN) {
          // A worker's answer, already [identity, seq, status, message]: pass it on.
          std::vector<zmq::message_t> answer;
          if (zmq::recv_multipart(results, std::back_inserter(answer))) {
            zmq::send_multipart(server, answer);
          }
        }
        if (!(items[0].revents & ZMQ_POLLIN)) continue;
        if (!zmq::recv_multipart(server, std::back_inserter(parts), zmq::recv_flags::dontwait)) {
          continue;
        }
      } catch (const zmq::error_t& e) {
        if (e.num() == EINTR || e.num() == EAGAIN) continue;
        return;  // ETERM: stopping
      }
      // Every request is [identity, seq, MAC, ...]; Authentic takes the MAC out or refuses it.
      // [identity, seq, command...] -> [identity, seq, "ok"|"invalid"|"unavailable"|"error",
      //                                 last index|message]
      // [identity, seq, "", "transfer", id] -> [identity, seq, "ok"|"error", message]
      // [identity, seq, "", "add", id, address] and [identity, seq, "", "remove", id]
      //   -> [identity, seq, "ok"|"invalid"|"unavailable"|"error", message], maybe later
      if (parts.size() < 3 || !Authentic(parts)) continue;
      if (parts[2].size() == 0 && parts.size() >= 5 &&
          (parts[3].to_string() == "add" || parts[3].to_string() == "remove")) {
        ServeChange(std::move(parts));
        continue;
      }
      std::string status, body;
      if (parts.size() == 5 && parts[2].size() == 0 && parts[3].to_string() == "transfer") {
        Status s = TransferLocally(std::strtoull(parts[4].to_string().c_str(), nullptr, 10));
        ++*transfers;
        status = s.ok() ? "ok" : "error";
        body = s.message();
      } else {
        std::vector<std::string> commands;
        for (size_t i = 2; i < parts.size(); ++i) commands.push_back(parts[i].to_string());
        auto result = ProposeLocally(
            node, std::move(commands),
            std::chrono::duration_cast<std::chrono::milliseconds>(kServeCommitTimeout));
        ++*served;
        status = result.ok() ? "ok" : StatusWord(result.status());
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

  // Whether `parts` ([identity, seq, MAC, rest...]) carries the MAC of seq and rest; if so the
  // MAC frame is taken out, else the request is answered "refused", counted and reported.
  bool Authentic(std::vector<zmq::message_t>& parts) {
    std::vector<std::string_view> signed_parts{kRouterPurpose, parts[1].to_string_view()};
    for (size_t i = 3; i < parts.size(); ++i) signed_parts.push_back(parts[i].to_string_view());
    if (options.peer_key.empty() ||
        replication::PeerMacMatches(options.peer_key, signed_parts, parts[2].to_string_view())) {
      parts.erase(parts.begin() + 2);
      return true;
    }
    ++*refused_count;
    if (options.on_refused) {
      options.on_refused("refused a forwarded request of " + std::to_string(parts.size() - 3) +
                         " frames: it does not carry this kernel's key");
    }
    const std::string_view word = "refused", message = "not signed with this kernel's key";
    std::array<zmq::const_buffer, 4> reply{zmq::buffer(parts[0].data(), parts[0].size()),
                                           zmq::buffer(parts[1].data(), parts[1].size()),
                                           zmq::buffer(word), zmq::buffer(message)};
    try {
      zmq::send_multipart(server, reply);
    } catch (const zmq::error_t&) {
    }
    return false;
  }

  // Starts a worker for a forwarded membership change, or answers at once.
  void ServeChange(std::vector<zmq::message_t> parts) {
    const std::string op = parts[3].to_string();
    replication::Member member;
    member.id = std::strtoull(parts[4].to_string().c_str(), nullptr, 10);
    Status refused;
    if (op == "add" && parts.size() == 6) {
      member.address = parts[5].to_string();
    } else if (op == "add" || parts.size() != 5) {
      refused = InvalidArgument("malformed membership request");
    }
    if (refused.ok() && change_busy.load()) {
      refused = Unavailable("another membership change is in progress on the leader");
    }
    if (!refused.ok()) {
      const std::string word = StatusWord(refused);
      std::array<zmq::const_buffer, 4> reply{zmq::buffer(parts[0].data(), parts[0].size()),
                                             zmq::buffer(parts[1].data(), parts[1].size()),
                                             zmq::buffer(word), zmq::buffer(refused.message())};
      try {
        zmq::send_multipart(server, reply);
      } catch (const zmq::error_t&) {
      }
      return;
    }
    if (change_thread.joinable()) change_thread.join();  // finished: change_busy was false
    change_busy = true;
    change_thread = std::thread(
        [this, op, member, identity = parts[0].to_string(), seq = parts[1].to_string()] {
          const auto deadline = std::chrono::steady_clock::now() + kServeChangeTimeout;
          Status s;
          {
            MutexLock lock(&change_mu);
            s = op == "add" ? AddLocally(member, deadline) : RemoveLocally(member.id, deadline);
          }
          try {
            zmq::socket_t push(ctx, zmq::socket_type::push);
            push.set(zmq::sockopt::linger, 0);
            push.connect(kChangeResults);
            // The buffers point into these until send_multipart returns.
            const std::string word(StatusWord(s));
            const std::string message(s.message());
            std::array<zmq::const_buffer, 4> answer{zmq::buffer(identity), zmq::buffer(seq),
                                                    zmq::buffer(word), zmq::buffer(message)};
            zmq::send_multipart(push, answer);
          } catch (const zmq::error_t&) {
            // Stopping: the asking member times out and retries elsewhere.
          }
          change_busy = false;
        });
  }

  // Runs one asynchronous log operation and waits for it until `deadline` or until stopping.
  Status Await(const std::function<void(replication::ReplicatedLog::Done)>& start,
               std::chrono::steady_clock::time_point deadline, const std::string& what) {
    auto promise = std::make_shared<std::promise<Status>>();
    auto future = promise->get_future();
    start([promise](Status s) { promise->set_value(std::move(s)); });
    while (future.wait_for(50ms) != std::future_status::ready) {
      if (stopping.load()) return Unavailable(what + ": member is stopping");
      if (std::chrono::steady_clock::now() >= deadline) {
        return Unavailable(what + " did not finish in time");
      }
    }
    return future.get();
  }

  // On the leader (else kUnavailable from the log): see ProposalRouter::AddMember.
  Status AddLocally(const replication::Member& member,
                    std::chrono::steady_clock::time_point deadline) {
    if (member.id == 0) return InvalidArgument("replica id must be positive");
    if (!IsRaftAddress(member.address)) {
      return InvalidArgument("raft address '" + member.address + "' is not IPv4:port");
    }
    const std::string name = "replica " + std::to_string(member.id);
    std::vector<replication::Member> members = node->Members();
    for (const auto& m : members) {
      if (m.address == member.address && m.id != member.id) {
        return InvalidArgument("raft address " + member.address + " already belongs to replica " +
                               std::to_string(m.id));
      }
    }
    const replication::Member* existing = FindMember(members, member.id);
    if (existing != nullptr && existing->address != member.address) {
      return InvalidArgument(name + " is already a member at " + existing->address);
    }
    if (existing != nullptr && existing->role == replication::Role::kVoter) return Status::Ok();
    if (existing == nullptr) {
      Status added = Await(
          [&](replication::ReplicatedLog::Done done) { node->AddSpare(member, std::move(done)); },
          deadline, "adding " + name);
      if (!added.ok()) return added;
    }
    // C-Raft catches the spare up (snapshot, then entries) before the promotion is appended.
    return Await(
        [&](replication::ReplicatedLog::Done done) {
          node->Assign(member.id, replication::Role::kVoter, std::move(done));
        },
        deadline, "promoting " + name + " to voter");
  }

  // On the leader (else kUnavailable from the log): see ProposalRouter::RemoveMember. When `id`
  // is this member, hands leadership over and answers kUnavailable so that the caller retries
  // with the new leader.
  Status RemoveLocally(replication::ServerId id, std::chrono::steady_clock::time_point deadline) {
    if (id == 0) return InvalidArgument("replica id must be positive");
    const std::string name = "replica " + std::to_string(id);
    std::vector<replication::Member> members = node->Members();
    const replication::Member* target = FindMember(members, id);
    if (target == nullptr) return Status::Ok();  // already gone
    std::vector<replication::ServerId> other_voters;
    for (const auto& m : members) {
      if (m.role == replication::Role::kVoter && m.id != id) other_voters.push_back(m.id);
    }
    if (target->role == replication::Role::kVoter && other_voters.empty()) {
      return InvalidArgument("cannot remove " + name + ": it is the only voter");
    }
    if (id == node->id()) {
      const replication::ServerId to = other_voters.front();
      // The successor must hold this leader's whole log (see RaftNode::HasAllEntries).
      while (!node->HasAllEntries(to)) {
        if (std::chrono::steady_clock::now() >= deadline) {
          return Unavailable("replica " + std::to_string(to) + " did not catch up in time");
        }
        std::this_thread::sleep_for(2ms);
      }
      Status moved = Await(
          [&](replication::ReplicatedLog::Done done) {
            node->TransferLeadership(to, std::move(done));
          },
          deadline, "handing leadership to replica " + std::to_string(to));
      if (!moved.ok()) return Unavailable(moved.message());
      return Unavailable("leader " + name + " handed leadership to replica " + std::to_string(to) +
                         " before its removal");
    }
    return Await([&](replication::ReplicatedLog::Done done) { node->Remove(id, std::move(done)); },
                 deadline, "removing " + name);
  }

  // Runs a membership change on the leader: here through `local` if this member leads, else by
  // forwarding `request` (the frames after seq) to it. Retries kUnavailable answers (leader
  // moved, change in progress) until `timeout`.
  Status ChangeThroughLeader(
      const std::vector<std::string>& request,
      const std::function<Status(std::chrono::steady_clock::time_point)>& local,
      std::chrono::milliseconds timeout) EXCLUDES(change_client_mu, change_mu) {
    MutexLock client_lock(&change_client_mu);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    Status last = Unavailable("no leader");
    // Retries come quickly at first: a leader that hands leadership over before its own removal
    // answers kUnavailable, and its successor is known a few milliseconds later.
    auto retry_after = 2ms;
    auto pause = [&retry_after] {
      std::this_thread::sleep_for(retry_after);
      retry_after = std::min(retry_after * 2, std::chrono::milliseconds(50));
    };
    while (std::chrono::steady_clock::now() < deadline && !stopping.load()) {
      replication::Member leader = node->Leader();
      if (leader.id == 0) {
        pause();  // an election is under way
        continue;
      }
      if (leader.address == self_address) {
        Status s;
        {
          MutexLock lock(&change_mu);
          s = local(deadline);
        }
        if (s.code() != StatusCode::kUnavailable) return s;
        last = s;
        pause();
        continue;
      }
      const std::string endpoint = PeerEndpointFor(leader.address);
      auto it = change_clients.find(endpoint);
      if (it == change_clients.end()) {
        zmq::socket_t socket(ctx, zmq::socket_type::dealer);
        socket.set(zmq::sockopt::linger, 0);
        socket.connect(endpoint);
        it = change_clients.emplace(endpoint, std::move(socket)).first;
      }
      zmq::socket_t& client = it->second;
      const std::string seq = std::to_string(++next_change_seq);
      std::vector<std::string_view> rest{std::string_view()};
      rest.insert(rest.end(), request.begin(), request.end());
      std::string mac;
      zmq::send_multipart(client, SignedRequest(options.peer_key, seq, rest, &mac));
      // A change can take long (catch-up), so wait until the deadline, but give up on a leader
      // that is no longer the leader.
      last = Unavailable("leader " + leader.address + " did not answer");
      bool answered = false;
      while (!answered && !stopping.load()) {
        auto wait = std::min(std::chrono::duration_cast<std::chrono::milliseconds>(
                                 deadline - std::chrono::steady_clock::now()),
                             std::chrono::milliseconds(500));
        if (wait.count() <= 0) break;
        zmq::pollitem_t item{client.handle(), 0, ZMQ_POLLIN, 0};
        if (zmq::poll(&item, 1, wait) <= 0) {
          if (node->Leader().id != leader.id) break;
          continue;
        }
        std::vector<zmq::message_t> parts;
        if (!zmq::recv_multipart(client, std::back_inserter(parts))) break;
        if (parts.size() != 3 || parts[0].to_string() != seq) continue;
        Status s = FromWire(parts[1].to_string(),
                            "leader " + leader.address + ": " + parts[2].to_string());
        if (s.code() != StatusCode::kUnavailable) return s;
        last = s;
        answered = true;
      }
      if (!answered) change_clients.erase(endpoint);  // stale answers must not confuse a retry
      pause();
    }
    return Unavailable("membership change not completed in time: " + last.message());
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

  zmq::socket_t& ClientFor(const std::string& endpoint) REQUIRES(client_mu) {
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
  impl_->transfers = &transfers_;
  impl_->refused_count = &refused_;
}

Result<std::unique_ptr<ProposalRouter>> ProposalRouter::Start(replication::RaftNode* node,
                                                              const std::string& raft_address,
                                                              ProposalRouterOptions options) {
  std::string endpoint = PeerEndpointFor(raft_address);
  if (endpoint.empty()) return InvalidArgument("bad raft address '" + raft_address + "'");
  if (options.forward_attempt_timeout.count() <= 0) {
    return InvalidArgument("forward attempt timeout must be positive");
  }
  auto impl = std::make_unique<Impl>();
  impl->node = node;
  impl->self_address = raft_address;
  impl->options = options;
  {
    MutexLock lock(&impl->client_mu);  // no other thread yet
    impl->drops_left = options.drop_forwarded_answers;
  }
  try {
    impl->server = zmq::socket_t(impl->ctx, zmq::socket_type::router);
    impl->server.set(zmq::sockopt::linger, 0);
    impl->server.bind(endpoint);
    impl->results = zmq::socket_t(impl->ctx, zmq::socket_type::pull);
    impl->results.set(zmq::sockopt::linger, 0);
    impl->results.bind(kChangeResults);
  } catch (const zmq::error_t& e) {
    return Unavailable("cannot bind peer endpoint " + endpoint + ": " + e.what());
  }
  std::unique_ptr<ProposalRouter> router(new ProposalRouter(std::move(impl)));
  Impl* p = router->impl_.get();
  p->serve_thread = std::thread([p] { p->Serve(); });
  return router;
}

ProposalRouter::~ProposalRouter() {
  impl_->stopping = true;
  impl_->ctx.shutdown();
  if (impl_->serve_thread.joinable()) impl_->serve_thread.join();
  if (impl_->change_thread.joinable()) impl_->change_thread.join();
  impl_->server.close();
  impl_->results.close();
  MutexLock lock(&impl_->client_mu);
  impl_->clients.clear();
  MutexLock change_lock(&impl_->change_client_mu);
  impl_->change_clients.clear();
  impl_->ctx.close();
}

Result<uint64_t> ProposalRouter::Propose(std::string command, std::chrono::milliseconds timeout) {
  std::vector<std::string> commands;
  commands.push_back(std::move(command));
  return ProposeAll(std::move(commands), timeout);
}

Result<uint64_t> ProposalRouter::ProposeAll(std::vector<std::string> commands,
                                            std::chrono::milliseconds timeout) {
  MutexLock lock(&impl_->client_mu);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  Status last = Unavailable("no leader");
  // Every attempt sends the same bytes: a command that carries an id keeps it on every retry.
  bool attempted = false;
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
    std::string mac;
    auto request =
        SignedRequest(impl_->options.peer_key, seq,
                      std::vector<std::string_view>(commands.begin(), commands.end()), &mac);
    if (attempted) ++retries_;
    attempted = true;
    if (!zmq::send_multipart(client, request)) {
      last = Unavailable("cannot send to leader " + leader.address);
    }
    // Wait for the answer to this seq; stale answers to earlier, timed-out calls are dropped. A
    // leader that just died never answers, so each attempt waits only so long before asking
    // the log again who leads.
    const auto attempt_deadline = std::min(
        deadline, std::chrono::steady_clock::now() + impl_->options.forward_attempt_timeout);
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
      if (impl_->drops_left > 0) {
        --impl_->drops_left;  // test only: as if the network lost it
        spdlog::debug("dropping the answer to forwarded proposal {} (test option)", seq);
        continue;
      }
      if (parts[1].to_string() == "ok") return std::stoull(parts[2].to_string());
      // Refused as such (too large, say): asking again cannot help.
      if (parts[1].to_string() == "invalid") {
        return InvalidArgument("leader " + leader.address + ": " + parts[2].to_string());
      }
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
  MutexLock lock(&impl_->client_mu);
  replication::Member leader = impl_->node->Leader();
  if (leader.id == self) return Status::Ok();
  if (leader.id == 0) return Unavailable("no leader to hand over leadership");
  const std::string endpoint = PeerEndpointFor(leader.address);
  zmq::socket_t& client = impl_->ClientFor(endpoint);
  const std::string seq = std::to_string(++impl_->next_seq);
  const std::string target = std::to_string(self);
  std::string mac;
  zmq::send_multipart(client, SignedRequest(impl_->options.peer_key, seq,
                                            {std::string_view(), "transfer", target}, &mac));
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

Status ProposalRouter::AddMember(const replication::Member& member,
                                 std::chrono::milliseconds timeout) {
  if (member.id == 0) return InvalidArgument("replica id must be positive");
  if (!IsRaftAddress(member.address)) {
    return InvalidArgument("raft address '" + member.address + "' is not IPv4:port");
  }
  Impl* p = impl_.get();
  return p->ChangeThroughLeader(
      {"add", std::to_string(member.id), member.address},
      [p, &member](std::chrono::steady_clock::time_point deadline) {
        return p->AddLocally(member, deadline);
      },
      timeout);
}

Status ProposalRouter::RemoveMember(replication::ServerId id, std::chrono::milliseconds timeout) {
  if (id == 0) return InvalidArgument("replica id must be positive");
  Impl* p = impl_.get();
  return p->ChangeThroughLeader(
      {"remove", std::to_string(id)},
      [p, id](std::chrono::steady_clock::time_point deadline) {
        return p->RemoveLocally(id, deadline);
      },
      timeout);
}

}  // namespace nbos::replica
