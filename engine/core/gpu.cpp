#include "engine/core/gpu.h"

#include <utility>

#include "engine/core/log.h"

#if defined(STRATA_HAVE_CUDA)
#include "engine/core/cuda_check.h"
#endif

namespace strata {

const GpuDiscovery& discover_gpus() {
  static const GpuDiscovery discovery = [] {
    GpuDiscovery result;
#if defined(STRATA_HAVE_CUDA)
    int count = 0;
    const cudaError_t error = cudaGetDeviceCount(&count);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      result.reason = std::string("the CUDA runtime reports no usable GPU: ") + cudaGetErrorString(error) + " (" +
                      cudaGetErrorName(error) + ")";
    } else if (count == 0) {
      result.reason = "the CUDA runtime found no GPU";
    } else {
      result.device_count = count;
    }
#else
    result.reason = "this build of Strata has no CUDA support (configured with STRATA_WITH_CUDA=OFF or no nvcc)";
#endif
    if (result.device_count == 0) {
      STRATA_LOG(kInfo) << "no GPU: " << result.reason;
    }
    return result;
  }();
  return discovery;
}

HostRegistration& HostRegistration::operator=(HostRegistration&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

void HostRegistration::reset() noexcept {
#if defined(STRATA_HAVE_CUDA)
  if (data_ != nullptr) {
    const cudaError_t error = cudaHostUnregister(data_);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      STRATA_LOG(kWarn) << "cudaHostUnregister failed: " << cudaGetErrorString(error);
    }
  }
#endif
  data_ = nullptr;
}

StatusOr<HostRegistration> register_host_memory_with_gpu(void* data, size_t bytes) {
  if (!gpu_available()) return UnavailableError("cannot page-lock host memory for the GPU: " + discover_gpus().reason);
#if defined(STRATA_HAVE_CUDA)
  STRATA_RETURN_IF_CUDA_ERROR(cudaHostRegister(data, bytes, cudaHostRegisterPortable));
  HostRegistration registration;
  registration.data_ = data;
  return registration;
#else
  (void)data;
  (void)bytes;
  return UnavailableError("built without CUDA");
#endif
}

}  // namespace strata
