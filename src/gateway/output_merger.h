// Turns the messages of a kernel's replicas into what one Jupyter kernel would send: exactly one
// reply per request, one busy and one idle per request, and each output once. Pure: messages in,
// messages to forward out; no sockets, no clocks.
//
// Rules. An execute_request goes to every replica; the executor's reply (metadata
// nbos.role == "executor") is the answer, and when no replica executes (every one yielded, or the
// executor died) the first reply is held until every live replica answered and then forwarded.
// Other requests go to one replica, whose messages are the answer. For a request, the first
// `busy` is forwarded, and `idle` once the replica whose reply was forwarded reported idle, so
// idle still comes last. IOPub output (anything but status) is forwarded from any replica:
// standbys emit none. Messages whose parent is no tracked request (start-up status, output of
// background threads) are forwarded from the primary replica only.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "jupyter/message.h"

namespace nbos::gateway {

using ReplicaId = uint32_t;

class OutputMerger {
 public:
  // The replica whose unparented messages are forwarded; usually the last executor.
  void SetPrimary(ReplicaId replica) { primary_ = replica; }
  ReplicaId primary() const { return primary_; }

  // Request `msg_id` was sent to `replicas`. `busy_sent`: its busy status went out already (the
  // gateway's, ahead of a status line while it waited), so the replicas' busy is not forwarded.
  void Expect(const std::string& msg_id, std::vector<ReplicaId> replicas, bool busy_sent = false);
  // A shell or control reply from `replica`. Returns what to forward now, in order.
  std::vector<jupyter::Message> OnReply(ReplicaId replica, jupyter::Message reply);
  std::vector<jupyter::Message> OnIopub(ReplicaId replica, jupyter::Message message);
  // `replica` is gone: what it still owed will not come. A replica that comes back (restarted by
  // its daemon) is announced with OnReplicaBack.
  std::vector<jupyter::Message> OnReplicaLost(ReplicaId replica);

  void OnReplicaBack(ReplicaId replica);
  // `replica` stopped answering while `msg_id` was in flight: the others' replies settle that
  // request; whatever `replica` still sends for it once they did is dropped. Returns what to
  // forward now.
  std::vector<jupyter::Message> Excuse(const std::string& msg_id, ReplicaId replica);
  // `msg_id` was answered on the replicas' behalf: what they still send for it is dropped.
  // Returns whether its busy status was forwarded.
  bool Abandon(const std::string& msg_id);
  // Which replica's reply answered `msg_id`, once known; for input_reply routing and stats.
  std::optional<ReplicaId> AnsweredBy(const std::string& msg_id) const;
  size_t pending() const { return requests_.size(); }

 private:
  struct Request {
    std::set<ReplicaId> waiting;                 // replicas whose reply has not come
    std::map<ReplicaId, jupyter::Message> idle;  // replicas that reported idle, and how
    std::optional<jupyter::Message> held_reply;
    ReplicaId held_from = 0;
    std::optional<ReplicaId> answered_by;
    bool busy_sent = false;
  };

  void Answer(const std::string& msg_id, Request& r, ReplicaId replica, jupyter::Message reply,
              std::vector<jupyter::Message>* out);
  void MaybeFinish(const std::string& msg_id, Request& r, std::vector<jupyter::Message>* out);
  void Finish(const std::string& msg_id);
  // Stops waiting for `replica`'s reply to request `id`; answers with the held reply when no one
  // else is waited for.
  void StopWaiting(const std::string& id, ReplicaId replica, std::vector<jupyter::Message>* out);

  ReplicaId primary_ = 1;
  std::map<std::string, Request> requests_;
  // Finished requests: late messages for them (standbys' replies and idles) are dropped.
  std::set<std::string> finished_;
  std::deque<std::string> finished_order_;
  std::map<std::string, ReplicaId> answered_;
  std::vector<ReplicaId> lost_;
};

}  // namespace nbos::gateway
