// Host entry points of the transformer ops: check the arguments at once, then enqueue
// the CUDA launcher (CudaDevice) or the CPU twin (CpuDevice) in stream order.
#include "kernels/transformer_ops.h"

#include <string>
#include <type_traits>

#include "kernels/gqa_attention.h"
#include "kernels/op_checks.h"
#include "kernels/transformer_ops_cpu.h"
#include "kernels/transformer_ops_cuda.h"

namespace strata::kernels {

using namespace op_checks;  // NOLINT: the argument checks of kernels/op_checks.h

// Embedding --------------------------------------------------------------------------

Status embedding_forward(Stream& stream, const EmbeddingShape& shape, DType dtype, const int32_t* tokens, const void* wte,
                         const void* wpe, void* out) {
  constexpr const char* kOp = "embedding_forward";
  if (shape.batch == 0 || shape.seq_len == 0 || shape.channels == 0) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  if (wpe != nullptr && shape.seq_len > shape.max_positions) {
    return InvalidArgumentError(std::string(kOp) + ": seq_len " + std::to_string(shape.seq_len) + " exceeds max_positions " +
                                std::to_string(shape.max_positions));
  }
  STRATA_RETURN_IF_ERROR(check_present(tokens, kOp, "tokens"));
  STRATA_RETURN_IF_ERROR(check_present(wte, kOp, "wte"));
  STRATA_RETURN_IF_ERROR(check_present(out, kOp, "out"));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) STRATA_OP_ON_CUDA(cuda::embedding_forward(ctx.native_stream, shape, dtype, tokens, wte, wpe, out));
    return cpu::embedding_forward(*ctx.executor, shape, tokens, f32(wte), f32(wpe), f32(out));
  });
}

Status embedding_backward(Stream& stream, const EmbeddingShape& shape, DType dtype, const int32_t* tokens, const void* dout,
                          float* dwte, float* dwpe, GradWrite param_grad) {
  constexpr const char* kOp = "embedding_backward";
  if (shape.batch == 0 || shape.seq_len == 0 || shape.channels == 0 || (dwte == nullptr && dwpe == nullptr)) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  if (dwpe != nullptr && shape.seq_len > shape.max_positions) {
    return InvalidArgumentError(std::string(kOp) + ": seq_len " + std::to_string(shape.seq_len) + " exceeds max_positions " +
                                std::to_string(shape.max_positions));
  }
  STRATA_RETURN_IF_ERROR(check_present(tokens, kOp, "tokens"));
  STRATA_RETURN_IF_ERROR(check_present(dout, kOp, "dout"));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::embedding_backward(ctx.native_stream, shape, dtype, tokens, dout, dwte, dwpe, param_grad));
    }
    return cpu::embedding_backward(*ctx.executor, shape, tokens, f32(dout), dwte, dwpe, param_grad);
  });
}

// LayerNorm --------------------------------------------------------------------------

Status layernorm_forward(Stream& stream, const LayerNormShape& shape, DType dtype, const void* x, const void* gamma,
                         const void* beta, void* y, float* mean, float* rstd) {
  constexpr const char* kOp = "layernorm_forward";
  if (shape.rows == 0 || shape.channels == 0) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  STRATA_RETURN_IF_ERROR(check_present(x, kOp, "x"));
  STRATA_RETURN_IF_ERROR(check_present(gamma, kOp, "gamma"));
  STRATA_RETURN_IF_ERROR(check_present(beta, kOp, "beta"));
  STRATA_RETURN_IF_ERROR(check_present(y, kOp, "y"));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::layernorm_forward(ctx.native_stream, shape, dtype, x, gamma, beta, y, mean, rstd));
    }
    cpu::layernorm_forward(*ctx.executor, shape, f32(x), f32(gamma), f32(beta), f32(y), mean, rstd);
    return {};
  });
}

Status layernorm_backward(Stream& stream, const LayerNormShape& shape, DType dtype, const void* dy, const void* x,
                          const void* gamma, const float* mean, const float* rstd, void* dx, float* dgamma, float* dbeta,
                          const GradOptions& options) {
  constexpr const char* kOp = "layernorm_backward";
  if (shape.rows == 0 || shape.channels == 0) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  STRATA_RETURN_IF_ERROR(check_present(dy, kOp, "dy"));
  STRATA_RETURN_IF_ERROR(check_present(x, kOp, "x"));
  STRATA_RETURN_IF_ERROR(check_present(mean, kOp, "mean"));
  STRATA_RETURN_IF_ERROR(check_present(rstd, kOp, "rstd"));
  if (dx != nullptr) STRATA_RETURN_IF_ERROR(check_present(gamma, kOp, "gamma"));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::layernorm_backward(ctx.native_stream, shape, dtype, dy, x, gamma, mean, rstd, dx, dgamma,
                                                 dbeta, options));
    }
    cpu::layernorm_backward(*ctx.executor, shape, f32(dy), f32(x), f32(gamma), mean, rstd, f32(dx), dgamma, dbeta, options);
    return {};
  });
}

// Matrix products --------------------------------------------------------------------

Status matmul_forward(Stream& stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* x,
                      const void* weight, const void* bias, void* y) {
  constexpr const char* kOp = "matmul_forward";
  if (shape.rows == 0 || shape.out_features == 0) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  STRATA_RETURN_IF_ERROR(check_blas(stream, blas, kOp));
  if (shape.in_features == 0) return InvalidArgumentError(std::string(kOp) + ": in_features is 0");
  STRATA_RETURN_IF_ERROR(check_present(x, kOp, "x"));
  STRATA_RETURN_IF_ERROR(check_present(weight, kOp, "weight"));
  STRATA_RETURN_IF_ERROR(check_present(y, kOp, "y"));
  BlasContext* context = &blas;
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::matmul_forward(ctx.native_stream, *context, shape, dtype, x, weight, bias, y));
    }
    (void)context;
    cpu::matmul_forward(*ctx.executor, shape, f32(x), f32(weight), f32(bias), f32(y));
    return {};
  });
}

Status matmul_backward(Stream& stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* dy,
                       const void* x, const void* weight, void* dx, float* dweight, float* dbias,
                       const GradOptions& options) {
  constexpr const char* kOp = "matmul_backward";
  if (shape.rows == 0 || shape.out_features == 0 || shape.in_features == 0) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  STRATA_RETURN_IF_ERROR(check_blas(stream, blas, kOp));
  STRATA_RETURN_IF_ERROR(check_present(dy, kOp, "dy"));
  if (dx != nullptr) STRATA_RETURN_IF_ERROR(check_present(weight, kOp, "weight"));
  if (dweight != nullptr) STRATA_RETURN_IF_ERROR(check_present(x, kOp, "x"));
  BlasContext* context = &blas;
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::matmul_backward(ctx.native_stream, *context, shape, dtype, dy, x, weight, dx, dweight, dbias,
                                              options));
    }
    (void)context;
    cpu::matmul_backward(*ctx.executor, shape, f32(dy), f32(x), f32(weight), f32(dx), dweight, dbias, options);
    return {};
  });
}

// A matrix product fused with the GELU ------------------------------------------------

Status matmul_bias_gelu_forward(Stream& stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* x,
                                const void* weight, const void* bias, void* pre_activation, void* y) {
  constexpr const char* kOp = "matmul_bias_gelu_forward";
  if (shape.rows == 0 || shape.out_features == 0) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  STRATA_RETURN_IF_ERROR(check_blas(stream, blas, kOp));
  if (shape.in_features == 0) return InvalidArgumentError(std::string(kOp) + ": in_features is 0");
  STRATA_RETURN_IF_ERROR(check_present(x, kOp, "x"));
  STRATA_RETURN_IF_ERROR(check_present(weight, kOp, "weight"));
  STRATA_RETURN_IF_ERROR(check_present(pre_activation, kOp, "pre_activation"));
  STRATA_RETURN_IF_ERROR(check_present(y, kOp, "y"));
  if (pre_activation == y) return InvalidArgumentError(std::string(kOp) + ": pre_activation and y are the same buffer");
  BlasContext* context = &blas;
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(
          cuda::matmul_bias_gelu_forward(ctx.native_stream, *context, shape, dtype, x, weight, bias, pre_activation, y));
    }
    (void)context;
    cpu::matmul_forward(*ctx.executor, shape, f32(x), f32(weight), f32(bias), f32(pre_activation));
    cpu::gelu_forward(*ctx.executor, f32(pre_activation), f32(y), shape.rows * shape.out_features);
    return {};
  });
}

Status gelu_matmul_backward(Stream& stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* dy,
                            const void* weight, const void* pre_activation, void* dpre, float* pre_bias_grad,
                            GradWrite bias_grad) {
  constexpr const char* kOp = "gelu_matmul_backward";
  if (shape.rows == 0 || shape.in_features == 0) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  STRATA_RETURN_IF_ERROR(check_blas(stream, blas, kOp));
  if (shape.out_features == 0) return InvalidArgumentError(std::string(kOp) + ": out_features is 0");
  STRATA_RETURN_IF_ERROR(check_present(dy, kOp, "dy"));
  STRATA_RETURN_IF_ERROR(check_present(weight, kOp, "weight"));
  STRATA_RETURN_IF_ERROR(check_present(pre_activation, kOp, "pre_activation"));
  STRATA_RETURN_IF_ERROR(check_present(dpre, kOp, "dpre"));
  BlasContext* context = &blas;
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::gelu_matmul_backward(ctx.native_stream, *context, shape, dtype, dy, weight, pre_activation,
                                                   dpre, pre_bias_grad, bias_grad));
    }
    (void)context;
    const size_t count = shape.rows * shape.in_features;
    cpu::matmul_backward(*ctx.executor, shape, f32(dy), nullptr, f32(weight), f32(dpre), nullptr, nullptr, GradOptions{});
    cpu::gelu_backward(*ctx.executor, f32(dpre), f32(pre_activation), f32(dpre), count, GradWrite::kOverwrite);
    if (pre_bias_grad != nullptr) {
      cpu::bias_backward(*ctx.executor, shape.rows, shape.in_features, f32(dpre), pre_bias_grad, bias_grad);
    }
    return {};
  });
}

// GELU and residual ------------------------------------------------------------------

Status gelu_forward(Stream& stream, DType dtype, const void* x, void* y, size_t count) {
  constexpr const char* kOp = "gelu_forward";
  if (count == 0) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  STRATA_RETURN_IF_ERROR(check_present(x, kOp, "x"));
  STRATA_RETURN_IF_ERROR(check_present(y, kOp, "y"));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) STRATA_OP_ON_CUDA(cuda::gelu_forward(ctx.native_stream, dtype, x, y, count));
    cpu::gelu_forward(*ctx.executor, f32(x), f32(y), count);
    return {};
  });
}

Status gelu_backward(Stream& stream, DType dtype, const void* dy, const void* x, void* dx, size_t count,
                     GradWrite input_grad) {
  constexpr const char* kOp = "gelu_backward";
  if (count == 0) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  STRATA_RETURN_IF_ERROR(check_present(dy, kOp, "dy"));
  STRATA_RETURN_IF_ERROR(check_present(x, kOp, "x"));
  STRATA_RETURN_IF_ERROR(check_present(dx, kOp, "dx"));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) STRATA_OP_ON_CUDA(cuda::gelu_backward(ctx.native_stream, dtype, dy, x, dx, count, input_grad));
    cpu::gelu_backward(*ctx.executor, f32(dy), f32(x), f32(dx), count, input_grad);
    return {};
  });
}

Status residual_forward(Stream& stream, DType dtype, const void* a, const void* b, void* out, size_t count) {
  constexpr const char* kOp = "residual_forward";
  if (count == 0) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  STRATA_RETURN_IF_ERROR(check_present(a, kOp, "a"));
  STRATA_RETURN_IF_ERROR(check_present(b, kOp, "b"));
  STRATA_RETURN_IF_ERROR(check_present(out, kOp, "out"));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) STRATA_OP_ON_CUDA(cuda::residual_forward(ctx.native_stream, dtype, a, b, out, count));
    cpu::residual_forward(*ctx.executor, f32(a), f32(b), f32(out), count);
    return {};
  });
}

Status residual_backward(Stream& stream, DType dtype, const void* dout, void* da, void* db, size_t count,
                         GradWrite input_grad) {
  constexpr const char* kOp = "residual_backward";
  if (count == 0 || (da == nullptr && db == nullptr)) return {};
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, kOp));
  STRATA_RETURN_IF_ERROR(check_present(dout, kOp, "dout"));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::residual_backward(ctx.native_stream, dtype, dout, da, db, count, input_grad));
    }
    cpu::residual_backward(*ctx.executor, f32(dout), f32(da), f32(db), count, input_grad);
    return {};
  });
}

// Attention --------------------------------------------------------------------------
// GPT-2's fused qkv is grouped-query attention with kv_heads == heads reading q, k, v
// from one row of 3C (kernels/gqa_attention.h): one attention implementation per device.

namespace {

// The start of slice `index` (0 q, 1 k, 2 v) of a fused qkv row.
template <class Pointer>
Pointer qkv_slice(Pointer qkv, const AttentionShape& shape, DType dtype, size_t index) {
  if (qkv == nullptr) return qkv;
  using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Pointer>>, const char, char>;
  return static_cast<Byte*>(qkv) + index * shape.heads * shape.head_dim * dtype_size(dtype);
}

}  // namespace

size_t attention_workspace_bytes(const AttentionShape& shape, DType dtype, DeviceKind kind) {
  return gqa_attention_workspace_bytes(gqa_shape_of_fused_qkv(shape), dtype, kind);
}

Status attention_forward(Stream& stream, BlasContext& blas, const AttentionShape& shape, DType dtype, const void* qkv,
                         void* out, float* lse, void* workspace, size_t workspace_bytes) {
  STRATA_RETURN_IF_ERROR_CTX(
      gqa_attention_forward(stream, blas, gqa_shape_of_fused_qkv(shape), dtype, qkv, qkv_slice(qkv, shape, dtype, 1),
                            qkv_slice(qkv, shape, dtype, 2), out, lse, workspace, workspace_bytes),
      "attention_forward (GPT-2's fused qkv)");
  return {};
}

Status attention_backward(Stream& stream, BlasContext& blas, const AttentionShape& shape, DType dtype, const void* dout,
                          const void* qkv, const float* lse, void* dqkv, void* workspace, size_t workspace_bytes,
                          GradWrite input_grad) {
  STRATA_RETURN_IF_ERROR_CTX(
      gqa_attention_backward(stream, blas, gqa_shape_of_fused_qkv(shape), dtype, dout, qkv, qkv_slice(qkv, shape, dtype, 1),
                             qkv_slice(qkv, shape, dtype, 2), lse, dqkv, qkv_slice(dqkv, shape, dtype, 1),
                             qkv_slice(dqkv, shape, dtype, 2), workspace, workspace_bytes, input_grad),
      "attention_backward (GPT-2's fused qkv)");
  return {};
}

// Cross-entropy ----------------------------------------------------------------------

namespace {
Status check_cross_entropy(Stream& stream, const CrossEntropyShape& shape, DType dtype, const void* logits,
                           const int32_t* targets, const char* op) {
  STRATA_RETURN_IF_ERROR(check_dtype(stream, dtype, op));
  if (shape.vocab_size == 0) return InvalidArgumentError(std::string(op) + ": vocab_size is 0");
  STRATA_RETURN_IF_ERROR(check_present(logits, op, "logits"));
  STRATA_RETURN_IF_ERROR(check_present(targets, op, "targets"));
  return {};
}
}  // namespace

Status cross_entropy_forward(Stream& stream, const CrossEntropyShape& shape, DType dtype, const void* logits,
                             const int32_t* targets, float* losses, float* lse, float* mean_loss) {
  constexpr const char* kOp = "cross_entropy_forward";
  if (shape.rows == 0) {
    if (mean_loss != nullptr) return stream.device().memset_async(mean_loss, 0, sizeof(float), stream);
    return {};
  }
  STRATA_RETURN_IF_ERROR(check_cross_entropy(stream, shape, dtype, logits, targets, kOp));
  STRATA_RETURN_IF_ERROR(check_present(losses, kOp, "losses"));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::cross_entropy_forward(ctx.native_stream, shape, dtype, logits, targets, losses, lse, mean_loss));
    }
    return cpu::cross_entropy_forward(*ctx.executor, shape, f32(logits), targets, losses, lse, mean_loss);
  });
}

Status cross_entropy_backward(Stream& stream, const CrossEntropyShape& shape, DType dtype, const void* logits,
                              const int32_t* targets, const float* lse, float grad_scale, void* dlogits,
                              GradWrite input_grad) {
  constexpr const char* kOp = "cross_entropy_backward";
  if (shape.rows == 0) return {};
  STRATA_RETURN_IF_ERROR(check_cross_entropy(stream, shape, dtype, logits, targets, kOp));
  STRATA_RETURN_IF_ERROR(check_present(lse, kOp, "lse"));
  STRATA_RETURN_IF_ERROR(check_present(dlogits, kOp, "dlogits"));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::cross_entropy_backward(ctx.native_stream, shape, dtype, logits, targets, lse, grad_scale,
                                                     dlogits, input_grad));
    }
    return cpu::cross_entropy_backward(*ctx.executor, shape, f32(logits), targets, lse, grad_scale, f32(dlogits), input_grad);
  });
}

Status cross_entropy_fused(Stream& stream, const CrossEntropyShape& shape, DType dtype, const void* logits,
                           const int32_t* targets, float grad_scale, float* losses, float* mean_loss, void* dlogits) {
  constexpr const char* kOp = "cross_entropy_fused";
  if (shape.rows == 0) {
    if (mean_loss != nullptr) return stream.device().memset_async(mean_loss, 0, sizeof(float), stream);
    return {};
  }
  STRATA_RETURN_IF_ERROR(check_cross_entropy(stream, shape, dtype, logits, targets, kOp));
  STRATA_RETURN_IF_ERROR(check_present(losses, kOp, "losses"));
  STRATA_RETURN_IF_ERROR(check_present(dlogits, kOp, "dlogits"));
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
      STRATA_OP_ON_CUDA(cuda::cross_entropy_fused(ctx.native_stream, shape, dtype, logits, targets, grad_scale, losses,
                                                  mean_loss, dlogits));
    }
    return cpu::cross_entropy_fused(*ctx.executor, shape, f32(logits), targets, grad_scale, losses, mean_loss, f32(dlogits));
  });
}

}  // namespace strata::kernels
