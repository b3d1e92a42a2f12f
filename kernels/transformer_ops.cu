// CUDA kernels of the transformer ops and their launchers (kernels/transformer_ops_cuda.h).
//
// Element types: T is float or __nv_bfloat16 for activations and parameters; all math
// is in fp32 (GEMMs accumulate in fp32), parameter gradients and statistics are fp32.
// Every reduction has a fixed order (warp butterflies, fixed-shape block trees, column
// sums over rows in order), no float atomics, so results are deterministic.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cublasLt.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <mutex>
#include <string>

#include "engine/core/cuda_check.h"
#include "kernels/cuda_common.cuh"
#include "kernels/transformer_ops_cuda.h"

namespace strata::kernels::cuda {
namespace {

// Running (max, sum of exp(x - max)) pairs, combined commutatively.
struct SoftmaxStats {
  float max;
  float sum;
};
__device__ __forceinline__ SoftmaxStats combine(SoftmaxStats a, SoftmaxStats b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.0f};
  const float sa = a.max == -INFINITY ? 0.0f : a.sum * expf(a.max - m);
  const float sb = b.max == -INFINITY ? 0.0f : b.sum * expf(b.max - m);
  return {m, sa + sb};
}
__device__ __forceinline__ SoftmaxStats warp_combine(SoftmaxStats s) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const SoftmaxStats other{__shfl_xor_sync(0xffffffffu, s.max, offset), __shfl_xor_sync(0xffffffffu, s.sum, offset)};
    s = combine(s, other);
  }
  return s;
}
// Block-wide combine for blockDim.x == kThreads; every thread gets the result.
__device__ SoftmaxStats block_combine(SoftmaxStats s) {
  __shared__ float maxes[kWarpsPerBlock];
  __shared__ float sums[kWarpsPerBlock];
  __shared__ SoftmaxStats result;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  s = warp_combine(s);
  if (lane == 0) {
    maxes[warp] = s.max;
    sums[warp] = s.sum;
  }
  __syncthreads();
  if (warp == 0) {
    SoftmaxStats w = lane < kWarpsPerBlock ? SoftmaxStats{maxes[lane], sums[lane]} : SoftmaxStats{-INFINITY, 0.0f};
    w = warp_combine(w);
    if (lane == 0) result = w;
  }
  __syncthreads();
  return result;
}

// Embedding ---------------------------------------------------------------------------

template <class T>
__global__ void embedding_forward_kernel(const int32_t* tokens, const T* wte, const T* wpe, T* out, size_t positions,
                                         size_t seq_len, size_t channels, size_t vocab) {
  const size_t total = positions * channels;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const size_t position = i / channels;
    const size_t c = i % channels;
    const int32_t token = tokens[position];
    const float token_part = (token >= 0 && size_t(token) < vocab) ? load(wte, size_t(token) * channels + c) : 0.0f;
    const float position_part = wpe != nullptr ? load(wpe, (position % seq_len) * channels + c) : 0.0f;
    store(out, i, token_part + position_part);
  }
}

// Block b owns vocabulary rows [b * rows_per_block, ...): it scans all positions in
// order, compacts those whose token falls in its rows, and adds their dout rows. Column
// c of a row is only ever touched by thread c % blockDim.x, in position order.
template <class T>
__global__ void embedding_backward_wte_kernel(const int32_t* tokens, const T* dout, float* dwte, size_t positions,
                                              size_t channels, size_t vocab, size_t rows_per_block, bool accumulate) {
  __shared__ int matches[kThreads];
  __shared__ int warp_counts[kWarpsPerBlock];
  const size_t first = blockIdx.x * rows_per_block;
  const size_t last = first + rows_per_block < vocab ? first + rows_per_block : vocab;
  if (!accumulate) {
    for (size_t r = first; r < last; ++r) {
      for (size_t c = threadIdx.x; c < channels; c += blockDim.x) dwte[r * channels + c] = 0.0f;
    }
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (size_t base = 0; base < positions; base += blockDim.x) {
    const size_t i = base + threadIdx.x;
    bool match = false;
    if (i < positions) {
      const int32_t token = tokens[i];
      match = token >= 0 && size_t(token) >= first && size_t(token) < last;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, match);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int offset = 0;
    int count = 0;
    for (int w = 0; w < kWarpsPerBlock; ++w) {
      if (w < warp) offset += warp_counts[w];
      count += warp_counts[w];
    }
    if (match) matches[offset + __popc(ballot & ((1u << lane) - 1u))] = int(i);
    __syncthreads();
    for (int m = 0; m < count; ++m) {
      const size_t position = size_t(matches[m]);
      float* grad_row = dwte + size_t(tokens[position]) * channels;
      for (size_t c = threadIdx.x; c < channels; c += blockDim.x) grad_row[c] += load(dout, position * channels + c);
    }
    __syncthreads();  // matches and warp_counts are rewritten next round
  }
}

template <class T>
__global__ void embedding_backward_wpe_kernel(const T* dout, float* dwpe, size_t batch, size_t seq_len, size_t channels,
                                              bool accumulate) {
  const size_t total = seq_len * channels;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (size_t b = 0; b < batch; ++b) acc += load(dout, b * total + i);
    dwpe[i] = accumulate ? dwpe[i] + acc : acc;
  }
}

// LayerNorm ---------------------------------------------------------------------------

template <class T>
__global__ void layernorm_forward_kernel(const T* x, const T* gamma, const T* beta, T* y, float* mean, float* rstd,
                                         size_t rows, size_t channels, float epsilon) {
  const size_t row = blockIdx.x * size_t(kWarpsPerBlock) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;  // whole warps leave together
  const T* x_row = x + row * channels;
  const float inverse_channels = 1.0f / float(channels);
  float sum = 0.0f;
  for (size_t c = lane; c < channels; c += 32) sum += load(x_row, c);
  const float mu = warp_sum(sum) * inverse_channels;
  float squares = 0.0f;
  for (size_t c = lane; c < channels; c += 32) {
    const float centered = load(x_row, c) - mu;
    squares += centered * centered;
  }
  const float inv_std = 1.0f / sqrtf(warp_sum(squares) * inverse_channels + epsilon);
  T* y_row = y + row * channels;
  for (size_t c = lane; c < channels; c += 32) {
    store(y_row, c, (load(x_row, c) - mu) * inv_std * load(gamma, c) + load(beta, c));
  }
  if (lane == 0) {
    if (mean != nullptr) mean[row] = mu;
    if (rstd != nullptr) rstd[row] = inv_std;
  }
}

template <class T>
__global__ void layernorm_backward_dx_kernel(const T* dy, const T* x, const T* gamma, const float* mean, const float* rstd,
                                             T* dx, size_t rows, size_t channels, bool accumulate) {
  const size_t row = blockIdx.x * size_t(kWarpsPerBlock) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const T* x_row = x + row * channels;
  const T* dy_row = dy + row * channels;
  const float mu = mean[row];
  const float inv_std = rstd[row];
  const float inverse_channels = 1.0f / float(channels);
  float sum_dxhat = 0.0f;
  float sum_dxhat_xhat = 0.0f;
  for (size_t c = lane; c < channels; c += 32) {
    const float dxhat = load(dy_row, c) * load(gamma, c);
    sum_dxhat += dxhat;
    sum_dxhat_xhat += dxhat * (load(x_row, c) - mu) * inv_std;
  }
  const float mean_dxhat = warp_sum(sum_dxhat) * inverse_channels;
  const float mean_dxhat_xhat = warp_sum(sum_dxhat_xhat) * inverse_channels;
  T* dx_row = dx + row * channels;
  for (size_t c = lane; c < channels; c += 32) {
    const float xhat = (load(x_row, c) - mu) * inv_std;
    const float dxhat = load(dy_row, c) * load(gamma, c);
    store_grad(dx_row, c, inv_std * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat), accumulate);
  }
}

// Element-wise ------------------------------------------------------------------------

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

template <class T>
__global__ void gelu_forward_kernel(const T* x, T* y, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    const float v = load(x, i);
    const float u = kGeluScale * (v + kGeluCubic * v * v * v);
    store(y, i, 0.5f * v * (1.0f + tanhf(u)));
  }
}

template <class T>
__global__ void gelu_backward_kernel(const T* dy, const T* x, T* dx, size_t count, bool accumulate) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    const float v = load(x, i);
    const float u = kGeluScale * (v + kGeluCubic * v * v * v);
    const float t = tanhf(u);
    const float du_dx = kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v);
    const float grad = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du_dx;
    store_grad(dx, i, grad * load(dy, i), accumulate);
  }
}

template <class T>
__global__ void residual_forward_kernel(const T* a, const T* b, T* out, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    store(out, i, load(a, i) + load(b, i));
  }
}

template <class T>
__global__ void residual_backward_kernel(const T* dout, T* da, T* db, size_t count, bool accumulate) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    const float g = load(dout, i);
    if (da != nullptr) store_grad(da, i, g, accumulate);
    if (db != nullptr) store_grad(db, i, g, accumulate);
  }
}

template <class T>
__global__ void broadcast_rows_kernel(const T* bias, T* y, size_t rows, size_t columns) {
  const size_t total = rows * columns;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    y[i] = bias[i % columns];
  }
}

// Cross-entropy -----------------------------------------------------------------------

template <class T>
__device__ SoftmaxStats row_stats(const T* row, size_t vocab) {
  SoftmaxStats s{-INFINITY, 0.0f};
  for (size_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float v = load(row, j);
    if (v > s.max) {
      s.sum = s.sum * expf(s.max - v) + 1.0f;
      s.max = v;
    } else {
      s.sum += expf(v - s.max);
    }
  }
  return block_combine(s);
}

__device__ __forceinline__ bool valid_target(int32_t target, size_t vocab) { return target >= 0 && size_t(target) < vocab; }

template <class T>
__global__ void cross_entropy_forward_kernel(const T* logits, const int32_t* targets, float* losses, float* lse,
                                             size_t vocab, int32_t ignore_index) {
  const size_t r = blockIdx.x;
  const T* row = logits + r * vocab;
  const SoftmaxStats s = row_stats(row, vocab);
  if (threadIdx.x != 0) return;
  const float row_lse = s.max + logf(s.sum);
  if (lse != nullptr) lse[r] = row_lse;
  const int32_t target = targets[r];
  if (target == ignore_index) {
    losses[r] = 0.0f;
  } else {
    losses[r] = valid_target(target, vocab) ? row_lse - load(row, size_t(target)) : NAN;
  }
}

template <class T>
__global__ void cross_entropy_backward_kernel(const T* logits, const int32_t* targets, const float* lse, float grad_scale,
                                              T* dlogits, size_t vocab, int32_t ignore_index, bool accumulate) {
  const size_t r = blockIdx.x;
  const int32_t target = targets[r];
  T* grad_row = dlogits + r * vocab;
  if (target == ignore_index) {
    if (!accumulate) {
      for (size_t j = threadIdx.x; j < vocab; j += blockDim.x) store(grad_row, j, 0.0f);
    }
    return;
  }
  const T* row = logits + r * vocab;
  const float row_lse = lse[r];
  for (size_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float p = expf(load(row, j) - row_lse);
    store_grad(grad_row, j, (p - (size_t(target) == j ? 1.0f : 0.0f)) * grad_scale, accumulate);
  }
}

template <class T>
__global__ void cross_entropy_fused_kernel(const T* logits, const int32_t* targets, float grad_scale, float* losses,
                                           T* dlogits, size_t vocab, int32_t ignore_index) {
  const size_t r = blockIdx.x;
  const int32_t target = targets[r];
  const T* row = logits + r * vocab;
  T* grad_row = dlogits + r * vocab;
  if (target == ignore_index) {
    if (threadIdx.x == 0) losses[r] = 0.0f;
    for (size_t j = threadIdx.x; j < vocab; j += blockDim.x) store(grad_row, j, 0.0f);
    return;
  }
  const bool valid = valid_target(target, vocab);
  // Read the target's logit before the row may be overwritten (dlogits may alias logits);
  // block_combine's barriers order it before any write below.
  const float target_logit = (threadIdx.x == 0 && valid) ? load(row, size_t(target)) : 0.0f;
  const SoftmaxStats s = row_stats(row, vocab);
  const float row_lse = s.max + logf(s.sum);
  if (threadIdx.x == 0) losses[r] = valid ? row_lse - target_logit : NAN;
  for (size_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float p = expf(load(row, j) - row_lse);
    store(grad_row, j, (p - (size_t(target) == j ? 1.0f : 0.0f)) * grad_scale);
  }
}

// Mean over rows not ignored, in one block of 1024 threads with a fixed reduction tree.
__global__ void mean_loss_kernel(const float* losses, const int32_t* targets, size_t rows, int32_t ignore_index,
                                 float* mean_loss) {
  __shared__ double sums[32];
  __shared__ double counts[32];
  double sum = 0.0;
  double count = 0.0;
  for (size_t r = threadIdx.x; r < rows; r += blockDim.x) {
    if (targets[r] == ignore_index) continue;
    sum += losses[r];
    count += 1.0;
  }
  sum = warp_sum(sum);
  count = warp_sum(count);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) {
    sums[warp] = sum;
    counts[warp] = count;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = int(blockDim.x >> 5);
    sum = lane < warps ? sums[lane] : 0.0;
    count = lane < warps ? counts[lane] : 0.0;
    sum = warp_sum(sum);
    count = warp_sum(count);
    if (lane == 0) *mean_loss = count == 0.0 ? 0.0f : float(sum / count);
  }
}

}  // namespace

// Launchers ---------------------------------------------------------------------------

Status embedding_forward(void* cuda_stream, const EmbeddingShape& shape, DType dtype, const int32_t* tokens,
                         const void* wte, const void* wpe, void* out) {
  return dispatch(dtype, "embedding_forward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    const size_t positions = shape.batch * shape.seq_len;
    embedding_forward_kernel<T><<<blocks_for(positions * shape.channels), kThreads, 0, native(cuda_stream)>>>(
        tokens, static_cast<const T*>(wte), static_cast<const T*>(wpe), static_cast<T*>(out), positions, shape.seq_len,
        shape.channels, shape.vocab_size);
    return check_launch();
  });
}

Status embedding_backward(void* cuda_stream, const EmbeddingShape& shape, DType dtype, const int32_t* tokens,
                          const void* dout, float* dwte, float* dwpe, GradWrite param_grad) {
  return dispatch(dtype, "embedding_backward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    const size_t positions = shape.batch * shape.seq_len;
    const bool accumulate = param_grad == GradWrite::kAccumulate;
    if (positions > size_t(INT_MAX)) return InvalidArgumentError("embedding_backward: more than INT_MAX positions");
    if (dwte != nullptr) {
      constexpr size_t kRowsPerBlock = 64;
      const size_t blocks = (shape.vocab_size + kRowsPerBlock - 1) / kRowsPerBlock;
      embedding_backward_wte_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, native(cuda_stream)>>>(
          tokens, static_cast<const T*>(dout), dwte, positions, shape.channels, shape.vocab_size, kRowsPerBlock, accumulate);
      STRATA_RETURN_IF_ERROR(check_launch());
    }
    if (dwpe != nullptr) {
      embedding_backward_wpe_kernel<T><<<blocks_for(shape.seq_len * shape.channels), kThreads, 0, native(cuda_stream)>>>(
          static_cast<const T*>(dout), dwpe, shape.batch, shape.seq_len, shape.channels, accumulate);
      STRATA_RETURN_IF_ERROR(check_launch());
    }
    return {};
  });
}

Status layernorm_forward(void* cuda_stream, const LayerNormShape& shape, DType dtype, const void* x, const void* gamma,
                         const void* beta, void* y, float* mean, float* rstd) {
  return dispatch(dtype, "layernorm_forward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    const unsigned blocks = static_cast<unsigned>((shape.rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
    layernorm_forward_kernel<T><<<blocks, kThreads, 0, native(cuda_stream)>>>(
        static_cast<const T*>(x), static_cast<const T*>(gamma), static_cast<const T*>(beta), static_cast<T*>(y), mean, rstd,
        shape.rows, shape.channels, shape.epsilon);
    return check_launch();
  });
}

Status layernorm_backward(void* cuda_stream, const LayerNormShape& shape, DType dtype, const void* dy, const void* x,
                          const void* gamma, const float* mean, const float* rstd, void* dx, float* dgamma,
                          float* dbeta, const GradOptions& options) {
  return dispatch(dtype, "layernorm_backward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    if (dx != nullptr) {
      const unsigned blocks = static_cast<unsigned>((shape.rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
      layernorm_backward_dx_kernel<T><<<blocks, kThreads, 0, native(cuda_stream)>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(gamma), mean, rstd, static_cast<T*>(dx),
          shape.rows, shape.channels, options.input_grad == GradWrite::kAccumulate);
      STRATA_RETURN_IF_ERROR(check_launch());
    }
    if (dgamma != nullptr || dbeta != nullptr) {
      STRATA_RETURN_IF_ERROR(launch_column_grads<T>(native(cuda_stream), static_cast<const T*>(dy), static_cast<const T*>(x),
                                                    mean, rstd, dgamma, dbeta, shape.rows, shape.channels,
                                                    options.param_grad == GradWrite::kAccumulate));
    }
    return {};
  });
}

namespace {

// cuBLASLt GEMMs with an epilogue -------------------------------------------------------

// What the epilogue does to a row-major GEMM C[m,n] = op(A) op(B) (+ beta C):
enum class GemmEpilogue : uint8_t {
  kBias,              // C[r,c] += bias[c] (bias of C's type), in fp32 before C is rounded
  kBiasGradOfA,       // bias[r'] = sum over the GEMM's k of op(A) (fp32): dbias from A = dy^T
  kBiasGradOfB,       // bias[c] = sum over the GEMM's k of op(B) (fp32): dbias from B = dy
  kGeluAux,           // aux = C (+ bias[c] when given), C = gelu(aux), both from the fp32 value
  kGeluGrad,          // C = op(A) op(B) * gelu'(aux) (aux: the forward's GELU input)
  kGeluGradBiasGrad,  // kGeluGrad, and bias[c] = sum over rows of the new C (fp32)
};

// The epilogue and the vector and matrix it reads or writes.
struct EpilogueArgs {
  GemmEpilogue kind;
  void* bias = nullptr;  // the bias it adds, or the bias gradient it writes
  void* aux = nullptr;   // kGelu*: the GELU input, C's type and layout (leading dimension ldc)
};

// cuBLASLt's name for an epilogue and the type of its bias vector. Our A is cuBLAS's B
// and vice versa (gemm()'s operand swap).
struct LtEpilogue {
  cublasLtEpilogue_t epilogue;
  cudaDataType_t bias_type;
};
LtEpilogue lt_epilogue_of(const EpilogueArgs& args, cudaDataType_t c_type) {
  switch (args.kind) {
    case GemmEpilogue::kBias: return {CUBLASLT_EPILOGUE_BIAS, c_type};
    case GemmEpilogue::kBiasGradOfA: return {CUBLASLT_EPILOGUE_BGRADB, CUDA_R_32F};
    case GemmEpilogue::kBiasGradOfB: return {CUBLASLT_EPILOGUE_BGRADA, CUDA_R_32F};
    case GemmEpilogue::kGeluAux:
      return {args.bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX, c_type};
    case GemmEpilogue::kGeluGrad: return {CUBLASLT_EPILOGUE_DGELU, c_type};
    case GemmEpilogue::kGeluGradBiasGrad: return {CUBLASLT_EPILOGUE_DGELU_BGRAD, CUDA_R_32F};
  }
  return {CUBLASLT_EPILOGUE_DEFAULT, c_type};
}

// The descriptors of one cublasLtMatmul, destroyed together.
struct LtDescriptors {
  cublasLtMatmulDesc_t matmul = nullptr;
  cublasLtMatrixLayout_t a = nullptr;
  cublasLtMatrixLayout_t b = nullptr;
  cublasLtMatrixLayout_t c = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  LtDescriptors() = default;
  LtDescriptors(const LtDescriptors&) = delete;
  LtDescriptors& operator=(const LtDescriptors&) = delete;
  ~LtDescriptors() {
    if (preference != nullptr) cublasLtMatmulPreferenceDestroy(preference);
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (matmul != nullptr) cublasLtMatmulDescDestroy(matmul);
  }
};

// The largest power of two (at most 256, cuBLASLt's default assumption) dividing the
// address: algorithms needing more are excluded instead of faulting.
uint32_t alignment_of(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// gemm_with_epilogue without the counting.
StatusOr<bool> try_gemm_with_epilogue(BlasContext::Impl& impl, cudaStream_t stream, cublasComputeType_t compute,
                                      size_t m, size_t n, size_t k, float alpha, Operand a, Operand b, float beta, void* c,
                                      cudaDataType_t c_type, size_t ldc, const EpilogueArgs& args) {
  for (size_t dim : {m, n, k, a.ld, b.ld, ldc}) {
    if (dim > size_t(INT_MAX)) return InvalidArgumentError("GEMM dimension " + std::to_string(dim) + " exceeds INT_MAX");
  }
  if (alignment_of(args.bias) < 16) return false;  // the epilogue reads the vector in 16-byte pieces
  if (args.aux != nullptr && ldc % 8 != 0) return false;  // cuBLASLt: the aux leading dimension is a multiple of 8
  // cuBLAS's handle encapsulates a cuBLASLt handle and may be cast to one (cuBLAS docs,
  // cublasLtHandle_t), so the context's handle and workspace serve both APIs.
  const auto lt = reinterpret_cast<cublasLtHandle_t>(impl.handle);
  LtDescriptors d;
  const cublasOperation_t op_first = b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS's A is our B
  const cublasOperation_t op_second = a.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  const LtEpilogue epilogue = lt_epilogue_of(args, c_type);
  STRATA_RETURN_IF_CUBLAS_ERROR(cublasLtMatmulDescCreate(&d.matmul, compute, CUDA_R_32F));
  STRATA_RETURN_IF_CUBLAS_ERROR(
      cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
  STRATA_RETURN_IF_CUBLAS_ERROR(
      cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
  STRATA_RETURN_IF_CUBLAS_ERROR(cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                               &epilogue.epilogue, sizeof(epilogue.epilogue)));
  if (args.bias != nullptr) {
    STRATA_RETURN_IF_CUBLAS_ERROR(
        cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &args.bias, sizeof(args.bias)));
    STRATA_RETURN_IF_CUBLAS_ERROR(cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                                 &epilogue.bias_type, sizeof(epilogue.bias_type)));
  }
  if (args.aux != nullptr) {
    // The aux matrix has C's shape, type (the default aux type) and leading dimension.
    const int64_t aux_ld = int64_t(ldc);
    STRATA_RETURN_IF_CUBLAS_ERROR(
        cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &args.aux, sizeof(args.aux)));
    STRATA_RETURN_IF_CUBLAS_ERROR(
        cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
  }
  // Column-major shapes of the stored matrices: cuBLAS's A (our B) is n x k, or k x n
  // stored when transposed; cuBLAS's B (our A) is k x m, or m x k; C is n x m.
  STRATA_RETURN_IF_CUBLAS_ERROR(cublasLtMatrixLayoutCreate(&d.a, b.type, b.trans ? k : n, b.trans ? n : k, int64_t(b.ld)));
  STRATA_RETURN_IF_CUBLAS_ERROR(cublasLtMatrixLayoutCreate(&d.b, a.type, a.trans ? m : k, a.trans ? k : m, int64_t(a.ld)));
  STRATA_RETURN_IF_CUBLAS_ERROR(cublasLtMatrixLayoutCreate(&d.c, c_type, n, m, int64_t(ldc)));
  STRATA_RETURN_IF_CUBLAS_ERROR(cublasLtMatmulPreferenceCreate(&d.preference));
  const size_t workspace_bytes = impl.workspace.size();
  STRATA_RETURN_IF_CUBLAS_ERROR(cublasLtMatmulPreferenceSetAttribute(
      d.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes)));
  const struct {
    cublasLtMatmulPreferenceAttributes_t attribute;
    uint32_t alignment;
  } alignments[] = {{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(b.data)},
                    {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(a.data)},
                    {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(c)},
                    {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(c)}};
  for (const auto& entry : alignments) {
    STRATA_RETURN_IF_CUBLAS_ERROR(
        cublasLtMatmulPreferenceSetAttribute(d.preference, entry.attribute, &entry.alignment, sizeof(entry.alignment)));
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t heuristic =
      cublasLtMatmulAlgoGetHeuristic(lt, d.matmul, d.a, d.b, d.c, d.c, d.preference, 1, &result, &found);
  // cuBLASLt answers an unsupported epilogue / type combination with NOT_SUPPORTED or,
  // for some, INVALID_VALUE: both mean "take the unfused path", not a failed op.
  if (heuristic == CUBLAS_STATUS_NOT_SUPPORTED || heuristic == CUBLAS_STATUS_INVALID_VALUE) return false;
  if (heuristic == CUBLAS_STATUS_SUCCESS && found == 0) return false;
  STRATA_RETURN_IF_CUBLAS_ERROR(heuristic);
  const cublasStatus_t matmul = cublasLtMatmul(lt, d.matmul, &alpha, b.data, d.a, a.data, d.b, &beta, c, d.c, c, d.c,
                                               &result.algo, impl.workspace.data(), workspace_bytes, stream);
  // Some combinations (an epilogue's bias or aux type) pass the heuristic and are refused
  // here, before anything is enqueued (cublasLt.h, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE).
  if (matmul == CUBLAS_STATUS_NOT_SUPPORTED || matmul == CUBLAS_STATUS_INVALID_VALUE) return false;
  STRATA_RETURN_IF_CUBLAS_ERROR(matmul);
  return true;
}

// Row-major C[m,n] = alpha op(A) op(B) + beta C with the epilogue, as gemm() (the
// operands swapped for column-major cuBLAS, so row-major columns are cuBLAS rows).
// Returns false, having enqueued nothing, when cuBLASLt has no algorithm for the
// combination; the caller then takes the unfused path. Counts both outcomes in the
// context (BlasContext::epilogue_counts). Call with impl.mutex held (the workspace is shared).
StatusOr<bool> gemm_with_epilogue(BlasContext::Impl& impl, cudaStream_t stream, cublasComputeType_t compute, size_t m,
                                  size_t n, size_t k, float alpha, Operand a, Operand b, float beta, void* c,
                                  cudaDataType_t c_type, size_t ldc, const EpilogueArgs& args) {
  STRATA_ASSIGN_OR_RETURN(const bool fused,
                          try_gemm_with_epilogue(impl, stream, compute, m, n, k, alpha, a, b, beta, c, c_type, ldc, args));
  ++(fused ? impl.epilogue_counts.fused : impl.epilogue_counts.fallbacks);
  const bool gelu = args.kind == GemmEpilogue::kGeluAux || args.kind == GemmEpilogue::kGeluGrad ||
                    args.kind == GemmEpilogue::kGeluGradBiasGrad;
  if (fused && gelu) ++impl.epilogue_counts.gelu_fused;
  return fused;
}

}  // namespace

Status matmul_forward(void* cuda_stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* x,
                      const void* weight, const void* bias, void* y) {
  STRATA_RETURN_IF_ERROR(check_handle(blas, "matmul_forward"));
  return dispatch(dtype, "matmul_forward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    const size_t m = shape.rows;
    const size_t k = shape.in_features;
    const size_t n = shape.out_features;
    const bool out_in = shape.layout == WeightLayout::kOutIn;
    const cudaDataType_t type = cuda_type<T>();
    const cublasComputeType_t compute = compute_type(blas, dtype);
    const Operand x_operand{x, type, k, 0, false};
    const Operand weight_operand{weight, type, out_in ? k : n, 0, out_in};
    std::lock_guard lock(blas.impl().mutex);
    STRATA_RETURN_IF_ERROR(bind_cublas_to_stream(blas.impl(), cuda_stream));
    float beta = 0.0f;
    if (bias != nullptr) {
      // The bias epilogue: added to the fp32 accumulator, y written and rounded once,
      // with no separate pass over y.
      STRATA_ASSIGN_OR_RETURN(const bool fused,
                              gemm_with_epilogue(blas.impl(), native(cuda_stream), compute, m, n, k, 1.0f, x_operand,
                                                 weight_operand, 0.0f, y, type, n,
                                                 EpilogueArgs{GemmEpilogue::kBias, const_cast<void*>(bias)}));
      if (fused) return {};
      // No cuBLASLt algorithm (or a misaligned bias): the GEMM adds onto the broadcast
      // bias, still one rounding for bf16.
      broadcast_rows_kernel<T><<<blocks_for(m * n), kThreads, 0, native(cuda_stream)>>>(static_cast<const T*>(bias),
                                                                                       static_cast<T*>(y), m, n);
      STRATA_RETURN_IF_ERROR(check_launch());
      beta = 1.0f;
    }
    return gemm(blas.impl().handle, compute, m, n, k, 1.0f, x_operand, weight_operand, beta, y, type, n, 0, 1);
  });
}

Status matmul_backward(void* cuda_stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* dy,
                       const void* x, const void* weight, void* dx, float* dweight, float* dbias,
                       const GradOptions& options) {
  STRATA_RETURN_IF_ERROR(check_handle(blas, "matmul_backward"));
  return dispatch(dtype, "matmul_backward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    const size_t m = shape.rows;
    const size_t k = shape.in_features;
    const size_t n = shape.out_features;
    const bool out_in = shape.layout == WeightLayout::kOutIn;
    const cudaDataType_t type = cuda_type<T>();
    const cublasComputeType_t compute = compute_type(blas, dtype);
    const bool accumulate_params = options.param_grad == GradWrite::kAccumulate;
    std::lock_guard lock(blas.impl().mutex);
    // dbias rides on the dweight GEMM as a bias-gradient epilogue (the column sums of dy
    // over the GEMM's k = rows) when it is overwritten: the epilogue cannot add to it.
    bool dbias_pending = dbias != nullptr;
    bool dweight_pending = dweight != nullptr;
    if (dbias_pending && dweight_pending && !accumulate_params) {
      STRATA_RETURN_IF_ERROR(bind_cublas_to_stream(blas.impl(), cuda_stream));
      const Operand dy_operand{dy, type, n, 0, out_in};  // dy^T for out_in (dW = dy^T x), dy for in_out (dW = x^T dy)
      const Operand x_operand{x, type, k, 0, !out_in};
      STRATA_ASSIGN_OR_RETURN(
          const bool fused,
          out_in ? gemm_with_epilogue(blas.impl(), native(cuda_stream), compute, n, k, m, 1.0f, dy_operand, x_operand,
                                      0.0f, dweight, CUDA_R_32F, k, EpilogueArgs{GemmEpilogue::kBiasGradOfA, dbias})
                 : gemm_with_epilogue(blas.impl(), native(cuda_stream), compute, k, n, m, 1.0f, x_operand, dy_operand,
                                      0.0f, dweight, CUDA_R_32F, n, EpilogueArgs{GemmEpilogue::kBiasGradOfB, dbias}));
      dbias_pending = dweight_pending = !fused;
    }
    if (dbias_pending) {
      STRATA_RETURN_IF_ERROR(launch_column_grads<T>(native(cuda_stream), static_cast<const T*>(dy), nullptr, nullptr,
                                                    nullptr, nullptr, dbias, m, n, accumulate_params));
    }
    if (dx == nullptr && !dweight_pending) return {};
    STRATA_RETURN_IF_ERROR(bind_cublas_to_stream(blas.impl(), cuda_stream));
    cublasHandle_t handle = blas.impl().handle;
    if (dx != nullptr) {
      // dx[m,k] = dy[m,n] . W'^T, W' = W (stored [k,n]) for in_out or W^T (stored [n,k]) for out_in.
      const float beta = options.input_grad == GradWrite::kAccumulate ? 1.0f : 0.0f;
      STRATA_RETURN_IF_ERROR(gemm(handle, compute, m, k, n, 1.0f, Operand{dy, type, n, 0, false},
                                  Operand{weight, type, out_in ? k : n, 0, !out_in}, beta, dx, type, k, 0, 1));
    }
    if (dweight_pending) {
      const float beta = accumulate_params ? 1.0f : 0.0f;
      if (out_in) {  // dW[n,k] = dy^T x
        STRATA_RETURN_IF_ERROR(gemm(handle, compute, n, k, m, 1.0f, Operand{dy, type, n, 0, true},
                                    Operand{x, type, k, 0, false}, beta, dweight, CUDA_R_32F, k, 0, 1));
      } else {  // dW[k,n] = x^T dy
        STRATA_RETURN_IF_ERROR(gemm(handle, compute, k, n, m, 1.0f, Operand{x, type, k, 0, true},
                                    Operand{dy, type, n, 0, false}, beta, dweight, CUDA_R_32F, n, 0, 1));
      }
    }
    return {};
  });
}

namespace {
// Whether to try cuBLASLt's GELU epilogues (BlasOptions::gelu_epilogue; bf16 only by
// default: cuBLASLt's GELU is not documented to be GPT-2's tanh form to fp32 accuracy).
bool gelu_epilogue_applies(const BlasContext& blas, DType dtype) {
  switch (blas.options().gelu_epilogue) {
    case GeluEpilogue::kBf16Only: return dtype == DType::kBFloat16;
    case GeluEpilogue::kAlways: return true;
    case GeluEpilogue::kNever: return false;
  }
  return false;
}
}  // namespace

Status matmul_bias_gelu_forward(void* cuda_stream, BlasContext& blas, const MatmulShape& shape, DType dtype,
                                const void* x, const void* weight, const void* bias, void* pre_activation, void* y) {
  STRATA_RETURN_IF_ERROR(check_handle(blas, "matmul_bias_gelu_forward"));
  if (gelu_epilogue_applies(blas, dtype)) {
    bool fused = false;
    STRATA_RETURN_IF_ERROR(dispatch(dtype, "matmul_bias_gelu_forward", [&](auto tag) -> Status {
      using T = typename decltype(tag)::type;
      const size_t k = shape.in_features;
      const size_t n = shape.out_features;
      const bool out_in = shape.layout == WeightLayout::kOutIn;
      const cudaDataType_t type = cuda_type<T>();
      std::lock_guard lock(blas.impl().mutex);
      STRATA_RETURN_IF_ERROR(bind_cublas_to_stream(blas.impl(), cuda_stream));
      STRATA_ASSIGN_OR_RETURN(
          fused, gemm_with_epilogue(blas.impl(), native(cuda_stream), compute_type(blas, dtype), shape.rows, n, k, 1.0f,
                                    Operand{x, type, k, 0, false}, Operand{weight, type, out_in ? k : n, 0, out_in}, 0.0f,
                                    y, type, n, EpilogueArgs{GemmEpilogue::kGeluAux, const_cast<void*>(bias), pre_activation}));
      return {};
    }));
    if (fused) return {};
  }
  STRATA_RETURN_IF_ERROR(matmul_forward(cuda_stream, blas, shape, dtype, x, weight, bias, pre_activation));
  return gelu_forward(cuda_stream, dtype, pre_activation, y, shape.rows * shape.out_features);
}

Status gelu_matmul_backward(void* cuda_stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* dy,
                            const void* weight, const void* pre_activation, void* dpre, float* pre_bias_grad,
                            GradWrite bias_grad) {
  STRATA_RETURN_IF_ERROR(check_handle(blas, "gelu_matmul_backward"));
  return dispatch(dtype, "gelu_matmul_backward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    const size_t m = shape.rows;
    const size_t k = shape.in_features;
    const size_t n = shape.out_features;
    const bool out_in = shape.layout == WeightLayout::kOutIn;
    const cudaDataType_t type = cuda_type<T>();
    // dpre[m,k] = dy[m,n] . W'^T, as matmul_backward's dx.
    const Operand dy_operand{dy, type, n, 0, false};
    const Operand weight_operand{weight, type, out_in ? k : n, 0, !out_in};
    void* aux = const_cast<void*>(pre_activation);
    std::lock_guard lock(blas.impl().mutex);
    STRATA_RETURN_IF_ERROR(bind_cublas_to_stream(blas.impl(), cuda_stream));
    const auto gemm_with = [&](const EpilogueArgs& args) {
      return gemm_with_epilogue(blas.impl(), native(cuda_stream), compute_type(blas, dtype), m, k, n, 1.0f, dy_operand,
                                weight_operand, 0.0f, dpre, type, k, args);
    };
    bool fused = false;
    bool bias_pending = pre_bias_grad != nullptr;
    if (gelu_epilogue_applies(blas, dtype)) {
      // The bias gradient rides on the epilogue only when overwritten (it cannot add).
      if (bias_pending && bias_grad == GradWrite::kOverwrite) {
        STRATA_ASSIGN_OR_RETURN(fused, gemm_with(EpilogueArgs{GemmEpilogue::kGeluGradBiasGrad, pre_bias_grad, aux}));
        bias_pending = !fused;
      }
      if (!fused) {
        STRATA_ASSIGN_OR_RETURN(fused, gemm_with(EpilogueArgs{GemmEpilogue::kGeluGrad, nullptr, aux}));
      }
    }
    if (!fused) {
      STRATA_RETURN_IF_ERROR(gemm(blas.impl().handle, compute_type(blas, dtype), m, k, n, 1.0f, dy_operand, weight_operand,
                                  0.0f, dpre, type, k, 0, 1));
      gelu_backward_kernel<T><<<blocks_for(m * k), kThreads, 0, native(cuda_stream)>>>(
          static_cast<const T*>(dpre), static_cast<const T*>(pre_activation), static_cast<T*>(dpre), m * k, false);
      STRATA_RETURN_IF_ERROR(check_launch());
    }
    if (!bias_pending) return {};
    return launch_column_grads<T>(native(cuda_stream), static_cast<const T*>(dpre), nullptr, nullptr, nullptr, nullptr,
                                  pre_bias_grad, m, k, bias_grad == GradWrite::kAccumulate);
  });
}

Status gelu_forward(void* cuda_stream, DType dtype, const void* x, void* y, size_t count) {
  return dispatch(dtype, "gelu_forward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    gelu_forward_kernel<T><<<blocks_for(count), kThreads, 0, native(cuda_stream)>>>(static_cast<const T*>(x),
                                                                                   static_cast<T*>(y), count);
    return check_launch();
  });
}

Status gelu_backward(void* cuda_stream, DType dtype, const void* dy, const void* x, void* dx, size_t count,
                     GradWrite input_grad) {
  return dispatch(dtype, "gelu_backward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    gelu_backward_kernel<T><<<blocks_for(count), kThreads, 0, native(cuda_stream)>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dx), count,
        input_grad == GradWrite::kAccumulate);
    return check_launch();
  });
}

Status residual_forward(void* cuda_stream, DType dtype, const void* a, const void* b, void* out, size_t count) {
  return dispatch(dtype, "residual_forward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    residual_forward_kernel<T><<<blocks_for(count), kThreads, 0, native(cuda_stream)>>>(
        static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), count);
    return check_launch();
  });
}

Status residual_backward(void* cuda_stream, DType dtype, const void* dout, void* da, void* db, size_t count,
                         GradWrite input_grad) {
  return dispatch(dtype, "residual_backward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    residual_backward_kernel<T><<<blocks_for(count), kThreads, 0, native(cuda_stream)>>>(
        static_cast<const T*>(dout), static_cast<T*>(da), static_cast<T*>(db), count, input_grad == GradWrite::kAccumulate);
    return check_launch();
  });
}

Status cross_entropy_forward(void* cuda_stream, const CrossEntropyShape& shape, DType dtype, const void* logits,
                             const int32_t* targets, float* losses, float* lse, float* mean_loss) {
  return dispatch(dtype, "cross_entropy_forward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    cross_entropy_forward_kernel<T><<<static_cast<unsigned>(shape.rows), kThreads, 0, native(cuda_stream)>>>(
        static_cast<const T*>(logits), targets, losses, lse, shape.vocab_size, shape.ignore_index);
    STRATA_RETURN_IF_ERROR(check_launch());
    if (mean_loss != nullptr) {
      mean_loss_kernel<<<1, 1024, 0, native(cuda_stream)>>>(losses, targets, shape.rows, shape.ignore_index, mean_loss);
      STRATA_RETURN_IF_ERROR(check_launch());
    }
    return {};
  });
}

Status cross_entropy_backward(void* cuda_stream, const CrossEntropyShape& shape, DType dtype, const void* logits,
                              const int32_t* targets, const float* lse, float grad_scale, void* dlogits,
                              GradWrite input_grad) {
  return dispatch(dtype, "cross_entropy_backward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    cross_entropy_backward_kernel<T><<<static_cast<unsigned>(shape.rows), kThreads, 0, native(cuda_stream)>>>(
        static_cast<const T*>(logits), targets, lse, grad_scale, static_cast<T*>(dlogits), shape.vocab_size,
        shape.ignore_index, input_grad == GradWrite::kAccumulate);
    return check_launch();
  });
}

Status cross_entropy_fused(void* cuda_stream, const CrossEntropyShape& shape, DType dtype, const void* logits,
                           const int32_t* targets, float grad_scale, float* losses, float* mean_loss, void* dlogits) {
  return dispatch(dtype, "cross_entropy_fused", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    cross_entropy_fused_kernel<T><<<static_cast<unsigned>(shape.rows), kThreads, 0, native(cuda_stream)>>>(
        static_cast<const T*>(logits), targets, grad_scale, losses, static_cast<T*>(dlogits), shape.vocab_size,
        shape.ignore_index);
    STRATA_RETURN_IF_ERROR(check_launch());
    if (mean_loss != nullptr) {
      mean_loss_kernel<<<1, 1024, 0, native(cuda_stream)>>>(losses, targets, shape.rows, shape.ignore_index, mean_loss);
      STRATA_RETURN_IF_ERROR(check_launch());
    }
    return {};
  });
}

}  // namespace strata::kernels::cuda
