#include "optim/cpu_adam.h"

#include <cmath>
#include <limits>
#include <string>

namespace strata {

StatusOr<AdamStepPlan> plan_adam_step(const kernels::AdamHyperparams& hyper, int64_t step, const GradientStats& global,
                                      const AdamStepPlanOptions& options) {
  if (!(options.loss_scale > 0.0f) || !std::isfinite(options.loss_scale))
    return InvalidArgumentError("adam step plan: loss_scale must be a positive finite number, got " + std::to_string(options.loss_scale));
  if (!(options.max_grad_norm >= 0.0) || !std::isfinite(options.max_grad_norm))
    return InvalidArgumentError("adam step plan: max_grad_norm (gradient_clipping) must be >= 0 and finite, got " +
                                std::to_string(options.max_grad_norm));
  AdamStepPlan plan;
  if (global.non_finite || !std::isfinite(global.sum_of_squares)) {
    plan.skip = true;
    plan.grad_norm = std::numeric_limits<double>::infinity();
    return plan;
  }
  plan.grad_norm = std::sqrt(global.sum_of_squares) / static_cast<double>(options.loss_scale);
  if (options.max_grad_norm > 0.0) {
    const double coefficient = options.max_grad_norm / (plan.grad_norm + 1e-6);
    if (coefficient < 1.0) plan.clip_coefficient = static_cast<float>(coefficient);
  }
  STRATA_ASSIGN_OR_RETURN(plan.scalars,
                          kernels::adam_step_scalars(hyper, step, {.loss_scale = options.loss_scale, .clip_coefficient = plan.clip_coefficient}));
  return plan;
}

StatusOr<CpuAdam> CpuAdam::create(const CpuAdamOptions& options) {
  if (options.chunk_elements == 0 || options.chunk_elements % 64 != 0)
    return InvalidArgumentError("CPU Adam: chunk_elements must be a positive multiple of 64 (keeps chunks vector- and line-aligned), got " +
                                std::to_string(options.chunk_elements));
  const CpuIsa isa = options.isa.value_or(best_cpu_isa());
  STRATA_ASSIGN_OR_RETURN(AdamSpanKernels kernels, adam_span_kernels(isa, options.span));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Executor> executor,
                          make_executor({.threads = options.threads, .kind = options.executor, .cpu_affinity = options.cpu_affinity}));
  return CpuAdam(options, kernels, std::move(executor));
}

Status CpuAdam::step(const kernels::AdamBuffers& buffers, const kernels::AdamStepScalars& scalars) {
  if (buffers.count == 0) return {};
  STRATA_RETURN_IF_ERROR(kernels::validate_adam_buffers(buffers));
  const AdamStepSpanFn span = kernels_.step;
  const AdamSpanStores stores = options_.stores;
  executor_->parallel_for(0, buffers.count, options_.chunk_elements, [&](size_t lo, size_t hi) {
    span(adam_buffers_slice(buffers, lo, hi), scalars, stores);
  });
  return {};
}

Status CpuAdam::step(const kernels::AdamBuffers& buffers, const AdamStepPlan& plan) {
  if (plan.skip) return {};
  return step(buffers, plan.scalars);
}

Status CpuAdam::step_on_this_thread(const kernels::AdamBuffers& buffers, const kernels::AdamStepScalars& scalars, size_t begin,
                                    size_t end) {
  if (begin > end || end > buffers.count)
    return InvalidArgumentError("CPU Adam: range [" + std::to_string(begin) + ", " + std::to_string(end) + ") is not inside a shard of " +
                                std::to_string(buffers.count) + " elements");
  if (begin == end) return {};
  STRATA_RETURN_IF_ERROR(kernels::validate_adam_buffers(buffers));
  kernels_.step(adam_buffers_slice(buffers, begin, end), scalars, options_.stores);
  return {};
}

StatusOr<GradientStats> CpuAdam::gradient_stats(const void* grad, DType grad_type, size_t count) {
  if (count != 0 && grad == nullptr) return InvalidArgumentError("CPU Adam: gradient statistics of a null buffer");
  const GradSumOfSquaresSpanFn sum_of_squares = kernels_.grad_sum_of_squares;
  const char* bytes = static_cast<const char*>(grad);
  const size_t width = dtype_size(grad_type);
  return reduce_gradient_chunks(*executor_, count, 1, chunk_sums_, [=](size_t begin, size_t end) {
    return sum_of_squares(bytes + begin * width, grad_type, end - begin);
  });
}

}  // namespace strata
