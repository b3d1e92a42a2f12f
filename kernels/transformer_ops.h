// The transformer ops a GPT-2 needs, forward and backward, on any device.
//
// One host-callable entry point per op and direction, in the pattern of kernels/cast.h:
// on a CudaDevice it enqueues CUDA kernels (and cuBLAS GEMMs) on the stream at once; on
// a CpuDevice the CPU twin (kernels/transformer_ops_cpu.h) runs later, in stream order,
// fanned out through the device's executor. The scalar references the tests compare
// against are in kernels/reference.h.
//
// Conventions shared by every op:
// - All pointers are memory of the stream's device; layouts are row-major and dense.
// - `dtype` is the compute type of the activations, their gradients and the
//   parameters: fp32 on every device; bf16 too on a CudaDevice (fp16: Unimplemented).
//   Parameter gradients, saved statistics (mean, rstd, logsumexp) and losses are
//   always fp32: they accumulate (over uses of a tied weight, over micro-batches) and
//   bf16 would swamp small additions.
// - GradWrite says whether a gradient output is overwritten or added to. Gradient
//   outputs are never aliased with inputs unless an op says so.
// - Nothing to compute (zero batch, rows, positions or count) is a no-op; a zero reduced
//   dimension (in_features, vocab_size) is InvalidArgument, as is a null pointer for a
//   required argument; both are reported at once, before anything is enqueued.
// - Determinism: every op gives bit-identical results run to run on the same device and
//   sizes (no atomics on floats, reductions in a fixed order, cuBLAS with a fixed
//   workspace), CPU and GPU alike; the CPU twins also whatever the executor's thread
//   count. CPU and GPU results differ in rounding only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "kernels/blas_context.h"

namespace strata::kernels {

enum class GradWrite : uint8_t {
  kOverwrite,   // grad = computed
  kAccumulate,  // grad += computed
};

struct GradOptions {
  GradWrite input_grad = GradWrite::kOverwrite;  // dx, dqkv, dlogits (dtype)
  GradWrite param_grad = GradWrite::kOverwrite;  // dweight, dbias, dgamma, dbeta, dwte, dwpe (fp32)
};

// ---------------------------------------------------------------------------------
// Token + position embedding.
//   out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]
// tokens: int32 [batch, seq_len] in [0, vocab_size); wte: [vocab_size, channels];
// wpe: [max_positions, channels] with seq_len <= max_positions, or null for a model with
// no position table (Llama: rotary positions; max_positions is then ignored);
// out: [batch, seq_len, channels].
// A token outside [0, vocab_size): the CPU twin fails with InvalidArgument naming it;
// the CUDA kernel, which cannot report, uses a zero token embedding for it.
struct EmbeddingShape {
  size_t batch = 0;
  size_t seq_len = 0;
  size_t channels = 0;
  size_t vocab_size = 0;
  size_t max_positions = 0;
};
Status embedding_forward(Stream& stream, const EmbeddingShape& shape, DType dtype, const int32_t* tokens, const void* wte,
                         const void* wpe, void* out);
// dwte[v,:] (+)= sum of dout[b,t,:] over positions with tokens[b,t] == v (added in
// position order); dwpe[t,:] (+)= sum over b of dout[b,t,:]. Only the first seq_len rows
// of dwpe are written. Either gradient may be null (not wanted; dwpe must be null when
// the forward had no wpe, and max_positions is then ignored). Saved from forward:
// the tokens only. Deterministic on the GPU too: each block owns a range of vocabulary
// rows and adds the matching positions in order (no atomics, no sort).
Status embedding_backward(Stream& stream, const EmbeddingShape& shape, DType dtype, const int32_t* tokens, const void* dout,
                          float* dwte, float* dwpe, GradWrite param_grad);

// ---------------------------------------------------------------------------------
// LayerNorm over the last dimension.
//   y = (x - mean) * rstd * gamma + beta, rstd = 1 / sqrt(var + epsilon) (biased variance)
// x, y: [rows, channels]; gamma, beta: [channels]; mean, rstd: fp32 [rows], saved for the
// backward (either may be null when no backward follows).
struct LayerNormShape {
  size_t rows = 0;
  size_t channels = 0;
  float epsilon = 1e-5f;
};
Status layernorm_forward(Stream& stream, const LayerNormShape& shape, DType dtype, const void* x, const void* gamma,
                         const void* beta, void* y, float* mean, float* rstd);
// Needs x, gamma and the forward's mean and rstd. dx (dtype) per options.input_grad;
// dgamma, dbeta (fp32, may be null) per options.param_grad.
Status layernorm_backward(Stream& stream, const LayerNormShape& shape, DType dtype, const void* dy, const void* x,
                          const void* gamma, const float* mean, const float* rstd, void* dx, float* dgamma, float* dbeta,
                          const GradOptions& options);

// ---------------------------------------------------------------------------------
// Matrix product with bias: y[rows, out] = x[rows, in] . W + bias.
enum class WeightLayout : uint8_t {
  kInOut,  // weight stored [in_features, out_features] (Hugging Face GPT-2 Conv1D: c_attn, c_proj, c_fc)
  kOutIn,  // weight stored [out_features, in_features] (nn.Linear; the tied LM head reading wte [vocab, channels])
};
struct MatmulShape {
  size_t rows = 0;          // batch * seq_len
  size_t in_features = 0;
  size_t out_features = 0;
  WeightLayout layout = WeightLayout::kInOut;
};
// bias: [out_features] or null. GPU: cuBLAS GEMM, fp32 accumulation for bf16; the bias
// is added by cuBLASLt's bias epilogue (one rounding), or, where cuBLASLt has no
// algorithm for the shape or the bias is not 16-byte aligned, broadcast into y first
// with the GEMM adding onto it (one rounding too). CPU: cblas_sgemm in 64-row/column
// tiles across the executor (see kernels/blas_context.h).
Status matmul_forward(Stream& stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* x,
                      const void* weight, const void* bias, void* y);
// Needs x and weight. dx (dtype, [rows, in], may be null) per options.input_grad;
// dweight (fp32, same layout as weight, may be null) and dbias (fp32 [out], may be
// null) per options.param_grad. GPU: with both wanted and param_grad kOverwrite, dbias
// comes from the dweight GEMM's bias-gradient epilogue (cuBLASLt BGRADA/BGRADB), else
// from a column-sum kernel.
Status matmul_backward(Stream& stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* dy,
                       const void* x, const void* weight, void* dx, float* dweight, float* dbias,
                       const GradOptions& options);

// ---------------------------------------------------------------------------------
// GELU, GPT-2's tanh form: y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
Status gelu_forward(Stream& stream, DType dtype, const void* x, void* y, size_t count);
// Needs x. dx may alias dy when input_grad is kOverwrite.
Status gelu_backward(Stream& stream, DType dtype, const void* dy, const void* x, void* dx, size_t count,
                     GradWrite input_grad);

// ---------------------------------------------------------------------------------
// A matrix product and the GELU after it, in one op (GPT-2's mlp.c_fc):
//   pre_activation = x . W + bias, y = gelu(pre_activation).
// Shape, layout and bias (may be null) as matmul_forward; pre_activation and y:
// [rows, out_features], distinct buffers, both kept for the backward (pre_activation
// for gelu_matmul_backward, y as the next product's input).
// GPU, bf16: one cuBLASLt GEMM whose GELU_AUX(_BIAS) epilogue adds the bias and writes
// pre_activation and gelu of it from the fp32 accumulator (one rounding each), where
// cuBLASLt has an algorithm and out_features is a multiple of 8 (its leading dimension
// of the aux matrix); otherwise, and in fp32, matmul_forward then gelu_forward
// (BlasOptions::gelu_epilogue changes which dtypes try the epilogue).
// Not in fp32: NVIDIA documents neither which GELU the epilogue computes (GPT-2's tanh
// form or the erf form) nor how accurately, and the two forms differ by up to 4.7e-4,
// 1.5e-4 to 2e-4 relative over a tensor of N(0, 1..2) inputs, which fp32 runs, held to
// 2e-5 against the CPU twin, would see. In bf16 one rounding (2^-9 relative, ~2e-3
// over a tensor) is ten times that, so the epilogue agrees with gelu_forward to bf16
// precision whichever form it computes. CPU: matmul_forward then gelu_forward, bit for bit.
Status matmul_bias_gelu_forward(Stream& stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* x,
                                const void* weight, const void* bias, void* pre_activation, void* y);
// The input gradient of a matrix product whose input was gelu(pre_activation) (GPT-2's
// mlp.c_proj after c_fc), through the GELU:
//   dpre = (dy . W'^T) * gelu'(pre_activation), overwritten ([rows, in_features]).
// Shape and weight are the product's; its dweight and dbias come from matmul_backward
// with dx null. pre_bias_grad (fp32 [in_features], may be null) gets the column sums of
// dpre per bias_grad: the bias gradient of the product that made pre_activation (c_fc).
// GPU, bf16: one cuBLASLt GEMM with the DGELU epilogue (DGELU_BGRAD, giving
// pre_bias_grad too, when it is overwritten and cuBLASLt takes an fp32 bias gradient),
// where cuBLASLt has an algorithm; otherwise, and in fp32, the GEMM, gelu_backward
// and a column sum. CPU: matmul_backward's dx, gelu_backward in place, matmul_backward's
// dbias column sum, bit for bit.
Status gelu_matmul_backward(Stream& stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* dy,
                            const void* weight, const void* pre_activation, void* dpre, float* pre_bias_grad,
                            GradWrite bias_grad);

// ---------------------------------------------------------------------------------
// Residual add: out = a + b (out may alias a or b).
Status residual_forward(Stream& stream, DType dtype, const void* a, const void* b, void* out, size_t count);
// da (+)= dout and db (+)= dout; either may be null. Needs nothing saved.
Status residual_backward(Stream& stream, DType dtype, const void* dout, void* da, void* db, size_t count,
                         GradWrite input_grad);

// ---------------------------------------------------------------------------------
// Causal multi-head self-attention on GPT-2's fused qkv (the output of c_attn).
// qkv: [batch, seq_len, 3 * channels] holding q | k | v, each split into `heads`
// consecutive slices of head_dim (channels = heads * head_dim); out: [batch, seq_len,
// channels], heads concatenated (the input of c_proj). Scores are q.k / sqrt(head_dim)
// with key j visible from query t iff j <= t.
// lse: fp32 [batch, heads, seq_len], the logsumexp of each query's scaled scores, saved
// for the backward, which recomputes the probabilities from it (nothing T x T is kept).
// This is gqa_attention_forward/backward (kernels/gqa_attention.h) with kv_heads == heads
// on the fused row (gqa_shape_of_fused_qkv): one attention implementation per device.
struct AttentionShape {
  size_t batch = 0;
  size_t seq_len = 0;
  size_t heads = 0;
  size_t head_dim = 0;
};
// Scratch the op needs from the caller's device memory (0 on a CpuDevice), the same for
// forward and backward: gqa_attention_workspace_bytes of the fused shape (on the GPU
// fp32 [batch, heads, seq_len], nothing T x T).
size_t attention_workspace_bytes(const AttentionShape& shape, DType dtype, DeviceKind kind);
Status attention_forward(Stream& stream, BlasContext& blas, const AttentionShape& shape, DType dtype, const void* qkv,
                         void* out, float* lse, void* workspace, size_t workspace_bytes);
// Needs qkv and lse from the forward. dqkv [batch, seq_len, 3 * channels] per input_grad.
Status attention_backward(Stream& stream, BlasContext& blas, const AttentionShape& shape, DType dtype, const void* dout,
                          const void* qkv, const float* lse, void* dqkv, void* workspace, size_t workspace_bytes,
                          GradWrite input_grad);

// ---------------------------------------------------------------------------------
// Softmax cross-entropy over the vocabulary.
// logits: [rows, vocab_size]; targets: int32 [rows]. Rows whose target equals
// ignore_index contribute no loss and get zero gradient (the default -1 ignores nothing
// real). A target outside [0, vocab_size) that is not ignore_index: the CPU twin fails
// with InvalidArgument; the CUDA kernel writes a NaN loss for that row.
struct CrossEntropyShape {
  size_t rows = 0;
  size_t vocab_size = 0;
  int32_t ignore_index = -1;
};
// losses: fp32 [rows] (0 for ignored rows); lse: fp32 [rows] logsumexp of each row,
// saved for cross_entropy_backward (may be null); mean_loss: fp32 scalar in device
// memory, the mean of the losses over the rows not ignored (0 when all are), or null.
Status cross_entropy_forward(Stream& stream, const CrossEntropyShape& shape, DType dtype, const void* logits,
                             const int32_t* targets, float* losses, float* lse, float* mean_loss);
// dlogits[r,:] (+)= grad_scale * (softmax(logits[r,:]) - onehot(targets[r])) for rows
// not ignored, nothing added (or zero written) for ignored rows. grad_scale is
// d(objective)/d(losses[r]): 1 / (number of rows not ignored) for the mean loss, times
// the loss scale or 1 / accumulation steps as the caller needs. Needs logits, targets
// and the forward's lse.
Status cross_entropy_backward(Stream& stream, const CrossEntropyShape& shape, DType dtype, const void* logits,
                              const int32_t* targets, const float* lse, float grad_scale, void* dlogits,
                              GradWrite input_grad);
// Forward and backward in one pass over the logits: losses, mean_loss (may be null) and
// dlogits (overwritten) as above. dlogits may alias logits (the logits are then gone).
Status cross_entropy_fused(Stream& stream, const CrossEntropyShape& shape, DType dtype, const void* logits,
                           const int32_t* targets, float grad_scale, float* losses, float* mean_loss, void* dlogits);

}  // namespace strata::kernels
