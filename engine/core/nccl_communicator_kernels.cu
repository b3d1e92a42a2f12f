// The kernels of NcclCommunicator's exact reduction path (see nccl_communicator.h).
// The conversions are CUDA's round-to-nearest-even intrinsics, which give the same bits
// as engine/core/dtype.h for every value but NaN payloads; the sums are __fadd_rn in rank
// order and the mean one __fdiv_rn, so results match HostCommunicator bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "engine/core/cuda_check.h"
#include "engine/core/nccl_communicator.h"

namespace strata::nccl_communicator_internal {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(size_t count) {
  const size_t wanted = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(wanted < 65535 * 8 ? wanted : 65535 * 8);
}

__device__ __forceinline__ float load_wire(const void* data, DType type, size_t i) {
  switch (type) {
    case DType::kFloat32: return static_cast<const float*>(data)[i];
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[i]);
    case DType::kFloat16: return __half2float(static_cast<const __half*>(data)[i]);
  }
  return 0.0f;
}

__device__ __forceinline__ void store_rounded(void* data, DType type, size_t i, float value) {
  switch (type) {
    case DType::kFloat32: static_cast<float*>(data)[i] = value; break;
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(value); break;
    case DType::kFloat16: static_cast<__half*>(data)[i] = __float2half_rn(value); break;
  }
}

__global__ void cast_to_wire_kernel(const float* src, void* dst, DType wire, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x)
    store_rounded(dst, wire, i, src[i]);
}

// A reduction over one rank: the value as it would travel on the wire (SelfCommunicator).
// Element-wise, so src may be dst.
__global__ void round_through_wire_kernel(const float* src, float* dst, DType wire, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    uint16_t on_wire = 0;
    store_rounded(&on_wire, wire, 0, src[i]);
    dst[i] = load_wire(&on_wire, wire, 0);
  }
}

__global__ void reduce_contributions_kernel(const void* contributions, int ranks, size_t count, DType wire, ReduceOp op,
                                            void* out, DType out_dtype) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    float accumulated = load_wire(contributions, wire, i);
    for (int rank = 1; rank < ranks; ++rank) {
      const float value = load_wire(contributions, wire, static_cast<size_t>(rank) * count + i);
      if (op == ReduceOp::kMax) {
        if (!isnan(accumulated) && (isnan(value) || value > accumulated)) accumulated = value;
      } else {
        accumulated = __fadd_rn(accumulated, value);
      }
    }
    if (op == ReduceOp::kMean) accumulated = __fdiv_rn(accumulated, static_cast<float>(ranks));
    store_rounded(out, out_dtype, i, accumulated);
  }
}

__global__ void divide_kernel(float* data, size_t count, float divisor) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x)
    data[i] = __fdiv_rn(data[i], divisor);
}

}  // namespace

Status launch_cast_to_wire(const float* src, void* dst, DType wire, size_t count, cudaStream_t stream) {
  if (count == 0) return {};
  cast_to_wire_kernel<<<blocks_for(count), kThreads, 0, stream>>>(src, dst, wire, count);
  STRATA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return {};
}

Status launch_reduce_contributions(const void* contributions, int ranks, size_t count, DType wire, ReduceOp op,
                                   void* out, DType out_dtype, cudaStream_t stream) {
  if (count == 0) return {};
  reduce_contributions_kernel<<<blocks_for(count), kThreads, 0, stream>>>(contributions, ranks, count, wire, op, out,
                                                                          out_dtype);
  STRATA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return {};
}

Status launch_round_through_wire(const float* src, float* dst, DType wire, size_t count, cudaStream_t stream) {
  if (count == 0) return {};
  round_through_wire_kernel<<<blocks_for(count), kThreads, 0, stream>>>(src, dst, wire, count);
  STRATA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return {};
}

Status launch_divide(float* data, size_t count, float divisor, cudaStream_t stream) {
  if (count == 0) return {};
  divide_kernel<<<blocks_for(count), kThreads, 0, stream>>>(data, count, divisor);
  STRATA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return {};
}

}  // namespace strata::nccl_communicator_internal
