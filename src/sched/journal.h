// Decision journal: a JSON-lines record of every event a Scheduler applied and the outcome it
// returned, written by the gateway or the simulator and replayed by `nbos sim replay`.
//
// Format (one JSON object per line):
//   line 1: {"journal":"nbos-sched","version":1,"options":{...SchedulerOptions...}}
//   then:   {"seq":N,"t_ms":T,"event":"<EventName>","input":{...},"outcome":{...}}
// seq counts records from 1. "outcome" is {"status":{"code":..,"message":..},"decision":{...}},
// with decision null for mutations and errors. Keys are written sorted, so encoding the same
// outcome twice gives the same bytes; replay compares those bytes.
// A tick's decision carries "rebalance" (its proactive moves, each a migration plan plus
// "kernel_id") only when it has some, and the header's options carry "rebalance" (read as off
// when absent), so journals written before proactive rebalancing still replay.
// Scheduler state that the cluster view does not hold (a kernel's committed GPUs, pending
// executor request, last cell size, last proactive move) is derived from the journaled events,
// so replay re-derives it too.
#pragma once

#include <cstdint>
#include <istream>
#include <ostream>
#include <string>
#include <string_view>

#include "common/status.h"
#include "sched/scheduler.h"

namespace nbos::sched {

inline constexpr int kJournalVersion = 1;

std::string EncodeJournalHeader(const SchedulerOptions& options);
// InvalidArgument: not a header line, an unknown version, or invalid options.
Result<SchedulerOptions> DecodeJournalHeader(std::string_view line);

// One record line (no trailing newline).
std::string EncodeJournalRecord(int64_t seq, int64_t now_ms, const SchedulerEvent& event,
                                const SchedulerOutcome& outcome);
// The canonical encoding of an outcome alone (the "outcome" field of a record).
std::string EncodeOutcome(const SchedulerOutcome& outcome);

struct JournalRecord {
  int64_t seq = 0;
  int64_t now_ms = 0;
  SchedulerEvent event;
  std::string outcome_json;  // canonical, as EncodeOutcome writes it
};
// InvalidArgument naming the field that is missing or malformed.
Result<JournalRecord> DecodeJournalRecord(std::string_view line);

// Writes the header at construction, then one line per event. The stream must outlive it.
class JournalWriter : public SchedulerObserver {
 public:
  JournalWriter(std::ostream& out, const SchedulerOptions& options);
  void OnEvent(int64_t now_ms, const SchedulerEvent& event,
               const SchedulerOutcome& outcome) override;
  int64_t records() const { return seq_; }

 private:
  std::ostream& out_;
  int64_t seq_ = 0;
};

struct ReplayReport {
  int64_t records = 0;  // records re-derived (up to and including a mismatch)
  bool matched = true;
  int64_t mismatch_seq = 0;  // with !matched
  std::string mismatch;      // with !matched: event, expected and derived outcomes
};

// Re-derives every record's outcome through a fresh Scheduler built from the header's options
// and compares it with the recorded one; stops at the first mismatch. Errors (malformed journal,
// time going backwards) are a Status, not a mismatch.
Result<ReplayReport> ReplayJournal(std::istream& in);

}  // namespace nbos::sched
