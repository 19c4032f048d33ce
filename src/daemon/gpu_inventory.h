// GPU discovery for a daemon (DESIGN.md §6): NVML devices when the driver is present, else
// virtual GPUs (bookkeeping only; replicas learn their grant through NBOS_GPU_IDS).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/ledger.h"

namespace nbos::daemon {

enum class GpuSource {
  kAuto,     // NVML when it loads and reports at least one device, else virtual GPUs
  kNvml,     // NVML or fail
  kVirtual,  // virtual GPUs even on a machine with GPUs (tests, `nbos up`)
};

struct GpuInventoryOptions {
  GpuSource source = GpuSource::kAuto;
  int virtual_gpus = 0;             // how many virtual GPUs when NVML is not used
  int64_t vram_mb_per_gpu = 16384;  // VRAM of each virtual GPU
};

struct GpuInventory {
  std::vector<GpuDevice> devices;  // ids ascending; NVML index order = PCI bus order
  std::vector<std::string> names;  // per device: NVML name or "virtual"
  bool is_virtual = true;
  std::string source;  // for logs: "nvml (driver 550.54)" or "virtual"
};

// Loads libnvidia-ml.so.1 with dlopen and lists its devices with their total memory. Errors:
// NotFound when the library is absent, Unavailable when NVML fails (no driver, no devices).
// Calls nvmlShutdown before returning; the library stays loaded.
Result<GpuInventory> ProbeNvml();

// `count` virtual GPUs with ids 0..count-1.
GpuInventory VirtualGpus(int count, int64_t vram_mb_per_gpu);

// Discovery per `options.source`. kAuto logs why it fell back to virtual GPUs. Errors only for
// kNvml (NVML unusable) and negative counts.
Result<GpuInventory> DiscoverGpus(const GpuInventoryOptions& options);

}  // namespace nbos::daemon
