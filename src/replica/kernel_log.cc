#include "replica/kernel_log.h"

#include <algorithm>
#include <cstring>

namespace nbos::replica {

namespace {

using jupyter::Json;

constexpr uint8_t kFormatVersion = 1;

void PutU32(std::string* out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out->push_back(static_cast<char>(v >> shift));
}

bool GetU32(std::string_view* in, uint32_t* v) {
  if (in->size() < 4) return false;
  *v = 0;
  for (int i = 0; i < 4; ++i) *v = (*v << 8) | static_cast<uint8_t>((*in)[i]);
  in->remove_prefix(4);
  return true;
}

bool ValidType(uint8_t t) { return t >= 1 && t <= 8; }

bool Contains(const std::vector<ReplicaId>& v, ReplicaId r) {
  return std::find(v.begin(), v.end(), r) != v.end();
}

// The non-empty lines of `text`.
std::vector<std::string> SplitLines(std::string_view text) {
  std::vector<std::string> lines;
  while (!text.empty()) {
    const size_t end = std::min(text.find('\n'), text.size());
    if (end > 0) lines.emplace_back(text.substr(0, end));
    text.remove_prefix(std::min(end + 1, text.size()));
  }
  return lines;
}

}  // namespace

// Layout: version byte, type byte, u32 header length, header JSON (exec_id, replica, meta, and
// the proposal id when there is one), payload bytes to the end. The payload stays raw: deltas can
// be megabytes of pickle. Decoders of the same version ignore header fields they do not know, so
// entries with an id stay readable by older code and entries without one by newer code.
std::string EncodeKernelEntry(const KernelEntry& entry) {
  Json fields{{"exec_id", entry.exec_id}, {"replica", entry.replica}, {"meta", entry.meta}};
  if (!entry.id.empty()) fields["id"] = entry.id;
  std::string header = fields.dump();
  std::string out;
  out.reserve(2 + 4 + header.size() + entry.payload.size());
  out.push_back(static_cast<char>(kFormatVersion));
  out.push_back(static_cast<char>(entry.type));
  PutU32(&out, static_cast<uint32_t>(header.size()));
  out += header;
  out += entry.payload;
  return out;
}

Result<KernelEntry> DecodeKernelEntry(std::string_view bytes) {
  if (bytes.size() < 2) return InvalidArgument("kernel log entry too short");
  if (static_cast<uint8_t>(bytes[0]) != kFormatVersion) {
    return InvalidArgument("kernel log entry of unknown format version " +
                           std::to_string(static_cast<uint8_t>(bytes[0])));
  }
  uint8_t type = static_cast<uint8_t>(bytes[1]);
  if (!ValidType(type)) return InvalidArgument("kernel log entry of unknown type");
  bytes.remove_prefix(2);
  uint32_t header_len = 0;
  if (!GetU32(&bytes, &header_len) || header_len > bytes.size()) {
    return InvalidArgument("kernel log entry header truncated");
  }
  Json header = Json::parse(bytes.substr(0, header_len), nullptr, false);
  if (!header.is_object() || !header.contains("exec_id") || !header["exec_id"].is_string() ||
      !header.contains("replica") || !header["replica"].is_number_unsigned()) {
    return InvalidArgument("kernel log entry header is malformed");
  }
  KernelEntry entry;
  entry.type = static_cast<KernelEntry::Type>(type);
  entry.exec_id = header["exec_id"].get<std::string>();
  entry.replica = header["replica"].get<ReplicaId>();
  if (auto meta = header.find("meta"); meta != header.end() && meta->is_object()) {
    entry.meta = *meta;
  }
  if (auto id = header.find("id"); id != header.end()) {
    if (!id->is_string()) return InvalidArgument("kernel log entry id is not a string");
    entry.id = id->get<std::string>();
  }
  entry.payload = std::string(bytes.substr(header_len));
  return entry;
}

ProposalIds::ProposalIds(ReplicaId replica, std::string nonce)
    : prefix_(std::to_string(replica) + ":" + std::move(nonce) + ":") {}

std::string ProposalIds::Next() { return prefix_ + std::to_string(next_seq_++); }

KernelStateMachine::KernelStateMachine(size_t replicas, Listener* listener)
    : replicas_(replicas), listener_(listener) {}

bool KernelStateMachine::FirstApplication(const std::string& id) {
  if (!applied_ids_.insert(id).second) return false;
  applied_id_order_.push_back(id);
  if (applied_id_order_.size() > kAppliedIdsKept) {
    applied_ids_.erase(applied_id_order_.front());
    applied_id_order_.pop_front();
  }
  return true;
}

Election& KernelStateMachine::ElectionSlot(const std::string& exec_id) {
  auto [it, inserted] = elections_.try_emplace(exec_id);
  if (inserted) {
    election_order_.push_back(exec_id);
    if (election_order_.size() > kElectionsKept) {
      elections_.erase(election_order_.front());
      election_order_.pop_front();
    }
  }
  return elections_[exec_id];
}

void KernelStateMachine::Apply(std::string_view command) {
  auto decoded = DecodeKernelEntry(command);
  if (!decoded.ok()) {
    // Every replica sees the same bytes, so every replica skips the same entry.
    ++malformed_entries_;
    return;
  }
  KernelEntry& e = *decoded;
  if (!e.id.empty() && !FirstApplication(e.id)) {
    // The same proposal committed again (a retry): its effects are already applied, on every
    // replica alike, since every replica skips the same copies.
    ++duplicates_skipped_;
    if (listener_) listener_->OnDuplicateSkipped(e);
    return;
  }
  const bool effect = e.type == KernelEntry::Type::kDelta ||
                      e.type == KernelEntry::Type::kSideEffect ||
                      e.type == KernelEntry::Type::kDone;
  if (effect && FromLoser(e)) {
    ++losers_skipped_;
    return;
  }
  switch (e.type) {
    case KernelEntry::Type::kLead:
    case KernelEntry::Type::kYield:
      ApplyProposal(e);
      return;
    case KernelEntry::Type::kCancel:
      Cancel(e.exec_id);
      return;
    case KernelEntry::Type::kDelta:
      journal_.push_back({e.type, e.exec_id, e.payload});
      ++journal_total_;
      if (listener_) listener_->OnDelta(e.exec_id, e.replica, journal_.back().payload);
      return;
    case KernelEntry::Type::kSideEffect:
      journal_.push_back({e.type, e.exec_id, e.payload});
      ++journal_total_;
      if (listener_) listener_->OnSideEffect(e.exec_id, journal_.back().payload);
      return;
    case KernelEntry::Type::kBlobHint:
      if (listener_) listener_->OnBlobHint(e.exec_id, e.replica, SplitLines(e.payload));
      return;
    case KernelEntry::Type::kDone:
      ++executions_done_;
      if (e.exec_id == running_) running_.clear();
      if (listener_) listener_->OnDone(e.exec_id, e.replica, e.meta);
      return;
    case KernelEntry::Type::kCheckpoint: {
      // Replicas already hold this state; it only shortens what catch-up must replay. It was
      // taken after its author applied `covers` records; any committed after that stay.
      const uint64_t first_kept = journal_total_ - journal_.size();
      const uint64_t covers = e.meta.value("covers", journal_total_);
      if (covers < first_kept || covers > journal_total_) return;  // stale or impossible
      journal_.erase(journal_.begin(), journal_.begin() + static_cast<long>(covers - first_kept));
      checkpoint_ = std::move(e.payload);
      if (listener_) listener_->OnCheckpoint(covers);
      return;
    }
  }
}

void KernelStateMachine::ApplyProposal(const KernelEntry& e) {
  Election& election = ElectionSlot(e.exec_id);
  if (election.winner || election.failed) return;  // decided: late proposals change nothing
  auto& list = e.type == KernelEntry::Type::kLead ? election.leads : election.yields;
  if (Contains(election.leads, e.replica) || Contains(election.yields, e.replica)) return;
  list.push_back(e.replica);
  if (e.type == KernelEntry::Type::kLead) {
    const auto ran_on = e.meta.find("ran_on");
    if (ran_on != e.meta.end() &&
        !(ran_on->is_number_unsigned() && ran_on->get<uint64_t>() == journal_total_)) {
      // The cell ran on a namespace that lacks effects committed before this LEAD: applying
      // its delta on top of them would make the replicas differ from what it computed.
      election.failed = election.overtaken = true;
      if (listener_) listener_->OnAllYielded(e.exec_id);
      return;
    }
    if (!EpochMayWin(e.exec_id)) {
      election.failed = election.cancelled = true;
      if (listener_) listener_->OnCancelled(e.exec_id);
      return;
    }
    election.winner = e.replica;
    Supersede(e.exec_id);
    if (listener_) listener_->OnElected(e.exec_id, e.replica);
    // Cells the gateway gave up on before this one: none may win after it, which would apply an
    // older cell's effects after this one's (a frozen executor running its queued request late).
    const auto cancels = e.meta.find("cancels");
    if (cancels != e.meta.end() && cancels->is_array()) {
      for (const auto& id : *cancels)
        if (id.is_string() && id.get_ref<const std::string&>() != e.exec_id)
          Cancel(id.get<std::string>());
    }
  } else if (election.yields.size() >= replicas_) {
    election.failed = true;
    if (listener_) listener_->OnAllYielded(e.exec_id);
  }
}

void KernelStateMachine::Cancel(const std::string& exec_id) {
  Election& election = ElectionSlot(exec_id);
  if (election.winner || election.failed) return;  // decided: the cancel comes too late
  election.failed = election.cancelled = true;
  if (listener_) listener_->OnCancelled(exec_id);
}

void KernelStateMachine::Supersede(const std::string& exec_id) {
  if (!running_.empty() && running_ != exec_id) {
    auto it = elections_.find(running_);
    if (it != elections_.end()) {
      it->second.superseded = true;
      if (listener_) listener_->OnSuperseded(running_);
    }
  }
  running_ = exec_id;
}

bool KernelStateMachine::EpochMayWin(const std::string& exec_id) {
  const size_t colon = exec_id.rfind(':');
  const size_t dot = exec_id.rfind('.');
  if (colon == std::string::npos || dot == std::string::npos || dot < colon) return true;
  const std::string epoch = exec_id.substr(colon + 1, dot - colon - 1);
  if (epoch.empty() || epoch == current_epoch_) return true;
  if (std::find(retired_epochs_.begin(), retired_epochs_.end(), epoch) != retired_epochs_.end()) {
    return false;
  }
  if (!current_epoch_.empty()) {
    retired_epochs_.push_back(std::move(current_epoch_));
    if (retired_epochs_.size() > kRetiredEpochsKept) retired_epochs_.pop_front();
  }
  current_epoch_ = epoch;
  return true;
}

bool KernelStateMachine::FromLoser(const KernelEntry& e) const {
  auto it = elections_.find(e.exec_id);
  if (it == elections_.end()) return false;  // forgotten long ago, or an entry without election
  const Election& el = it->second;
  return el.failed || el.superseded || (el.winner && *el.winner != e.replica);
}

std::string KernelStateMachine::Snapshot() {
  // Checkpoint and journal are binary: they travel as payloads of entries in a length-prefixed
  // sequence, with the small election table and the window of applied proposal ids in the first
  // entry's meta.
  Json elections = Json::array();
  for (const auto& id : election_order_) {
    const Election& el = elections_.at(id);
    elections.push_back(Json{{"id", id},
                             {"winner", el.winner ? Json(*el.winner) : Json()},
                             {"failed", el.failed},
                             {"overtaken", el.overtaken},
                             {"cancelled", el.cancelled},
                             {"superseded", el.superseded},
                             {"leads", el.leads},
                             {"yields", el.yields}});
  }
  std::vector<KernelEntry> parts;
  parts.push_back({KernelEntry::Type::kCheckpoint, "", 0,
                   Json{{"elections", std::move(elections)},
                        {"executions_done", executions_done_},
                        {"running", running_},
                        {"current_epoch", current_epoch_},
                        {"retired_epochs", retired_epochs_},
                        {"journal_total", journal_total_},
                        {"malformed_entries", malformed_entries_},
                        {"applied_ids", applied_id_order_},
                        {"duplicates_skipped", duplicates_skipped_}},
                   checkpoint_});
  for (const auto& r : journal_) parts.push_back({r.type, r.exec_id, 0, Json::object(), r.payload});
  std::string out;
  for (const auto& p : parts) {
    std::string encoded = EncodeKernelEntry(p);
    PutU32(&out, static_cast<uint32_t>(encoded.size()));
    out += encoded;
  }
  return out;
}

Status KernelStateMachine::Restore(std::string_view snapshot) {
  std::vector<KernelEntry> parts;
  while (!snapshot.empty()) {
    uint32_t len = 0;
    if (!GetU32(&snapshot, &len) || len > snapshot.size()) {
      return InvalidArgument("kernel snapshot truncated");
    }
    auto entry = DecodeKernelEntry(snapshot.substr(0, len));
    if (!entry.ok()) return entry.status();
    parts.push_back(std::move(*entry));
    snapshot.remove_prefix(len);
  }
  if (parts.empty() || parts[0].type != KernelEntry::Type::kCheckpoint) {
    return InvalidArgument("kernel snapshot lacks its checkpoint");
  }
  std::map<std::string, Election> elections;
  std::deque<std::string> order;
  for (const auto& el : parts[0].meta.value("elections", Json::array())) {
    Election e;
    if (!el.value("winner", Json()).is_null()) e.winner = el["winner"].get<ReplicaId>();
    e.failed = el.value("failed", false);
    e.overtaken = el.value("overtaken", false);
    e.cancelled = el.value("cancelled", false);
    e.superseded = el.value("superseded", false);
    e.leads = el.value("leads", std::vector<ReplicaId>{});
    e.yields = el.value("yields", std::vector<ReplicaId>{});
    std::string id = el.value("id", "");
    order.push_back(id);
    elections[id] = std::move(e);
  }
  // Snapshots of older versions have no window: nothing applied before them is deduped.
  std::deque<std::string> applied_order;
  std::unordered_set<std::string> applied;
  const Json ids = parts[0].meta.value("applied_ids", Json::array());
  if (!ids.is_array()) return InvalidArgument("kernel snapshot applied_ids is not a list");
  for (const auto& id : ids) {
    if (!id.is_string()) return InvalidArgument("kernel snapshot applied_ids holds a non-string");
    std::string value = id.get<std::string>();
    if (applied.insert(value).second) applied_order.push_back(std::move(value));
  }
  while (applied_order.size() > kAppliedIdsKept) {
    applied.erase(applied_order.front());
    applied_order.pop_front();
  }
  elections_ = std::move(elections);
  election_order_ = std::move(order);
  applied_ids_ = std::move(applied);
  applied_id_order_ = std::move(applied_order);
  duplicates_skipped_ = parts[0].meta.value("duplicates_skipped", uint64_t{0});
  executions_done_ = parts[0].meta.value("executions_done", uint64_t{0});
  running_ = parts[0].meta.value("running", "");
  // Snapshots of older versions have no epochs: none is retired until a later one wins.
  current_epoch_ = parts[0].meta.value("current_epoch", "");
  retired_epochs_ = parts[0].meta.value("retired_epochs", std::deque<std::string>{});
  journal_total_ = parts[0].meta.value("journal_total", uint64_t{0});
  malformed_entries_ = parts[0].meta.value("malformed_entries", uint64_t{0});
  checkpoint_ = std::move(parts[0].payload);
  journal_.clear();
  for (size_t i = 1; i < parts.size(); ++i) {
    journal_.push_back({parts[i].type, parts[i].exec_id, std::move(parts[i].payload)});
  }
  if (journal_total_ < journal_.size()) return InvalidArgument("kernel snapshot inconsistent");
  if (listener_) listener_->OnRestored(checkpoint_, journal_, journal_total_);
  return Status::Ok();
}

std::optional<Election> KernelStateMachine::ElectionFor(const std::string& exec_id) const {
  auto it = elections_.find(exec_id);
  if (it == elections_.end()) return std::nullopt;
  return it->second;
}

}  // namespace nbos::replica
