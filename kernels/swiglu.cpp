// Host entry points of kernels/swiglu.h: arguments checked, then the CUDA launcher on a
// CudaDevice or the CPU twin on a CpuDevice's stream.
#include "kernels/swiglu.h"

#include <string>

#include "kernels/rmsnorm_rope_swiglu_cpu.h"
#include "kernels/rmsnorm_rope_swiglu_cuda.h"
#include "kernels/op_checks.h"

namespace strata::kernels {

using namespace op_checks;  // NOLINT: the argument checks of kernels/op_checks.h

// SwiGLU ------------------------------------------------------------------------------

Status swiglu_forward(Stream& stream, DType dtype, const void* gate, const void* up, void* out, size_t count) {
  constexpr const char* kOp = "swiglu_forward";
  if (count == 0) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  STRATA_RETURN_IF_ERROR(check_present(gate, kOp, "gate"));
  STRATA_RETURN_IF_ERROR(check_present(up, kOp, "up"));
  STRATA_RETURN_IF_ERROR(check_present(out, kOp, "out"));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) STRATA_OP_ON_CUDA(cuda::swiglu_forward(ctx.native_stream, dtype, gate, up, out, count));
    cpu::swiglu_forward(*ctx.executor, f32(gate), f32(up), f32(out), count);
    return {};
  });
}

Status swiglu_backward(Stream& stream, DType dtype, const void* dout, const void* gate, const void* up, void* dgate,
                       void* dup, size_t count, GradWrite input_grad) {
  constexpr const char* kOp = "swiglu_backward";
  if (count == 0 || (dgate == nullptr && dup == nullptr)) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  STRATA_RETURN_IF_ERROR(check_present(dout, kOp, "dout"));
  STRATA_RETURN_IF_ERROR(check_present(gate, kOp, "gate"));
  STRATA_RETURN_IF_ERROR(check_present(up, kOp, "up"));
  for (const void* grad : {dgate, dup}) {
    if (grad != nullptr && (grad == gate || grad == up || grad == dout || dgate == dup)) {
      return InvalidArgumentError(std::string(kOp) + ": dgate and dup may not alias gate, up, dout or each other");
    }
  }
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::swiglu_backward(ctx.native_stream, dtype, dout, gate, up, dgate, dup, count, input_grad));
    }
    cpu::swiglu_backward(*ctx.executor, f32(dout), f32(gate), f32(up), f32(dgate), f32(dup), count, input_grad);
    return {};
  });
}

}  // namespace strata::kernels
