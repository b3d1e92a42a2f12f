// Host entry points of kernels/gqa_attention.h: arguments checked, then the CUDA launcher on a
// CudaDevice or the CPU twin on a CpuDevice's stream.
#include "kernels/gqa_attention.h"

#include <string>

#include "kernels/transformer_ops_cpu.h"
#include "kernels/gqa_attention_cuda.h"
#include "kernels/op_checks.h"

namespace strata::kernels {

using namespace op_checks;  // NOLINT: the argument checks of kernels/op_checks.h

// Grouped-query attention -------------------------------------------------------------

namespace {

size_t round_up_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The shape with every stride spelled out (0 = dense).
GqaAttentionShape with_strides(GqaAttentionShape shape) {
  if (shape.q_stride == 0) shape.q_stride = shape.heads * shape.head_dim;
  if (shape.k_stride == 0) shape.k_stride = shape.kv_heads * shape.head_dim;
  if (shape.v_stride == 0) shape.v_stride = shape.kv_heads * shape.head_dim;
  return shape;
}

Status check_gqa_attention(Stream& stream, BlasContext& blas, const GqaAttentionShape& shape, DType dtype,
                           const void* workspace, size_t workspace_bytes, const char* op) {
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, op));
  STRATA_RETURN_IF_ERROR(check_blas(stream, blas, op));
  if (shape.kv_heads == 0 || shape.heads % shape.kv_heads != 0) {
    return InvalidArgumentError(std::string(op) + ": heads " + std::to_string(shape.heads) +
                                " is not a multiple of kv_heads " + std::to_string(shape.kv_heads));
  }
  const struct {
    const char* name;
    size_t stride;
    size_t width;
  } rows[] = {{"q_stride", shape.q_stride, shape.heads * shape.head_dim},
              {"k_stride", shape.k_stride, shape.kv_heads * shape.head_dim},
              {"v_stride", shape.v_stride, shape.kv_heads * shape.head_dim}};
  for (const auto& row : rows) {
    if (row.stride != 0 && row.stride < row.width) {
      return InvalidArgumentError(std::string(op) + ": " + row.name + " " + std::to_string(row.stride) +
                                  " is less than the row's width " + std::to_string(row.width));
    }
  }
  if (stream.device().kind() == DeviceKind::kCuda && shape.head_dim > kMaxCudaAttentionHeadDim) {
    return UnimplementedError(std::string(op) + ": head_dim " + std::to_string(shape.head_dim) +
                              " has no CUDA attention kernel (at most " + std::to_string(kMaxCudaAttentionHeadDim) +
                              "); run this model on the CPU device");
  }
  const size_t needed = gqa_attention_workspace_bytes(shape, dtype, stream.device().kind());
  if (workspace_bytes < needed || (needed > 0 && workspace == nullptr)) {
    return InvalidArgumentError(std::string(op) + ": the workspace has " + std::to_string(workspace_bytes) +
                                " bytes, gqa_attention_workspace_bytes() asks " + std::to_string(needed) + " for heads " +
                                std::to_string(shape.heads) + " x seq_len " + std::to_string(shape.seq_len) + " on " +
                                stream.device().description());
  }
  return {};
}

bool nothing_to_attend(const GqaAttentionShape& shape) {
  return shape.batch == 0 || shape.seq_len == 0 || shape.heads == 0 || shape.head_dim == 0;
}

}  // namespace

GqaAttentionShape gqa_shape_of_fused_qkv(const AttentionShape& shape) {
  const size_t row = 3 * shape.heads * shape.head_dim;
  return GqaAttentionShape{.batch = shape.batch,
                           .seq_len = shape.seq_len,
                           .heads = shape.heads,
                           .kv_heads = shape.heads,
                           .head_dim = shape.head_dim,
                           .q_stride = row,
                           .k_stride = row,
                           .v_stride = row};
}

size_t gqa_attention_workspace_bytes(const GqaAttentionShape& shape, DType /*dtype*/, DeviceKind kind) {
  if (kind == DeviceKind::kCpu) return 0;
  // The backward's delta = sum_j P_tj dP_tj per (batch, head, query), written by its dq
  // kernel and read by its dk/dv kernel (kernels/flash_attention.cu).
  return round_up_256(shape.batch * shape.heads * shape.seq_len * sizeof(float));
}

Status gqa_attention_forward(Stream& stream, BlasContext& blas, const GqaAttentionShape& shape, DType dtype, const void* q,
                             const void* k, const void* v, void* out, float* lse, void* workspace,
                             size_t workspace_bytes) {
  constexpr const char* kOp = "gqa_attention_forward";
  if (nothing_to_attend(shape)) return {};
  STRATA_RETURN_IF_ERROR(check_gqa_attention(stream, blas, shape, dtype, workspace, workspace_bytes, kOp));
  for (const auto& [pointer, name] : {std::pair<const void*, const char*>{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {lse, "lse"}}) {
    STRATA_RETURN_IF_ERROR(check_present(pointer, kOp, name));
  }
  const GqaAttentionShape strided = with_strides(shape);
  BlasContext* context = &blas;
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(
          cuda::gqa_attention_forward(ctx.native_stream, *context, strided, dtype, q, k, v, out, lse, workspace));
    }
    (void)context;
    (void)workspace;
    cpu::gqa_attention_forward(*ctx.executor, strided, f32(q), f32(k), f32(v), f32(out), lse);
    return {};
  });
}

Status gqa_attention_backward(Stream& stream, BlasContext& blas, const GqaAttentionShape& shape, DType dtype,
                              const void* dout, const void* q, const void* k, const void* v, const float* lse, void* dq,
                              void* dk, void* dv, void* workspace, size_t workspace_bytes, GradWrite input_grad) {
  constexpr const char* kOp = "gqa_attention_backward";
  if (nothing_to_attend(shape)) return {};
  STRATA_RETURN_IF_ERROR(check_gqa_attention(stream, blas, shape, dtype, workspace, workspace_bytes, kOp));
  for (const auto& [pointer, name] : {std::pair<const void*, const char*>{dout, "dout"}, {q, "q"}, {k, "k"}, {v, "v"},
                                      {lse, "lse"}, {dq, "dq"}, {dk, "dk"}, {dv, "dv"}}) {
    STRATA_RETURN_IF_ERROR(check_present(pointer, kOp, name));
  }
  const GqaAttentionShape strided = with_strides(shape);
  BlasContext* context = &blas;
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::gqa_attention_backward(ctx.native_stream, *context, strided, dtype, dout, q, k, v, lse, dq,
                                                     dk, dv, workspace, input_grad));
    }
    (void)context;
    (void)workspace;
    cpu::gqa_attention_backward(*ctx.executor, strided, f32(dout), f32(q), f32(k), f32(v), lse, f32(dq), f32(dk), f32(dv),
                                input_grad);
    return {};
  });
}

}  // namespace strata::kernels
