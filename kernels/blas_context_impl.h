// Internals of BlasContext, shared by kernels/blas_context.cpp and the CUDA ops.
// Not for callers outside kernels/.
#pragma once

#include <mutex>

#include "kernels/blas_context.h"

#if defined(STRATA_HAVE_CUDA)
#include <cublas_v2.h>
#endif

namespace strata::kernels {

struct BlasContext::Impl {
  Device* device = nullptr;
  BlasOptions options;
#if defined(STRATA_HAVE_CUDA)
  // Guards the handle: cublasSetStream + the GEMMs of one op run under it, so callers
  // on several threads may share a context (though their streams then share the workspace).
  std::mutex mutex;
  cublasHandle_t handle = nullptr;  // null on a CpuDevice
  DeviceBuffer workspace;           // cuBLAS workspace from the device budget
  EpilogueCounts epilogue_counts;   // guarded by mutex, counted by the CUDA ops' epilogue GEMMs
#endif
  ~Impl();
};

#if defined(STRATA_HAVE_CUDA)
// Points the handle at `cuda_stream` and sets the workspace again (cublasSetStream
// resets it). Call with impl.mutex held.
Status bind_cublas_to_stream(BlasContext::Impl& impl, void* cuda_stream);
#endif

}  // namespace strata::kernels
