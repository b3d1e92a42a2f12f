// CUDA kernels of the Llama-family ops and their launchers (kernels/llama_ops_cuda.h),
// including the one CUDA attention (GPT-2's fused-qkv attention calls it).
//
// As kernels/transformer_ops.cu: T is float or __nv_bfloat16, all math in fp32 (GEMMs
// accumulate in fp32), parameter gradients and statistics fp32, every reduction in a
// fixed order and no float atomics, so results are deterministic.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <mutex>
#include <string>

#include "engine/core/cuda_check.h"
#include "kernels/cuda_common.cuh"
#include "kernels/llama_ops_cuda.h"

namespace strata::kernels::cuda {
namespace {

// The value v takes once stored as T (bf16 rounds; fp32 is itself).
template <class T>
__device__ __forceinline__ float round_to(float v) {
  T stored;
  store(&stored, 0, v);
  return load(&stored, 0);
}

// RMSNorm -------------------------------------------------------------------------------

// One warp per row. As Hugging Face: statistics in fp32, the normalized x rounded to T,
// then multiplied by gamma.
template <class T>
__global__ void rmsnorm_forward_kernel(const T* x, const T* gamma, T* y, float* rstd, size_t rows, size_t channels,
                                       float epsilon) {
  const size_t row = blockIdx.x * size_t(kWarpsPerBlock) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;  // whole warps leave together
  const T* x_row = x + row * channels;
  float squares = 0.0f;
  for (size_t c = lane; c < channels; c += 32) {
    const float v = load(x_row, c);
    squares += v * v;
  }
  const float inv_rms = 1.0f / sqrtf(warp_sum(squares) / float(channels) + epsilon);
  T* y_row = y + row * channels;  // y may alias x: each lane reads its elements before writing them
  for (size_t c = lane; c < channels; c += 32) {
    store(y_row, c, load(gamma, c) * round_to<T>(load(x_row, c) * inv_rms));
  }
  if (lane == 0 && rstd != nullptr) rstd[row] = inv_rms;
}

// dx = rstd (dy gamma - x rstd^2 mean(dy gamma x)). One warp per row.
template <class T>
__global__ void rmsnorm_backward_dx_kernel(const T* dy, const T* x, const T* gamma, const float* rstd, T* dx, size_t rows,
                                           size_t channels, bool accumulate) {
  const size_t row = blockIdx.x * size_t(kWarpsPerBlock) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const T* x_row = x + row * channels;
  const T* dy_row = dy + row * channels;
  const float inv_rms = rstd[row];
  float dot = 0.0f;
  for (size_t c = lane; c < channels; c += 32) dot += load(dy_row, c) * load(gamma, c) * load(x_row, c);
  const float projection = warp_sum(dot) / float(channels) * inv_rms * inv_rms;
  T* dx_row = dx + row * channels;
  for (size_t c = lane; c < channels; c += 32) {
    store_grad(dx_row, c, inv_rms * (load(dy_row, c) * load(gamma, c) - load(x_row, c) * projection), accumulate);
  }
}

// RoPE ----------------------------------------------------------------------------------

// One thread per (row, head, i < head_dim / 2) pair; sign +1 rotates, -1 applies the
// transpose. Reads both elements of its pair before writing them, so out may alias in.
template <class T>
__global__ void rope_kernel(const int32_t* positions, const float* inv_freq, const T* in, T* out, size_t rows, size_t heads,
                            size_t head_dim, size_t row_stride, float sign, bool accumulate) {
  const size_t half = head_dim / 2;
  const size_t total = rows * heads * half;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const size_t pair = i % half;
    const size_t head = (i / half) % heads;
    const size_t row = i / (half * heads);
    const float angle = float(positions[row]) * inv_freq[pair];  // fp32, as Hugging Face
    float s;
    float c;
    sincosf(angle, &s, &c);
    s *= sign;
    const size_t first = row * row_stride + head * head_dim + pair;
    const float a = load(in, first);
    const float b = load(in, first + half);
    store_grad(out, first, a * c - b * s, accumulate);
    store_grad(out, first + half, b * c + a * s, accumulate);
  }
}

// SwiGLU --------------------------------------------------------------------------------

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <class T>
__global__ void swiglu_forward_kernel(const T* gate, const T* up, T* out, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    const float g = load(gate, i);
    store(out, i, g * sigmoid(g) * load(up, i));
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* dout, const T* gate, const T* up, T* dgate, T* dup, size_t count,
                                       bool accumulate) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    const float g = load(gate, i);
    const float d = load(dout, i);
    const float s = sigmoid(g);
    if (dgate != nullptr) store_grad(dgate, i, d * load(up, i) * (s * (1.0f + g * (1.0f - s))), accumulate);
    if (dup != nullptr) store_grad(dup, i, d * (g * s), accumulate);
  }
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

// out[r * out_stride + c] (+)= acc[r * width + c]: the fp32 sums of a KV head's group,
// rounded to T once.
template <class T>
__global__ void store_strided_rows_kernel(const float* acc, T* out, size_t rows, size_t width, size_t out_stride,
                                          bool accumulate) {
  const size_t total = rows * width;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    store_grad(out, (i / width) * out_stride + i % width, acc[i], accumulate);
  }
}

// The workspace of one batch element (sizes as gqa_attention_workspace_bytes).
template <class T>
struct AttentionWorkspace {
  float* scores;  // [heads, T, T] fp32: S, then dP
  T* probs;       // [heads, T, T]: P, then dS
  float* dk_sum;  // [T, kv_heads * head_dim] fp32, grouped heads only
  float* dv_sum;

  AttentionWorkspace(void* workspace, const GqaAttentionShape& shape) {
    const size_t square = shape.heads * shape.seq_len * shape.seq_len;
    const size_t kv_bytes = round_up(shape.seq_len * shape.kv_heads * shape.head_dim * sizeof(float), 256);
    char* base = static_cast<char*>(workspace);
    scores = reinterpret_cast<float*>(base);
    base += round_up(square * sizeof(float), 256);
    probs = reinterpret_cast<T*>(base);
    base += round_up(square * sizeof(T), 256);
    dk_sum = reinterpret_cast<float*>(base);
    dv_sum = reinterpret_cast<float*>(base + kv_bytes);
  }
};

}  // namespace

// Launchers -----------------------------------------------------------------------------

Status rmsnorm_forward(void* cuda_stream, const RmsNormShape& shape, DType dtype, const void* x, const void* gamma, void* y,
                       float* rstd) {
  return dispatch(dtype, "rmsnorm_forward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    const unsigned blocks = static_cast<unsigned>((shape.rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
    rmsnorm_forward_kernel<T><<<blocks, kThreads, 0, native(cuda_stream)>>>(
        static_cast<const T*>(x), static_cast<const T*>(gamma), static_cast<T*>(y), rstd, shape.rows, shape.channels,
        shape.epsilon);
    return check_launch();
  });
}

Status rmsnorm_backward(void* cuda_stream, const RmsNormShape& shape, DType dtype, const void* dy, const void* x,
                        const void* gamma, const float* rstd, void* dx, float* dgamma, const GradOptions& options) {
  return dispatch(dtype, "rmsnorm_backward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    if (dx != nullptr) {
      const unsigned blocks = static_cast<unsigned>((shape.rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
      rmsnorm_backward_dx_kernel<T><<<blocks, kThreads, 0, native(cuda_stream)>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(gamma), rstd, static_cast<T*>(dx),
          shape.rows, shape.channels, options.input_grad == GradWrite::kAccumulate);
      STRATA_RETURN_IF_ERROR(check_launch());
    }
    if (dgamma != nullptr) {  // dgamma = sum over rows of dy * (x * rstd): LayerNorm's column sum with mean 0
      STRATA_RETURN_IF_ERROR(launch_column_grads<T>(native(cuda_stream), static_cast<const T*>(dy), static_cast<const T*>(x),
                                                    nullptr, rstd, dgamma, nullptr, shape.rows, shape.channels,
                                                    options.param_grad == GradWrite::kAccumulate));
    }
    return {};
  });
}

namespace {
template <class T>
Status launch_rope(void* cuda_stream, const RopeShape& shape, const int32_t* positions, const float* inv_freq, const void* in,
                   void* out, float sign, bool accumulate) {
  const size_t stride = shape.row_stride != 0 ? shape.row_stride : shape.heads * shape.head_dim;
  rope_kernel<T><<<blocks_for(shape.rows * shape.heads * (shape.head_dim / 2)), kThreads, 0, native(cuda_stream)>>>(
      positions, inv_freq, static_cast<const T*>(in), static_cast<T*>(out), shape.rows, shape.heads, shape.head_dim, stride,
      sign, accumulate);
  return check_launch();
}
}  // namespace

Status rope_forward(void* cuda_stream, const RopeShape& shape, DType dtype, const int32_t* positions, const float* inv_freq,
                    const void* x, void* y) {
  return dispatch(dtype, "rope_forward", [&](auto tag) -> Status {
    return launch_rope<typename decltype(tag)::type>(cuda_stream, shape, positions, inv_freq, x, y, 1.0f, false);
  });
}

Status rope_backward(void* cuda_stream, const RopeShape& shape, DType dtype, const int32_t* positions,
                     const float* inv_freq, const void* dy, void* dx, GradWrite input_grad) {
  return dispatch(dtype, "rope_backward", [&](auto tag) -> Status {
    return launch_rope<typename decltype(tag)::type>(cuda_stream, shape, positions, inv_freq, dy, dx, -1.0f,
                                                     input_grad == GradWrite::kAccumulate);
  });
}

Status swiglu_forward(void* cuda_stream, DType dtype, const void* gate, const void* up, void* out, size_t count) {
  return dispatch(dtype, "swiglu_forward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    swiglu_forward_kernel<T><<<blocks_for(count), kThreads, 0, native(cuda_stream)>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(out), count);
    return check_launch();
  });
}

Status swiglu_backward(void* cuda_stream, DType dtype, const void* dout, const void* gate, const void* up, void* dgate,
                       void* dup, size_t count, GradWrite input_grad) {
  return dispatch(dtype, "swiglu_backward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    swiglu_backward_kernel<T><<<blocks_for(count), kThreads, 0, native(cuda_stream)>>>(
        static_cast<const T*>(dout), static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(dgate),
        static_cast<T*>(dup), count, input_grad == GradWrite::kAccumulate);
    return check_launch();
  });
}

// Attention: per batch element, GEMMs batched over heads without a permute. Query head
// h = g * group + j reads KV head g; for each j in [0, group) one strided-batched GEMM
// covers the KV heads g (q's batch stride group * head_dim, k's and v's head_dim, the
// scores' group * T^2). With group == 1 these are the GEMMs of plain multi-head
// attention. The dK and dV of grouped heads are summed in fp32 in the workspace, in
// head order, then rounded to T once.

Status gqa_attention_forward(void* cuda_stream, BlasContext& blas, const GqaAttentionShape& shape, DType dtype,
                             const void* q, const void* k, const void* v, void* out, float* lse, void* workspace) {
  STRATA_RETURN_IF_ERROR(check_handle(blas, "gqa_attention_forward"));
  return dispatch(dtype, "gqa_attention_forward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    const size_t seq = shape.seq_len;
    const size_t heads = shape.heads;
    const size_t hd = shape.head_dim;
    const size_t group = heads / shape.kv_heads;
    const size_t channels = heads * hd;
    const long long square = static_cast<long long>(seq * seq);
    const long long q_head_stride = static_cast<long long>(group * hd);
    const long long kv_head_stride = static_cast<long long>(hd);
    const float scale = 1.0f / sqrtf(float(hd));
    const AttentionWorkspace<T> ws(workspace, shape);
    const cudaDataType_t type = cuda_type<T>();
    const cublasComputeType_t compute = compute_type(blas, dtype);
    const int kv_heads = static_cast<int>(shape.kv_heads);
    const unsigned softmax_blocks = static_cast<unsigned>((heads * seq + kWarpsPerBlock - 1) / kWarpsPerBlock);
    std::lock_guard lock(blas.impl().mutex);
    STRATA_RETURN_IF_ERROR(bind_cublas_to_stream(blas.impl(), cuda_stream));
    cublasHandle_t handle = blas.impl().handle;
    for (size_t b = 0; b < shape.batch; ++b) {
      const T* q_b = static_cast<const T*>(q) + b * seq * shape.q_stride;
      const T* k_b = static_cast<const T*>(k) + b * seq * shape.k_stride;
      const T* v_b = static_cast<const T*>(v) + b * seq * shape.v_stride;
      T* out_b = static_cast<T*>(out) + b * seq * channels;
      for (size_t j = 0; j < group; ++j) {  // S_h = scale Q_h K_g^T (fp32)
        STRATA_RETURN_IF_ERROR(gemm(handle, compute, seq, seq, hd, scale,
                                    Operand{q_b + j * hd, type, shape.q_stride, q_head_stride, false},
                                    Operand{k_b, type, shape.k_stride, kv_head_stride, true}, 0.0f, ws.scores + j * square,
                                    CUDA_R_32F, seq, group * square, kv_heads));
      }
      causal_softmax_kernel<T><<<softmax_blocks, kThreads, 0, native(cuda_stream)>>>(ws.scores, ws.probs, nullptr,
                                                                                     lse + b * heads * seq, heads * seq, seq);
      STRATA_RETURN_IF_ERROR(check_launch());
      for (size_t j = 0; j < group; ++j) {  // O_h = P_h V_g
        STRATA_RETURN_IF_ERROR(gemm(handle, compute, seq, hd, seq, 1.0f,
                                    Operand{ws.probs + j * square, type, seq, static_cast<long long>(group) * square, false},
                                    Operand{v_b, type, shape.v_stride, kv_head_stride, false}, 0.0f, out_b + j * hd, type,
                                    channels, q_head_stride, kv_heads));
      }
    }
    return {};
  });
}

Status gqa_attention_backward(void* cuda_stream, BlasContext& blas, const GqaAttentionShape& shape, DType dtype,
                              const void* dout, const void* q, const void* k, const void* v, const float* lse, void* dq,
                              void* dk, void* dv, void* workspace, GradWrite input_grad) {
  STRATA_RETURN_IF_ERROR(check_handle(blas, "gqa_attention_backward"));
  return dispatch(dtype, "gqa_attention_backward", [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    const size_t seq = shape.seq_len;
    const size_t heads = shape.heads;
    const size_t hd = shape.head_dim;
    const size_t group = heads / shape.kv_heads;
    const size_t channels = heads * hd;
    const size_t kv_width = shape.kv_heads * hd;
    const long long square = static_cast<long long>(seq * seq);
    const long long group_square = static_cast<long long>(group) * square;
    const long long q_head_stride = static_cast<long long>(group * hd);
    const long long kv_head_stride = static_cast<long long>(hd);
    const float scale = 1.0f / sqrtf(float(hd));
    const bool accumulate = input_grad == GradWrite::kAccumulate;
    const float beta = accumulate ? 1.0f : 0.0f;
    const bool grouped = group > 1;
    const AttentionWorkspace<T> ws(workspace, shape);
    const cudaDataType_t type = cuda_type<T>();
    const cublasComputeType_t compute = compute_type(blas, dtype);
    const int kv_heads = static_cast<int>(shape.kv_heads);
    const unsigned row_blocks = static_cast<unsigned>((heads * seq + kWarpsPerBlock - 1) / kWarpsPerBlock);
    std::lock_guard lock(blas.impl().mutex);
    STRATA_RETURN_IF_ERROR(bind_cublas_to_stream(blas.impl(), cuda_stream));
    cublasHandle_t handle = blas.impl().handle;
    for (size_t b = 0; b < shape.batch; ++b) {
      const T* q_b = static_cast<const T*>(q) + b * seq * shape.q_stride;
      const T* k_b = static_cast<const T*>(k) + b * seq * shape.k_stride;
      const T* v_b = static_cast<const T*>(v) + b * seq * shape.v_stride;
      const T* dout_b = static_cast<const T*>(dout) + b * seq * channels;
      T* dq_b = static_cast<T*>(dq) + b * seq * shape.q_stride;
      T* dk_b = static_cast<T*>(dk) + b * seq * shape.k_stride;
      T* dv_b = static_cast<T*>(dv) + b * seq * shape.v_stride;
      // Grouped heads sum into fp32 [T, kv_width] first; a lone head writes straight through.
      void* dk_target = grouped ? static_cast<void*>(ws.dk_sum) : static_cast<void*>(dk_b);
      void* dv_target = grouped ? static_cast<void*>(ws.dv_sum) : static_cast<void*>(dv_b);
      const cudaDataType_t kv_type = grouped ? CUDA_R_32F : type;
      const size_t dk_ld = grouped ? kv_width : shape.k_stride;
      const size_t dv_ld = grouped ? kv_width : shape.v_stride;
      auto kv_beta = [&](size_t j) { return grouped ? (j == 0 ? 0.0f : 1.0f) : beta; };
      // Recompute P from the saved logsumexp.
      for (size_t j = 0; j < group; ++j) {
        STRATA_RETURN_IF_ERROR(gemm(handle, compute, seq, seq, hd, scale,
                                    Operand{q_b + j * hd, type, shape.q_stride, q_head_stride, false},
                                    Operand{k_b, type, shape.k_stride, kv_head_stride, true}, 0.0f, ws.scores + j * square,
                                    CUDA_R_32F, seq, group_square, kv_heads));
      }
      causal_softmax_kernel<T><<<row_blocks, kThreads, 0, native(cuda_stream)>>>(ws.scores, ws.probs, lse + b * heads * seq,
                                                                                 nullptr, heads * seq, seq);
      STRATA_RETURN_IF_ERROR(check_launch());
      for (size_t j = 0; j < group; ++j) {  // dV_g (+)= P_h^T dO_h
        STRATA_RETURN_IF_ERROR(gemm(handle, compute, seq, hd, seq, 1.0f,
                                    Operand{ws.probs + j * square, type, seq, group_square, true},
                                    Operand{dout_b + j * hd, type, channels, q_head_stride, false}, kv_beta(j), dv_target,
                                    kv_type, dv_ld, kv_head_stride, kv_heads));
      }
      for (size_t j = 0; j < group; ++j) {  // dP_h = dO_h V_g^T (fp32, over the scores)
        STRATA_RETURN_IF_ERROR(gemm(handle, compute, seq, seq, hd, 1.0f,
                                    Operand{dout_b + j * hd, type, channels, q_head_stride, false},
                                    Operand{v_b, type, shape.v_stride, kv_head_stride, true}, 0.0f, ws.scores + j * square,
                                    CUDA_R_32F, seq, group_square, kv_heads));
      }
      softmax_backward_kernel<T><<<row_blocks, kThreads, 0, native(cuda_stream)>>>(ws.probs, ws.scores, heads * seq, seq);
      STRATA_RETURN_IF_ERROR(check_launch());
      for (size_t j = 0; j < group; ++j) {  // dQ_h = scale dS_h K_g; dK_g (+)= scale dS_h^T Q_h
        STRATA_RETURN_IF_ERROR(gemm(handle, compute, seq, hd, seq, scale,
                                    Operand{ws.probs + j * square, type, seq, group_square, false},
                                    Operand{k_b, type, shape.k_stride, kv_head_stride, false}, beta, dq_b + j * hd, type,
                                    shape.q_stride, q_head_stride, kv_heads));
        STRATA_RETURN_IF_ERROR(gemm(handle, compute, seq, hd, seq, scale,
                                    Operand{ws.probs + j * square, type, seq, group_square, true},
                                    Operand{q_b + j * hd, type, shape.q_stride, q_head_stride, false}, kv_beta(j), dk_target,
                                    kv_type, dk_ld, kv_head_stride, kv_heads));
      }
      if (grouped) {
        const unsigned blocks = blocks_for(seq * kv_width);
        store_strided_rows_kernel<T><<<blocks, kThreads, 0, native(cuda_stream)>>>(ws.dk_sum, dk_b, seq, kv_width,
                                                                                   shape.k_stride, accumulate);
        STRATA_RETURN_IF_ERROR(check_launch());
        store_strided_rows_kernel<T><<<blocks, kThreads, 0, native(cuda_stream)>>>(ws.dv_sum, dv_b, seq, kv_width,
                                                                                   shape.v_stride, accumulate);
        STRATA_RETURN_IF_ERROR(check_launch());
      }
    }
    return {};
  });
}

}  // namespace strata::kernels::cuda
