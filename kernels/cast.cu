#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "engine/core/cuda_check.h"
#include "kernels/cast.h"

namespace strata::kernels {
namespace {

__device__ __forceinline__ float load_element(const void* data, DType type, size_t i) {
  switch (type) {
    case DType::kFloat32: return static_cast<const float*>(data)[i];
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[i]);
    case DType::kFloat16: return __half2float(static_cast<const __half*>(data)[i]);
  }
  return 0.0f;
}

__device__ __forceinline__ void store_element(void* data, DType type, size_t i, float value) {
  switch (type) {
    case DType::kFloat32: static_cast<float*>(data)[i] = value; break;
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(value); break;
    case DType::kFloat16: static_cast<__half*>(data)[i] = __float2half_rn(value); break;
  }
}

__global__ void cast_kernel(const void* src, DType src_type, void* dst, DType dst_type, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    store_element(dst, dst_type, i, load_element(src, src_type, i));
  }
}

}  // namespace

Status cast_cuda(void* cuda_stream, const void* src, DType src_type, void* dst, DType dst_type, size_t count) {
  constexpr int kThreads = 256;
  const size_t wanted = (count + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(wanted < 65535 * 8 ? wanted : 65535 * 8);
  cast_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(cuda_stream)>>>(src, src_type, dst, dst_type, count);
  STRATA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return {};
}

}  // namespace strata::kernels
