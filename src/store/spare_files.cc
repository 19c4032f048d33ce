#include "store/spare_files.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace nbos::store {

namespace {

// The refill thread also wakes this often to drop idle spares.
constexpr auto kIdleCheckInterval = std::chrono::seconds(5);
// Allocate checks for a closing store this often while it touches a spare's pages.
constexpr size_t kStopCheckBytes = size_t{1} << 20;

// A number from a one-line file, or nullopt ("max", missing, unreadable).
std::optional<uint64_t> ReadNumber(const std::filesystem::path& path) {
  std::ifstream in(path);
  uint64_t value = 0;
  if (!(in >> value)) return std::nullopt;
  return value;
}

// Limit less usage of this process's memory cgroup (v2, else v1's memory controller), or
// nullopt where there is no limit or it cannot be read (a sandbox without /sys/fs/cgroup).
std::optional<uint64_t> CgroupHeadroomBytes() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    // "0::/path" (v2) or "4:memory:/path" (v1).
    const size_t first = line.find(':');
    const size_t second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const std::string path = line.substr(second + 1);
    std::optional<uint64_t> limit, usage;
    if (controllers.empty()) {
      limit = ReadNumber("/sys/fs/cgroup" + path + "/memory.max");
      usage = ReadNumber("/sys/fs/cgroup" + path + "/memory.current");
    } else if (controllers == "memory") {
      limit = ReadNumber("/sys/fs/cgroup/memory" + path + "/memory.limit_in_bytes");
      usage = ReadNumber("/sys/fs/cgroup/memory" + path + "/memory.usage_in_bytes");
    }
    if (limit && usage) return *limit > *usage ? *limit - *usage : 0;
  }
  return std::nullopt;
}

uint64_t MemAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string name;
  uint64_t kib = 0;
  std::string unit;
  while (in >> name >> kib) {
    std::getline(in, unit);
    if (name == "MemAvailable:") return kib * 1024;
  }
  return 0;  // unknown: make no spares
}

}  // namespace

void SpareFile::Unmap() {
  if (map != nullptr) ::munmap(map, allocated_bytes);
  map = nullptr;
}

void SpareFile::Close() {
  Unmap();
  if (fd >= 0) ::close(fd);
  fd = -1;
}

int64_t SteadyNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

uint64_t SpareFiles::MemoryHeadroomBytes() {
  const uint64_t available = MemAvailableBytes();
  const std::optional<uint64_t> cgroup = CgroupHeadroomBytes();
  return cgroup ? std::min(available, *cgroup) : available;
}

SpareFiles::SpareFiles(std::filesystem::path dir, SpareFilesOptions options)
    : dir_(std::move(dir)), options_(std::move(options)) {
  last_take_ms_ = SteadyNowMs();
  if (options_.refill_thread) refill_ = std::thread([this] { RefillLoop(); });
}

SpareFiles::~SpareFiles() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  wake_.SignalAll();
  if (refill_.joinable()) refill_.join();
  MutexLock lock(&mu_);
  for (SpareFile& spare : TakeAllLocked()) spare.Close();
}

std::optional<SpareFile> SpareFiles::Take(size_t bytes) {
  std::optional<SpareFile> taken;
  {
    MutexLock lock(&mu_);
    last_take_ms_ = SteadyNowMs();
    auto best = spares_.end();  // the smallest that fits
    for (auto it = spares_.begin(); it != spares_.end(); ++it) {
      if (it->allocated_bytes >= bytes &&
          (best == spares_.end() || it->allocated_bytes < best->allocated_bytes)) {
        best = it;
      }
    }
    if (best == spares_.end()) {  // else the largest
      best = std::max_element(spares_.begin(), spares_.end(),
                              [](const SpareFile& a, const SpareFile& b) {
                                return a.allocated_bytes < b.allocated_bytes;
                              });
    }
    if (best != spares_.end()) {
      taken = *best;
      spare_bytes_ -= best->allocated_bytes;
      spares_.erase(best);
    }
    wanted_.push_back(std::min(bytes, options_.budget_bytes));
    // Asking for more than the budget holds would only churn: the oldest wishes go.
    size_t wanted_bytes = 0;
    for (size_t w : wanted_) wanted_bytes += w;
    while (wanted_bytes > options_.budget_bytes && !wanted_.empty()) {
      wanted_bytes -= wanted_.front();
      wanted_.pop_front();
    }
  }
  wake_.Signal();
  return taken;
}

std::optional<SpareFile> SpareFiles::Allocate(size_t bytes) const {
  const uint64_t headroom =
      options_.memory_headroom_bytes ? options_.memory_headroom_bytes() : MemoryHeadroomBytes();
  if (bytes == 0 || bytes > headroom / 4) return std::nullopt;
  SpareFile spare;
  spare.fd = ::open(dir_.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0644);
  if (spare.fd < 0) return std::nullopt;
  spare.allocated_bytes = bytes;
  // Mode 0 allocates (on tmpfs: zero-filled pages) and sets the size; a put that writes fewer
  // bytes truncates the rest away.
  void* map = MAP_FAILED;
  if (::fallocate(spare.fd, 0, 0, static_cast<off_t>(bytes)) == 0) {
    map = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, spare.fd, 0);
  }
  if (map == MAP_FAILED) {
    spare.Close();
    return std::nullopt;
  }
  spare.map = static_cast<char*>(map);
  // Touched from user space, page by page: MAP_POPULATE would fill the page tables from the
  // kernel, which does not spare the put's own first touches where those tables are shadowed.
  // At idle priority this can take long on a busy host: a closing store does not wait for it.
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  for (size_t offset = 0; offset < bytes; offset += page) {
    if (offset % kStopCheckBytes == 0 && stopping_.load(std::memory_order_relaxed)) {
      spare.Close();
      return std::nullopt;
    }
    static_cast<volatile char*>(spare.map)[offset] = 0;
  }
  return spare;
}

void SpareFiles::RefillOnce(int64_t now_ms) {
  MutexLock lock(&mu_);
  if (now_ms - last_take_ms_ >= options_.idle_release_ms) {
    std::deque<SpareFile> idle = TakeAllLocked();
    wanted_.clear();
    lock.Unlock();
    for (SpareFile& spare : idle) spare.Close();
    return;
  }
  while (!wanted_.empty() && !stopping_) {
    const size_t bytes = wanted_.front();
    wanted_.pop_front();
    std::vector<SpareFile> pushed_out;
    while (!spares_.empty() && spare_bytes_ + bytes > options_.budget_bytes) {
      spare_bytes_ -= spares_.front().allocated_bytes;
      pushed_out.push_back(spares_.front());
      spares_.pop_front();
    }
    // Unmapping and allocating are the slow parts: not under the lock, which a put's Take needs
    // while this thread, at idle priority, may wait long for a core.
    lock.Unlock();
    for (SpareFile& old : pushed_out) old.Close();
    std::optional<SpareFile> spare = Allocate(bytes);
    lock.Lock();
    if (!spare) continue;
    // Takes only free room; another RefillOnce (a test's, beside the thread) may have used it.
    if (spare_bytes_ + spare->allocated_bytes > options_.budget_bytes) {
      lock.Unlock();
      spare->Close();
      lock.Lock();
      continue;
    }
    spares_.push_back(*spare);
    spare_bytes_ += spare->allocated_bytes;
  }
}

void SpareFiles::RefillLoop() {
  // Spares serve later puts: allocating them is worth no core that anything else wants. On a
  // shared host the standbys verify a cell's blobs just after its puts, when the refill starts.
  const sched_param idle{};
  ::pthread_setschedparam(::pthread_self(), SCHED_IDLE, &idle);  // a hint; failure is harmless
  MutexLock lock(&mu_);
  while (!stopping_) {
    const auto idle_check = std::chrono::steady_clock::now() + kIdleCheckInterval;
    while (!stopping_ && wanted_.empty() && wake_.WaitUntil(&mu_, idle_check)) {
    }
    // Puts come in bursts (a cell's tensors, one after the other): allocating beside them would
    // take the cores their hashing needs, so the refill waits for a pause.
    for (int64_t quiet_ms = 0; !stopping_ && !wanted_.empty();) {
      quiet_ms = SteadyNowMs() - last_take_ms_;
      if (quiet_ms >= options_.refill_pause_ms) break;
      wake_.WaitFor(&mu_, std::chrono::milliseconds(options_.refill_pause_ms - quiet_ms));
    }
    if (stopping_) break;
    lock.Unlock();
    RefillOnce(SteadyNowMs());
    lock.Lock();
  }
}

std::deque<SpareFile> SpareFiles::TakeAllLocked() {
  spare_bytes_ = 0;
  return std::exchange(spares_, {});
}

size_t SpareFiles::spare_bytes() const {
  MutexLock lock(&mu_);
  return spare_bytes_;
}

size_t SpareFiles::spare_count() const {
  MutexLock lock(&mu_);
  return spares_.size();
}

}  // namespace nbos::store
