#include "tests/engine/dense_reference.h"

#include <algorithm>
#include <cmath>

namespace strata::testing {
namespace {
float gelu(float x) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * x * (1.0f + std::tanh(k * (x + 0.044715f * x * x * x)));
}
float gelu_grad(float x) {
  const float k = 0.7978845608028654f;
  const float inner = k * (x + 0.044715f * x * x * x);
  const float t = std::tanh(inner);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * x * x);
}
}  // namespace

double relative_error(const float* a, const float* b, size_t n) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < n; ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return norm == 0.0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

DenseLinearStack::DenseLinearStack(const models::LinearStackConfig& config, uint64_t seed, const kernels::AdamHyperparams& hyper,
                                   float gradient_clipping)
    : config_(config), hyper_(hyper), clipping_(gradient_clipping) {
  const auto specs = models::linear_stack_groups(config);
  for (size_t g = 0; g < specs.size(); ++g) {
    auto layout = layout_group(specs[g], static_cast<int>(g), 1);
    layouts_.push_back(*layout);
    std::vector<float> shard(layouts_.back().shard_numel);
    init_shard(layouts_.back(), 0, seed, shard.data());
    params_.push_back(shard);
    exp_avg_.emplace_back(shard.size(), 0.0f);
    exp_avg_sq_.emplace_back(shard.size(), 0.0f);
    grads_.emplace_back(shard.size(), 0.0f);
  }
}

double DenseLinearStack::step(int64_t step, int micro_batches, double learning_rate) {
  const int rows = config_.global_rows, f = config_.features, w = config_.width, layers = config_.layers;
  for (auto& g : grads_) std::fill(g.begin(), g.end(), 0.0f);
  double total_loss = 0.0;
  std::vector<float> x(static_cast<size_t>(rows) * f);
  std::vector<int32_t> labels(static_cast<size_t>(rows));
  const float* e = params_[0].data();
  float* de = grads_[0].data();
  for (int micro = 0; micro < micro_batches; ++micro) {
    models::make_batch(config_, step, micro, 0, rows, x.data(), labels.data());
    std::vector<std::vector<float>> h(static_cast<size_t>(layers) + 1, std::vector<float>(static_cast<size_t>(rows) * w));
    std::vector<std::vector<float>> pre(static_cast<size_t>(layers) + 1, std::vector<float>(static_cast<size_t>(rows) * w));
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < w; ++j) {
        double sum = 0;
        for (int i = 0; i < f; ++i) sum += double(x[r * f + i]) * e[i * w + j];
        h[0][r * w + j] = float(sum);
      }
    for (int l = 1; l <= layers; ++l) {
      const float* W = params_[l].data();
      const float* b = params_[l].data() + layouts_[l].tensors[1].offset;
      for (int r = 0; r < rows; ++r)
        for (int j = 0; j < w; ++j) {
          double sum = b[j];
          for (int i = 0; i < w; ++i) sum += double(h[l - 1][r * w + i]) * W[i * w + j];
          pre[l][r * w + j] = float(sum);
          h[l][r * w + j] = gelu(float(sum));
        }
    }
    // logits = h_L . E^T, cross-entropy, dlogits scaled for the mean over rows and micro-batches.
    std::vector<float> dlogits(static_cast<size_t>(rows) * f);
    for (int r = 0; r < rows; ++r) {
      std::vector<double> logits(static_cast<size_t>(f));
      double max_logit = -1e300;
      for (int c = 0; c < f; ++c) {
        double sum = 0;
        for (int j = 0; j < w; ++j) sum += double(h[layers][r * w + j]) * e[c * w + j];
        logits[c] = sum;
        max_logit = std::max(max_logit, sum);
      }
      double z = 0;
      for (int c = 0; c < f; ++c) z += std::exp(logits[c] - max_logit);
      const double lse = max_logit + std::log(z);
      total_loss += (lse - logits[labels[r]]) / rows;
      for (int c = 0; c < f; ++c) {
        const double p = std::exp(logits[c] - lse);
        dlogits[r * f + c] = float((p - (c == labels[r] ? 1.0 : 0.0)) / (double(rows) * micro_batches));
      }
    }
    // Backward through the output layer: dE += dlogits^T . h_L ; dh_L = dlogits . E.
    std::vector<float> dh(static_cast<size_t>(rows) * w), dh_prev(static_cast<size_t>(rows) * w);
    for (int c = 0; c < f; ++c)
      for (int j = 0; j < w; ++j) {
        double sum = 0;
        for (int r = 0; r < rows; ++r) sum += double(dlogits[r * f + c]) * h[layers][r * w + j];
        de[c * w + j] += float(sum);
      }
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < w; ++j) {
        double sum = 0;
        for (int c = 0; c < f; ++c) sum += double(dlogits[r * f + c]) * e[c * w + j];
        dh[r * w + j] = float(sum);
      }
    for (int l = layers; l >= 1; --l) {
      const float* W = params_[l].data();
      float* dW = grads_[l].data();
      float* db = grads_[l].data() + layouts_[l].tensors[1].offset;
      for (int r = 0; r < rows; ++r)
        for (int j = 0; j < w; ++j) dh[r * w + j] *= gelu_grad(pre[l][r * w + j]);
      for (int i = 0; i < w; ++i)
        for (int j = 0; j < w; ++j) {
          double sum = 0;
          for (int r = 0; r < rows; ++r) sum += double(h[l - 1][r * w + i]) * dh[r * w + j];
          dW[i * w + j] += float(sum);
        }
      for (int j = 0; j < w; ++j) {
        double sum = 0;
        for (int r = 0; r < rows; ++r) sum += dh[r * w + j];
        db[j] += float(sum);
      }
      for (int r = 0; r < rows; ++r)
        for (int i = 0; i < w; ++i) {
          double sum = 0;
          for (int j = 0; j < w; ++j) sum += double(dh[r * w + j]) * W[i * w + j];
          dh_prev[r * w + i] = float(sum);
        }
      std::swap(dh, dh_prev);
    }
    // The input projection: dE += x^T . dh_0.
    for (int i = 0; i < f; ++i)
      for (int j = 0; j < w; ++j) {
        double sum = 0;
        for (int r = 0; r < rows; ++r) sum += double(x[r * f + i]) * dh[r * w + j];
        de[i * w + j] += float(sum);
      }
  }
  // Clipping by the global norm, then AdamW per tensor (no decay for biases).
  double sum_sq = 0;
  for (const auto& g : grads_)
    for (float v : g) sum_sq += double(v) * v;
  const double norm = std::sqrt(sum_sq);
  kernels::GradientScaling scaling;
  if (clipping_ > 0) scaling.clip_coefficient = float(std::min(1.0, clipping_ / (norm + 1e-6)));
  ++applied_;
  kernels::AdamHyperparams hyper = hyper_;
  hyper.lr = learning_rate;
  kernels::AdamHyperparams no_decay = hyper;
  no_decay.weight_decay = 0;
  const auto decay_scalars = *kernels::adam_step_scalars(hyper, applied_, scaling);
  const auto plain_scalars = *kernels::adam_step_scalars(no_decay, applied_, scaling);
  for (size_t g = 0; g < params_.size(); ++g) {
    for (const auto& tensor : layouts_[g].tensors) {
      kernels::AdamBuffers buffers;
      buffers.grad = grads_[g].data() + tensor.offset;
      buffers.grad_type = DType::kFloat32;
      buffers.master = params_[g].data() + tensor.offset;
      buffers.exp_avg = exp_avg_[g].data() + tensor.offset;
      buffers.exp_avg_sq = exp_avg_sq_[g].data() + tensor.offset;
      buffers.moment_type = DType::kFloat32;
      buffers.param = nullptr;
      buffers.count = tensor.numel;
      kernels::adam_step_cpu_range(buffers, tensor.weight_decay ? decay_scalars : plain_scalars, 0, tensor.numel);
    }
  }
  return total_loss / micro_batches;
}

}  // namespace strata::testing
