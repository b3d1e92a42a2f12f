// The scalar Adam: the CPU twin of the CUDA kernel and the reference the SIMD paths of
// optim/ are compared against. Compiled without floating-point contraction (see
// kernels/adam.h): every multiply and add is rounded on its own.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "kernels/adam.h"

#include <cmath>
#include <string>

namespace strata::kernels {

std::string_view adam_weight_decay_name(AdamWeightDecay decay) {
  return decay == AdamWeightDecay::kDecoupled ? "adamw" : "adam";
}

namespace {

bool finite(double value) { return std::isfinite(value); }

Status check_range(const char* name, double value, double low, bool low_inclusive, double high, bool high_inclusive) {
  const bool above = low_inclusive ? value >= low : value > low;
  const bool below = high_inclusive ? value <= high : value < high;
  if (finite(value) && above && below) return {};
  return InvalidArgumentError(std::string("adam: ") + name + " must be in " + (low_inclusive ? "[" : "(") + std::to_string(low) + ", " +
                              (std::isinf(high) ? std::string("inf") : std::to_string(high)) + (high_inclusive ? "]" : ")") +
                              ", got " + std::to_string(value));
}

}  // namespace

StatusOr<AdamStepScalars> adam_step_scalars(const AdamHyperparams& hyper, int64_t step, const GradientScaling& scaling) {
  constexpr double kInf = HUGE_VAL;
  STRATA_RETURN_IF_ERROR(check_range("lr", hyper.lr, 0.0, true, kInf, false));
  STRATA_RETURN_IF_ERROR(check_range("beta1", hyper.beta1, 0.0, true, 1.0, false));
  STRATA_RETURN_IF_ERROR(check_range("beta2", hyper.beta2, 0.0, true, 1.0, false));
  STRATA_RETURN_IF_ERROR(check_range("eps", hyper.eps, 0.0, false, kInf, false));
  STRATA_RETURN_IF_ERROR(check_range("weight_decay", hyper.weight_decay, 0.0, true, kInf, false));
  STRATA_RETURN_IF_ERROR(check_range("loss_scale", scaling.loss_scale, 0.0, false, kInf, false));
  STRATA_RETURN_IF_ERROR(check_range("clip_coefficient", scaling.clip_coefficient, 0.0, false, kInf, false));
  if (step < 1) return InvalidArgumentError("adam: step must be >= 1 (the first update is step 1), got " + std::to_string(step));

  // Derived in double, as PyTorch does in Python, then rounded once to fp32.
  const double beta1 = hyper.beta1;
  const double beta2 = hyper.beta2;
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamStepScalars s;
  s.grad_scale = static_cast<float>(static_cast<double>(scaling.clip_coefficient) / static_cast<double>(scaling.loss_scale));
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.step_size = static_cast<float>(hyper.lr / bias_correction1);
  s.inv_sqrt_bias_correction2 = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  s.eps = static_cast<float>(hyper.eps);
  s.decay = hyper.decay;
  if (hyper.decay == AdamWeightDecay::kDecoupled) {
    s.decay_factor = static_cast<float>(1.0 - hyper.lr * hyper.weight_decay);
    s.l2_weight_decay = 0.0f;
  } else {
    s.decay_factor = 1.0f;
    s.l2_weight_decay = static_cast<float>(hyper.weight_decay);
  }
  if (!finite(s.step_size) || !finite(s.inv_sqrt_bias_correction2))
    return InvalidArgumentError("adam: the bias corrections of step " + std::to_string(step) + " are not finite (beta1 " +
                                std::to_string(beta1) + ", beta2 " + std::to_string(beta2) + ")");
  return s;
}

Status validate_adam_buffers(const AdamBuffers& b) {
  if (b.count == 0) return {};
  if (b.grad == nullptr) return InvalidArgumentError("adam: the gradient buffer is null");
  if (b.master == nullptr) return InvalidArgumentError("adam: the master weight buffer is null");
  if (b.exp_avg == nullptr) return InvalidArgumentError("adam: the exp_avg buffer is null");
  if (b.exp_avg_sq == nullptr) return InvalidArgumentError("adam: the exp_avg_sq buffer is null");
  if (b.moment_type == DType::kFloat16)
    return InvalidArgumentError("adam: moments must be fp32 or bf16, got fp16 (its range cannot hold exp_avg_sq)");
  return {};
}

size_t adam_bytes_per_element(const AdamBuffers& b) {
  const size_t moments = 2 * 2 * dtype_size(b.moment_type);  // read and written
  const size_t master = 2 * 4;
  const size_t param = b.param != nullptr ? dtype_size(b.param_type) : 0;
  return dtype_size(b.grad_type) + master + moments + param;
}

namespace {

template <DType kType>
float load(const void* data, size_t i) {
  if constexpr (kType == DType::kFloat32) return static_cast<const float*>(data)[i];
  if constexpr (kType == DType::kBFloat16) return bf16_bits_to_float(static_cast<const uint16_t*>(data)[i]);
  if constexpr (kType == DType::kFloat16) return fp16_bits_to_float(static_cast<const uint16_t*>(data)[i]);
}

template <DType kType>
void store(void* data, size_t i, float value) {
  if constexpr (kType == DType::kFloat32) static_cast<float*>(data)[i] = value;
  if constexpr (kType == DType::kBFloat16) static_cast<uint16_t*>(data)[i] = float_to_bf16_bits(value);
  if constexpr (kType == DType::kFloat16) static_cast<uint16_t*>(data)[i] = float_to_fp16_bits(value);
}

// kParam: the parameter copy's type; kWriteParam false means no copy.
template <DType kGrad, DType kMoment, bool kWriteParam, DType kParam>
void step_range(const AdamBuffers& b, const AdamStepScalars& s, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    float master = b.master[i];
    float exp_avg = load<kMoment>(b.exp_avg, i);
    float exp_avg_sq = load<kMoment>(b.exp_avg_sq, i);
    adam_update_element(load<kGrad>(b.grad, i), master, exp_avg, exp_avg_sq, s);
    b.master[i] = master;
    store<kMoment>(b.exp_avg, i, exp_avg);
    store<kMoment>(b.exp_avg_sq, i, exp_avg_sq);
    if constexpr (kWriteParam) store<kParam>(b.param, i, master);
  }
}

template <DType kGrad, DType kMoment>
void dispatch_param(const AdamBuffers& b, const AdamStepScalars& s, size_t begin, size_t end) {
  if (b.param == nullptr) return step_range<kGrad, kMoment, false, DType::kFloat32>(b, s, begin, end);
  switch (b.param_type) {
    case DType::kFloat32: return step_range<kGrad, kMoment, true, DType::kFloat32>(b, s, begin, end);
    case DType::kBFloat16: return step_range<kGrad, kMoment, true, DType::kBFloat16>(b, s, begin, end);
    case DType::kFloat16: return step_range<kGrad, kMoment, true, DType::kFloat16>(b, s, begin, end);
  }
}

template <DType kGrad>
void dispatch_moment(const AdamBuffers& b, const AdamStepScalars& s, size_t begin, size_t end) {
  if (b.moment_type == DType::kBFloat16) return dispatch_param<kGrad, DType::kBFloat16>(b, s, begin, end);
  return dispatch_param<kGrad, DType::kFloat32>(b, s, begin, end);
}

}  // namespace

void adam_step_cpu_range(const AdamBuffers& b, const AdamStepScalars& s, size_t begin, size_t end) {
  switch (b.grad_type) {
    case DType::kFloat32: return dispatch_moment<DType::kFloat32>(b, s, begin, end);
    case DType::kBFloat16: return dispatch_moment<DType::kBFloat16>(b, s, begin, end);
    case DType::kFloat16: return dispatch_moment<DType::kFloat16>(b, s, begin, end);
  }
}

Status adam_step(Stream& stream, const AdamBuffers& buffers, const AdamStepScalars& scalars) {
  if (buffers.count == 0) return {};
  STRATA_RETURN_IF_ERROR(validate_adam_buffers(buffers));
  return stream.launch([buffers, scalars](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
#if defined(STRATA_HAVE_CUDA)
      return adam_step_cuda(ctx.native_stream, buffers, scalars);
#else
      return InternalError("adam: a native stream in a build without CUDA");
#endif
    }
    if (ctx.executor == nullptr) return InternalError("adam: a CPU launch without an executor");
    constexpr size_t kGrain = size_t{1} << 16;
    ctx.executor->parallel_for(0, buffers.count, kGrain,
                               [&](size_t lo, size_t hi) { adam_step_cpu_range(buffers, scalars, lo, hi); });
    return {};
  });
}

}  // namespace strata::kernels
