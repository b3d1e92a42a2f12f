// CUDA kernels of the transformer ops and their launchers (kernels/transformer_ops_cuda.h).
//
// Element types: T is float or __nv_bfloat16 for activations and parameters; all math
// is in fp32 (GEMMs accumulate in fp32), parameter gradients and statistics are fp32.
// Every reduction has a fixed order (warp butterflies, fixed-shape block trees, column
// sums over rows in order), no float atomics, so results are deterministic.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <mutex>
#include <string>

#include "engine/core/cuda_check.h"
#include "kernels/blas_context_impl.h"
#include "kernels/transformer_ops_cuda.h"

namespace strata::kernels::cuda {
namespace {

using bf16 = __nv_bfloat16;

// Loads and stores in fp32 ------------------------------------------------------------

__device__ __forceinline__ float load(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float load(const bf16* p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(bf16* p, size_t i, float v) { p[i] = __float2bfloat16_rn(v); }
template <class T>
__device__ __forceinline__ void store_grad(T* p, size_t i, float v, bool accumulate) {
  store(p, i, accumulate ? load(p, i) + v : v);
}

template <class T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<float>) or f(TypeTag<bf16>) for `dtype`.
template <class F>
Status dispatch(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(TypeTag<float>{});
    case DType::kBFloat16: return f(TypeTag<bf16>{});
    case DType::kFloat16: break;
  }
  return UnimplementedError(std::string(op) + ": dtype " + std::string(dtype_name(dtype)) + " has no CUDA kernel");
}

cudaStream_t native(void* stream) { return static_cast<cudaStream_t>(stream); }

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

unsigned blocks_for(size_t work_items, int threads = kThreads) {
  const size_t wanted = (work_items + threads - 1) / threads;
  constexpr size_t kMaxBlocks = size_t{1} << 20;  // grid-stride loops cover the rest
  return static_cast<unsigned>(wanted < 1 ? 1 : (wanted > kMaxBlocks ? kMaxBlocks : wanted));
}

Status check_launch() {
  STRATA_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return {};
}

// Butterfly reductions: every lane ends with the same bits (each step adds the same two
// values, commutatively), so the result does not depend on the lane that reads it.
__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

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

// Column sums over rows for dgamma / dbeta (LayerNorm, x != nullptr) or dbias (x ==
// nullptr, result in dsum). Block (32, 32): threadIdx.x picks the column of a 32-wide
// tile, threadIdx.y strides over rows; the 32 partials are added in a fixed order.
template <class T>
__global__ void column_grads_kernel(const T* dy, const T* x, const float* mean, const float* rstd, float* dscaled,
                                    float* dsum, size_t rows, size_t channels, bool accumulate) {
  __shared__ float scaled_part[32][33];
  __shared__ float sum_part[32][33];
  const size_t c = blockIdx.x * size_t(32) + threadIdx.x;
  float scaled = 0.0f;
  float sum = 0.0f;
  if (c < channels) {
    for (size_t r = threadIdx.y; r < rows; r += 32) {
      const float d = load(dy, r * channels + c);
      sum += d;
      if (x != nullptr) scaled += d * ((load(x, r * channels + c) - mean[r]) * rstd[r]);
    }
  }
  scaled_part[threadIdx.y][threadIdx.x] = scaled;
  sum_part[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < channels) {
    float total_scaled = 0.0f;
    float total_sum = 0.0f;
    for (int y = 0; y < 32; ++y) {
      total_scaled += scaled_part[y][threadIdx.x];
      total_sum += sum_part[y][threadIdx.x];
    }
    if (dscaled != nullptr) dscaled[c] = accumulate ? dscaled[c] + total_scaled : total_scaled;
    if (dsum != nullptr) dsum[c] = accumulate ? dsum[c] + total_sum : total_sum;
  }
}

template <class T>
Status launch_column_grads(cudaStream_t stream, const T* dy, const T* x, const float* mean, const float* rstd,
                           float* dscaled, float* dsum, size_t rows, size_t channels, bool accumulate) {
  const dim3 block(32, 32);
  const dim3 grid(static_cast<unsigned>((channels + 31) / 32));
  column_grads_kernel<T><<<grid, block, 0, stream>>>(dy, x, mean, rstd, dscaled, dsum, rows, channels, accumulate);
  return check_launch();
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

// GEMMs -------------------------------------------------------------------------------

template <class T>
constexpr cudaDataType_t cuda_type() {
  if constexpr (sizeof(T) == 4) {
    return CUDA_R_32F;
  } else {
    return CUDA_R_16BF;
  }
}

// One operand of a row-major GEMM: `data` stored row-major with row length `ld`;
// `trans` means the product uses its transpose; `stride` is the distance in elements
// between consecutive matrices of a batch.
struct Operand {
  const void* data;
  cudaDataType_t type;
  size_t ld;
  long long stride;
  bool trans;
};

// Row-major C[m,n] = alpha op(A)[m,k] op(B)[k,n] + beta C, `batch` times. cuBLAS is
// column-major, where a row-major matrix reads as its transpose, so this computes
// C^T = op(B)^T op(A)^T with the operands swapped.
Status gemm(cublasHandle_t handle, cublasComputeType_t compute, size_t m, size_t n, size_t k, float alpha, Operand a,
            Operand b, float beta, void* c, cudaDataType_t c_type, size_t ldc, long long stride_c, int batch) {
  for (size_t dim : {m, n, k, a.ld, b.ld, ldc}) {
    if (dim > size_t(INT_MAX)) return InvalidArgumentError("GEMM dimension " + std::to_string(dim) + " exceeds INT_MAX");
  }
  const cublasOperation_t op_a = a.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (batch == 1) {
    STRATA_RETURN_IF_CUBLAS_ERROR(cublasGemmEx(handle, op_b, op_a, int(n), int(m), int(k), &alpha, b.data, b.type, int(b.ld),
                                               a.data, a.type, int(a.ld), &beta, c, c_type, int(ldc), compute,
                                               CUBLAS_GEMM_DEFAULT));
  } else {
    STRATA_RETURN_IF_CUBLAS_ERROR(cublasGemmStridedBatchedEx(handle, op_b, op_a, int(n), int(m), int(k), &alpha, b.data,
                                                             b.type, int(b.ld), b.stride, a.data, a.type, int(a.ld),
                                                             a.stride, &beta, c, c_type, int(ldc), stride_c, batch, compute,
                                                             CUBLAS_GEMM_DEFAULT));
  }
  return {};
}

cublasComputeType_t compute_type(const BlasContext& blas, DType dtype) {
  if (dtype == DType::kFloat32 && blas.options().fp32_math == Fp32Math::kTf32) return CUBLAS_COMPUTE_32F_FAST_TF32;
  return CUBLAS_COMPUTE_32F;
}

Status check_handle(BlasContext& blas, const char* op) {
  if (blas.impl().handle == nullptr) {
    return InvalidArgumentError(std::string(op) + ": the BlasContext has no cuBLAS handle (made for " +
                                blas.device().description() + ")");
  }
  return {};
}

// Attention ---------------------------------------------------------------------------

// Scores are [heads, T, T] fp32 for one batch element; one warp per (head, query) row.
// Writes probs (zero above the diagonal) and, when `lse_out` is set, the row's
// logsumexp; with `lse_in` it recomputes the probabilities from a saved logsumexp.
template <class T>
__global__ void causal_softmax_kernel(const float* scores, T* probs, const float* lse_in, float* lse_out, size_t rows,
                                      size_t seq_len) {
  const size_t row = blockIdx.x * size_t(kWarpsPerBlock) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const size_t t = row % seq_len;
  const float* s = scores + row * seq_len;
  T* p = probs + row * seq_len;
  float row_lse;
  if (lse_in != nullptr) {
    row_lse = lse_in[row];
  } else {
    float max_score = -INFINITY;
    for (size_t j = lane; j <= t; j += 32) max_score = fmaxf(max_score, s[j]);
    max_score = warp_max(max_score);
    float sum = 0.0f;
    for (size_t j = lane; j <= t; j += 32) sum += expf(s[j] - max_score);
    row_lse = max_score + logf(warp_sum(sum));
    if (lane == 0) lse_out[row] = row_lse;
  }
  for (size_t j = lane; j < seq_len; j += 32) store(p, j, j <= t ? expf(s[j] - row_lse) : 0.0f);
}

// dS = P o (dP - D), D = sum_j P_j dP_j, written over P. One warp per row.
template <class T>
__global__ void softmax_backward_kernel(T* probs_then_dscores, const float* dprobs, size_t rows, size_t seq_len) {
  const size_t row = blockIdx.x * size_t(kWarpsPerBlock) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const size_t t = row % seq_len;
  T* p = probs_then_dscores + row * seq_len;
  const float* dp = dprobs + row * seq_len;
  float d = 0.0f;
  for (size_t j = lane; j <= t; j += 32) d += load(p, j) * dp[j];
  d = warp_sum(d);  // every lane has read its P values before any lane writes
  for (size_t j = lane; j < seq_len; j += 32) store(p, j, j <= t ? load(p, j) * (dp[j] - d) : 0.0f);
}

size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

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

Status matmul_forward(void* cuda_stream, BlasContext& blas, const MatmulShape& shape, DType dtype, const void* x,
                      const void* weight, const void* bias, void* y) {
  STRATA_RETURN_IF_ERROR(check_handle(blas, "matmul_forward"));
  return dispatch(dtype, "matmul_forward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    const size_t m = shape.rows;
    const size_t k = shape.in_features;
    const size_t n = shape.out_features;
    const bool out_in = shape.layout == WeightLayout::kOutIn;
    float beta = 0.0f;
    if (bias != nullptr) {
      // The GEMM adds onto the broadcast bias: one rounding for bf16.
      broadcast_rows_kernel<T><<<blocks_for(m * n), kThreads, 0, native(cuda_stream)>>>(static_cast<const T*>(bias),
                                                                                       static_cast<T*>(y), m, n);
      STRATA_RETURN_IF_ERROR(check_launch());
      beta = 1.0f;
    }
    std::lock_guard lock(blas.impl().mutex);
    STRATA_RETURN_IF_ERROR(bind_cublas_to_stream(blas.impl(), cuda_stream));
    const cudaDataType_t type = cuda_type<T>();
    return gemm(blas.impl().handle, compute_type(blas, dtype), m, n, k, 1.0f, Operand{x, type, k, 0, false},
                Operand{weight, type, out_in ? k : n, 0, out_in}, beta, y, type, n, 0, 1);
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
    if (dbias != nullptr) {
      STRATA_RETURN_IF_ERROR(launch_column_grads<T>(native(cuda_stream), static_cast<const T*>(dy), nullptr, nullptr,
                                                    nullptr, nullptr, dbias, m, n, accumulate_params));
    }
    if (dx == nullptr && dweight == nullptr) return {};
    std::lock_guard lock(blas.impl().mutex);
    STRATA_RETURN_IF_ERROR(bind_cublas_to_stream(blas.impl(), cuda_stream));
    cublasHandle_t handle = blas.impl().handle;
    if (dx != nullptr) {
      // dx[m,k] = dy[m,n] . W'^T, W' = W (stored [k,n]) for in_out or W^T (stored [n,k]) for out_in.
      const float beta = options.input_grad == GradWrite::kAccumulate ? 1.0f : 0.0f;
      STRATA_RETURN_IF_ERROR(gemm(handle, compute, m, k, n, 1.0f, Operand{dy, type, n, 0, false},
                                  Operand{weight, type, out_in ? k : n, 0, !out_in}, beta, dx, type, k, 0, 1));
    }
    if (dweight != nullptr) {
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

// Attention: per batch element, GEMMs batched over heads. Head h of q, k, v is a
// [T, head_dim] matrix with row length 3C starting at h * head_dim (+ C, + 2C), so one
// strided-batched GEMM covers all heads without a permute; out's heads have row length C.

Status attention_forward(void* cuda_stream, BlasContext& blas, const AttentionShape& shape, DType dtype, const void* qkv,
                         void* out, float* lse, void* workspace) {
  STRATA_RETURN_IF_ERROR(check_handle(blas, "attention_forward"));
  return dispatch(dtype, "attention_forward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    const size_t seq = shape.seq_len;
    const size_t heads = shape.heads;
    const size_t head_dim = shape.head_dim;
    const size_t channels = heads * head_dim;
    const size_t row = 3 * channels;
    const long long square = static_cast<long long>(seq * seq);
    const float scale = 1.0f / sqrtf(float(head_dim));
    float* scores = static_cast<float*>(workspace);
    T* probs = reinterpret_cast<T*>(static_cast<char*>(workspace) + round_up(heads * seq * seq * sizeof(float), 256));
    const cudaDataType_t type = cuda_type<T>();
    const cublasComputeType_t compute = compute_type(blas, dtype);
    const int batch_heads = static_cast<int>(heads);
    const unsigned softmax_blocks = static_cast<unsigned>((heads * seq + kWarpsPerBlock - 1) / kWarpsPerBlock);
    std::lock_guard lock(blas.impl().mutex);
    STRATA_RETURN_IF_ERROR(bind_cublas_to_stream(blas.impl(), cuda_stream));
    cublasHandle_t handle = blas.impl().handle;
    for (size_t b = 0; b < shape.batch; ++b) {
      const T* q = static_cast<const T*>(qkv) + b * seq * row;
      const T* k = q + channels;
      const T* v = q + 2 * channels;
      // S_h = scale Q_h K_h^T (fp32)
      STRATA_RETURN_IF_ERROR(gemm(handle, compute, seq, seq, head_dim, scale,
                                  Operand{q, type, row, static_cast<long long>(head_dim), false},
                                  Operand{k, type, row, static_cast<long long>(head_dim), true}, 0.0f, scores, CUDA_R_32F,
                                  seq, square, batch_heads));
      causal_softmax_kernel<T><<<softmax_blocks, kThreads, 0, native(cuda_stream)>>>(scores, probs, nullptr,
                                                                                     lse + b * heads * seq, heads * seq, seq);
      STRATA_RETURN_IF_ERROR(check_launch());
      // O_h = P_h V_h
      T* out_b = static_cast<T*>(out) + b * seq * channels;
      STRATA_RETURN_IF_ERROR(gemm(handle, compute, seq, head_dim, seq, 1.0f, Operand{probs, type, seq, square, false},
                                  Operand{v, type, row, static_cast<long long>(head_dim), false}, 0.0f, out_b, type, channels,
                                  static_cast<long long>(head_dim), batch_heads));
    }
    return {};
  });
}

Status attention_backward(void* cuda_stream, BlasContext& blas, const AttentionShape& shape, DType dtype,
                          const void* dout, const void* qkv, const float* lse, void* dqkv, void* workspace,
                          GradWrite input_grad) {
  STRATA_RETURN_IF_ERROR(check_handle(blas, "attention_backward"));
  return dispatch(dtype, "attention_backward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    const size_t seq = shape.seq_len;
    const size_t heads = shape.heads;
    const size_t head_dim = shape.head_dim;
    const size_t channels = heads * head_dim;
    const size_t row = 3 * channels;
    const long long square = static_cast<long long>(seq * seq);
    const long long head_stride = static_cast<long long>(head_dim);
    const float scale = 1.0f / sqrtf(float(head_dim));
    const float beta = input_grad == GradWrite::kAccumulate ? 1.0f : 0.0f;
    float* scores = static_cast<float*>(workspace);  // S, then dP
    T* probs = reinterpret_cast<T*>(static_cast<char*>(workspace) + round_up(heads * seq * seq * sizeof(float), 256));
    const cudaDataType_t type = cuda_type<T>();
    const cublasComputeType_t compute = compute_type(blas, dtype);
    const int batch_heads = static_cast<int>(heads);
    const unsigned row_blocks = static_cast<unsigned>((heads * seq + kWarpsPerBlock - 1) / kWarpsPerBlock);
    std::lock_guard lock(blas.impl().mutex);
    STRATA_RETURN_IF_ERROR(bind_cublas_to_stream(blas.impl(), cuda_stream));
    cublasHandle_t handle = blas.impl().handle;
    for (size_t b = 0; b < shape.batch; ++b) {
      const T* q = static_cast<const T*>(qkv) + b * seq * row;
      const T* k = q + channels;
      const T* v = q + 2 * channels;
      const T* dout_b = static_cast<const T*>(dout) + b * seq * channels;
      T* dq = static_cast<T*>(dqkv) + b * seq * row;
      T* dk = dq + channels;
      T* dv = dq + 2 * channels;
      // Recompute P from the saved logsumexp.
      STRATA_RETURN_IF_ERROR(gemm(handle, compute, seq, seq, head_dim, scale, Operand{q, type, row, head_stride, false},
                                  Operand{k, type, row, head_stride, true}, 0.0f, scores, CUDA_R_32F, seq, square,
                                  batch_heads));
      causal_softmax_kernel<T><<<row_blocks, kThreads, 0, native(cuda_stream)>>>(scores, probs, lse + b * heads * seq,
                                                                                 nullptr, heads * seq, seq);
      STRATA_RETURN_IF_ERROR(check_launch());
      // dV_h = P_h^T dO_h
      STRATA_RETURN_IF_ERROR(gemm(handle, compute, seq, head_dim, seq, 1.0f, Operand{probs, type, seq, square, true},
                                  Operand{dout_b, type, channels, head_stride, false}, beta, dv, type, row, head_stride,
                                  batch_heads));
      // dP_h = dO_h V_h^T (fp32, over the scores)
      STRATA_RETURN_IF_ERROR(gemm(handle, compute, seq, seq, head_dim, 1.0f,
                                  Operand{dout_b, type, channels, head_stride, false},
                                  Operand{v, type, row, head_stride, true}, 0.0f, scores, CUDA_R_32F, seq, square,
                                  batch_heads));
      softmax_backward_kernel<T><<<row_blocks, kThreads, 0, native(cuda_stream)>>>(probs, scores, heads * seq, seq);
      STRATA_RETURN_IF_ERROR(check_launch());
      // dQ_h = scale dS_h K_h; dK_h = scale dS_h^T Q_h
      STRATA_RETURN_IF_ERROR(gemm(handle, compute, seq, head_dim, seq, scale, Operand{probs, type, seq, square, false},
                                  Operand{k, type, row, head_stride, false}, beta, dq, type, row, head_stride,
                                  batch_heads));
      STRATA_RETURN_IF_ERROR(gemm(handle, compute, seq, head_dim, seq, scale, Operand{probs, type, seq, square, true},
                                  Operand{q, type, row, head_stride, false}, beta, dk, type, row, head_stride,
                                  batch_heads));
    }
    return {};
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
