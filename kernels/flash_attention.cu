// The one CUDA attention (kernels/gqa_attention_cuda.h declares its launchers): causal
// grouped-query attention in the manner of FlashAttention-2, so nothing T x T is ever
// stored. GPT-2's fused-qkv attention calls it too.
//
// Forward, one block per (query tile of 32 rows, query head, batch element): the block
// walks the key tiles left of and on the diagonal (tiles right of it are fully masked
// and never loaded), keeps a running max and sum per row (online softmax) and the
// un-normalised output in registers, and writes out = acc / sum and the row's
// logsumexp. Backward recomputes the probabilities from that logsumexp in two kernels,
// so no float atomics are needed and results stay bit-identical run to run:
//   1. dq: one block per (query tile, query head). Pass 1 over the key tiles computes
//      delta_t = sum_j P_tj dP_tj (kept in the workspace: fp32 [batch, heads, T]);
//      pass 2 computes dS = P o (dP - delta) and dq = scale dS K.
//   2. dk, dv: one block per (key tile, KV head). It walks the query heads of its group
//      in head order and, for each, the query tiles on and below the diagonal, summing
//      dv = P^T dO and dk = scale dS^T Q in fp32 registers, rounded to T once.
// (delta is rowsum(dO o O) too, but the op's backward is not given O, so pass 1
// recomputes it; passing O would save two of the backward's nine tile products.)
//
// Layout of the work inside a block (128 threads = 4 warps, tiles of 32 = a warp):
// - a score tile is computed as 8 rows per warp x 32 columns, lane j owning column j, so
//   each lane holds 8 scores and row reductions are warp butterflies (same bits in
//   every lane);
// - products with a value-like tile (P V, dS K, P^T dO, dS^T Q) give 8 rows per warp
//   x head_dim columns, lane l owning columns l, l + 32, ...: kDim / 32 per row;
// - tiles are fp32 in shared memory whatever T is ([32][kDim + 4]: the 4-float pad
//   makes the float4 row reads of a quarter-warp hit distinct banks), loaded with the
//   columns past head_dim and the rows past T zeroed, so every head_dim <= 128 runs in
//   the kernel of the next of 32, 64 or 128.
// All arithmetic is fp32 on CUDA cores (FMA), bf16 only in loads and stores.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "engine/core/cuda_check.h"
#include "kernels/cuda_common.cuh"
#include "kernels/flash_attention_kernels.cuh"
#include "kernels/gqa_attention_cuda.h"

namespace strata::kernels::cuda {
namespace {
using namespace flash;  // NOLINT: the kernels and their sizes

// Launching ---------------------------------------------------------------------------------

enum class AttentionKernel : uint8_t { kForward, kBackwardDq, kBackwardDkv };

template <int kDim>
constexpr size_t shared_bytes(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::kForward: return (3 * tile_floats<kDim>() + kWeightFloats) * sizeof(float);
    case AttentionKernel::kBackwardDq: return (4 * tile_floats<kDim>() + kWeightFloats) * sizeof(float);
    case AttentionKernel::kBackwardDkv: return (4 * tile_floats<kDim>() + 2 * kWeightFloats) * sizeof(float);
  }
  return 0;
}
// The largest (backward dk/dv at head_dim 128, 75,776 bytes) must fit Hopper's 227 KiB.
static_assert(shared_bytes<128>(AttentionKernel::kBackwardDkv) <= 227 * 1024);

template <class T, int kDim>
auto kernel_function(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::kForward: return &flash_forward_kernel<T, kDim>;
    case AttentionKernel::kBackwardDq: return &flash_backward_dq_kernel<T, kDim>;
    case AttentionKernel::kBackwardDkv: break;
  }
  return &flash_backward_dkv_kernel<T, kDim>;
}

// Grid: (tiles of 32 along the sequence, heads, batch). The dk/dv kernel's heads are the
// KV heads.
template <class T, int kDim>
Status launch_attention_kernel(cudaStream_t stream, AttentionKernel kernel, const AttentionParams<T>& params,
                               size_t grid_heads, size_t batch) {
  const size_t tiles = (params.seq_len + kTile - 1) / kTile;
  if (tiles > size_t(INT_MAX) || grid_heads > 65535 || batch > 65535) {
    return InvalidArgumentError("attention: a grid of " + std::to_string(tiles) + " x " + std::to_string(grid_heads) +
                                " x " + std::to_string(batch) +
                                " blocks exceeds CUDA's limits (seq_len / 32, heads and batch at most 65535)");
  }
  const auto function = kernel_function<T, kDim>(kernel);
  const size_t bytes = shared_bytes<kDim>(kernel);
  // Above 48 KiB a kernel must opt in; the attribute is per device, so set it each time.
  STRATA_RETURN_IF_CUDA_ERROR(
      cudaFuncSetAttribute(function, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(grid_heads), static_cast<unsigned>(batch));
  function<<<grid, kAttentionThreads, bytes, stream>>>(params);
  return check_launch();
}

template <class T>
Status launch_for_head_dim(cudaStream_t stream, AttentionKernel kernel, const AttentionParams<T>& params,
                           size_t grid_heads, size_t batch) {
  static_assert(kMaxCudaAttentionHeadDim == 128, "a kernel per bucket up to the limit");
  if (params.head_dim <= 32) return launch_attention_kernel<T, 32>(stream, kernel, params, grid_heads, batch);
  if (params.head_dim <= 64) return launch_attention_kernel<T, 64>(stream, kernel, params, grid_heads, batch);
  if (params.head_dim <= kMaxCudaAttentionHeadDim) return launch_attention_kernel<T, 128>(stream, kernel, params, grid_heads, batch);
  return UnimplementedError("attention: head_dim " + std::to_string(params.head_dim) +
                            " has no CUDA kernel (at most " + std::to_string(kMaxCudaAttentionHeadDim) + ")");
}

template <class T>
AttentionParams<T> params_of(const GqaAttentionShape& shape) {
  AttentionParams<T> params{};
  params.seq_len = shape.seq_len;
  params.heads = shape.heads;
  params.group = shape.heads / shape.kv_heads;
  params.head_dim = shape.head_dim;
  params.q_stride = shape.q_stride;
  params.k_stride = shape.k_stride;
  params.v_stride = shape.v_stride;
  params.scale = 1.0f / sqrtf(float(shape.head_dim));
  return params;
}

}  // namespace

Status gqa_attention_forward(void* cuda_stream, BlasContext& /*blas: no GEMM library call*/, const GqaAttentionShape& shape,
                             DType dtype, const void* q, const void* k, const void* v, void* out, float* lse,
                             void* /*workspace: the forward needs none*/) {
  return dispatch(dtype, "gqa_attention_forward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    AttentionParams<T> params = params_of<T>(shape);
    params.q = static_cast<const T*>(q);
    params.k = static_cast<const T*>(k);
    params.v = static_cast<const T*>(v);
    params.out = static_cast<T*>(out);
    params.lse = lse;
    return launch_for_head_dim<T>(native(cuda_stream), AttentionKernel::kForward, params, shape.heads, shape.batch)
        .with_context("gqa_attention_forward");
  });
}

Status gqa_attention_backward(void* cuda_stream, BlasContext& /*blas*/, const GqaAttentionShape& shape, DType dtype,
                              const void* dout, const void* q, const void* k, const void* v, const float* lse, void* dq,
                              void* dk, void* dv, void* workspace, GradWrite input_grad) {
  return dispatch(dtype, "gqa_attention_backward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    AttentionParams<T> params = params_of<T>(shape);
    params.q = static_cast<const T*>(q);
    params.k = static_cast<const T*>(k);
    params.v = static_cast<const T*>(v);
    params.dout = static_cast<const T*>(dout);
    params.dq = static_cast<T*>(dq);
    params.dk = static_cast<T*>(dk);
    params.dv = static_cast<T*>(dv);
    params.lse = const_cast<float*>(lse);  // read only by the backward kernels
    params.delta = static_cast<float*>(workspace);
    params.accumulate = input_grad == GradWrite::kAccumulate;
    const cudaStream_t stream = native(cuda_stream);
    // dq first: it writes delta, which the dk/dv kernel reads (stream order).
    STRATA_RETURN_IF_ERROR(launch_for_head_dim<T>(stream, AttentionKernel::kBackwardDq, params, shape.heads, shape.batch)
                               .with_context("gqa_attention_backward: dq"));
    return launch_for_head_dim<T>(stream, AttentionKernel::kBackwardDkv, params, shape.kv_heads, shape.batch)
        .with_context("gqa_attention_backward: dk, dv");
  });
}

}  // namespace strata::kernels::cuda
