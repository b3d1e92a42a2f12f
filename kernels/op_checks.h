// Internal to kernels/: the argument checks the host entry points share
// (kernels/transformer_ops.cpp, kernels/rmsnorm.cpp, rope.cpp, swiglu.cpp, gqa_attention.cpp), run at once, before anything
// is enqueued.
#pragma once

#include <string>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "kernels/blas_context.h"

// Inside a launched kernel: the CUDA call, or an error in a build without CUDA (a
// native stream cannot exist there).
#if defined(STRATA_HAVE_CUDA)
#define STRATA_OP_ON_CUDA(call) return (call)
#else
#define STRATA_OP_ON_CUDA(call) return InternalError("a native stream in a build without CUDA")
#endif

namespace strata::kernels::op_checks {

inline const float* f32(const void* p) { return static_cast<const float*>(p); }
inline float* f32(void* p) { return static_cast<float*>(p); }

inline Status check_dtype(Stream& stream, DType dtype, const char* op) {
  const DeviceKind kind = stream.device().kind();
  if (dtype == DType::kFloat32) return {};
  if (kind == DeviceKind::kCuda && dtype == DType::kBFloat16) return {};
  return UnimplementedError(std::string(op) + ": dtype " + std::string(dtype_name(dtype)) + " is not supported on " +
                            stream.device().description() +
                            (kind == DeviceKind::kCpu ? " (the CPU ops are fp32)" : " (fp32 and bf16 only)"));
}

inline Status check_present(const void* pointer, const char* op, const char* name) {
  if (pointer == nullptr) return InvalidArgumentError(std::string(op) + ": " + name + " is null");
  return {};
}

inline Status check_blas(Stream& stream, BlasContext& blas, const char* op) {
  if (&blas.device() != &stream.device()) {
    return InvalidArgumentError(std::string(op) + ": the BlasContext was made for " + blas.device().description() +
                                ", the stream '" + stream.name() + "' belongs to " + stream.device().description());
  }
  return {};
}

}  // namespace strata::kernels::op_checks
