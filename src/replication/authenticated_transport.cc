#include "replication/authenticated_transport.h"

#include <cstring>
#include <set>

#include "common/check.h"
#include "replication/peer_auth.h"

namespace nbos::replication {

namespace {

constexpr std::string_view kPurpose = "raft";

struct Handshake;

// A connect request of Raft's, while the TCP transport underneath connects.
struct PendingConnect {
  AuthenticatedTransport::Impl* self = nullptr;
  struct raft_uv_connect* req = nullptr;
  raft_uv_connect_cb cb = nullptr;
  raft_id peer_id = 0;
  std::string peer_address;
  struct raft_uv_connect inner_req {};
};

}  // namespace

struct AuthenticatedTransport::Impl {
  AuthenticatedTransportOptions options;
  uv_loop_t* loop = nullptr;
  struct raft_uv_transport outer {};
  struct raft_uv_transport inner {};
  raft_id self_id = 0;
  raft_uv_accept_cb accept_cb = nullptr;
  bool closing = false;
  bool inner_closed = false;
  raft_uv_transport_close_cb close_cb = nullptr;
  std::set<Handshake*> undecided;  // handshakes that neither admitted nor failed their stream
  size_t alive = 0;                // handshakes and pending connects not yet released

  void MaybeFinishClose() {
    if (!closing || !inner_closed || alive > 0 || close_cb == nullptr) return;
    raft_uv_transport_close_cb cb = close_cb;
    close_cb = nullptr;
    cb(&outer);
  }
};

namespace {

using Impl = AuthenticatedTransport::Impl;

// One connection between C-Raft's preamble and Raft's first byte. It owns the stream until it
// hands it over or closes it, and lives until its timer closed and its write (if any) completed.
struct Handshake {
  Impl* self = nullptr;
  uv_stream_t* stream = nullptr;
  bool accepting = false;
  raft_id peer_id = 0;
  std::string peer_address;
  struct raft_uv_connect* req = nullptr;  // the connecting end's
  raft_uv_connect_cb cb = nullptr;
  uv_timer_t timer{};
  uv_write_t write{};
  std::string nonce;     // the accepting end's, sent
  std::string outgoing;  // what `write` is sending
  char incoming[kPeerMacBytes] = {};
  size_t received = 0;
  bool timer_open = false;
  bool write_pending = false;
  bool stream_released = false;  // handed to Raft, or closed by us

  std::string Peer() const {
    return "replica " + std::to_string(peer_id) + " (" + peer_address + ")";
  }
};

static_assert(kPeerNonceBytes == kPeerMacBytes, "both ends read one fixed-size block");

void MaybeRelease(Handshake* h) {
  if (h->timer_open || h->write_pending || !h->stream_released) return;
  Impl* self = h->self;
  delete h;
  --self->alive;
  self->MaybeFinishClose();
}

void OnTimerClosed(uv_handle_t* handle) {
  auto* h = static_cast<Handshake*>(handle->data);
  h->timer_open = false;
  MaybeRelease(h);
}

void OnStreamClosed(uv_handle_t* handle) {
  auto* h = static_cast<Handshake*>(handle->data);
  raft_free(handle);
  h->stream_released = true;
  MaybeRelease(h);
}

void OnWritten(uv_write_t* write, int /*status*/) {
  // A failed write shows on the other end (or in our next read); nothing to do here.
  auto* h = static_cast<Handshake*>(write->data);
  h->write_pending = false;
  MaybeRelease(h);
}

void Send(Handshake* h, std::string bytes) {
  h->outgoing = std::move(bytes);
  uv_buf_t buf = uv_buf_init(h->outgoing.data(), static_cast<unsigned>(h->outgoing.size()));
  h->write.data = h;
  if (uv_write(&h->write, h->stream, &buf, 1, OnWritten) == 0) h->write_pending = true;
}

void Decide(Handshake* h) {
  h->self->undecided.erase(h);
  uv_timer_stop(&h->timer);
  uv_close(reinterpret_cast<uv_handle_t*>(&h->timer), OnTimerClosed);
}

// Closes the stream. A refusal of an incoming connection is reported; a failed outgoing one is
// only failed to Raft, which tries again.
void Fail(Handshake* h, const std::string& why) {
  Decide(h);
  uv_read_stop(h->stream);
  uv_close(reinterpret_cast<uv_handle_t*>(h->stream), OnStreamClosed);
  if (h->accepting) {
    if (!h->self->closing && h->self->options.on_refused) {
      h->self->options.on_refused("refused a Raft connection from " + h->Peer() + ": " + why);
    }
  } else {
    h->cb(h->req, nullptr, h->self->closing ? RAFT_CANCELED : RAFT_NOCONNECTION);
  }
}

void Admit(Handshake* h) {
  Decide(h);
  h->stream->data = nullptr;
  h->stream_released = true;
  Impl* self = h->self;
  uv_stream_t* stream = h->stream;
  if (h->accepting) {
    const std::string address = h->peer_address;
    const raft_id id = h->peer_id;
    MaybeRelease(h);
    self->accept_cb(&self->outer, id, address.c_str(), stream);
  } else {
    struct raft_uv_connect* req = h->req;
    raft_uv_connect_cb cb = h->cb;
    MaybeRelease(h);  // its answer may still be in flight: then it waits for that
    cb(req, stream, 0);
  }
}

// The whole block arrived: the accepting end checks the answer, the connecting end answers.
void OnBlock(Handshake* h) {
  const std::string_view block(h->incoming, sizeof h->incoming);
  const std::string& key = h->self->options.peer_key;
  if (h->accepting) {
    if (PeerMacMatches(key,
                       {kPurpose, h->nonce, PeerIdBytes(h->self->self_id), PeerIdBytes(h->peer_id)},
                       block)) {
      Admit(h);
    } else {
      Fail(h, "it does not hold this kernel's key");
    }
    return;
  }
  Send(h, PeerMac(key, {kPurpose, block, PeerIdBytes(h->peer_id), PeerIdBytes(h->self->self_id)}));
  Admit(h);
}

void OnAlloc(uv_handle_t* handle, size_t /*suggested*/, uv_buf_t* buf) {
  // Exactly what is missing: a byte more would be Raft's, and it would be lost to it.
  auto* h = static_cast<Handshake*>(handle->data);
  *buf = uv_buf_init(h->incoming + h->received,
                     static_cast<unsigned>(sizeof h->incoming - h->received));
}

void OnRead(uv_stream_t* stream, ssize_t nread, const uv_buf_t* /*buf*/) {
  auto* h = static_cast<Handshake*>(stream->data);
  if (nread < 0) {
    Fail(h, nread == UV_EOF ? "it closed the connection before it authenticated"
                            : std::string("read: ") + uv_strerror(static_cast<int>(nread)));
    return;
  }
  h->received += static_cast<size_t>(nread);
  if (h->received < sizeof h->incoming) return;
  uv_read_stop(stream);
  OnBlock(h);
}

void OnTimeout(uv_timer_t* timer) {
  auto* h = static_cast<Handshake*>(timer->data);
  Fail(h,
       "no authentication within " + std::to_string(h->self->options.handshake_timeout_ms) + " ms");
}

void Begin(Handshake* h) {
  Impl* self = h->self;
  ++self->alive;
  self->undecided.insert(h);
  h->stream->data = h;
  h->timer.data = h;
  uv_timer_init(self->loop, &h->timer);
  h->timer_open = true;
  if (self->closing) {
    Fail(h, "the transport is closing");
    return;
  }
  uv_timer_start(&h->timer, OnTimeout, self->options.handshake_timeout_ms, 0);
  if (h->accepting) {
    h->nonce = PeerNonce();
    Send(h, h->nonce);
  }
  if (int rv = uv_read_start(h->stream, OnAlloc, OnRead); rv != 0) {
    Fail(h, std::string("read: ") + uv_strerror(rv));
  }
}

Impl* ImplOf(struct raft_uv_transport* t) { return static_cast<Impl*>(t->impl); }

void OnInnerAccept(struct raft_uv_transport* inner, raft_id id, const char* address,
                   uv_stream_t* stream) {
  auto* h = new Handshake();
  h->self = static_cast<Impl*>(inner->data);
  h->stream = stream;
  h->accepting = true;
  h->peer_id = id;
  h->peer_address = address;
  Begin(h);
}

void OnInnerConnected(struct raft_uv_connect* inner_req, uv_stream_t* stream, int status) {
  std::unique_ptr<PendingConnect> pc(static_cast<PendingConnect*>(inner_req->data));
  Impl* self = pc->self;
  --self->alive;
  if (status != 0) {
    pc->cb(pc->req, nullptr, status);
    self->MaybeFinishClose();
    return;
  }
  auto* h = new Handshake();
  h->self = self;
  h->stream = stream;
  h->peer_id = pc->peer_id;
  h->peer_address = pc->peer_address;
  h->req = pc->req;
  h->cb = pc->cb;
  Begin(h);
}

int Init(struct raft_uv_transport* t, raft_id id, const char* address) {
  Impl* self = ImplOf(t);
  self->self_id = id;
  int rv = self->inner.init(&self->inner, id, address);
  if (rv != 0) std::memcpy(t->errmsg, self->inner.errmsg, sizeof t->errmsg);
  return rv;
}

int Listen(struct raft_uv_transport* t, raft_uv_accept_cb cb) {
  Impl* self = ImplOf(t);
  self->accept_cb = cb;
  int rv = self->inner.listen(&self->inner, OnInnerAccept);
  if (rv != 0) std::memcpy(t->errmsg, self->inner.errmsg, sizeof t->errmsg);
  return rv;
}

int Connect(struct raft_uv_transport* t, struct raft_uv_connect* req, raft_id id,
            const char* address, raft_uv_connect_cb cb) {
  Impl* self = ImplOf(t);
  auto pc = std::make_unique<PendingConnect>();
  pc->self = self;
  pc->req = req;
  pc->cb = cb;
  pc->peer_id = id;
  pc->peer_address = address;
  pc->inner_req.data = pc.get();
  int rv = self->inner.connect(&self->inner, &pc->inner_req, id, address, OnInnerConnected);
  if (rv != 0) {
    std::memcpy(t->errmsg, self->inner.errmsg, sizeof t->errmsg);
    return rv;
  }
  pc.release();  // OnInnerConnected takes it back
  ++self->alive;
  return 0;
}

void OnInnerClosed(struct raft_uv_transport* inner) {
  Impl* self = static_cast<Impl*>(inner->data);
  self->inner_closed = true;
  self->MaybeFinishClose();
}

void Close(struct raft_uv_transport* t, raft_uv_transport_close_cb cb) {
  Impl* self = ImplOf(t);
  self->closing = true;
  self->close_cb = cb;
  const std::set<Handshake*> undecided = self->undecided;
  for (Handshake* h : undecided) Fail(h, "the transport is closing");
  self->inner.close(&self->inner, OnInnerClosed);
}

}  // namespace

int AuthenticatedTransport::Create(uv_loop_t* loop, AuthenticatedTransportOptions options,
                                   std::unique_ptr<AuthenticatedTransport>* out) {
  NBOS_CHECK(!options.peer_key.empty(), "an authenticated transport needs a key");
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  impl->loop = loop;
  if (int rv = raft_uv_tcp_init(&impl->inner, loop); rv != 0) return rv;
  impl->inner.data = impl.get();
  impl->outer.impl = impl.get();
  impl->outer.init = Init;
  impl->outer.listen = Listen;
  impl->outer.connect = Connect;
  impl->outer.close = Close;
  out->reset(new AuthenticatedTransport(std::move(impl)));
  return 0;
}

AuthenticatedTransport::AuthenticatedTransport(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}

AuthenticatedTransport::~AuthenticatedTransport() {
  NBOS_CHECK(impl_->alive == 0, "transport released with connections in its handshake");
  raft_uv_tcp_close(&impl_->inner);
}

struct raft_uv_transport* AuthenticatedTransport::transport() {
  return &impl_->outer;
}

}  // namespace nbos::replication
