// Resources: the integer quantities the scheduler counts. Plain value type, no invariants of its
// own; callers decide whether negative components are an error.
#pragma once

#include <cstdint>
#include <string>

namespace nbos::sched {

struct Resources {
  int64_t millicpus = 0;
  int64_t memory_mb = 0;
  int32_t gpus = 0;
  int64_t vram_mb = 0;

  Resources& operator+=(const Resources& o) {
    millicpus += o.millicpus;
    memory_mb += o.memory_mb;
    gpus += o.gpus;
    vram_mb += o.vram_mb;
    return *this;
  }
  Resources& operator-=(const Resources& o) {
    millicpus -= o.millicpus;
    memory_mb -= o.memory_mb;
    gpus -= o.gpus;
    vram_mb -= o.vram_mb;
    return *this;
  }
  friend Resources operator+(Resources a, const Resources& b) { return a += b; }
  friend Resources operator-(Resources a, const Resources& b) { return a -= b; }
  friend bool operator==(const Resources&, const Resources&) = default;

  // Every component is <= the same component of `capacity`.
  bool FitsWithin(const Resources& capacity) const {
    return millicpus <= capacity.millicpus && memory_mb <= capacity.memory_mb &&
           gpus <= capacity.gpus && vram_mb <= capacity.vram_mb;
  }
  bool IsNonNegative() const {
    return millicpus >= 0 && memory_mb >= 0 && gpus >= 0 && vram_mb >= 0;
  }
  bool IsZero() const { return *this == Resources{}; }

  // "cpu=4000m mem=8192MB gpus=1 vram=16000MB", for logs and error messages.
  std::string ToString() const {
    return "cpu=" + std::to_string(millicpus) + "m mem=" + std::to_string(memory_mb) +
           "MB gpus=" + std::to_string(gpus) + " vram=" + std::to_string(vram_mb) + "MB";
  }
};

}  // namespace nbos::sched
