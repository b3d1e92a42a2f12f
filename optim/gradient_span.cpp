// The scalar accumulate span (the reference the SIMD spans are tested against) and the
// run-time choice of ISA.
#include "optim/gradient_span.h"

#include <string>

namespace strata {

namespace internal {
namespace {

// One loop per (dtype, mode), so the switch happens once per span, not per element.
template <DType kType, AccumulateMode kMode>
void accumulate_scalar(float* accum, const void* src, size_t count) {
  for (size_t i = 0; i < count; ++i) accum[i] = accumulate_element(accum[i], load_as_float(src, kType, i), kMode);
}

template <DType kType>
void accumulate_scalar_mode(float* accum, const void* src, size_t count, AccumulateMode mode) {
  if (mode == AccumulateMode::kAssign) return accumulate_scalar<kType, AccumulateMode::kAssign>(accum, src, count);
  return accumulate_scalar<kType, AccumulateMode::kAdd>(accum, src, count);
}

}  // namespace

void accumulate_span_scalar(float* accum, const void* src, DType src_type, size_t count, AccumulateMode mode) {
  switch (src_type) {
    case DType::kFloat32: return accumulate_scalar_mode<DType::kFloat32>(accum, src, count, mode);
    case DType::kBFloat16: return accumulate_scalar_mode<DType::kBFloat16>(accum, src, count, mode);
    case DType::kFloat16: return accumulate_scalar_mode<DType::kFloat16>(accum, src, count, mode);
  }
}

}  // namespace internal

StatusOr<GradientSpanKernels> gradient_span_kernels(CpuIsa isa) {
  // The CPU Adam's span table says whether `isa` runs here (with the reason when not) and
  // holds the sum of squares this layer shares with it.
  STRATA_ASSIGN_OR_RETURN(AdamSpanKernels adam, adam_span_kernels(isa));
  GradientSpanKernels kernels;
  kernels.isa = isa;
  kernels.grad_sum_of_squares = adam.grad_sum_of_squares;
  switch (isa) {
    case CpuIsa::kScalar: kernels.accumulate = internal::accumulate_span_scalar; break;
#if defined(STRATA_OPTIM_X86_KERNELS)
    case CpuIsa::kAvx2: kernels.accumulate = internal::accumulate_span_avx2; break;
    case CpuIsa::kAvx512: kernels.accumulate = internal::accumulate_span_avx512; break;
#else
    default: return UnavailableError("gradient span kernels: no kernels for " + std::string(cpu_isa_name(isa)));
#endif
  }
  return kernels;
}

}  // namespace strata
