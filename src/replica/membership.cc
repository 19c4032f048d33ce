#include "replica/membership.h"

#include <arpa/inet.h>

#include <algorithm>

namespace nbos::replica {

bool IsRaftAddress(const std::string& address) {
  size_t colon = address.rfind(':');
  if (colon == std::string::npos) return false;
  in_addr ip{};
  if (inet_pton(AF_INET, address.substr(0, colon).c_str(), &ip) != 1) return false;
  const std::string port = address.substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  const int number = std::stoi(port);
  return number >= 1 && number <= 65534;
}

namespace {
constexpr uint64_t kMaxTimeoutMs = 24 * 3600 * 1000;

// The value of a positive JSON integer, else 0. JSON parsed off the wire holds positive numbers
// as unsigned, literals in code as signed.
uint64_t PositiveInteger(const jupyter::Json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() > 0) return static_cast<uint64_t>(v.get<int64_t>());
  return 0;
}
}  // namespace

Result<MembershipChange> ParseMembershipRequest(const jupyter::Json& content) {
  if (!content.is_object()) return InvalidArgument("membership request content is not an object");
  MembershipChange change;
  auto op = content.find("op");
  if (op == content.end() || !op->is_string()) {
    return InvalidArgument("membership request needs \"op\": \"add\" or \"remove\"");
  }
  if (*op == "add") {
    change.op = MembershipChange::Op::kAdd;
  } else if (*op == "remove") {
    change.op = MembershipChange::Op::kRemove;
  } else {
    return InvalidArgument("membership request op '" + op->get<std::string>() +
                           "' is neither \"add\" nor \"remove\"");
  }
  auto id = content.find("replica_id");
  if (id == content.end() || !PositiveInteger(*id)) {
    return InvalidArgument("membership request needs a positive integer \"replica_id\"");
  }
  change.replica_id = PositiveInteger(*id);
  if (auto timeout = content.find("timeout_ms"); timeout != content.end()) {
    if (!PositiveInteger(*timeout)) {
      return InvalidArgument("membership request \"timeout_ms\" is not a positive integer");
    }
    change.timeout =
        std::chrono::milliseconds(std::min<uint64_t>(PositiveInteger(*timeout), kMaxTimeoutMs));
  }
  if (change.op == MembershipChange::Op::kAdd) {
    auto address = content.find("raft_address");
    if (address == content.end() || !address->is_string()) {
      return InvalidArgument("membership request \"add\" needs \"raft_address\": \"IPv4:port\"");
    }
    change.raft_address = address->get<std::string>();
    if (!IsRaftAddress(change.raft_address)) {
      return InvalidArgument("raft_address '" + change.raft_address +
                             "' is not IPv4:port with a port in 1..65534");
    }
  }
  return change;
}

}  // namespace nbos::replica
