// The device factories and the helpers the device implementations share.
#include <cstdio>
#include <iterator>
#include <string>

#include "engine/core/cpu_device.h"
#include "engine/core/device.h"
#include "engine/core/device_internal.h"
#include "engine/core/gpu.h"

#if defined(STRATA_HAVE_CUDA)
#include "engine/core/cuda_device.h"
#endif

namespace strata {

namespace internal {

std::string format_bytes(size_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(kUnits)) {
    value /= 1024.0;
    ++unit;
  }
  char scaled[48];
  std::snprintf(scaled, sizeof(scaled), "%.1f %s", value, kUnits[unit]);
  return std::to_string(bytes) + " bytes (" + scaled + ")";
}

Status budget_exceeded_error(std::string_view device_name, size_t requested_bytes, std::string_view purpose,
                             const MemoryStats& stats) {
  std::string message = std::string(device_name) + ": cannot allocate " + format_bytes(requested_bytes) + " for '" +
                        std::string(purpose) + "': it would exceed the device budget of " +
                        format_bytes(stats.budget_bytes) + "; in use " + format_bytes(stats.in_use_bytes) +
                        ", reserved " + format_bytes(stats.reserved_bytes) + ", high-water " +
                        format_bytes(stats.high_water_bytes);
  return OutOfMemoryError(std::move(message));
}

}  // namespace internal

StatusOr<std::unique_ptr<Device>> create_cpu_device(const CpuDeviceOptions& options) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<CpuDevice> device, CpuDevice::create(options));
  return std::unique_ptr<Device>(std::move(device));
}

StatusOr<std::unique_ptr<Device>> create_cuda_device(const CudaDeviceOptions& options) {
  const GpuDiscovery& discovery = discover_gpus();
  if (discovery.device_count == 0) {
    return UnavailableError("cannot create cuda:" + std::to_string(options.ordinal) + ": " + discovery.reason);
  }
  if (options.ordinal < 0 || options.ordinal >= discovery.device_count) {
    return InvalidArgumentError("cannot create cuda:" + std::to_string(options.ordinal) + ": this machine has " +
                                std::to_string(discovery.device_count) + " GPU(s), ordinals 0.." +
                                std::to_string(discovery.device_count - 1));
  }
#if defined(STRATA_HAVE_CUDA)
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<CudaDevice> device, CudaDevice::create(options));
  return std::unique_ptr<Device>(std::move(device));
#else
  return UnavailableError("cannot create cuda:" + std::to_string(options.ordinal) + ": " + discovery.reason);
#endif
}

}  // namespace strata
