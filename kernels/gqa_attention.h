// Causal self-attention with grouped-query heads, forward and backward, on any device
// (GPT-2's attention in kernels/transformer_ops.h is this op on its fused qkv).
//
// Same conventions as kernels/transformer_ops.h (read its header comment): one host entry
// point per direction; CUDA kernels enqueued at once on a CudaDevice, the CPU twin run in
// stream order on a CpuDevice; `dtype` fp32 everywhere, bf16 too on a CudaDevice;
// parameter gradients and saved statistics fp32; GradWrite / GradOptions; bad arguments
// reported at once, before anything is enqueued; bit-identical results run to run and, on
// the CPU, whatever the thread count. Scalar references: kernels/reference.h.
// The matrix products around it (q/k/v/o projections) are transformer_ops.h's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "kernels/blas_context.h"
#include "kernels/transformer_ops.h"

namespace strata::kernels {

// Causal self-attention with grouped-query heads (GQA; kv_heads == heads is ordinary
// multi-head attention, kv_heads == 1 multi-query).
// q: [batch, seq_len, heads * head_dim], row stride q_stride elements;
// k, v: [batch, seq_len, kv_heads * head_dim], row strides k_stride, v_stride;
// query head h reads KV head h / (heads / kv_heads) (heads must be a multiple of kv_heads).
// A stride of 0 means dense (the row's own width). out: [batch, seq_len, heads * head_dim]
// dense, heads concatenated (the input of o_proj). Scores q.k / sqrt(head_dim), key j
// visible from query t iff j <= t. lse: fp32 [batch, heads, seq_len], the logsumexp of
// each query's scaled scores, saved for the backward (nothing T x T is kept).
// GPT-2's attention_forward/backward (transformer_ops.h) are this op on its fused qkv.
struct GqaAttentionShape {
  size_t batch = 0;
  size_t seq_len = 0;
  size_t heads = 0;     // query heads (num_attention_heads)
  size_t kv_heads = 0;  // key/value heads (num_key_value_heads), divides heads
  size_t head_dim = 0;
  size_t q_stride = 0;  // elements between consecutive rows (tokens) of q; 0 = heads * head_dim
  size_t k_stride = 0;  // the same for k; 0 = kv_heads * head_dim
  size_t v_stride = 0;  // the same for v; 0 = kv_heads * head_dim
};
// GPT-2's fused qkv [batch, seq_len, 3 * channels] as this op sees it: q, k, v at
// offsets 0, channels, 2 * channels of each row, strides 3 * channels, kv_heads == heads.
GqaAttentionShape gqa_shape_of_fused_qkv(const AttentionShape& shape);
// The GPU kernel is tiled in the manner of FlashAttention-2 (kernels/flash_attention.cu):
// nothing T x T is stored, fully masked tiles are skipped, the backward recomputes the
// probabilities from lse. It handles head_dim up to kMaxCudaAttentionHeadDim (a larger
// one is Unimplemented on a CudaDevice, reported before anything is enqueued).
inline constexpr size_t kMaxCudaAttentionHeadDim = 128;
// Scratch the op needs from the caller's device memory, forward and backward alike:
// 0 on a CpuDevice; on the GPU the backward's fp32 [batch, heads, seq_len] row sums
// delta = sum_j P dP (rounded up to 256 bytes), linear in seq_len.
size_t gqa_attention_workspace_bytes(const GqaAttentionShape& shape, DType dtype, DeviceKind kind);
Status gqa_attention_forward(Stream& stream, BlasContext& blas, const GqaAttentionShape& shape, DType dtype, const void* q,
                             const void* k, const void* v, void* out, float* lse, void* workspace,
                             size_t workspace_bytes);
// Needs q, k, v and the forward's lse. dq (strided like q), dk, dv (strided like k, v)
// per input_grad; dk and dv sum over the query heads that share them, in head order
// (on the GPU in fp32 registers, rounded to dtype once; no atomics).
// The elements of a strided row outside the op's heads are not touched, so dq, dk, dv
// may be slices of one fused gradient buffer.
Status gqa_attention_backward(Stream& stream, BlasContext& blas, const GqaAttentionShape& shape, DType dtype,
                              const void* dout, const void* q, const void* k, const void* v, const float* lse, void* dq,
                              void* dk, void* dv, void* workspace, size_t workspace_bytes, GradWrite input_grad);

}  // namespace strata::kernels
