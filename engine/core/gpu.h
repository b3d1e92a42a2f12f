// GPU discovery and host-memory page-locking through the CUDA runtime.
//
// Every error from the CUDA runtime during discovery (no driver, a driver too old for
// the runtime, no device, a build without CUDA) means "no GPU"; the reason is logged
// once per process and kept for callers that want to print it.
#pragma once

#include <cstddef>
#include <string>

#include "engine/core/status.h"

namespace strata {

struct GpuDiscovery {
  int device_count = 0;  // usable CUDA devices; 0 when there is no GPU
  std::string reason;    // why device_count is 0 ("built without CUDA", "no CUDA driver ..."); empty otherwise
};

// Queries the CUDA runtime once and caches the answer for the life of the process.
const GpuDiscovery& discover_gpus();
inline bool gpu_available() { return discover_gpus().device_count > 0; }

// Move-only owner of a cudaHostRegister'ed range; the destructor unregisters it.
class HostRegistration {
 public:
  HostRegistration() = default;
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  HostRegistration(HostRegistration&& other) noexcept { *this = std::move(other); }
  HostRegistration& operator=(HostRegistration&& other) noexcept;
  ~HostRegistration() { reset(); }
  bool registered() const { return data_ != nullptr; }
  void reset() noexcept;

 private:
  friend StatusOr<HostRegistration> register_host_memory_with_gpu(void* data, size_t bytes);
  void* data_ = nullptr;
};

// Page-locks [data, data + bytes) for the GPU's DMA engines (cudaHostRegister).
// Unavailable when there is no GPU.
StatusOr<HostRegistration> register_host_memory_with_gpu(void* data, size_t bytes);

}  // namespace strata
