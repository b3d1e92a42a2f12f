// CUDA launchers of the transformer ops (kernels/transformer_ops.cu). Internal to
// kernels/: the host entry points in kernels/transformer_ops.cpp call these on a
// CudaDevice stream after checking arguments. `cuda_stream` is a cudaStream_t; dtype is
// fp32 or bf16 (checked by the caller).
#pragma once

#if defined(STRATA_HAVE_CUDA)

#include <cstddef>
#include <cstdint>

#include "kernels/transformer_ops.h"

namespace strata::kernels::cuda {

Status embedding_forward(void* cuda_stream, const EmbeddingShape& shape, DType dtype, const int32_t* tokens,
                         const void* wte, const void* wpe, void* out);
Status embedding_backward(void* cuda_stream, const EmbeddingShape& shape, DType dtype, const int32_t* tokens,
                          const void* dout, float* dwte, float* dwpe, GradWrite param_grad);

Status layernorm_forward(void* cuda_stream, const LayerNormShape& shape, DType dtype, const void* x, const void* gamma,
                         const void* beta, void* y, float* mean, float* rstd);
Status layernorm_backward(void* cuda_stream, const LayerNormShape& shape, DType dtype, const void* dy, const void* x,
                          const void* gamma, const float* mean, const float* rstd, void* dx, float* dgamma,
                          float* dbeta, const GradOptions& options);

Status matmul_forward(void* cuda_stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* x,
                      const void* weight, const void* bias, void* y);
Status matmul_backward(void* cuda_stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* dy,
                       const void* x, const void* weight, void* dx, float* dweight, float* dbias,
                       const GradOptions& options);

Status gelu_forward(void* cuda_stream, DType dtype, const void* x, void* y, size_t count);
Status gelu_backward(void* cuda_stream, DType dtype, const void* dy, const void* x, void* dx, size_t count,
                     GradWrite input_grad);

Status matmul_bias_gelu_forward(void* cuda_stream, BlasContext& blas, const MatmulShape& shape, DType dtype,
                                const void* x, const void* weight, const void* bias, void* pre_activation, void* y);
Status gelu_matmul_backward(void* cuda_stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* dy,
                            const void* weight, const void* pre_activation, void* dpre, float* pre_bias_grad,
                            GradWrite bias_grad);

Status residual_forward(void* cuda_stream, DType dtype, const void* a, const void* b, void* out, size_t count);
Status residual_backward(void* cuda_stream, DType dtype, const void* dout, void* da, void* db, size_t count,
                         GradWrite input_grad);

// GPT-2's attention: gqa_attention_forward/backward in kernels/gqa_attention_cuda.h.

Status cross_entropy_forward(void* cuda_stream, const CrossEntropyShape& shape, DType dtype, const void* logits,
                             const int32_t* targets, float* losses, float* lse, float* mean_loss);
Status cross_entropy_backward(void* cuda_stream, const CrossEntropyShape& shape, DType dtype, const void* logits,
                              const int32_t* targets, const float* lse, float grad_scale, void* dlogits,
                              GradWrite input_grad);
Status cross_entropy_fused(void* cuda_stream, const CrossEntropyShape& shape, DType dtype, const void* logits,
                           const int32_t* targets, float grad_scale, float* losses, float* mean_loss, void* dlogits);

}  // namespace strata::kernels::cuda

#endif  // STRATA_HAVE_CUDA
