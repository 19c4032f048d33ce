#include "replication/raft_node.h"

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstring>
#include <deque>
#include <filesystem>
#include <future>
#include <string_view>
#include <thread>

extern "C" {
#include <raft.h>
#include <raft/uv.h>
}
#include <uv.h>

#include "common/check.h"
#include "common/thread_annotations.h"
#include "replication/authenticated_transport.h"
#include "replication/raft_fsm.h"

namespace nbos::replication {

namespace {

int RaftRole(Role role) {
  switch (role) {
    case Role::kVoter:
      return RAFT_VOTER;
    case Role::kStandby:
      return RAFT_STANDBY;
    case Role::kSpare:
      return RAFT_SPARE;
  }
  return RAFT_SPARE;
}

Role RoleOf(int raft_role) {
  switch (raft_role) {
    case RAFT_VOTER:
      return Role::kVoter;
    case RAFT_STANDBY:
      return Role::kStandby;
    default:
      return Role::kSpare;
  }
}

}  // namespace

struct RaftNode::Impl {
  RaftNodeOptions options;
  StateMachine* machine = nullptr;

  uv_loop_t loop{};
  uv_async_t wake{};
  std::thread thread;
  std::thread::id loop_thread_id;

  Mutex mu;
  std::deque<std::function<void()>> posted GUARDED_BY(mu);
  bool closed GUARDED_BY(mu) = false;  // no more work is accepted

  struct raft_uv_transport transport {};  // plain TCP, without a peer key
  std::unique_ptr<AuthenticatedTransport> authenticated;
  struct raft_io io {};
  struct raft_fsm fsm {};
  struct raft raft {};

  // Loop-thread state.
  bool in_flight = false;
  std::deque<std::pair<std::string, Committed>> waiting;
  bool raft_closing = false;

  // What Leader, Members and LastApplied answer on other threads, published by the loop at the
  // end of each of its turns. Asking the loop instead cost every proposal a round trip through
  // it (two thread wake-ups) just to learn who leads.
  uv_check_t turn_end{};
  bool turn_end_open = false;
  // Written by the loop thread with view_mu held; read by it without (see PublishView).
  Mutex view_mu;
  Member leader_view GUARDED_BY(view_mu);
  std::vector<Member> members_view GUARDED_BY(view_mu);
  std::atomic<uint64_t> last_applied_view{0};

  // Runs `fn` on the loop thread. False when the node is closed (fn is dropped).
  bool Post(std::function<void()> fn) EXCLUDES(mu) {
    {
      MutexLock lock(&mu);
      if (closed) return false;
      posted.push_back(std::move(fn));
    }
    uv_async_send(&wake);
    return true;
  }

  // Runs `fn(done)` on the loop thread while the node is open; otherwise fails `done` there (or
  // here, once the loop is gone). Every public operation goes through this.
  template <typename DoneT, typename Fn>
  void Submit(const char* what, DoneT done, Fn fn) {
    auto shared = std::make_shared<DoneT>(std::move(done));
    bool accepted = Post([this, what, shared, fn = std::move(fn)]() mutable {
      if (raft_closing) {
        (*shared)(Unavailable(std::string(what) + ": node is shutting down"));
        return;
      }
      fn(std::move(*shared));
    });
    if (!accepted) (*shared)(Unavailable(std::string(what) + ": node is closed"));
  }

  static void OnWake(uv_async_t* handle) {
    auto* self = static_cast<Impl*>(handle->data);
    std::deque<std::function<void()>> work;
    {
      MutexLock lock(&self->mu);
      work.swap(self->posted);
    }
    for (auto& fn : work) fn();
  }

  Status Error(int rv, const char* what) {
    if (rv == RAFT_NOTLEADER) {
      raft_id leader_id = 0;
      const char* leader_address = nullptr;
      raft_leader(&raft, &leader_id, &leader_address);
      if (leader_id == 0) return Unavailable(std::string(what) + ": not leader, no leader known");
      return Unavailable(std::string(what) + ": not leader; leader is " +
                         std::to_string(leader_id) + " at " + leader_address);
    }
    if (rv == RAFT_SHUTDOWN) return Unavailable(std::string(what) + ": node is shutting down");
    if (rv == RAFT_LEADERSHIPLOST) {
      return Unavailable(std::string(what) + ": leadership lost before commit");
    }
    return Internal(std::string(what) + ": " + raft_strerror(rv));
  }

  // --- the view other threads read ---

  Member CurrentLeader() {
    if (raft_closing) return Member{};
    raft_id id = 0;
    const char* address = nullptr;
    raft_leader(&raft, &id, &address);
    return Member{id, address ? address : "", Role::kVoter};
  }

  std::vector<Member> CurrentMembers() {
    std::vector<Member> members;
    if (raft_closing) return members;
    const struct raft_configuration& conf = raft.configuration;
    for (unsigned i = 0; i < conf.n; ++i) {
      const struct raft_server& s = conf.servers[i];
      members.push_back({s.id, s.address ? s.address : "", RoleOf(s.role)});
    }
    return members;
  }

  // Whether the published leader and members are C-Raft's current ones. It runs at the end of
  // every loop turn, so it compares in place instead of building the values. Loop thread only:
  // it reads the view without view_mu, which the analysis cannot tell from a race.
  bool ViewIsCurrent() NO_THREAD_SAFETY_ANALYSIS {
    if (raft_closing) return leader_view == Member{} && members_view.empty();
    raft_id id = 0;
    const char* address = nullptr;
    raft_leader(&raft, &id, &address);
    if (id != leader_view.id || std::string_view(address ? address : "") != leader_view.address)
      return false;
    const struct raft_configuration& conf = raft.configuration;
    if (conf.n != members_view.size()) return false;
    for (unsigned i = 0; i < conf.n; ++i) {
      const struct raft_server& s = conf.servers[i];
      const Member& m = members_view[i];
      if (s.id != m.id || RoleOf(s.role) != m.role ||
          std::string_view(s.address ? s.address : "") != m.address)
        return false;
    }
    return true;
  }

  // Called on the loop thread, or before it starts. Takes the lock only when something changed;
  // the loop thread is the only writer, so it reads the view without it.
  void PublishView() EXCLUDES(view_mu) {
    last_applied_view.store(raft_closing ? 0 : raft_last_applied(&raft), std::memory_order_release);
    if (ViewIsCurrent()) return;
    Member leader = CurrentLeader();
    std::vector<Member> members = CurrentMembers();
    MutexLock lock(&view_mu);
    leader_view = std::move(leader);
    members_view = std::move(members);
  }

  static void OnTurnEnd(uv_check_t* handle) { static_cast<Impl*>(handle->data)->PublishView(); }

  // --- proposals, bounded in flight ---

  // One raft_apply carries every waiting command (up to max_batch) as consecutive entries, and
  // only one is in flight at a time. Batching is what C-Raft handles well (many concurrent
  // requests degrade it badly), and C-Raft 0.15 crashes in raft_close when more than one apply
  // request is pending.
  struct ApplyRequest {
    struct raft_apply req {};
    Impl* impl = nullptr;
    std::vector<Committed> done;  // one per entry, in log order; empty for a nudge
  };

  static void OnApplied(struct raft_apply* req, int status, void* /*result*/) {
    std::unique_ptr<ApplyRequest> r(static_cast<ApplyRequest*>(req->data));
    Impl* self = r->impl;
    self->in_flight = false;
    for (size_t i = 0; i < r->done.size(); ++i) {
      if (status == 0) {
        r->done[i](static_cast<uint64_t>(req->index + i));
      } else {
        r->done[i](self->Error(status, "propose"));
      }
    }
    // Commands that came meanwhile carry the commit index themselves; a nudge never follows a
    // nudge.
    if (status == 0 && !r->done.empty() && self->waiting.empty() && self->options.nudge_followers) {
      self->SubmitNudge();
    } else if (status == 0) {
      self->SubmitWaiting();
    } else {
      // A failed request is failed while C-Raft converts a deposed leader: it still reads as
      // leader but has freed its followers' progress, so raft_apply from here would crash. The
      // next loop turn sees the follower it became (and fails the waiting ones: not leader).
      self->Post([self] { self->SubmitWaiting(); });
    }
  }

  void SubmitNudge() {
    if (in_flight || raft_closing) return;
    struct raft_buffer buf {};
    if (!EncodeNudge(&buf)) return;
    auto r = std::make_unique<ApplyRequest>();
    r->impl = this;
    r->req.data = r.get();
    if (raft_apply(&raft, &r->req, &buf, 1, OnApplied) != 0) {
      raft_free(buf.base);  // e.g. leadership lost: followers hear from the next leader
      return;
    }
    in_flight = true;
    r.release();
  }

  void SubmitWaiting() {
    if (in_flight || waiting.empty() || raft_closing) return;
    size_t n = 0;
    for (size_t bytes = 0; n < std::min(waiting.size(), options.max_batch); ++n) {
      bytes += waiting[n].first.size();
      if (n > 0 && bytes > options.max_batch_bytes) break;
    }
    std::vector<struct raft_buffer> bufs(n);
    auto r = std::make_unique<ApplyRequest>();
    r->impl = this;
    r->req.data = r.get();
    for (size_t i = 0; i < n; ++i) {
      auto [command, done] = std::move(waiting.front());
      waiting.pop_front();
      if (!EncodeEntry(command, &bufs[i])) {
        for (size_t j = 0; j < i; ++j) raft_free(bufs[j].base);
        for (auto& d : r->done) d(Internal("propose: out of memory"));
        done(Internal("propose: out of memory"));
        return;
      }
      r->done.push_back(std::move(done));
    }
    int rv = raft_apply(&raft, &r->req, bufs.data(), static_cast<unsigned>(n), OnApplied);
    if (rv != 0) {
      for (auto& b : bufs) raft_free(b.base);  // ownership passes to C-Raft only on success
      Status error = Error(rv, "propose");
      for (auto& d : r->done) d(error);
      // The waiting ones would fail the same way (e.g. not leader): fail them now, in order.
      while (!waiting.empty()) {
        auto done = std::move(waiting.front().second);
        waiting.pop_front();
        done(error);
      }
      return;
    }
    in_flight = true;
    r.release();  // owned by the request until OnApplied
  }

  // --- barrier, membership, transfer ---

  struct BarrierRequest {
    struct raft_barrier req {};
    Impl* impl = nullptr;
    Committed done;
  };

  static void OnBarrier(struct raft_barrier* req, int status) {
    std::unique_ptr<BarrierRequest> r(static_cast<BarrierRequest*>(req->data));
    if (status == 0) {
      r->done(static_cast<uint64_t>(req->index));
    } else {
      r->done(r->impl->Error(status, "barrier"));
    }
  }

  struct ChangeRequest {
    struct raft_change req {};
    Impl* impl = nullptr;
    Done done;
    const char* what = "";
  };

  static void OnChanged(struct raft_change* req, int status) {
    std::unique_ptr<ChangeRequest> r(static_cast<ChangeRequest*>(req->data));
    r->done(status == 0 ? Status::Ok() : r->impl->Error(status, r->what));
  }

  template <typename Submit>
  void Change(const char* what, Done done, Submit submit) {
    auto* r = new ChangeRequest();
    r->impl = this;
    r->done = std::move(done);
    r->what = what;
    r->req.data = r;
    int rv = submit(&r->req);
    if (rv != 0) {
      Done failed = std::move(r->done);
      delete r;
      failed(Error(rv, what));
    }
  }

  struct TransferRequest {
    struct raft_transfer req {};
    Impl* impl = nullptr;
    Done done;
    ServerId target = 0;
  };

  static void OnTransferred(struct raft_transfer* req) {
    std::unique_ptr<TransferRequest> r(static_cast<TransferRequest*>(req->data));
    raft_id leader = 0;
    const char* address = nullptr;
    raft_leader(&r->impl->raft, &leader, &address);
    // The callback also fires when the election timeout passes without the target winning.
    if (leader == r->target) {
      r->done(Status::Ok());
    } else {
      r->done(
          Unavailable("leadership transfer to " + std::to_string(r->target) + " did not complete"));
    }
  }

  // --- transport ---

  int OpenTransport() {
    if (options.peer_key.empty()) return raft_uv_tcp_init(&transport, &loop);
    return AuthenticatedTransport::Create(&loop, {options.peer_key, 5000, options.on_refused_peer},
                                          &authenticated);
  }
  struct raft_uv_transport* Transport() {
    return authenticated ? authenticated->transport() : &transport;
  }
  // After raft_uv_close, or before the transport was handed to raft_uv_init.
  void CloseTransport() {
    if (authenticated) {
      authenticated.reset();
    } else {
      raft_uv_tcp_close(&transport);
    }
  }

  // --- shutdown ---

  static void OnRaftClosed(struct raft* raft) {
    auto* self = static_cast<Impl*>(raft->data);
    raft_uv_close(&self->io);
    self->CloseTransport();
    uv_close(reinterpret_cast<uv_handle_t*>(&self->wake), nullptr);
    if (self->turn_end_open) uv_close(reinterpret_cast<uv_handle_t*>(&self->turn_end), nullptr);
  }

  void BeginClose() {
    raft_closing = true;
    PublishView();
    for (auto& [command, done] : waiting) done(Unavailable("propose: node is shutting down"));
    waiting.clear();
    raft_close(&raft, OnRaftClosed);
  }
};

RaftNode::RaftNode(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RaftNode::~RaftNode() { Close(); }

Result<std::unique_ptr<RaftNode>> RaftNode::Start(const RaftNodeOptions& options,
                                                  StateMachine* machine) {
  if (options.id == 0) return InvalidArgument("raft server id must be positive");
  if (options.address.empty()) return InvalidArgument("raft address is empty");
  std::error_code ec;
  std::filesystem::create_directories(options.data_dir, ec);
  if (ec)
    return Unavailable("cannot create raft directory " + options.data_dir + ": " + ec.message());

  // A peer that closes its connection must not kill this process through a write.
  static std::once_flag ignore_sigpipe;
  std::call_once(ignore_sigpipe, [] { signal(SIGPIPE, SIG_IGN); });

  auto impl = std::make_unique<Impl>();
  Impl* p = impl.get();
  p->options = options;
  p->machine = machine;
  if (uv_loop_init(&p->loop) != 0) return Internal("uv_loop_init failed");
  p->wake.data = p;
  uv_async_init(&p->loop, &p->wake, Impl::OnWake);
  BindFsm(&p->fsm, machine);

  auto abandon = [p](Status status) -> Status {
    // Close whatever was opened and let the loop run the close callbacks to completion.
    uv_close(reinterpret_cast<uv_handle_t*>(&p->wake), nullptr);
    uv_run(&p->loop, UV_RUN_DEFAULT);
    uv_loop_close(&p->loop);
    return status;
  };

  int rv = p->OpenTransport();
  if (rv != 0) return abandon(Internal(std::string("raft transport: ") + raft_strerror(rv)));
  rv = raft_uv_init(&p->io, &p->loop, options.data_dir.c_str(), p->Transport());
  if (rv != 0) {
    std::string msg = std::string("raft storage in ") + options.data_dir + ": " + p->io.errmsg;
    p->CloseTransport();
    return abandon(Unavailable(msg));
  }
  raft_uv_set_connect_retry_delay(&p->io, options.connect_retry_delay_ms);
  rv = raft_init(&p->raft, &p->io, &p->fsm, options.id, options.address.c_str());
  if (rv != 0) {
    std::string msg = std::string("raft init: ") + raft_strerror(rv);
    raft_uv_close(&p->io);
    p->CloseTransport();
    return abandon(Internal(msg));
  }
  p->raft.data = p;
  raft_set_election_timeout(&p->raft, options.election_timeout_ms);
  raft_set_heartbeat_timeout(&p->raft, options.heartbeat_timeout_ms);
  raft_set_snapshot_threshold(&p->raft, options.snapshot_threshold);
  raft_set_snapshot_trailing(&p->raft, options.snapshot_trailing);
  raft_set_install_snapshot_timeout(&p->raft, options.install_snapshot_timeout_ms);
  raft_set_pre_vote(&p->raft, true);

  auto close_raft = [p](Status status) -> Status {
    p->BeginClose();
    uv_run(&p->loop, UV_RUN_DEFAULT);
    uv_loop_close(&p->loop);
    return status;
  };

  if (!options.bootstrap.empty()) {
    struct raft_configuration conf;
    raft_configuration_init(&conf);
    for (const Member& m : options.bootstrap) {
      rv = raft_configuration_add(&conf, m.id, m.address.c_str(), RaftRole(m.role));
      if (rv != 0) {
        raft_configuration_close(&conf);
        return close_raft(InvalidArgument("bad bootstrap member " + std::to_string(m.id) + ": " +
                                          raft_strerror(rv)));
      }
    }
    rv = raft_bootstrap(&p->raft, &conf);
    raft_configuration_close(&conf);
    // A data directory that already holds state restarts from it instead.
    if (rv != 0 && rv != RAFT_CANTBOOTSTRAP) {
      return close_raft(Unavailable(std::string("raft bootstrap: ") + raft_errmsg(&p->raft)));
    }
  }
  rv = raft_start(&p->raft);
  if (rv != 0) {
    return close_raft(
        Unavailable("raft start on " + options.address + ": " + raft_errmsg(&p->raft)));
  }

  p->PublishView();
  p->turn_end.data = p;
  uv_check_init(&p->loop, &p->turn_end);
  uv_check_start(&p->turn_end, Impl::OnTurnEnd);
  p->turn_end_open = true;

  std::promise<void> running;
  auto started = running.get_future();
  p->thread = std::thread([p, &running] {
    p->loop_thread_id = std::this_thread::get_id();
    running.set_value();
    uv_run(&p->loop, UV_RUN_DEFAULT);
  });
  started.wait();
  return std::unique_ptr<RaftNode>(new RaftNode(std::move(impl)));
}

void RaftNode::Close() {
  if (!impl_ || !impl_->thread.joinable()) return;
  NBOS_CHECK(std::this_thread::get_id() != impl_->loop_thread_id,
             "Close() from a callback would join the loop thread from itself");
  Impl* p = impl_.get();
  p->Post([p] { p->BeginClose(); });
  {
    MutexLock lock(&p->mu);
    p->closed = true;
  }
  p->thread.join();
  // Work posted while the close was under way never ran: run it now so every callback fires
  // (raft_closing makes each one fail fast).
  Impl::OnWake(&p->wake);
  uv_loop_close(&p->loop);
}

ServerId RaftNode::id() const { return impl_->options.id; }

void RaftNode::Propose(std::string command, Committed done) {
  Impl* p = impl_.get();
  p->Submit("propose", std::move(done), [p, command = std::move(command)](Committed d) mutable {
    if (command.size() > p->options.max_batch_bytes) {
      d(InvalidArgument("propose: an entry of " + std::to_string(command.size()) +
                        " bytes is over this log's limit of " +
                        std::to_string(p->options.max_batch_bytes)));
      return;
    }
    p->waiting.emplace_back(std::move(command), std::move(d));
    p->SubmitWaiting();
  });
}

void RaftNode::Barrier(Committed done) {
  Impl* p = impl_.get();
  p->Submit("barrier", std::move(done), [p](Committed d) {
    auto* r = new Impl::BarrierRequest();
    r->impl = p;
    r->done = std::move(d);
    r->req.data = r;
    int rv = raft_barrier(&p->raft, &r->req, Impl::OnBarrier);
    if (rv != 0) {
      Committed failed = std::move(r->done);
      delete r;
      failed(p->Error(rv, "barrier"));
    }
  });
}

void RaftNode::AddSpare(const Member& member, Done done) {
  Impl* p = impl_.get();
  p->Submit("add member", std::move(done), [p, member](Done d) {
    p->Change("add member", std::move(d), [&](struct raft_change* req) {
      return raft_add(&p->raft, req, member.id, member.address.c_str(), Impl::OnChanged);
    });
  });
}

void RaftNode::Assign(ServerId id, Role role, Done done) {
  Impl* p = impl_.get();
  p->Submit("assign role", std::move(done), [p, id, role](Done d) {
    p->Change("assign role", std::move(d), [&](struct raft_change* req) {
      return raft_assign(&p->raft, req, id, RaftRole(role), Impl::OnChanged);
    });
  });
}

void RaftNode::Remove(ServerId id, Done done) {
  Impl* p = impl_.get();
  p->Submit("remove member", std::move(done), [p, id](Done d) {
    p->Change("remove member", std::move(d), [&](struct raft_change* req) {
      return raft_remove(&p->raft, req, id, Impl::OnChanged);
    });
  });
}

void RaftNode::TransferLeadership(ServerId to, Done done) {
  Impl* p = impl_.get();
  p->Submit("transfer leadership", std::move(done), [p, to](Done d) {
    auto* r = new Impl::TransferRequest();
    r->impl = p;
    r->done = std::move(d);
    r->target = to;
    r->req.data = r;
    int rv = raft_transfer(&p->raft, &r->req, to, Impl::OnTransferred);
    if (rv != 0) {
      Done failed = std::move(r->done);
      delete r;
      failed(p->Error(rv, "transfer leadership"));
    }
  });
}

Member RaftNode::Leader() {
  Impl* p = impl_.get();
  if (std::this_thread::get_id() == p->loop_thread_id) return p->CurrentLeader();
  MutexLock lock(&p->view_mu);
  return p->leader_view;
}

uint64_t RaftNode::LastApplied() {
  Impl* p = impl_.get();
  if (std::this_thread::get_id() == p->loop_thread_id) {
    return static_cast<uint64_t>(raft_last_applied(&p->raft));
  }
  return p->last_applied_view.load(std::memory_order_acquire);
}

bool RaftNode::HasAllEntries(ServerId id) {
  Impl* p = impl_.get();
  auto check = [p, id] {
    if (p->raft_closing || raft_state(&p->raft) != RAFT_LEADER) return false;
    const struct raft_configuration& conf = p->raft.configuration;
    for (unsigned i = 0; i < conf.n; ++i) {
      if (conf.servers[i].id != id) continue;
      return p->raft.leader_state.progress[i].match_index >= raft_last_index(&p->raft);
    }
    return false;
  };
  if (std::this_thread::get_id() == p->loop_thread_id) return check();
  auto promise = std::make_shared<std::promise<bool>>();
  auto future = promise->get_future();
  if (!p->Post([check, promise] { promise->set_value(check()); })) return false;
  return future.get();
}

RaftNode::GroupView RaftNode::Group() {
  Impl* p = impl_.get();
  auto read = [p] {
    GroupView view;
    if (p->raft_closing) return view;
    view.members = p->CurrentMembers();
    view.committed = p->raft.configuration_uncommitted_index == 0;
    view.leading = raft_state(&p->raft) == RAFT_LEADER;
    view.term = p->raft.current_term;
    return view;
  };
  if (std::this_thread::get_id() == p->loop_thread_id) return read();
  auto promise = std::make_shared<std::promise<GroupView>>();
  auto future = promise->get_future();
  if (!p->Post([read, promise] { promise->set_value(read()); })) return GroupView{};
  return future.get();
}

std::vector<Member> RaftNode::Members() {
  Impl* p = impl_.get();
  if (std::this_thread::get_id() == p->loop_thread_id) return p->CurrentMembers();
  MutexLock lock(&p->view_mu);
  return p->members_view;
}

}  // namespace nbos::replication
