// The ops the Llama family (Llama, Mistral, Qwen2) needs beyond GPT-2's, forward and
// backward, on any device: RMSNorm, rotary position embeddings, SwiGLU and causal
// grouped-query attention.
//
// Same conventions as kernels/transformer_ops.h (read its header comment): one host
// entry point per op and direction; CUDA kernels enqueued at once on a CudaDevice, the
// CPU twin (kernels/llama_ops_cpu.h) run in stream order on a CpuDevice; `dtype` fp32
// everywhere, bf16 too on a CudaDevice; parameter gradients and saved statistics fp32;
// GradWrite / GradOptions; bad arguments reported at once, before anything is
// enqueued; bit-identical results run to run and, on the CPU, whatever the thread
// count. Scalar references: kernels/reference.h. The matrix products (nn.Linear:
// WeightLayout::kOutIn, with Qwen2's optional q/k/v biases), residual adds,
// cross-entropy and the token embedding (wpe == nullptr) are transformer_ops.h's.
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

// ---------------------------------------------------------------------------------
// RMSNorm over the last dimension, as Hugging Face's LlamaRMSNorm:
//   y = x * rstd * gamma, rstd = 1 / sqrt(mean(x^2) + epsilon)
// with the statistics in fp32 whatever dtype is (x.float(), variance, rsqrt; then the
// normalized x is rounded to dtype before the multiplication by gamma, as HF does).
// x, y: [rows, channels] dense; gamma: [channels]; rstd: fp32 [rows], saved for the
// backward (may be null when no backward follows). y may alias x.
struct RmsNormShape {
  size_t rows = 0;
  size_t channels = 0;
  float epsilon = 1e-6f;  // config.json's rms_norm_eps
};
Status rmsnorm_forward(Stream& stream, const RmsNormShape& shape, DType dtype, const void* x, const void* gamma, void* y,
                       float* rstd);
// Needs x, gamma and the forward's rstd. dx (dtype, may be null) per options.input_grad;
// dgamma (fp32 [channels], may be null) per options.param_grad.
Status rmsnorm_backward(Stream& stream, const RmsNormShape& shape, DType dtype, const void* dy, const void* x,
                        const void* gamma, const float* rstd, void* dx, float* dgamma, const GradOptions& options);

// ---------------------------------------------------------------------------------
// Rotary position embedding in Hugging Face's rotate_half convention (each head's first
// half rotates against its second half, NOT interleaved pairs). For i < head_dim / 2,
// with angle = positions[row] * inv_freq[i] and cos, sin evaluated in fp32:
//   y[i]                = x[i] * cos - x[i + head_dim/2] * sin
//   y[i + head_dim / 2] = x[i + head_dim/2] * cos + x[i] * sin
// x, y: [rows, heads * head_dim], row r starting at r * row_stride elements (row_stride
// >= heads * head_dim, or 0 for dense), so q or k can be rotated inside a fused buffer;
// the other elements of a row are not touched. y may alias x. positions: int32 [rows]
// (device memory), the position id of each row (token), so packed sequences restart at 0.
// inv_freq: fp32 [head_dim / 2] (device memory), from rope_inverse_frequencies().
// head_dim must be even.
struct RopeShape {
  size_t rows = 0;        // batch * seq_len
  size_t heads = 0;       // heads rotated per row (num_attention_heads for q, num_key_value_heads for k)
  size_t head_dim = 0;    // even
  size_t row_stride = 0;  // elements from one row to the next; 0 = heads * head_dim
};
Status rope_forward(Stream& stream, const RopeShape& shape, DType dtype, const int32_t* positions, const float* inv_freq,
                    const void* x, void* y);
// The inverse rotation (the transpose): dx (+)= R(-angle) dy per input_grad. dx may
// alias dy when input_grad is kOverwrite. Needs only the positions.
Status rope_backward(Stream& stream, const RopeShape& shape, DType dtype, const int32_t* positions, const float* inv_freq,
                     const void* dy, void* dx, GradWrite input_grad);

// How config.json's rope_scaling changes the inverse frequencies.
struct RopeScaling {
  enum class Kind : uint8_t {
    kNone,    // no rope_scaling, or rope_type "default"
    kLinear,  // rope_type "linear": every inverse frequency divided by factor
    kLlama3,  // rope_type "llama3" (Llama 3.1 / 3.2): wavelength-dependent, see below
  };
  Kind kind = Kind::kNone;
  double factor = 1.0;                               // linear and llama3
  double low_freq_factor = 1.0;                      // llama3
  double high_freq_factor = 4.0;                     // llama3
  int64_t original_max_position_embeddings = 8192;   // llama3
};
// Host: the head_dim / 2 inverse frequencies transformers (4.44, modeling_rope_utils)
// computes: 1 / theta^(2i / head_dim); kLinear divides them by factor; kLlama3 as
// _compute_llama3_parameters: wavelengths longer than original / low_freq_factor are
// divided by factor, shorter than original / high_freq_factor kept, and those between
// blended smoothly. Computed as transformers does (float32 powers, then the llama3
// blend in float32), so the result matches its tensor to within an ulp or two.
// InvalidArgument for an odd or zero head_dim, theta <= 0, factor <= 0 or (llama3)
// high_freq_factor <= low_freq_factor.
StatusOr<std::vector<float>> rope_inverse_frequencies(size_t head_dim, double theta, const RopeScaling& scaling);

// ---------------------------------------------------------------------------------
// SwiGLU, the Llama MLP's gate: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
// gate, up, out: count elements each (dense). out may alias gate or up.
Status swiglu_forward(Stream& stream, DType dtype, const void* gate, const void* up, void* out, size_t count);
// Needs gate and up. dgate = dout * up * silu'(gate), dup = dout * silu(gate), each
// (+)= per input_grad; either may be null (not wanted). Neither may alias gate, up, dout
// or the other (InvalidArgument).
Status swiglu_backward(Stream& stream, DType dtype, const void* dout, const void* gate, const void* up, void* dgate,
                       void* dup, size_t count, GradWrite input_grad);

// ---------------------------------------------------------------------------------
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
