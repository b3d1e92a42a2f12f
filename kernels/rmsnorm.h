// RMSNorm, forward and backward, on any device (the Llama family's norm, Mistral's, Qwen2's).
//
// Same conventions as kernels/transformer_ops.h (read its header comment): one host entry
// point per direction; CUDA kernels enqueued at once on a CudaDevice, the CPU twin run in
// stream order on a CpuDevice; `dtype` fp32 everywhere, bf16 too on a CudaDevice;
// parameter gradients and saved statistics fp32; GradWrite / GradOptions; bad arguments
// reported at once, before anything is enqueued; bit-identical results run to run and, on
// the CPU, whatever the thread count. Scalar references: kernels/reference.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "kernels/transformer_ops.h"

namespace strata::kernels {

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

}  // namespace strata::kernels
