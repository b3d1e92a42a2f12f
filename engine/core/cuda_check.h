// CUDA, cuBLAS and NCCL members of the check-macro family (see check.h). Include only
// from code compiled with STRATA_HAVE_CUDA.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

#include "engine/core/check.h"

namespace strata::internal {

// "cudaMemcpyAsync(...) failed on device 0: out of memory (cudaErrorMemoryAllocation)".
[[gnu::cold]] Status cuda_error(cudaError_t error, const char* statement, const char* file, int line);
[[gnu::cold]] Status cublas_error(cublasStatus_t error, const char* statement, const char* file, int line);
[[gnu::cold]] Status nccl_error(ncclResult_t error, const char* statement, const char* file, int line);

}  // namespace strata::internal

#define STRATA_RETURN_IF_CUDA_ERROR(expr)                                                     \
  do {                                                                                        \
    const cudaError_t strata_cuda_error_ = (expr);                                            \
    if (strata_cuda_error_ != cudaSuccess) [[unlikely]]                                       \
      return ::strata::internal::cuda_error(strata_cuda_error_, #expr, __FILE__, __LINE__);   \
  } while (0)

#define STRATA_RETURN_IF_CUBLAS_ERROR(expr)                                                   \
  do {                                                                                        \
    const cublasStatus_t strata_cublas_error_ = (expr);                                       \
    if (strata_cublas_error_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                           \
      return ::strata::internal::cublas_error(strata_cublas_error_, #expr, __FILE__, __LINE__); \
  } while (0)

#define STRATA_RETURN_IF_NCCL_ERROR(expr)                                                     \
  do {                                                                                        \
    const ncclResult_t strata_nccl_error_ = (expr);                                           \
    if (strata_nccl_error_ != ncclSuccess) [[unlikely]]                                       \
      return ::strata::internal::nccl_error(strata_nccl_error_, #expr, __FILE__, __LINE__);   \
  } while (0)

// Aborting forms for programs and tests.
#define STRATA_CHECK_CUDA(expr) STRATA_CHECK_OK([&]() -> ::strata::Status { STRATA_RETURN_IF_CUDA_ERROR(expr); return {}; }())
