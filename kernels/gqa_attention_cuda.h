// CUDA launchers of causal grouped-query attention (kernels/flash_attention.cu). Internal to
// kernels/: the host entry points in kernels/gqa_attention.cpp call these on a CudaDevice
// stream after checking arguments. `cuda_stream` is a cudaStream_t; dtype is fp32 or bf16
// (checked by the caller); shapes arrive with every stride spelled out (non-zero).
#pragma once

#if defined(STRATA_HAVE_CUDA)

#include <cstddef>

#include "kernels/blas_context.h"
#include "kernels/gqa_attention.h"

namespace strata::kernels::cuda {

// The one CUDA attention: GPT-2's attention_forward/backward call these on the fused qkv.
Status gqa_attention_forward(void* cuda_stream, BlasContext& blas, const GqaAttentionShape& shape, DType dtype,
                             const void* q, const void* k, const void* v, void* out, float* lse, void* workspace);
Status gqa_attention_backward(void* cuda_stream, BlasContext& blas, const GqaAttentionShape& shape, DType dtype,
                              const void* dout, const void* q, const void* k, const void* v, const float* lse, void* dq,
                              void* dk, void* dv, void* workspace, GradWrite input_grad);

}  // namespace strata::kernels::cuda

#endif  // STRATA_HAVE_CUDA
