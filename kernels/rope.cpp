// Host entry points of kernels/rope.h: arguments checked, then the CUDA launcher on a
// CudaDevice or the CPU twin on a CpuDevice's stream.
#include "kernels/rope.h"

#include <string>

#include "kernels/rmsnorm_rope_swiglu_cpu.h"
#include "kernels/rmsnorm_rope_swiglu_cuda.h"
#include "kernels/op_checks.h"

namespace strata::kernels {

using namespace op_checks;  // NOLINT: the argument checks of kernels/op_checks.h

// RoPE --------------------------------------------------------------------------------

namespace {
Status check_rope(Stream& stream, const RopeShape& shape, DType dtype, const int32_t* positions, const float* inv_freq,
                  const void* in, const void* out, const char* op) {
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, op));
  if (shape.head_dim % 2 != 0) {
    return InvalidArgumentError(std::string(op) + ": head_dim must be even, got " + std::to_string(shape.head_dim));
  }
  const size_t width = shape.heads * shape.head_dim;
  if (shape.row_stride != 0 && shape.row_stride < width) {
    return InvalidArgumentError(std::string(op) + ": row_stride " + std::to_string(shape.row_stride) + " is less than heads " +
                                std::to_string(shape.heads) + " x head_dim " + std::to_string(shape.head_dim));
  }
  STRATA_RETURN_IF_ERROR(check_present(positions, op, "positions"));
  STRATA_RETURN_IF_ERROR(check_present(inv_freq, op, "inv_freq"));
  STRATA_RETURN_IF_ERROR(check_present(in, op, "the input"));
  return check_present(out, op, "the output");
}
}  // namespace

Status rope_forward(Stream& stream, const RopeShape& shape, DType dtype, const int32_t* positions, const float* inv_freq,
                    const void* x, void* y) {
  constexpr const char* kOp = "rope_forward";
  if (shape.rows == 0 || shape.heads == 0 || shape.head_dim == 0) return {};
  STRATA_RETURN_IF_ERROR(check_rope(stream, shape, dtype, positions, inv_freq, x, y, kOp));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::rope_forward(ctx.native_stream, shape, dtype, positions, inv_freq, x, y));
    }
    cpu::rope_forward(*ctx.executor, shape, positions, inv_freq, f32(x), f32(y));
    return {};
  });
}

Status rope_backward(Stream& stream, const RopeShape& shape, DType dtype, const int32_t* positions, const float* inv_freq,
                     const void* dy, void* dx, GradWrite input_grad) {
  constexpr const char* kOp = "rope_backward";
  if (shape.rows == 0 || shape.heads == 0 || shape.head_dim == 0) return {};
  STRATA_RETURN_IF_ERROR(check_rope(stream, shape, dtype, positions, inv_freq, dy, dx, kOp));
  if (dx == dy && input_grad == GradWrite::kAccumulate) {
    return InvalidArgumentError(std::string(kOp) + ": dx aliases dy, which only GradWrite::kOverwrite allows");
  }
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::rope_backward(ctx.native_stream, shape, dtype, positions, inv_freq, dy, dx, input_grad));
    }
    cpu::rope_backward(*ctx.executor, shape, positions, inv_freq, f32(dy), f32(dx), input_grad);
    return {};
  });
}

}  // namespace strata::kernels
