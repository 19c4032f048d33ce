// Demand forecast from session state: how likely an idle kernel is to ask for GPUs again within
// a horizon, learned online from the idle gaps the scheduler has seen (from a kernel's placement
// or its last GPU release to its next executor request). Pure and deterministic: gaps and times
// are passed in; nothing here reads a clock. Only what has already happened is used, so the
// gateway can run it as the simulator does.
//
// Each kernel's chance mixes its own history of gaps with that of all kernels (a kernel with few
// gaps of its own looks like the population), and the population's is weighted by a
// time-of-week profile of executor requests learned from the same events.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <map>

namespace nbos::sched {

struct ForecastOptions {
  // Off: no forecast (the gateway's default). `nbos sim` turns it on for notebookos.
  bool enabled = false;
  // How far ahead expected demand is counted: a server asked for now joins after the
  // provisioning time (120 s in the simulator's cloud estimate), so demand within about that
  // long can still be met by scaling now.
  int64_t horizon_ms = 180000;
  // A kernel's own gaps count as much as this many of the population's: with n gaps of its own
  // beyond the current idle time, its chance is (n × own + prior_weight × population) /
  // (n + prior_weight).
  double prior_weight = 4.0;
  // Gaps remembered per kernel (the most recent), > 0.
  int32_t kernel_history = 32;
  // The GPUs an idle kernel is kept ready for (rebalancing) are the most its next cell needs
  // with at least this chance (GpuNeed::cover_gpus): a kernel whose 1-GPU cells are often
  // followed by 8-GPU ones is kept next to a wholly idle server.
  double cover_chance = 0.25;
  // With ScalingOptions::release_max_pinning_replicas >= 0: an idle kernel at least this likely
  // to run a cell within the horizon pins one server that has its next cell's GPUs (cover_gpus)
  // idle against scale-in, unless a busy server has them (Scheduler::ReliedOn).
  double pin_min_chance = 0.1;
  // Executor choice spares covers (executor.h SpareSoleCovers): among the replicas that can run
  // a cell, those whose server is the only cover of fewer idle kernels at least this likely to
  // run a cell within the horizon go first. < 0: off.
  double spare_cover_min_chance = -1;
  // Auto-scaling keeps wholly idle servers for the whole-server cells that idle kernels are
  // expected to run within the horizon: ⌈E + z·σ⌉ of them, E and σ² the mean and variance of how
  // many such cells come (Σ p·w and Σ p·w·(1 − p·w) over idle kernels, p the return chance, w
  // GpuNeed::whole_chance). One busy minute of the trace brings several at once, and each finds
  // its server only if one was idle before it came (a new server takes minutes). < 0: off.
  double idle_servers_z = -1;
  // Rebalancing keeps an idle kernel next to a whole server's idle GPUs as well as its cover when
  // its cover is smaller but it is at least this likely to run a whole-server cell within the
  // horizon (return chance × GpuNeed::whole_chance): at cover_chance 0.25, a kernel whose 1-GPU
  // cells are followed by 8-GPU ones one time in six is covered for 1 GPU only. < 0: off.
  double whole_cover_min_chance = -1;
};

// An online distribution of idle gaps, in log-spaced bins from 1 s to months, plus gaps that
// never ended (the kernel was removed while idle, which counts as a gap longer than any).
class GapDistribution {
 public:
  void Observe(int64_t gap_ms);  // gap_ms >= 0
  void ObserveNeverReturned() { ++never_; }
  int64_t count() const { return total_ + never_; }
  // P(gap <= idle_ms + horizon_ms | gap > idle_ms), linear within a bin; 0 when (less than one)
  // gap longer than idle_ms has been seen, `fallback` when no gap at all has.
  double ChanceWithin(int64_t idle_ms, int64_t horizon_ms, double fallback) const;
  // The bin of a gap: a caller may keep a kernel's chance while its idle time stays in one bin
  // (4 per doubling from 1 s, so at most a fifth of the idle time so far).
  static int BinOf(int64_t gap_ms);

 private:
  static constexpr int kBins = 100;  // the last ends after 2^25 s
  // Observed gaps > t_ms (counting never-returned ones), interpolated within t's bin.
  double Above(int64_t t_ms) const;
  std::array<int64_t, kBins> counts_{};
  std::array<int64_t, kBins + 1> from_{};  // gaps in bins >= i, so that Above is O(1)
  int64_t total_ = 0;
  int64_t never_ = 0;
};

// The gaps of one kernel, most recent last, at most ForecastOptions::kernel_history of them.
struct KernelGaps {
  std::deque<int64_t> gaps_ms;
  void Add(int64_t gap_ms, int32_t history);
  // Own gaps longer than idle_ms, and of those the ones ending within idle_ms + horizon_ms.
  void Count(int64_t idle_ms, int64_t horizon_ms, int32_t* longer, int32_t* within) const;
};

// Time-of-week activity: executor requests per hour of the week, learned online. Weight(t) is
// the hour's rate against the mean over the hours seen so far (1 until a full week is seen, and
// clamped to [0.25, 4]), so a kernel idle on a quiet night counts for less than one idle on a
// busy afternoon.
class WeekProfile {
 public:
  void Observe(int64_t now_ms);
  double Weight(int64_t now_ms) const;

 private:
  static constexpr int kHours = 7 * 24;
  std::array<int64_t, kHours> counts_{};
  int64_t first_ms_ = -1;
  int64_t last_ms_ = 0;
  int64_t total_ = 0;
};

// What a cell of N GPUs is followed by: counts of the next cell's GPUs per last cell's GPUs,
// learned online (for all kernels, and for each kernel on its own).
class NeedHistory {
 public:
  void Observe(int32_t last_gpus, int32_t next_gpus) { ++counts_[last_gpus][next_gpus]; }
  // Next cells after a cell of last_gpus: how many were seen, and how many needed >= gpus.
  int64_t After(int32_t last_gpus) const;
  int64_t AfterAtLeast(int32_t last_gpus, int32_t gpus) const;
  // The GPU counts ever seen after a cell of last_gpus, ascending.
  const std::map<int32_t, int64_t>* Next(int32_t last_gpus) const;

 private:
  std::map<int32_t, std::map<int32_t, int64_t>> counts_;
};

struct GpuNeed {
  double expected_gpus = 0;  // E[next cell's GPUs]
  int32_t cover_gpus = 0;    // the most it needs with at least options.cover_chance
  double whole_chance = 0;   // P(next cell's GPUs >= server_gpus): it takes a whole server
};
// The next cell's likely GPUs after a cell of last_gpus, the kernel's own history mixed with the
// population's as in ReturnChance. With no history at all: last_gpus for both (and whole_chance 1
// if that is a whole server, else 0). server_gpus > 0.
GpuNeed NextNeed(const NeedHistory& population, const NeedHistory& own, int32_t last_gpus,
                 const ForecastOptions& options, int32_t server_gpus);

// P(the kernel asks for GPUs within options.horizon_ms | idle for idle_ms), in [0, 1].
double ReturnChance(const GapDistribution& population, const KernelGaps& own,
                    const WeekProfile& week, int64_t now_ms, int64_t idle_ms,
                    const ForecastOptions& options);

}  // namespace nbos::sched
