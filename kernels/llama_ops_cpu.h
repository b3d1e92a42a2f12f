// CPU twins of the Llama-family ops (kernels/llama_ops.h), fp32 only.
//
// As kernels/transformer_ops_cpu.h: each runs on the calling thread and fans out
// through `executor`; the host entry points call them on a CpuDevice stream's worker.
// Shapes, layouts and GradWrite semantics are those of kernels/llama_ops.h. Splits never
// change the order of a sum: rows are independent (rmsnorm, rope), dgamma is a column
// sum over rows in order, swiglu is element-wise, attention is split by (batch, head)
// forward and (batch, KV head) backward. So results do not depend on the thread count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/core/executor.h"
#include "kernels/llama_ops.h"

namespace strata::kernels::cpu {

void rmsnorm_forward(Executor& executor, const RmsNormShape& shape, const float* x, const float* gamma, float* y,
                     float* rstd);
void rmsnorm_backward(Executor& executor, const RmsNormShape& shape, const float* dy, const float* x, const float* gamma,
                      const float* rstd, float* dx, float* dgamma, const GradOptions& options);

void rope_forward(Executor& executor, const RopeShape& shape, const int32_t* positions, const float* inv_freq,
                  const float* x, float* y);
void rope_backward(Executor& executor, const RopeShape& shape, const int32_t* positions, const float* inv_freq,
                   const float* dy, float* dx, GradWrite input_grad);

void swiglu_forward(Executor& executor, const float* gate, const float* up, float* out, size_t count);
void swiglu_backward(Executor& executor, const float* dout, const float* gate, const float* up, float* dgate, float* dup,
                     size_t count, GradWrite input_grad);

// In kernels/transformer_ops_cpu.cpp, next to GPT-2's attention that wraps them.
void gqa_attention_forward(Executor& executor, const GqaAttentionShape& shape, const float* q, const float* k,
                           const float* v, float* out, float* lse);
void gqa_attention_backward(Executor& executor, const GqaAttentionShape& shape, const float* dout, const float* q,
                            const float* k, const float* v, const float* lse, float* dq, float* dk, float* dv,
                            GradWrite input_grad);

}  // namespace strata::kernels::cpu
