// Finite-difference checks of the scalar references' backward passes (kernels/reference.h).
//
// For each op, L = sum_i w_i y_i with random weights w; the analytic gradient of the
// reference backward (fed dy = w) must match central differences of the reference
// forward, in double precision, on tiny sizes. The device ops are compared with these
// references in transformer_ops_test.cpp, so this closes the chain from the math to
// every device. Tolerance: relative error (||a - b|| / ||b||) <= 1e-7; central
// differences with step 1e-5 are accurate to ~1e-10 here.
#include "kernels/reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

namespace strata {
namespace {

namespace ref = kernels::reference;
using kernels::AttentionShape;
using kernels::CrossEntropyShape;
using kernels::EmbeddingShape;
using kernels::LayerNormShape;
using kernels::MatmulShape;
using kernels::WeightLayout;

constexpr double kStep = 1e-5;
constexpr double kTolerance = 1e-7;

std::vector<double> random_vector(size_t n, std::mt19937& rng, double scale = 1.0, double offset = 0.0) {
  std::normal_distribution<double> dist(offset, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  double diff = 0.0;
  double norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-300);
}

double weighted_sum(const std::vector<double>& y, const std::vector<double>& w) {
  double sum = 0.0;
  for (size_t i = 0; i < y.size(); ++i) sum += y[i] * w[i];
  return sum;
}

// Central differences of objective() with respect to each element of `input`.
std::vector<double> numeric_gradient(std::vector<double>& input, const std::function<double()>& objective) {
  std::vector<double> grad(input.size());
  for (size_t i = 0; i < input.size(); ++i) {
    const double saved = input[i];
    input[i] = saved + kStep;
    const double plus = objective();
    input[i] = saved - kStep;
    const double minus = objective();
    input[i] = saved;
    grad[i] = (plus - minus) / (2 * kStep);
  }
  return grad;
}

TEST(ReferenceGradientTest, Embedding) {
  std::mt19937 rng(1);
  const EmbeddingShape shape{.batch = 2, .seq_len = 3, .channels = 4, .vocab_size = 5, .max_positions = 4};
  const std::vector<int32_t> tokens{1, 4, 1, 0, 1, 3};
  auto wte = random_vector(5 * 4, rng);
  auto wpe = random_vector(3 * 4, rng);
  const auto w = random_vector(6 * 4, rng);
  auto objective = [&] {
    std::vector<double> out(6 * 4);
    ref::embedding_forward(shape, tokens.data(), wte.data(), wpe.data(), out.data());
    return weighted_sum(out, w);
  };
  std::vector<double> dwte(5 * 4);
  std::vector<double> dwpe(3 * 4);
  ref::embedding_backward(shape, tokens.data(), w.data(), dwte.data(), dwpe.data());
  EXPECT_LE(relative_error(dwte, numeric_gradient(wte, objective)), kTolerance);
  EXPECT_LE(relative_error(dwpe, numeric_gradient(wpe, objective)), kTolerance);
}

TEST(ReferenceGradientTest, LayerNorm) {
  std::mt19937 rng(2);
  const LayerNormShape shape{.rows = 3, .channels = 5};
  auto x = random_vector(15, rng, 2.0, 1.0);
  auto gamma = random_vector(5, rng);
  auto beta = random_vector(5, rng);
  const auto w = random_vector(15, rng);
  auto objective = [&] {
    std::vector<double> y(15);
    ref::layernorm_forward(shape, x.data(), gamma.data(), beta.data(), y.data(), nullptr, nullptr);
    return weighted_sum(y, w);
  };
  std::vector<double> dx(15), dgamma(5), dbeta(5);
  ref::layernorm_backward(shape, w.data(), x.data(), gamma.data(), dx.data(), dgamma.data(), dbeta.data());
  EXPECT_LE(relative_error(dx, numeric_gradient(x, objective)), kTolerance);
  EXPECT_LE(relative_error(dgamma, numeric_gradient(gamma, objective)), kTolerance);
  EXPECT_LE(relative_error(dbeta, numeric_gradient(beta, objective)), kTolerance);
}

TEST(ReferenceGradientTest, MatmulBothLayouts) {
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    std::mt19937 rng(3);
    const MatmulShape shape{.rows = 3, .in_features = 4, .out_features = 5, .layout = layout};
    auto x = random_vector(12, rng);
    auto weight = random_vector(20, rng);
    auto bias = random_vector(5, rng);
    const auto w = random_vector(15, rng);
    auto objective = [&] {
      std::vector<double> y(15);
      ref::matmul_forward(shape, x.data(), weight.data(), bias.data(), y.data());
      return weighted_sum(y, w);
    };
    std::vector<double> dx(12), dweight(20), dbias(5);
    ref::matmul_backward(shape, w.data(), x.data(), weight.data(), dx.data(), dweight.data(), dbias.data());
    EXPECT_LE(relative_error(dx, numeric_gradient(x, objective)), kTolerance);
    EXPECT_LE(relative_error(dweight, numeric_gradient(weight, objective)), kTolerance);
    EXPECT_LE(relative_error(dbias, numeric_gradient(bias, objective)), kTolerance);
  }
}

TEST(ReferenceGradientTest, Gelu) {
  std::mt19937 rng(4);
  auto x = random_vector(17, rng, 2.0);
  const auto w = random_vector(17, rng);
  auto objective = [&] {
    std::vector<double> y(17);
    ref::gelu_forward(x.data(), y.data(), 17);
    return weighted_sum(y, w);
  };
  std::vector<double> dx(17);
  ref::gelu_backward(w.data(), x.data(), dx.data(), 17);
  EXPECT_LE(relative_error(dx, numeric_gradient(x, objective)), kTolerance);
}

TEST(ReferenceGradientTest, Residual) {
  std::mt19937 rng(5);
  auto a = random_vector(9, rng);
  auto b = random_vector(9, rng);
  const auto w = random_vector(9, rng);
  auto objective = [&] {
    std::vector<double> out(9);
    ref::residual_forward(a.data(), b.data(), out.data(), 9);
    return weighted_sum(out, w);
  };
  std::vector<double> da(9), db(9);
  ref::residual_backward(w.data(), da.data(), db.data(), 9);
  EXPECT_LE(relative_error(da, numeric_gradient(a, objective)), kTolerance);
  EXPECT_LE(relative_error(db, numeric_gradient(b, objective)), kTolerance);
}

TEST(ReferenceGradientTest, CausalAttention) {
  std::mt19937 rng(6);
  const AttentionShape shape{.batch = 2, .seq_len = 4, .heads = 2, .head_dim = 3};
  const size_t channels = 6;
  auto qkv = random_vector(2 * 4 * 3 * channels, rng);
  const auto w = random_vector(2 * 4 * channels, rng);
  auto objective = [&] {
    std::vector<double> out(2 * 4 * channels);
    std::vector<double> lse(2 * 2 * 4);
    ref::attention_forward(shape, qkv.data(), out.data(), lse.data());
    return weighted_sum(out, w);
  };
  std::vector<double> dqkv(qkv.size());
  ref::attention_backward(shape, w.data(), qkv.data(), dqkv.data());
  EXPECT_LE(relative_error(dqkv, numeric_gradient(qkv, objective)), kTolerance);

  // Causality: the output at position t does not depend on inputs after t.
  std::vector<double> out(2 * 4 * channels), lse(16), changed(out.size());
  ref::attention_forward(shape, qkv.data(), out.data(), lse.data());
  qkv[3 * 3 * channels + 2 * channels + 1] += 1.0;  // v of the last position of batch 0
  ref::attention_forward(shape, qkv.data(), changed.data(), lse.data());
  for (size_t i = 0; i < 3 * channels; ++i) EXPECT_EQ(out[i], changed[i]) << i;
}

TEST(ReferenceGradientTest, CrossEntropyMeanWithIgnoredRow) {
  std::mt19937 rng(7);
  const CrossEntropyShape shape{.rows = 4, .vocab_size = 6, .ignore_index = -100};
  const std::vector<int32_t> targets{2, -100, 5, 0};
  auto logits = random_vector(24, rng, 2.0);
  auto objective = [&] {
    std::vector<double> losses(4);
    return ref::cross_entropy_forward(shape, logits.data(), targets.data(), losses.data(), nullptr);
  };
  std::vector<double> dlogits(24);
  ref::cross_entropy_backward(shape, logits.data(), targets.data(), 1.0 / 3.0, dlogits.data());
  EXPECT_LE(relative_error(dlogits, numeric_gradient(logits, objective)), kTolerance);
  for (size_t j = 0; j < 6; ++j) EXPECT_EQ(dlogits[6 + j], 0.0);
}

}  // namespace
}  // namespace strata
