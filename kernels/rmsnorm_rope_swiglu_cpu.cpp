// Before every include: GCC does not inline functions compiled under other optimization
// options (see kernels/cpu_elements.h).
#pragma GCC optimize("no-trapping-math")

#include "kernels/rmsnorm_rope_swiglu_cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu_elements.h"

// Three layers as in kernels/transformer_ops_cpu.cpp: element functions, span functions
// compiled per ISA (STRATA_SIMD_SPAN), parallel drivers over the executor.

namespace strata::kernels::cpu {
namespace {

using namespace elements;  // NOLINT: the shared element functions of kernels/cpu_elements.h

// Element functions ------------------------------------------------------------------

// sigmoid(g) with the branch-free exp, so SwiGLU loops vectorize.
[[gnu::always_inline]] inline float sigmoid(float g) { return 1.0f / (1.0f + exp_approx(-g)); }

// RMSNorm span functions --------------------------------------------------------------

// Sum of squares of one row in eight interleaved partial sums (vectorizes, and the
// order is fixed by the row length alone).
STRATA_SIMD_SPAN float sum_of_squares(const float* x, size_t n) {
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (size_t i = 0; i < n; ++i) partial[i % 8] += x[i] * x[i];
  return ((partial[0] + partial[1]) + (partial[2] + partial[3])) + ((partial[4] + partial[5]) + (partial[6] + partial[7]));
}

// y = gamma * (x * rstd): Hugging Face multiplies the normalized x by the weight last.
STRATA_SIMD_SPAN void rmsnorm_row(const float* x, const float* gamma, float inv_rms, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] = gamma[i] * (x[i] * inv_rms);
}

// sum_i dy_i gamma_i x_i (the projection term of the backward).
STRATA_SIMD_SPAN float dot_dy_gamma_x(const float* dy, const float* gamma, const float* x, size_t n) {
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (size_t i = 0; i < n; ++i) partial[i % 8] += dy[i] * gamma[i] * x[i];
  return ((partial[0] + partial[1]) + (partial[2] + partial[3])) + ((partial[4] + partial[5]) + (partial[6] + partial[7]));
}

// dx = rstd * (dy gamma - xhat * mean(dy gamma xhat)), xhat = x rstd; here with
// projection = rstd^2 * mean(dy gamma x), so dx = rstd * dy gamma - x * rstd * projection.
STRATA_SIMD_SPAN void rmsnorm_backward_row(const float* dy, const float* gamma, const float* x, float inv_rms,
                                           float projection, float* dx, size_t n, GradWrite mode) {
  if (mode == GradWrite::kAccumulate) {
    for (size_t i = 0; i < n; ++i) dx[i] += inv_rms * (dy[i] * gamma[i] - x[i] * projection);
  } else {
    for (size_t i = 0; i < n; ++i) dx[i] = inv_rms * (dy[i] * gamma[i] - x[i] * projection);
  }
}

// RoPE span functions -----------------------------------------------------------------

// One head: rotate (a, b) = (x[i], x[i + half]) by the angle with cos c, sin s; `sign`
// +1 for the forward rotation, -1 for its transpose. Reads both halves before writing,
// so y may alias x.
STRATA_SIMD_SPAN void rotate_head(const float* x, const float* cos_row, const float* sin_row, float sign, float* y,
                                  size_t half, GradWrite mode) {
  for (size_t i = 0; i < half; ++i) {
    const float a = x[i];
    const float b = x[i + half];
    const float s = sign * sin_row[i];
    const float first = a * cos_row[i] - b * s;
    const float second = b * cos_row[i] + a * s;
    if (mode == GradWrite::kAccumulate) {
      y[i] += first;
      y[i + half] += second;
    } else {
      y[i] = first;
      y[i + half] = second;
    }
  }
}

// The rotation of every head of rows [lo, hi), cos and sin evaluated once per row.
void rope_rows(const RopeShape& shape, const int32_t* positions, const float* inv_freq, const float* x, float* y,
               float sign, GradWrite mode, size_t lo, size_t hi) {
  const size_t half = shape.head_dim / 2;
  const size_t stride = shape.row_stride != 0 ? shape.row_stride : shape.heads * shape.head_dim;
  std::vector<float> cos_row(half);
  std::vector<float> sin_row(half);
  for (size_t r = lo; r < hi; ++r) {
    const float position = static_cast<float>(positions[r]);
    for (size_t i = 0; i < half; ++i) {
      const float angle = position * inv_freq[i];  // rounded to fp32 first, as Hugging Face's fp32 product
      cos_row[i] = std::cos(angle);
      sin_row[i] = std::sin(angle);
    }
    for (size_t h = 0; h < shape.heads; ++h) {
      const size_t offset = r * stride + h * shape.head_dim;
      rotate_head(x + offset, cos_row.data(), sin_row.data(), sign, y + offset, half, mode);
    }
  }
}

// SwiGLU span functions ---------------------------------------------------------------

STRATA_SIMD_SPAN void swiglu_forward_span(const float* gate, const float* up, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = gate[i] * sigmoid(gate[i]) * up[i];
}

// dgate = dout * up * silu'(gate), silu'(g) = s (1 + g (1 - s)), s = sigmoid(g).
STRATA_SIMD_SPAN void swiglu_dgate_span(const float* dout, const float* gate, const float* up, float* dgate, size_t n,
                                        GradWrite mode) {
  for (size_t i = 0; i < n; ++i) {
    const float s = sigmoid(gate[i]);
    const float grad = dout[i] * up[i] * (s * (1.0f + gate[i] * (1.0f - s)));
    dgate[i] = mode == GradWrite::kAccumulate ? dgate[i] + grad : grad;
  }
}

// dup = dout * silu(gate).
STRATA_SIMD_SPAN void swiglu_dup_span(const float* dout, const float* gate, float* dup, size_t n, GradWrite mode) {
  for (size_t i = 0; i < n; ++i) {
    const float grad = dout[i] * (gate[i] * sigmoid(gate[i]));
    dup[i] = mode == GradWrite::kAccumulate ? dup[i] + grad : grad;
  }
}

}  // namespace

// RMSNorm -----------------------------------------------------------------------------

void rmsnorm_forward(Executor& executor, const RmsNormShape& shape, const float* x, const float* gamma, float* y,
                     float* rstd) {
  const size_t channels = shape.channels;
  const float inverse_channels = 1.0f / static_cast<float>(channels);
  executor.parallel_for(0, shape.rows, row_grain(channels), [&](size_t lo, size_t hi) {
    for (size_t r = lo; r < hi; ++r) {
      const float* x_row = x + r * channels;
      const float inv_rms = 1.0f / std::sqrt(sum_of_squares(x_row, channels) * inverse_channels + shape.epsilon);
      rmsnorm_row(x_row, gamma, inv_rms, y + r * channels, channels);
      if (rstd != nullptr) rstd[r] = inv_rms;
    }
  });
}

void rmsnorm_backward(Executor& executor, const RmsNormShape& shape, const float* dy, const float* x, const float* gamma,
                      const float* rstd, float* dx, float* dgamma, const GradOptions& options) {
  const size_t channels = shape.channels;
  const float inverse_channels = 1.0f / static_cast<float>(channels);
  if (dx != nullptr) {
    executor.parallel_for(0, shape.rows, row_grain(channels), [&](size_t lo, size_t hi) {
      for (size_t r = lo; r < hi; ++r) {
        const size_t offset = r * channels;
        const float inv_rms = rstd[r];
        const float projection =
            dot_dy_gamma_x(dy + offset, gamma, x + offset, channels) * inverse_channels * inv_rms * inv_rms;
        rmsnorm_backward_row(dy + offset, gamma, x + offset, inv_rms, projection, dx + offset, channels,
                             options.input_grad);
      }
    });
  }
  if (dgamma != nullptr) {
    column_sums(executor, shape.rows, channels, dgamma, options.param_grad, [&](size_t r, size_t c0, size_t c1, float* acc) {
      const float* x_row = x + r * channels;
      const float* dy_row = dy + r * channels;
      const float inv_rms = rstd[r];
      for (size_t c = c0; c < c1; ++c) acc[c - c0] += dy_row[c] * (x_row[c] * inv_rms);
    });
  }
}

// RoPE --------------------------------------------------------------------------------

void rope_forward(Executor& executor, const RopeShape& shape, const int32_t* positions, const float* inv_freq,
                  const float* x, float* y) {
  executor.parallel_for(0, shape.rows, row_grain(shape.heads * shape.head_dim), [&](size_t lo, size_t hi) {
    rope_rows(shape, positions, inv_freq, x, y, 1.0f, GradWrite::kOverwrite, lo, hi);
  });
}

void rope_backward(Executor& executor, const RopeShape& shape, const int32_t* positions, const float* inv_freq,
                   const float* dy, float* dx, GradWrite input_grad) {
  executor.parallel_for(0, shape.rows, row_grain(shape.heads * shape.head_dim), [&](size_t lo, size_t hi) {
    rope_rows(shape, positions, inv_freq, dy, dx, -1.0f, input_grad, lo, hi);
  });
}

// SwiGLU ------------------------------------------------------------------------------

void swiglu_forward(Executor& executor, const float* gate, const float* up, float* out, size_t count) {
  executor.parallel_for(0, count, kElementsPerChunk,
                        [&](size_t lo, size_t hi) { swiglu_forward_span(gate + lo, up + lo, out + lo, hi - lo); });
}

void swiglu_backward(Executor& executor, const float* dout, const float* gate, const float* up, float* dgate, float* dup,
                     size_t count, GradWrite input_grad) {
  executor.parallel_for(0, count, kElementsPerChunk, [&](size_t lo, size_t hi) {
    if (dgate != nullptr) swiglu_dgate_span(dout + lo, gate + lo, up + lo, dgate + lo, hi - lo, input_grad);
    if (dup != nullptr) swiglu_dup_span(dout + lo, gate + lo, dup + lo, hi - lo, input_grad);
  });
}

}  // namespace strata::kernels::cpu
