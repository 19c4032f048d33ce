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
  // JSON parsed off the wire holds positive numbers as unsigned, literals in code as signed.
  const bool positive =
      id != content.end() && ((id->is_number_unsigned() && id->get<uint64_t>() > 0) ||
                              (id->is_number_integer() && id->get<int64_t>() > 0));
  if (!positive) {
    return InvalidArgument("membership request needs a positive integer \"replica_id\"");
  }
  change.replica_id =
      id->is_number_unsigned() ? id->get<uint64_t>() : static_cast<uint64_t>(id->get<int64_t>());
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
