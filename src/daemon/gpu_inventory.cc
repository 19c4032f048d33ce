#include "daemon/gpu_inventory.h"

#include <dlfcn.h>
#include <spdlog/spdlog.h>

namespace nbos::daemon {
namespace {

// The few NVML declarations we use (nvml.h, stable ABI since the _v2 entry points). We declare
// them here rather than depending on the CUDA toolkit's header, which build machines lack.
using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
struct nvmlMemory_t {
  unsigned long long total;  // NOLINT(runtime/int): NVML's ABI
  unsigned long long free;   // NOLINT(runtime/int)
  unsigned long long used;   // NOLINT(runtime/int)
};
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr unsigned kNvmlNameBuffer = 96;
constexpr unsigned kNvmlVersionBuffer = 80;

using InitFn = nvmlReturn_t (*)();
using ShutdownFn = nvmlReturn_t (*)();
using CountFn = nvmlReturn_t (*)(unsigned*);
using HandleFn = nvmlReturn_t (*)(unsigned, nvmlDevice_t*);
using MemoryFn = nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_t*);
using NameFn = nvmlReturn_t (*)(nvmlDevice_t, char*, unsigned);
using DriverFn = nvmlReturn_t (*)(char*, unsigned);
using ErrorStringFn = const char* (*)(nvmlReturn_t);

template <typename Fn>
Fn Symbol(void* lib, const char* name) {
  return reinterpret_cast<Fn>(dlsym(lib, name));
}

}  // namespace

Result<GpuInventory> ProbeNvml() {
  // Loaded once and never closed: unloading a driver library while another thread (or a later
  // probe) uses it buys nothing.
  static void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return NotFound("libnvidia-ml.so.1 not found");
  auto init = Symbol<InitFn>(lib, "nvmlInit_v2");
  auto shutdown = Symbol<ShutdownFn>(lib, "nvmlShutdown");
  auto count_fn = Symbol<CountFn>(lib, "nvmlDeviceGetCount_v2");
  auto handle_fn = Symbol<HandleFn>(lib, "nvmlDeviceGetHandleByIndex_v2");
  auto memory_fn = Symbol<MemoryFn>(lib, "nvmlDeviceGetMemoryInfo");
  auto name_fn = Symbol<NameFn>(lib, "nvmlDeviceGetName");
  auto driver_fn = Symbol<DriverFn>(lib, "nvmlSystemGetDriverVersion");
  auto error_fn = Symbol<ErrorStringFn>(lib, "nvmlErrorString");
  if (!init || !shutdown || !count_fn || !handle_fn || !memory_fn) {
    return Unavailable("libnvidia-ml.so.1 lacks the NVML v2 entry points");
  }
  auto describe = [&](nvmlReturn_t rc) {
    return error_fn ? std::string(error_fn(rc)) : "NVML error " + std::to_string(rc);
  };
  nvmlReturn_t rc = init();
  if (rc != kNvmlSuccess) return Unavailable("nvmlInit_v2: " + describe(rc));

  GpuInventory inv;
  inv.is_virtual = false;
  inv.source = "nvml";
  char version[kNvmlVersionBuffer] = {};
  if (driver_fn && driver_fn(version, sizeof version) == kNvmlSuccess) {
    inv.source += std::string(" (driver ") + version + ")";
  }
  unsigned count = 0;
  Status status;
  rc = count_fn(&count);
  if (rc != kNvmlSuccess) status = Unavailable("nvmlDeviceGetCount_v2: " + describe(rc));
  for (unsigned i = 0; status.ok() && i < count; ++i) {
    nvmlDevice_t device = nullptr;
    nvmlMemory_t memory{};
    rc = handle_fn(i, &device);
    if (rc == kNvmlSuccess) rc = memory_fn(device, &memory);
    if (rc != kNvmlSuccess) {
      status = Unavailable("NVML device " + std::to_string(i) + ": " + describe(rc));
      break;
    }
    char name[kNvmlNameBuffer] = {};
    if (!name_fn || name_fn(device, name, sizeof name) != kNvmlSuccess) name[0] = '\0';
    inv.devices.push_back({static_cast<int>(i), static_cast<int64_t>(memory.total >> 20)});
    inv.names.emplace_back(name[0] ? name : "GPU");
  }
  shutdown();
  if (!status.ok()) return status;
  if (inv.devices.empty()) return Unavailable("NVML reports no GPUs");
  return inv;
}

GpuInventory VirtualGpus(int count, int64_t vram_mb_per_gpu) {
  GpuInventory inv;
  inv.is_virtual = true;
  inv.source = "virtual";
  for (int i = 0; i < count; ++i) {
    inv.devices.push_back({i, vram_mb_per_gpu});
    inv.names.emplace_back("virtual");
  }
  return inv;
}

Result<GpuInventory> DiscoverGpus(const GpuInventoryOptions& options) {
  if (options.virtual_gpus < 0 || options.vram_mb_per_gpu < 0) {
    return InvalidArgument("negative virtual GPU count or VRAM");
  }
  if (options.source == GpuSource::kVirtual) {
    return VirtualGpus(options.virtual_gpus, options.vram_mb_per_gpu);
  }
  Result<GpuInventory> nvml = ProbeNvml();
  if (nvml.ok() || options.source == GpuSource::kNvml) return nvml;
  spdlog::info("no NVML GPUs ({}); using {} virtual GPUs of {} MB", nvml.status().message(),
               options.virtual_gpus, options.vram_mb_per_gpu);
  return VirtualGpus(options.virtual_gpus, options.vram_mb_per_gpu);
}

}  // namespace nbos::daemon
