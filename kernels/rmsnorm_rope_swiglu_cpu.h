// CPU twins of RMSNorm, RoPE and SwiGLU (kernels/rmsnorm.h, rope.h, swiglu.h), fp32 only.
//
// As kernels/transformer_ops_cpu.h: each runs on the calling thread and fans out
// through `executor`; the host entry points call them on a CpuDevice stream's worker.
// Shapes, layouts and GradWrite semantics are those of the ops' headers. Splits never
// change the order of a sum: rows are independent (rmsnorm, rope), dgamma is a column
// sum over rows in order, swiglu is element-wise. So results do not depend on the thread count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/core/executor.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

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

}  // namespace strata::kernels::cpu
