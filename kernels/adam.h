// Adam and AdamW: the per-element update, its scalar reference, and one host-callable
// entry point that steps a shard on any device.
//
// The math lives here, on floor 2, so the CUDA kernel (kernels/adam.cu), the CPU twin
// (kernels/adam.cpp, also the scalar reference every SIMD path of optim/ is tested
// against) and the SIMD span kernels of optim/ all compute the same thing.
//
// One fused pass per element, with per-call scalars (see AdamStepScalars):
//
//   g  = grad * grad_scale                     grad_scale = clip coefficient / loss scale
//   g  = g + weight_decay * p                  (kL2, classic Adam, only)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * (g * g)
//   d  = sqrt(v) * inv_sqrt_bias_correction2 + eps
//   p  = p * decay_factor                      (kDecoupled, AdamW: 1 - lr * weight_decay)
//   p  = p - step_size * (m / d)               step_size = lr / (1 - beta1^t)
//   param_out = round_to_nearest_even(p)       (bf16, fp16 or fp32; or nothing)
//
// Every operation is a separately rounded IEEE fp32 multiply, add, divide or square
// root: no fused multiply-add anywhere, so the scalar, AVX2, AVX-512 and CUDA paths are
// bit-identical (a multiply-add fused on one path and not on another would differ in
// the last bit). Translation units that evaluate adam_update_element must therefore be
// compiled without floating-point contraction (GCC/Clang contract `a * b + c` into an
// FMA by default where the target has one): kernels/adam.cpp and optim/ turn it off;
// the CUDA kernel uses the explicitly rounded __fmul_rn/__fadd_rn intrinsics.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "engine/core/device.h"
#include "engine/core/dtype.h"

#if defined(__CUDACC__)
#define STRATA_ADAM_HOST_DEVICE __host__ __device__ __forceinline__
#else
// Always inlined, so each translation unit evaluates the math under its own (contraction-
// free) flags rather than through whichever out-of-line copy the linker keeps.
#define STRATA_ADAM_HOST_DEVICE [[gnu::always_inline]] inline
#endif

namespace strata::kernels {

// How weight decay enters the update.
enum class AdamWeightDecay : uint8_t {
  kDecoupled,  // AdamW (Loshchilov & Hutter): p *= 1 - lr * weight_decay, outside the moments
  kL2,         // classic Adam: weight_decay * p is added to the gradient before the moments
};
std::string_view adam_weight_decay_name(AdamWeightDecay decay);  // "adamw" | "adam"

// The optimizer's hyperparameters; lr and betas may change every call (a scheduler).
// Doubles, as a Python scheduler hands them over; the per-step scalars derived from them
// are rounded to fp32 once.
struct AdamHyperparams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  AdamWeightDecay decay = AdamWeightDecay::kDecoupled;
};

// What the gradient is multiplied by before the update: undoes the loss scale and
// applies the clipping coefficient (both 1 when off).
struct GradientScaling {
  float loss_scale = 1.0f;        // the loss was multiplied by this before backward
  float clip_coefficient = 1.0f;  // min(1, max_norm / (global_norm + 1e-6)), or 1 without clipping
};

// The scalars one step uses for every element, derived once per call (in double, then
// rounded to fp32) by adam_step_scalars().
struct AdamStepScalars {
  float grad_scale = 1.0f;                 // clip_coefficient / loss_scale
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float step_size = 1e-3f;                 // lr / (1 - beta1^step)
  float inv_sqrt_bias_correction2 = 1.0f;  // 1 / sqrt(1 - beta2^step)
  float eps = 1e-8f;
  float decay_factor = 1.0f;               // kDecoupled: 1 - lr * weight_decay; kL2: 1
  float l2_weight_decay = 0.0f;            // kL2: weight_decay; kDecoupled: 0
  AdamWeightDecay decay = AdamWeightDecay::kDecoupled;
};

// Validates the hyperparameters and derives the scalars of step number `step` (1 for
// the first update; a skipped step does not count). Errors name the bad value.
StatusOr<AdamStepScalars> adam_step_scalars(const AdamHyperparams& hyper, int64_t step, const GradientScaling& scaling = {});

// Explicitly rounded fp32 operations: plain operators on the host (compiled without
// contraction), the _rn intrinsics on a GPU so nvcc cannot fuse them either.
namespace adam_math {
STRATA_ADAM_HOST_DEVICE float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
STRATA_ADAM_HOST_DEVICE float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
STRATA_ADAM_HOST_DEVICE float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
STRATA_ADAM_HOST_DEVICE float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
STRATA_ADAM_HOST_DEVICE float sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}
}  // namespace adam_math

// The element function: updates one parameter's master weight and moments from its raw
// (still loss-scaled) gradient value. The definition of the math for every path.
STRATA_ADAM_HOST_DEVICE void adam_update_element(float grad, float& master, float& exp_avg, float& exp_avg_sq,
                                                 const AdamStepScalars& s) {
  using namespace adam_math;
  float g = mul(grad, s.grad_scale);
  if (s.decay == AdamWeightDecay::kL2) g = add(g, mul(s.l2_weight_decay, master));
  const float m = add(mul(s.beta1, exp_avg), mul(s.one_minus_beta1, g));
  const float v = add(mul(s.beta2, exp_avg_sq), mul(s.one_minus_beta2, mul(g, g)));
  const float denom = add(mul(adam_math::sqrt(v), s.inv_sqrt_bias_correction2), s.eps);
  const float decayed = mul(master, s.decay_factor);
  master = sub(decayed, mul(s.step_size, div(m, denom)));
  exp_avg = m;
  exp_avg_sq = v;
}

// One shard's tensors, all `count` elements long, all on the same device (or host
// memory for the CPU paths).
struct AdamBuffers {
  const void* grad = nullptr;                // the gradient shard, still multiplied by the loss scale
  DType grad_type = DType::kBFloat16;        // bf16, fp16 or fp32
  float* master = nullptr;                   // fp32 master weights, updated in place
  void* exp_avg = nullptr;                   // first moment, updated in place
  void* exp_avg_sq = nullptr;                // second moment, updated in place
  DType moment_type = DType::kFloat32;       // fp32, or bf16 (halves the optimizer state; RNE each step)
  void* param = nullptr;                     // receives the new parameter in param_type; nullptr = no copy
  DType param_type = DType::kBFloat16;       // bf16, fp16 or fp32 (ignored when param is nullptr)
  size_t count = 0;                          // elements
};

// Checks the buffers: non-null state, supported dtypes (moments fp32 or bf16). Errors
// name the buffer.
Status validate_adam_buffers(const AdamBuffers& buffers);

// Bytes one element's update moves through memory (reads and writes), for bandwidth figures.
size_t adam_bytes_per_element(const AdamBuffers& buffers);

// Steps `buffers` in `stream` order: the CUDA kernel on a CudaDevice, the CPU twin
// (fanned out through the device's executor) on a CpuDevice. Buffers are memory of the
// stream's device.
Status adam_step(Stream& stream, const AdamBuffers& buffers, const AdamStepScalars& scalars);

// The CPU twin and scalar reference: updates elements [begin, end) on the calling thread.
void adam_step_cpu_range(const AdamBuffers& buffers, const AdamStepScalars& scalars, size_t begin, size_t end);

#if defined(STRATA_HAVE_CUDA)
// The CUDA kernel launcher (kernels/adam.cu); `cuda_stream` is a cudaStream_t.
Status adam_step_cuda(void* cuda_stream, const AdamBuffers& buffers, const AdamStepScalars& scalars);
#endif

}  // namespace strata::kernels
