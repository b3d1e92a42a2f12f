#include "optim/gradient_ops.h"

#include <cstdint>
#include <string>

namespace strata {

namespace {

bool known_dtype(DType type) { return type == DType::kFloat32 || type == DType::kBFloat16 || type == DType::kFloat16; }
bool known_mode(AccumulateMode mode) { return mode == AccumulateMode::kAssign || mode == AccumulateMode::kAdd; }

Status check_gradient(const void* grad, DType type, size_t count, const char* what) {
  if (!known_dtype(type))
    return InvalidArgumentError(std::string("gradient ops: ") + what + " has an unknown dtype (" +
                                std::to_string(static_cast<int>(type)) + ")");
  if (count != 0 && grad == nullptr) return InvalidArgumentError(std::string("gradient ops: ") + what + " is null");
  return {};
}

Status check_accumulation(const float* accum, const void* src, DType src_type, size_t count, AccumulateMode mode) {
  STRATA_RETURN_IF_ERROR(check_gradient(src, src_type, count, "the source"));
  STRATA_RETURN_IF_ERROR(check_gradient(accum, DType::kFloat32, count, "the accumulator"));
  if (!known_mode(mode))
    return InvalidArgumentError("gradient ops: unknown accumulate mode " + std::to_string(static_cast<int>(mode)));
  if (count == 0) return {};
  // Compared as integers: the arrays are unrelated objects when they do not overlap.
  const auto accum_begin = reinterpret_cast<uintptr_t>(accum);
  const auto src_begin = reinterpret_cast<uintptr_t>(src);
  if (accum_begin < src_begin + count * dtype_size(src_type) && src_begin < accum_begin + count * sizeof(float))
    return InvalidArgumentError("gradient ops: the accumulator and the source overlap (" + std::to_string(count) + " elements)");
  return {};
}

}  // namespace

StatusOr<GradientOps> GradientOps::create(Executor& executor, const GradientOpsOptions& options) {
  if (options.chunk_elements == 0 || options.chunk_elements % 64 != 0)
    return InvalidArgumentError("gradient ops: chunk_elements must be a positive multiple of 64 (keeps chunks vector- and line-aligned), got " +
                                std::to_string(options.chunk_elements));
  STRATA_ASSIGN_OR_RETURN(GradientSpanKernels kernels, gradient_span_kernels(options.isa.value_or(best_cpu_isa())));
  return GradientOps(executor, kernels, options);
}

size_t GradientOps::stats_grain_chunks() const {
  const size_t chunks = options_.chunk_elements / kGradientStatsChunkElements;
  return chunks == 0 ? 1 : chunks;
}

Status GradientOps::accumulate(float* accum, const void* src, DType src_type, size_t count, AccumulateMode mode) {
  STRATA_RETURN_IF_ERROR(check_accumulation(accum, src, src_type, count, mode));
  // The body captures one pointer, which std::function keeps inline: no allocation per call.
  struct Job {
    float* accum;
    const char* src;
    size_t width;
    DType src_type;
    AccumulateMode mode;
    AccumulateSpanFn span;
  } job{accum, static_cast<const char*>(src), dtype_size(src_type), src_type, mode, kernels_.accumulate};
  executor_->parallel_for(0, count, options_.chunk_elements, [job = &job](size_t lo, size_t hi) {
    job->span(job->accum + lo, job->src + lo * job->width, job->src_type, hi - lo, job->mode);
  });
  return {};
}

StatusOr<GradientStats> GradientOps::accumulate_with_stats(float* accum, const void* src, DType src_type, size_t count,
                                                           AccumulateMode mode) {
  STRATA_RETURN_IF_ERROR(check_accumulation(accum, src, src_type, count, mode));
  const AccumulateSpanFn accumulate_span = kernels_.accumulate;
  const GradSumOfSquaresSpanFn sum_of_squares = kernels_.grad_sum_of_squares;
  const char* src_bytes = static_cast<const char*>(src);
  const size_t width = dtype_size(src_type);
  // Per statistics chunk: accumulate it, then sum the squares of the result while its
  // 256 KiB are still in this core's cache.
  return reduce_gradient_chunks(*executor_, count, stats_grain_chunks(), chunk_sums_, [&](size_t begin, size_t end) {
    accumulate_span(accum + begin, src_bytes + begin * width, src_type, end - begin, mode);
    return sum_of_squares(accum + begin, DType::kFloat32, end - begin);
  });
}

StatusOr<GradientStats> GradientOps::stats(const void* grad, DType grad_type, size_t count) {
  STRATA_RETURN_IF_ERROR(check_gradient(grad, grad_type, count, "the gradient"));
  const GradSumOfSquaresSpanFn sum_of_squares = kernels_.grad_sum_of_squares;
  const char* bytes = static_cast<const char*>(grad);
  const size_t width = dtype_size(grad_type);
  return reduce_gradient_chunks(*executor_, count, stats_grain_chunks(), chunk_sums_, [&](size_t begin, size_t end) {
    return sum_of_squares(bytes + begin * width, grad_type, end - begin);
  });
}

}  // namespace strata
