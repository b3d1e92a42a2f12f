// The CUDA Adam: one thread per element (grid-stride), the same element function as the
// CPU paths (kernels/adam.h), whose device arithmetic uses explicitly rounded
// intrinsics so that nvcc cannot contract it into FMAs: results match the scalar
// reference bit for bit.
#include <cuda_fp16.h>

#include "engine/core/cuda_check.h"
#include "kernels/adam.h"

namespace strata::kernels {
namespace {

template <DType kType>
__device__ __forceinline__ float load_element(const void* data, size_t i) {
  if constexpr (kType == DType::kFloat32) {
    return static_cast<const float*>(data)[i];
  } else if constexpr (kType == DType::kBFloat16) {
    return __uint_as_float(static_cast<unsigned>(static_cast<const uint16_t*>(data)[i]) << 16);
  } else {
    return __half2float(static_cast<const __half*>(data)[i]);
  }
}

// bf16 round-to-nearest-even with the same NaN rule as float_to_bf16_bits (engine/core/dtype.h).
__device__ __forceinline__ uint16_t to_bf16_bits(float value) {
  const unsigned bits = __float_as_uint(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

template <DType kType>
__device__ __forceinline__ void store_element(void* data, size_t i, float value) {
  if constexpr (kType == DType::kFloat32) {
    static_cast<float*>(data)[i] = value;
  } else if constexpr (kType == DType::kBFloat16) {
    static_cast<uint16_t*>(data)[i] = to_bf16_bits(value);
  } else {
    static_cast<__half*>(data)[i] = __float2half_rn(value);
  }
}

template <DType kGrad, DType kMoment, bool kWriteParam, DType kParam>
__global__ void adam_kernel(AdamBuffers b, AdamStepScalars s) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < b.count; i += stride) {
    float master = b.master[i];
    float exp_avg = load_element<kMoment>(b.exp_avg, i);
    float exp_avg_sq = load_element<kMoment>(b.exp_avg_sq, i);
    adam_update_element(load_element<kGrad>(b.grad, i), master, exp_avg, exp_avg_sq, s);
    b.master[i] = master;
    store_element<kMoment>(b.exp_avg, i, exp_avg);
    store_element<kMoment>(b.exp_avg_sq, i, exp_avg_sq);
    if constexpr (kWriteParam) store_element<kParam>(b.param, i, master);
  }
}

struct LaunchShape {
  unsigned blocks;
  unsigned threads;
  cudaStream_t stream;
};

template <DType kGrad, DType kMoment, bool kWriteParam, DType kParam>
void launch(const LaunchShape& shape, const AdamBuffers& b, const AdamStepScalars& s) {
  adam_kernel<kGrad, kMoment, kWriteParam, kParam><<<shape.blocks, shape.threads, 0, shape.stream>>>(b, s);
}

template <DType kGrad, DType kMoment>
void dispatch_param(const LaunchShape& shape, const AdamBuffers& b, const AdamStepScalars& s) {
  if (b.param == nullptr) return launch<kGrad, kMoment, false, DType::kFloat32>(shape, b, s);
  switch (b.param_type) {
    case DType::kFloat32: return launch<kGrad, kMoment, true, DType::kFloat32>(shape, b, s);
    case DType::kBFloat16: return launch<kGrad, kMoment, true, DType::kBFloat16>(shape, b, s);
    case DType::kFloat16: return launch<kGrad, kMoment, true, DType::kFloat16>(shape, b, s);
  }
}

template <DType kGrad>
void dispatch_moment(const LaunchShape& shape, const AdamBuffers& b, const AdamStepScalars& s) {
  if (b.moment_type == DType::kBFloat16) return dispatch_param<kGrad, DType::kBFloat16>(shape, b, s);
  return dispatch_param<kGrad, DType::kFloat32>(shape, b, s);
}

}  // namespace

Status adam_step_cuda(void* cuda_stream, const AdamBuffers& buffers, const AdamStepScalars& scalars) {
  if (buffers.count == 0) return {};
  STRATA_RETURN_IF_ERROR(validate_adam_buffers(buffers));
  constexpr unsigned kThreads = 256;
  const size_t wanted = (buffers.count + kThreads - 1) / kThreads;
  constexpr size_t kMaxBlocks = size_t{65535} * 8;
  const LaunchShape shape{static_cast<unsigned>(wanted < kMaxBlocks ? wanted : kMaxBlocks), kThreads,
                          static_cast<cudaStream_t>(cuda_stream)};
  switch (buffers.grad_type) {
    case DType::kFloat32: dispatch_moment<DType::kFloat32>(shape, buffers, scalars); break;
    case DType::kBFloat16: dispatch_moment<DType::kBFloat16>(shape, buffers, scalars); break;
    case DType::kFloat16: dispatch_moment<DType::kFloat16>(shape, buffers, scalars); break;
  }
  STRATA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return {};
}

}  // namespace strata::kernels
