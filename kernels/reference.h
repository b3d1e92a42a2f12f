// Scalar references of the transformer ops (kernels/transformer_ops.h), for tests and
// benchmark validation only: plain loops in double precision, written from the
// definitions, sharing no code with the CPU twins or the CUDA kernels. Shapes and
// layouts are those of kernels/transformer_ops.h. Gradients are always overwritten.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/gqa_attention.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "kernels/transformer_ops.h"

namespace strata::kernels::reference {

// wpe and dwpe may be null (no position table).
void embedding_forward(const EmbeddingShape& shape, const int32_t* tokens, const double* wte, const double* wpe,
                       double* out);
void embedding_backward(const EmbeddingShape& shape, const int32_t* tokens, const double* dout, double* dwte,
                        double* dwpe);

void layernorm_forward(const LayerNormShape& shape, const double* x, const double* gamma, const double* beta, double* y,
                       double* mean, double* rstd);
// Recomputes mean and rstd from x.
void layernorm_backward(const LayerNormShape& shape, const double* dy, const double* x, const double* gamma, double* dx,
                        double* dgamma, double* dbeta);

// bias may be null.
void matmul_forward(const MatmulShape& shape, const double* x, const double* weight, const double* bias, double* y);
void matmul_backward(const MatmulShape& shape, const double* dy, const double* x, const double* weight, double* dx,
                     double* dweight, double* dbias);

void gelu_forward(const double* x, double* y, size_t count);
void gelu_backward(const double* dy, const double* x, double* dx, size_t count);

void residual_forward(const double* a, const double* b, double* out, size_t count);
void residual_backward(const double* dout, double* da, double* db, size_t count);

// lse: [batch, heads, seq_len].
void attention_forward(const AttentionShape& shape, const double* qkv, double* out, double* lse);
void attention_backward(const AttentionShape& shape, const double* dout, const double* qkv, double* dqkv);

// losses: [rows]; returns the mean over rows not ignored (0 when none).
double cross_entropy_forward(const CrossEntropyShape& shape, const double* logits, const int32_t* targets, double* losses,
                             double* lse);
void cross_entropy_backward(const CrossEntropyShape& shape, const double* logits, const int32_t* targets, double grad_scale,
                            double* dlogits);

// RMSNorm, RoPE, SwiGLU, grouped-query attention (kernels/rmsnorm.h ... gqa_attention.h) -----

// rstd may be null.
void rmsnorm_forward(const RmsNormShape& shape, const double* x, const double* gamma, double* y, double* rstd);
// Recomputes rstd from x.
void rmsnorm_backward(const RmsNormShape& shape, const double* dy, const double* x, const double* gamma, double* dx,
                      double* dgamma);

// The angle is rounded to fp32 (float(position) * inv_freq[i]) as Hugging Face's fp32
// product rounds it; cos, sin and the rotation are in double. Rows are strided as in
// RopeShape (0 = dense); elements outside the heads are left as they are.
void rope_forward(const RopeShape& shape, const int32_t* positions, const float* inv_freq, const double* x, double* y);
void rope_backward(const RopeShape& shape, const int32_t* positions, const float* inv_freq, const double* dy, double* dx);

void swiglu_forward(const double* gate, const double* up, double* out, size_t count);
void swiglu_backward(const double* dout, const double* gate, const double* up, double* dgate, double* dup, size_t count);

// Strides as in GqaAttentionShape (0 = dense); lse: [batch, heads, seq_len]. The
// backward writes only the heads' elements of dq, dk, dv (zeroed first).
void gqa_attention_forward(const GqaAttentionShape& shape, const double* q, const double* k, const double* v, double* out,
                           double* lse);
void gqa_attention_backward(const GqaAttentionShape& shape, const double* dout, const double* q, const double* k,
                            const double* v, double* dq, double* dk, double* dv);

}  // namespace strata::kernels::reference
