#include "kernels/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace strata::kernels::reference {

void embedding_forward(const EmbeddingShape& shape, const int32_t* tokens, const double* wte, const double* wpe,
                       double* out) {
  const size_t C = shape.channels;
  for (size_t b = 0; b < shape.batch; ++b) {
    for (size_t t = 0; t < shape.seq_len; ++t) {
      const size_t i = b * shape.seq_len + t;
      for (size_t c = 0; c < C; ++c) out[i * C + c] = wte[static_cast<size_t>(tokens[i]) * C + c] + (wpe != nullptr ? wpe[t * C + c] : 0.0);
    }
  }
}

void embedding_backward(const EmbeddingShape& shape, const int32_t* tokens, const double* dout, double* dwte,
                        double* dwpe) {
  const size_t C = shape.channels;
  std::fill_n(dwte, shape.vocab_size * C, 0.0);
  if (dwpe != nullptr) std::fill_n(dwpe, shape.seq_len * C, 0.0);
  for (size_t b = 0; b < shape.batch; ++b) {
    for (size_t t = 0; t < shape.seq_len; ++t) {
      const size_t i = b * shape.seq_len + t;
      for (size_t c = 0; c < C; ++c) {
        dwte[static_cast<size_t>(tokens[i]) * C + c] += dout[i * C + c];
        if (dwpe != nullptr) dwpe[t * C + c] += dout[i * C + c];
      }
    }
  }
}

void layernorm_forward(const LayerNormShape& shape, const double* x, const double* gamma, const double* beta, double* y,
                       double* mean, double* rstd) {
  const size_t C = shape.channels;
  for (size_t r = 0; r < shape.rows; ++r) {
    double mu = 0.0;
    for (size_t c = 0; c < C; ++c) mu += x[r * C + c];
    mu /= static_cast<double>(C);
    double var = 0.0;
    for (size_t c = 0; c < C; ++c) var += (x[r * C + c] - mu) * (x[r * C + c] - mu);
    var /= static_cast<double>(C);
    const double s = 1.0 / std::sqrt(var + shape.epsilon);
    for (size_t c = 0; c < C; ++c) y[r * C + c] = (x[r * C + c] - mu) * s * gamma[c] + beta[c];
    if (mean != nullptr) mean[r] = mu;
    if (rstd != nullptr) rstd[r] = s;
  }
}

void layernorm_backward(const LayerNormShape& shape, const double* dy, const double* x, const double* gamma, double* dx,
                        double* dgamma, double* dbeta) {
  const size_t C = shape.channels;
  std::fill_n(dgamma, C, 0.0);
  std::fill_n(dbeta, C, 0.0);
  for (size_t r = 0; r < shape.rows; ++r) {
    double mu = 0.0;
    for (size_t c = 0; c < C; ++c) mu += x[r * C + c];
    mu /= static_cast<double>(C);
    double var = 0.0;
    for (size_t c = 0; c < C; ++c) var += (x[r * C + c] - mu) * (x[r * C + c] - mu);
    const double s = 1.0 / std::sqrt(var / static_cast<double>(C) + shape.epsilon);
    // y = xhat * gamma + beta, xhat = (x - mu) s; d/dx through mu and s:
    // dx_i = s (g_i - mean(g) - xhat_i mean(g xhat)), g = dy * gamma.
    double mean_g = 0.0;
    double mean_g_xhat = 0.0;
    for (size_t c = 0; c < C; ++c) {
      const double xhat = (x[r * C + c] - mu) * s;
      const double g = dy[r * C + c] * gamma[c];
      mean_g += g;
      mean_g_xhat += g * xhat;
      dgamma[c] += dy[r * C + c] * xhat;
      dbeta[c] += dy[r * C + c];
    }
    mean_g /= static_cast<double>(C);
    mean_g_xhat /= static_cast<double>(C);
    for (size_t c = 0; c < C; ++c) {
      const double xhat = (x[r * C + c] - mu) * s;
      dx[r * C + c] = s * (dy[r * C + c] * gamma[c] - mean_g - xhat * mean_g_xhat);
    }
  }
}

namespace {
// W'[k][n]: the effective [in, out] matrix whatever the stored layout.
double weight_at(const MatmulShape& shape, const double* weight, size_t k, size_t n) {
  return shape.layout == WeightLayout::kInOut ? weight[k * shape.out_features + n] : weight[n * shape.in_features + k];
}
double& weight_at(const MatmulShape& shape, double* weight, size_t k, size_t n) {
  return shape.layout == WeightLayout::kInOut ? weight[k * shape.out_features + n] : weight[n * shape.in_features + k];
}
}  // namespace

void matmul_forward(const MatmulShape& shape, const double* x, const double* weight, const double* bias, double* y) {
  const size_t K = shape.in_features;
  const size_t N = shape.out_features;
  for (size_t m = 0; m < shape.rows; ++m) {
    for (size_t n = 0; n < N; ++n) {
      double sum = bias != nullptr ? bias[n] : 0.0;
      for (size_t k = 0; k < K; ++k) sum += x[m * K + k] * weight_at(shape, weight, k, n);
      y[m * N + n] = sum;
    }
  }
}

void matmul_backward(const MatmulShape& shape, const double* dy, const double* x, const double* weight, double* dx,
                     double* dweight, double* dbias) {
  const size_t K = shape.in_features;
  const size_t N = shape.out_features;
  std::fill_n(dx, shape.rows * K, 0.0);
  std::fill_n(dweight, K * N, 0.0);
  std::fill_n(dbias, N, 0.0);
  for (size_t m = 0; m < shape.rows; ++m) {
    for (size_t n = 0; n < N; ++n) {
      const double g = dy[m * N + n];
      dbias[n] += g;
      for (size_t k = 0; k < K; ++k) {
        dx[m * K + k] += g * weight_at(shape, weight, k, n);
        weight_at(shape, dweight, k, n) += g * x[m * K + k];
      }
    }
  }
}

namespace {
constexpr double kGeluScale = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kGeluCubic = 0.044715;
}  // namespace

void gelu_forward(const double* x, double* y, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    y[i] = 0.5 * x[i] * (1.0 + std::tanh(kGeluScale * (x[i] + kGeluCubic * x[i] * x[i] * x[i])));
  }
}

void gelu_backward(const double* dy, const double* x, double* dx, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    const double u = kGeluScale * (x[i] + kGeluCubic * x[i] * x[i] * x[i]);
    const double t = std::tanh(u);
    const double du = kGeluScale * (1.0 + 3.0 * kGeluCubic * x[i] * x[i]);
    dx[i] = dy[i] * (0.5 * (1.0 + t) + 0.5 * x[i] * (1.0 - t * t) * du);
  }
}

void residual_forward(const double* a, const double* b, double* out, size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = a[i] + b[i];
}

void residual_backward(const double* dout, double* da, double* db, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    da[i] = dout[i];
    db[i] = dout[i];
  }
}

namespace {
// Materializes each head's probability matrix P[t][j] (zero above the diagonal).
struct HeadView {
  const AttentionShape& shape;
  size_t C() const { return shape.heads * shape.head_dim; }
  size_t index(size_t b, size_t t, size_t part, size_t h, size_t d) const {
    return (b * shape.seq_len + t) * 3 * C() + part * C() + h * shape.head_dim + d;
  }
};

std::vector<double> probabilities(const AttentionShape& shape, const double* qkv, size_t b, size_t h, double* lse_row) {
  const HeadView view{shape};
  const size_t T = shape.seq_len;
  const double scale = 1.0 / std::sqrt(static_cast<double>(shape.head_dim));
  std::vector<double> p(T * T, 0.0);
  for (size_t t = 0; t < T; ++t) {
    double max_score = -std::numeric_limits<double>::infinity();
    for (size_t j = 0; j <= t; ++j) {
      double s = 0.0;
      for (size_t d = 0; d < shape.head_dim; ++d) s += qkv[view.index(b, t, 0, h, d)] * qkv[view.index(b, j, 1, h, d)];
      p[t * T + j] = s * scale;
      max_score = std::max(max_score, p[t * T + j]);
    }
    double sum = 0.0;
    for (size_t j = 0; j <= t; ++j) sum += std::exp(p[t * T + j] - max_score);
    for (size_t j = 0; j <= t; ++j) p[t * T + j] = std::exp(p[t * T + j] - max_score) / sum;
    if (lse_row != nullptr) lse_row[t] = max_score + std::log(sum);
  }
  return p;
}
}  // namespace

void attention_forward(const AttentionShape& shape, const double* qkv, double* out, double* lse) {
  const HeadView view{shape};
  const size_t T = shape.seq_len;
  for (size_t b = 0; b < shape.batch; ++b) {
    for (size_t h = 0; h < shape.heads; ++h) {
      const std::vector<double> p = probabilities(shape, qkv, b, h, lse + (b * shape.heads + h) * T);
      for (size_t t = 0; t < T; ++t) {
        for (size_t d = 0; d < shape.head_dim; ++d) {
          double sum = 0.0;
          for (size_t j = 0; j <= t; ++j) sum += p[t * T + j] * qkv[view.index(b, j, 2, h, d)];
          out[(b * T + t) * view.C() + h * shape.head_dim + d] = sum;
        }
      }
    }
  }
}

void attention_backward(const AttentionShape& shape, const double* dout, const double* qkv, double* dqkv) {
  const HeadView view{shape};
  const size_t T = shape.seq_len;
  const double scale = 1.0 / std::sqrt(static_cast<double>(shape.head_dim));
  std::fill_n(dqkv, shape.batch * T * 3 * view.C(), 0.0);
  for (size_t b = 0; b < shape.batch; ++b) {
    for (size_t h = 0; h < shape.heads; ++h) {
      const std::vector<double> p = probabilities(shape, qkv, b, h, nullptr);
      auto dout_at = [&](size_t t, size_t d) { return dout[(b * T + t) * view.C() + h * shape.head_dim + d]; };
      // dP = dO V^T; dV = P^T dO; dS = P o (dP - rowsum(P o dP)); dQ = scale dS K; dK = scale dS^T Q.
      std::vector<double> dp(T * T, 0.0);
      for (size_t t = 0; t < T; ++t) {
        for (size_t j = 0; j <= t; ++j) {
          double sum = 0.0;
          for (size_t d = 0; d < shape.head_dim; ++d) sum += dout_at(t, d) * qkv[view.index(b, j, 2, h, d)];
          dp[t * T + j] = sum;
          for (size_t d = 0; d < shape.head_dim; ++d) dqkv[view.index(b, j, 2, h, d)] += p[t * T + j] * dout_at(t, d);
        }
      }
      for (size_t t = 0; t < T; ++t) {
        double row = 0.0;
        for (size_t j = 0; j <= t; ++j) row += p[t * T + j] * dp[t * T + j];
        for (size_t j = 0; j <= t; ++j) {
          const double ds = p[t * T + j] * (dp[t * T + j] - row) * scale;
          for (size_t d = 0; d < shape.head_dim; ++d) {
            dqkv[view.index(b, t, 0, h, d)] += ds * qkv[view.index(b, j, 1, h, d)];
            dqkv[view.index(b, j, 1, h, d)] += ds * qkv[view.index(b, t, 0, h, d)];
          }
        }
      }
    }
  }
}

double cross_entropy_forward(const CrossEntropyShape& shape, const double* logits, const int32_t* targets, double* losses,
                             double* lse) {
  const size_t V = shape.vocab_size;
  double total = 0.0;
  size_t valid = 0;
  for (size_t r = 0; r < shape.rows; ++r) {
    const double* row = logits + r * V;
    const double max_value = *std::max_element(row, row + V);
    double sum = 0.0;
    for (size_t j = 0; j < V; ++j) sum += std::exp(row[j] - max_value);
    const double row_lse = max_value + std::log(sum);
    if (lse != nullptr) lse[r] = row_lse;
    if (targets[r] == shape.ignore_index) {
      losses[r] = 0.0;
      continue;
    }
    losses[r] = row_lse - row[targets[r]];
    total += losses[r];
    ++valid;
  }
  return valid == 0 ? 0.0 : total / static_cast<double>(valid);
}

void cross_entropy_backward(const CrossEntropyShape& shape, const double* logits, const int32_t* targets, double grad_scale,
                            double* dlogits) {
  const size_t V = shape.vocab_size;
  std::vector<double> losses(shape.rows);
  std::vector<double> lse(shape.rows);
  cross_entropy_forward(shape, logits, targets, losses.data(), lse.data());
  for (size_t r = 0; r < shape.rows; ++r) {
    for (size_t j = 0; j < V; ++j) {
      const bool ignored = targets[r] == shape.ignore_index;
      const double p = std::exp(logits[r * V + j] - lse[r]);
      dlogits[r * V + j] = ignored ? 0.0 : (p - (static_cast<size_t>(targets[r]) == j ? 1.0 : 0.0)) * grad_scale;
    }
  }
}

// RMSNorm, RoPE, SwiGLU, grouped-query attention ----------------------------------------

namespace {
double root_mean_square_inverse(const double* x_row, size_t channels, double epsilon) {
  double squares = 0.0;
  for (size_t c = 0; c < channels; ++c) squares += x_row[c] * x_row[c];
  return 1.0 / std::sqrt(squares / static_cast<double>(channels) + epsilon);
}
}  // namespace

void rmsnorm_forward(const RmsNormShape& shape, const double* x, const double* gamma, double* y, double* rstd) {
  const size_t C = shape.channels;
  for (size_t r = 0; r < shape.rows; ++r) {
    const double inv_rms = root_mean_square_inverse(x + r * C, C, shape.epsilon);
    for (size_t c = 0; c < C; ++c) y[r * C + c] = x[r * C + c] * inv_rms * gamma[c];
    if (rstd != nullptr) rstd[r] = inv_rms;
  }
}

// y_c = g_c x_c s, s = (mean(x^2) + eps)^(-1/2), ds/dx_j = -s^3 x_j / C, so
// dx_j = s g_j dy_j - x_j s^3 / C sum_c dy_c g_c x_c.
void rmsnorm_backward(const RmsNormShape& shape, const double* dy, const double* x, const double* gamma, double* dx,
                      double* dgamma) {
  const size_t C = shape.channels;
  std::fill_n(dgamma, C, 0.0);
  for (size_t r = 0; r < shape.rows; ++r) {
    const double* x_row = x + r * C;
    const double* dy_row = dy + r * C;
    const double s = root_mean_square_inverse(x_row, C, shape.epsilon);
    double projection = 0.0;
    for (size_t c = 0; c < C; ++c) projection += dy_row[c] * gamma[c] * x_row[c];
    for (size_t c = 0; c < C; ++c) {
      dx[r * C + c] = s * gamma[c] * dy_row[c] - x_row[c] * s * s * s / static_cast<double>(C) * projection;
      dgamma[c] += dy_row[c] * x_row[c] * s;
    }
  }
}

namespace {
// y = R(sign * angle) x for every head of every row.
void rope_rotate(const RopeShape& shape, const int32_t* positions, const float* inv_freq, const double* x, double* y,
                 double sign) {
  const size_t half = shape.head_dim / 2;
  const size_t stride = shape.row_stride != 0 ? shape.row_stride : shape.heads * shape.head_dim;
  for (size_t r = 0; r < shape.rows; ++r) {
    for (size_t h = 0; h < shape.heads; ++h) {
      const size_t base = r * stride + h * shape.head_dim;
      for (size_t i = 0; i < half; ++i) {
        const double angle = static_cast<float>(static_cast<float>(positions[r]) * inv_freq[i]);
        const double c = std::cos(angle);
        const double s = sign * std::sin(angle);
        const double a = x[base + i];
        const double b = x[base + i + half];
        y[base + i] = a * c - b * s;
        y[base + i + half] = b * c + a * s;
      }
    }
  }
}
}  // namespace

void rope_forward(const RopeShape& shape, const int32_t* positions, const float* inv_freq, const double* x, double* y) {
  rope_rotate(shape, positions, inv_freq, x, y, 1.0);
}

void rope_backward(const RopeShape& shape, const int32_t* positions, const float* inv_freq, const double* dy, double* dx) {
  rope_rotate(shape, positions, inv_freq, dy, dx, -1.0);
}

void swiglu_forward(const double* gate, const double* up, double* out, size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
}

void swiglu_backward(const double* dout, const double* gate, const double* up, double* dgate, double* dup, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    const double sigmoid = 1.0 / (1.0 + std::exp(-gate[i]));
    dgate[i] = dout[i] * up[i] * (sigmoid + gate[i] * sigmoid * (1.0 - sigmoid));
    dup[i] = dout[i] * gate[i] * sigmoid;
  }
}

namespace {
// Element (b, t, head, d) of a strided [batch, seq_len, heads * head_dim] tensor.
struct StridedView {
  size_t seq_len;
  size_t head_dim;
  size_t stride;
  size_t index(size_t b, size_t t, size_t head, size_t d) const { return (b * seq_len + t) * stride + head * head_dim + d; }
};

struct GqaViews {
  StridedView q, k, v, out;
  explicit GqaViews(const GqaAttentionShape& s)
      : q{s.seq_len, s.head_dim, s.q_stride != 0 ? s.q_stride : s.heads * s.head_dim},
        k{s.seq_len, s.head_dim, s.k_stride != 0 ? s.k_stride : s.kv_heads * s.head_dim},
        v{s.seq_len, s.head_dim, s.v_stride != 0 ? s.v_stride : s.kv_heads * s.head_dim},
        out{s.seq_len, s.head_dim, s.heads * s.head_dim} {}
};

// P[t][j] of query head h (zero above the diagonal), and the rows' logsumexp.
std::vector<double> gqa_probabilities(const GqaAttentionShape& shape, const double* q, const double* k, size_t b, size_t h,
                                      double* lse_row) {
  const GqaViews views(shape);
  const size_t T = shape.seq_len;
  const size_t kv = h / (shape.heads / shape.kv_heads);
  const double scale = 1.0 / std::sqrt(static_cast<double>(shape.head_dim));
  std::vector<double> p(T * T, 0.0);
  for (size_t t = 0; t < T; ++t) {
    double max_score = -std::numeric_limits<double>::infinity();
    for (size_t j = 0; j <= t; ++j) {
      double s = 0.0;
      for (size_t d = 0; d < shape.head_dim; ++d) s += q[views.q.index(b, t, h, d)] * k[views.k.index(b, j, kv, d)];
      p[t * T + j] = s * scale;
      max_score = std::max(max_score, p[t * T + j]);
    }
    double sum = 0.0;
    for (size_t j = 0; j <= t; ++j) sum += std::exp(p[t * T + j] - max_score);
    for (size_t j = 0; j <= t; ++j) p[t * T + j] = std::exp(p[t * T + j] - max_score) / sum;
    if (lse_row != nullptr) lse_row[t] = max_score + std::log(sum);
  }
  return p;
}
}  // namespace

void gqa_attention_forward(const GqaAttentionShape& shape, const double* q, const double* k, const double* v, double* out,
                           double* lse) {
  const GqaViews views(shape);
  const size_t T = shape.seq_len;
  for (size_t b = 0; b < shape.batch; ++b) {
    for (size_t h = 0; h < shape.heads; ++h) {
      const size_t kv = h / (shape.heads / shape.kv_heads);
      const std::vector<double> p = gqa_probabilities(shape, q, k, b, h, lse + (b * shape.heads + h) * T);
      for (size_t t = 0; t < T; ++t) {
        for (size_t d = 0; d < shape.head_dim; ++d) {
          double sum = 0.0;
          for (size_t j = 0; j <= t; ++j) sum += p[t * T + j] * v[views.v.index(b, j, kv, d)];
          out[views.out.index(b, t, h, d)] = sum;
        }
      }
    }
  }
}

// With P the probabilities: dV += P^T dO; dP = dO V^T; dS = P o (dP - rowsum(P o dP));
// dQ = scale dS K; dK += scale dS^T Q.
void gqa_attention_backward(const GqaAttentionShape& shape, const double* dout, const double* q, const double* k,
                            const double* v, double* dq, double* dk, double* dv) {
  const GqaViews views(shape);
  const size_t T = shape.seq_len;
  const size_t hd = shape.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (size_t b = 0; b < shape.batch; ++b) {
    for (size_t t = 0; t < T; ++t) {
      for (size_t d = 0; d < hd; ++d) {
        for (size_t h = 0; h < shape.heads; ++h) dq[views.q.index(b, t, h, d)] = 0.0;
        for (size_t g = 0; g < shape.kv_heads; ++g) {
          dk[views.k.index(b, t, g, d)] = 0.0;
          dv[views.v.index(b, t, g, d)] = 0.0;
        }
      }
    }
  }
  for (size_t b = 0; b < shape.batch; ++b) {
    for (size_t h = 0; h < shape.heads; ++h) {
      const size_t kv = h / (shape.heads / shape.kv_heads);
      const std::vector<double> p = gqa_probabilities(shape, q, k, b, h, nullptr);
      for (size_t t = 0; t < T; ++t) {
        std::vector<double> dp(t + 1);
        double row_dot = 0.0;
        for (size_t j = 0; j <= t; ++j) {
          double sum = 0.0;
          for (size_t d = 0; d < hd; ++d) sum += dout[views.out.index(b, t, h, d)] * v[views.v.index(b, j, kv, d)];
          dp[j] = sum;
          row_dot += p[t * T + j] * sum;
        }
        for (size_t j = 0; j <= t; ++j) {
          const double ds = p[t * T + j] * (dp[j] - row_dot) * scale;
          for (size_t d = 0; d < hd; ++d) {
            dv[views.v.index(b, j, kv, d)] += p[t * T + j] * dout[views.out.index(b, t, h, d)];
            dq[views.q.index(b, t, h, d)] += ds * k[views.k.index(b, j, kv, d)];
            dk[views.k.index(b, j, kv, d)] += ds * q[views.q.index(b, t, h, d)];
          }
        }
      }
    }
  }
}

}  // namespace strata::kernels::reference
