#include "kernels/blas_context.h"

#include <mutex>
#include <string>
#include <utility>

#include "engine/core/cpu_device.h"
#include "kernels/blas_context_impl.h"
#include "kernels/transformer_ops_cpu.h"

#if defined(STRATA_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include "engine/core/cuda_check.h"
#endif

namespace strata::kernels {

BlasContext::Impl::~Impl() {
#if defined(STRATA_HAVE_CUDA)
  if (handle != nullptr) {
    // cublasDestroy synchronizes the device it was created on; make that one current.
    int previous = 0;
    const bool have_previous = cudaGetDevice(&previous) == cudaSuccess;
    const bool switched = have_previous && previous != device->ordinal() && cudaSetDevice(device->ordinal()) == cudaSuccess;
    (void)cublasDestroy(handle);
    if (switched) (void)cudaSetDevice(previous);
    (void)cudaGetLastError();
  }
#endif
}

#if defined(STRATA_HAVE_CUDA)
Status bind_cublas_to_stream(BlasContext::Impl& impl, void* cuda_stream) {
  STRATA_RETURN_IF_CUBLAS_ERROR(cublasSetStream(impl.handle, static_cast<cudaStream_t>(cuda_stream)));
  if (!impl.workspace.empty()) {
    STRATA_RETURN_IF_CUBLAS_ERROR(cublasSetWorkspace(impl.handle, impl.workspace.data(), impl.workspace.size()));
  }
  return {};
}

namespace {
// cublasCreate binds the handle to the calling thread's current device.
StatusOr<cublasHandle_t> create_cublas_handle(int ordinal) {
  int previous = 0;
  STRATA_RETURN_IF_CUDA_ERROR(cudaGetDevice(&previous));
  if (previous != ordinal) STRATA_RETURN_IF_CUDA_ERROR(cudaSetDevice(ordinal));
  cublasHandle_t handle = nullptr;
  const cublasStatus_t created = cublasCreate(&handle);
  if (previous != ordinal) (void)cudaSetDevice(previous);
  STRATA_RETURN_IF_CUBLAS_ERROR(created);
  return handle;
}
}  // namespace
#endif

StatusOr<BlasContext> BlasContext::create(Device& device, const BlasOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->device = &device;
  impl->options = options;
  if (device.kind() == DeviceKind::kCuda) {
#if defined(STRATA_HAVE_CUDA)
    STRATA_ASSIGN_OR_RETURN(impl->handle, create_cublas_handle(device.ordinal()));
    if (options.cuda_workspace_bytes > 0) {
      STRATA_ASSIGN_OR_RETURN(impl->workspace, device.allocate(options.cuda_workspace_bytes, "cuBLAS workspace"));
    }
#else
    return UnimplementedError("BlasContext: " + device.description() + " is a CUDA device in a build without CUDA");
#endif
  } else {
    // The threads that may multiply at once: the executor's workers and a caller beside them.
    auto* cpu = dynamic_cast<CpuDevice*>(&device);
    const int callers = (cpu != nullptr ? cpu->executor().concurrency() : available_cpu_count()) + 1;
    STRATA_RETURN_IF_ERROR(cpu::reserve_blas_buffers(callers).with_context("BlasContext on " + device.description()));
  }
  return BlasContext(std::move(impl));
}

BlasContext::BlasContext(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BlasContext::BlasContext(BlasContext&& other) noexcept = default;
BlasContext& BlasContext::operator=(BlasContext&& other) noexcept = default;
BlasContext::~BlasContext() = default;

Device& BlasContext::device() const { return *impl_->device; }
const BlasOptions& BlasContext::options() const { return impl_->options; }
EpilogueCounts BlasContext::epilogue_counts() const {
#if defined(STRATA_HAVE_CUDA)
  std::lock_guard lock(impl_->mutex);
  return impl_->epilogue_counts;
#else
  return {};
#endif
}
MatmulPrecision BlasContext::matmul_precision() const {
  return impl_->options.matmul_precision.value_or(impl_->device->matmul_precision());
}

}  // namespace strata::kernels
