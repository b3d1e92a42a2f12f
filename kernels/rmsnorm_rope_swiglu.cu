// CUDA kernels of RMSNorm, RoPE and SwiGLU and their launchers (kernels/rmsnorm_rope_swiglu_cuda.h);
// the attention is in kernels/flash_attention.cu.
//
// As kernels/transformer_ops.cu: T is float or __nv_bfloat16, all math in fp32 (GEMMs
// accumulate in fp32), parameter gradients and statistics fp32, every reduction in a
// fixed order and no float atomics, so results are deterministic.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "engine/core/cuda_check.h"
#include "kernels/cuda_common.cuh"
#include "kernels/rmsnorm_rope_swiglu_cuda.h"

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

}  // namespace strata::kernels::cuda
