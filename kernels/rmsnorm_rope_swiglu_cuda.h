// CUDA launchers of RMSNorm, RoPE and SwiGLU (kernels/rmsnorm_rope_swiglu.cu). Internal to
// kernels/: the host entry points (kernels/rmsnorm.cpp, rope.cpp, swiglu.cpp) call these on a CudaDevice stream after
// checking arguments. `cuda_stream` is a cudaStream_t; dtype is fp32 or bf16 (checked by
// the caller).
#pragma once

#if defined(STRATA_HAVE_CUDA)

#include <cstddef>
#include <cstdint>

#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

namespace strata::kernels::cuda {

Status rmsnorm_forward(void* cuda_stream, const RmsNormShape& shape, DType dtype, const void* x, const void* gamma, void* y,
                       float* rstd);
Status rmsnorm_backward(void* cuda_stream, const RmsNormShape& shape, DType dtype, const void* dy, const void* x,
                        const void* gamma, const float* rstd, void* dx, float* dgamma, const GradOptions& options);

Status rope_forward(void* cuda_stream, const RopeShape& shape, DType dtype, const int32_t* positions, const float* inv_freq,
                    const void* x, void* y);
Status rope_backward(void* cuda_stream, const RopeShape& shape, DType dtype, const int32_t* positions,
                     const float* inv_freq, const void* dy, void* dx, GradWrite input_grad);

Status swiglu_forward(void* cuda_stream, DType dtype, const void* gate, const void* up, void* out, size_t count);
Status swiglu_backward(void* cuda_stream, DType dtype, const void* dout, const void* gate, const void* up, void* dgate,
                       void* dup, size_t count, GradWrite input_grad);

}  // namespace strata::kernels::cuda

#endif  // STRATA_HAVE_CUDA
