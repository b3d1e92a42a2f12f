// Internal to kernels/: what the CUDA files of the ops share (kernels/transformer_ops.cu,
// kernels/rmsnorm_rope_swiglu.cu): fp32 loads and stores of float / bf16, dtype dispatch, launch
// sizes, warp reductions, the deterministic column-sum kernel and the row-major cuBLAS
// GEMM. Everything is in an unnamed namespace: each .cu gets its own copy, as when it
// was one file.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <string>

#include "engine/core/cuda_check.h"
#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "kernels/blas_context_impl.h"
#include "kernels/transformer_ops.h"

namespace strata::kernels::cuda {
namespace {

using bf16 = __nv_bfloat16;

// Loads and stores in fp32 ------------------------------------------------------------

__device__ __forceinline__ float load(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float load(const bf16* p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(bf16* p, size_t i, float v) { p[i] = __float2bfloat16_rn(v); }
template <class T>
__device__ __forceinline__ void store_grad(T* p, size_t i, float v, bool accumulate) {
  store(p, i, accumulate ? load(p, i) + v : v);
}

template <class T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<float>) or f(TypeTag<bf16>) for `dtype`.
template <class F>
Status dispatch(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(TypeTag<float>{});
    case DType::kBFloat16: return f(TypeTag<bf16>{});
    case DType::kFloat16: break;
  }
  return UnimplementedError(std::string(op) + ": dtype " + std::string(dtype_name(dtype)) + " has no CUDA kernel");
}

cudaStream_t native(void* stream) { return static_cast<cudaStream_t>(stream); }

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

unsigned blocks_for(size_t work_items, int threads = kThreads) {
  const size_t wanted = (work_items + threads - 1) / threads;
  constexpr size_t kMaxBlocks = size_t{1} << 20;  // grid-stride loops cover the rest
  return static_cast<unsigned>(wanted < 1 ? 1 : (wanted > kMaxBlocks ? kMaxBlocks : wanted));
}

Status check_launch() {
  STRATA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return {};
}

// Butterfly reductions: every lane ends with the same bits (each step adds the same two
// values, commutatively), so the result does not depend on the lane that reads it.
__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Column sums over rows for dgamma / dbeta (LayerNorm and, with mean == nullptr,
// RMSNorm: x != nullptr) or dbias (x == nullptr, result in dsum).
//
// One 32-column tile is summed by a cluster of kColumnGradSplits blocks (Hopper thread
// block clusters): block b of the cluster takes rows b*32 + threadIdx.y, stepping by
// 32 x kColumnGradSplits, so a tile's rows are read by 8 SMs instead of one (GPT-2 XL's
// 1600 channels are 50 tiles: one block per tile would leave 82 of the H200's 132 SMs idle
// and keep too few loads in flight on the others). Each block adds its 32 row partials in
// a fixed order into shared memory; the cluster's first block then adds the blocks'
// partials, read through distributed shared memory, in block order. No atomics and no
// global scratch: the same bits on every run.
constexpr unsigned kColumnGradSplits = 8;

template <class T>
__global__ void __cluster_dims__(1, kColumnGradSplits, 1)
    column_grads_kernel(const T* dy, const T* x, const float* mean, const float* rstd, float* dscaled, float* dsum, size_t rows,
                        size_t channels, bool accumulate) {
  __shared__ float scaled_part[32][33];
  __shared__ float sum_part[32][33];
  __shared__ float block_scaled[32];
  __shared__ float block_sum[32];
  const size_t c = blockIdx.x * size_t(32) + threadIdx.x;
  float scaled = 0.0f;
  float sum = 0.0f;
  if (c < channels) {
    const size_t step = size_t(32) * kColumnGradSplits;
    for (size_t r = blockIdx.y * size_t(32) + threadIdx.y; r < rows; r += step) {
      const float d = load(dy, r * channels + c);
      sum += d;
      if (x != nullptr) scaled += d * ((load(x, r * channels + c) - (mean != nullptr ? mean[r] : 0.0f)) * rstd[r]);
    }
  }
  scaled_part[threadIdx.y][threadIdx.x] = scaled;
  sum_part[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0) {
    float total_scaled = 0.0f;
    float total_sum = 0.0f;
    for (int y = 0; y < 32; ++y) {
      total_scaled += scaled_part[y][threadIdx.x];
      total_sum += sum_part[y][threadIdx.x];
    }
    block_scaled[threadIdx.x] = total_scaled;
    block_sum[threadIdx.x] = total_sum;
  }
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  cluster.sync();  // every block's partials are in its shared memory
  if (cluster.block_rank() == 0 && threadIdx.y == 0 && c < channels) {
    float total_scaled = 0.0f;
    float total_sum = 0.0f;
    for (unsigned b = 0; b < kColumnGradSplits; ++b) {
      total_scaled += cluster.map_shared_rank(block_scaled, b)[threadIdx.x];
      total_sum += cluster.map_shared_rank(block_sum, b)[threadIdx.x];
    }
    if (dscaled != nullptr) dscaled[c] = accumulate ? dscaled[c] + total_scaled : total_scaled;
    if (dsum != nullptr) dsum[c] = accumulate ? dsum[c] + total_sum : total_sum;
  }
  cluster.sync();  // the first block has read the others' shared memory before they exit
}

template <class T>
Status launch_column_grads(cudaStream_t stream, const T* dy, const T* x, const float* mean, const float* rstd,
                           float* dscaled, float* dsum, size_t rows, size_t channels, bool accumulate) {
  const dim3 block(32, 32);
  const dim3 grid(static_cast<unsigned>((channels + 31) / 32), kColumnGradSplits);
  column_grads_kernel<T><<<grid, block, 0, stream>>>(dy, x, mean, rstd, dscaled, dsum, rows, channels, accumulate);
  return check_launch();
}

// GEMMs -------------------------------------------------------------------------------

template <class T>
constexpr cudaDataType_t cuda_type() {
  if constexpr (sizeof(T) == 4) {
    return CUDA_R_32F;
  } else {
    return CUDA_R_16BF;
  }
}

// One operand of a row-major GEMM: `data` stored row-major with row length `ld`;
// `trans` means the product uses its transpose; `stride` is the distance in elements
// between consecutive matrices of a batch.
struct Operand {
  const void* data;
  cudaDataType_t type;
  size_t ld;
  long long stride;
  bool trans;
};

// Row-major C[m,n] = alpha op(A)[m,k] op(B)[k,n] + beta C, `batch` times. cuBLAS is
// column-major, where a row-major matrix reads as its transpose, so this computes
// C^T = op(B)^T op(A)^T with the operands swapped.
Status gemm(cublasHandle_t handle, cublasComputeType_t compute, size_t m, size_t n, size_t k, float alpha, Operand a,
            Operand b, float beta, void* c, cudaDataType_t c_type, size_t ldc, long long stride_c, int batch) {
  for (size_t dim : {m, n, k, a.ld, b.ld, ldc}) {
    if (dim > size_t(INT_MAX)) return InvalidArgumentError("GEMM dimension " + std::to_string(dim) + " exceeds INT_MAX");
  }
  const cublasOperation_t op_a = a.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (batch == 1) {
    STRATA_RETURN_IF_CUBLAS_ERROR(cublasGemmEx(handle, op_b, op_a, int(n), int(m), int(k), &alpha, b.data, b.type, int(b.ld),
                                               a.data, a.type, int(a.ld), &beta, c, c_type, int(ldc), compute,
                                               CUBLAS_GEMM_DEFAULT));
  } else {
    STRATA_RETURN_IF_CUBLAS_ERROR(cublasGemmStridedBatchedEx(handle, op_b, op_a, int(n), int(m), int(k), &alpha, b.data,
                                                             b.type, int(b.ld), b.stride, a.data, a.type, int(a.ld),
                                                             a.stride, &beta, c, c_type, int(ldc), stride_c, batch, compute,
                                                             CUBLAS_GEMM_DEFAULT));
  }
  return {};
}

cublasComputeType_t compute_type(const BlasContext& blas, DType dtype) {
  if (dtype != DType::kFloat32) return CUBLAS_COMPUTE_32F;
  switch (blas.matmul_precision()) {
    case MatmulPrecision::kTf32: return CUBLAS_COMPUTE_32F_FAST_TF32;
    case MatmulPrecision::kBf16: return CUBLAS_COMPUTE_32F_FAST_16BF;
    case MatmulPrecision::kFp32: break;
  }
  return CUBLAS_COMPUTE_32F;
}

Status check_handle(BlasContext& blas, const char* op) {
  if (blas.impl().handle == nullptr) {
    return InvalidArgumentError(std::string(op) + ": the BlasContext has no cuBLAS handle (made for " +
                                blas.device().description() + ")");
  }
  return {};
}

size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }


}  // namespace
}  // namespace strata::kernels::cuda
