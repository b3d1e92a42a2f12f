// Host entry points of kernels/rmsnorm.h: arguments checked, then the CUDA launcher on a
// CudaDevice or the CPU twin on a CpuDevice's stream.
#include "kernels/rmsnorm.h"

#include <string>

#include "kernels/rmsnorm_rope_swiglu_cpu.h"
#include "kernels/rmsnorm_rope_swiglu_cuda.h"
#include "kernels/op_checks.h"

namespace strata::kernels {

using namespace op_checks;  // NOLINT: the argument checks of kernels/op_checks.h

// RMSNorm -----------------------------------------------------------------------------

Status rmsnorm_forward(Stream& stream, const RmsNormShape& shape, DType dtype, const void* x, const void* gamma, void* y,
                       float* rstd) {
  constexpr const char* kOp = "rmsnorm_forward";
  if (shape.rows == 0 || shape.channels == 0) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  STRATA_RETURN_IF_ERROR(check_present(x, kOp, "x"));
  STRATA_RETURN_IF_ERROR(check_present(gamma, kOp, "gamma"));
  STRATA_RETURN_IF_ERROR(check_present(y, kOp, "y"));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) STRATA_OP_ON_CUDA(cuda::rmsnorm_forward(ctx.native_stream, shape, dtype, x, gamma, y, rstd));
    cpu::rmsnorm_forward(*ctx.executor, shape, f32(x), f32(gamma), f32(y), rstd);
    return {};
  });
}

Status rmsnorm_backward(Stream& stream, const RmsNormShape& shape, DType dtype, const void* dy, const void* x,
                        const void* gamma, const float* rstd, void* dx, float* dgamma, const GradOptions& options) {
  constexpr const char* kOp = "rmsnorm_backward";
  if (shape.rows == 0 || shape.channels == 0 || (dx == nullptr && dgamma == nullptr)) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  STRATA_RETURN_IF_ERROR(check_present(dy, kOp, "dy"));
  STRATA_RETURN_IF_ERROR(check_present(x, kOp, "x"));
  STRATA_RETURN_IF_ERROR(check_present(rstd, kOp, "rstd"));
  if (dx != nullptr) STRATA_RETURN_IF_ERROR(check_present(gamma, kOp, "gamma"));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::rmsnorm_backward(ctx.native_stream, shape, dtype, dy, x, gamma, rstd, dx, dgamma, options));
    }
    cpu::rmsnorm_backward(*ctx.executor, shape, f32(dy), f32(x), f32(gamma), rstd, f32(dx), dgamma, options);
    return {};
  });
}

}  // namespace strata::kernels
