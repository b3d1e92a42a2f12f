// The scalar span functions and the run-time choice of ISA.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "optim/adam_span.h"

#include <string>

namespace strata {

kernels::AdamBuffers adam_buffers_slice(const kernels::AdamBuffers& b, size_t begin, size_t end) {
  kernels::AdamBuffers s = b;
  s.grad = static_cast<const char*>(b.grad) + begin * dtype_size(b.grad_type);
  s.master = b.master + begin;
  s.exp_avg = static_cast<char*>(b.exp_avg) + begin * dtype_size(b.moment_type);
  s.exp_avg_sq = static_cast<char*>(b.exp_avg_sq) + begin * dtype_size(b.moment_type);
  if (b.param != nullptr) s.param = static_cast<char*>(b.param) + begin * dtype_size(b.param_type);
  s.count = end - begin;
  return s;
}

namespace internal {

void adam_step_span_scalar(const kernels::AdamBuffers& span, const kernels::AdamStepScalars& scalars, const AdamSpanStores&) {
  kernels::adam_step_cpu_range(span, scalars, 0, span.count);
}

double grad_sum_of_squares_scalar(const void* grad, DType grad_type, size_t count) {
  double sum = 0.0;
  for (size_t i = 0; i < count; ++i) {
    const double g = load_as_float(grad, grad_type, i);
    sum += g * g;
  }
  return sum;
}

}  // namespace internal

StatusOr<AdamSpanKernels> adam_span_kernels(CpuIsa isa, const AdamSpanKernelOptions& options) {
  if (!cpu_isa_supported(isa)) {
#if defined(STRATA_OPTIM_X86_KERNELS)
    return UnavailableError("CPU Adam: this CPU cannot run the " + std::string(cpu_isa_name(isa)) + " kernels (" +
                            (isa == CpuIsa::kAvx512 ? "needs AVX-512 F, BW, VL and DQ" : "needs AVX2 and F16C") + ")");
#else
    return UnavailableError("CPU Adam: this build has no " + std::string(cpu_isa_name(isa)) + " kernels (not an x86 target)");
#endif
  }
  AdamSpanKernels kernels;
  kernels.isa = isa;
  switch (isa) {
    case CpuIsa::kScalar:
      kernels.step = internal::adam_step_span_scalar;
      kernels.grad_sum_of_squares = internal::grad_sum_of_squares_scalar;
      break;
#if defined(STRATA_OPTIM_X86_KERNELS)
    case CpuIsa::kAvx2:
      kernels.step = internal::adam_step_span_avx2;
      kernels.grad_sum_of_squares = internal::grad_sum_of_squares_avx2;
      break;
    case CpuIsa::kAvx512:
      kernels.native_bf16 = options.use_avx512_bf16 && cpu_features().avx512_bf16;
      kernels.step = kernels.native_bf16 ? internal::adam_step_span_avx512_bf16 : internal::adam_step_span_avx512;
      kernels.grad_sum_of_squares = internal::grad_sum_of_squares_avx512;
      break;
#else
    default:
      (void)options;
      return UnavailableError("CPU Adam: no kernels for " + std::string(cpu_isa_name(isa)));
#endif
  }
  return kernels;
}

}  // namespace strata
