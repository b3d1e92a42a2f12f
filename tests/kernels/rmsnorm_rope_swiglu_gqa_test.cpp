// RMSNorm, RoPE, SwiGLU and grouped-query attention (kernels/rmsnorm.h, rope.h, swiglu.h,
// gqa_attention.h): their scalar references checked against
// finite differences, then every op, forward and backward, on every device present
// against those references, in the manner of tests/kernels/transformer_ops_test.cpp.
//
// Targets: cpu/fp32 always; cuda/fp32 and cuda/bf16 when a GPU is present (skipped with
// the reason otherwise). Sizes are odd on purpose: rows 1, 7, 22, 55; head_dim 6, 10,
// 64; heads / kv_heads 4/2, 6/3, 4/1, 3/3; seq_len up to 97; element counts up to 4097.
// The reference runs on the inputs rounded to the device dtype, so only the op's own
// rounding is measured. Tolerances (relative error ||got - want|| / ||want|| over a
// tensor) as in transformer_ops_test.cpp: 2e-5 for fp32 runs; 2e-2 for bf16 outputs and
// 1e-2 for the fp32 outputs of bf16 runs.
#include "kernels/gqa_attention.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "engine/core/executor.h"
#include "engine/core/gpu.h"
#include "kernels/rmsnorm_rope_swiglu_cpu.h"
#include "kernels/transformer_ops_cpu.h"
#include "kernels/reference.h"
#include "tests/kernels/op_test_harness.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

namespace ref = kernels::reference;
using kernels::GqaAttentionShape;
using kernels::GradOptions;
using kernels::GradWrite;
using kernels::RmsNormShape;
using kernels::RopeScaling;
using kernels::RopeShape;
using test_ops::Harness;
using test_ops::plus;
using test_ops::random_vector;
using test_ops::relative_error;
using test_ops::rounded;
using test_ops::Target;
using test_ops::target_name;

// Finite differences of the references ------------------------------------------------
//
// L = sum_i w_i y_i with random w; the reference backward fed dy = w must match central
// differences (step 1e-5) of the reference forward, relative error <= 1e-7.

constexpr double kStep = 1e-5;
constexpr double kGradientTolerance = 1e-7;

double weighted_sum(const std::vector<double>& y, const std::vector<double>& w) {
  double sum = 0.0;
  for (size_t i = 0; i < y.size(); ++i) sum += y[i] * w[i];
  return sum;
}

std::vector<double> numeric_gradient(std::vector<double>& input, const std::function<double()>& objective) {
  std::vector<double> grad(input.size());
  for (size_t i = 0; i < input.size(); ++i) {
    const double saved = input[i];
    input[i] = saved + kStep;
    const double up = objective();
    input[i] = saved - kStep;
    const double down = objective();
    input[i] = saved;
    grad[i] = (up - down) / (2 * kStep);
  }
  return grad;
}

TEST(OpReferenceGradientTest, RmsNorm) {
  std::mt19937 rng(21);
  const RmsNormShape shape{.rows = 3, .channels = 7, .epsilon = 1e-5f};
  auto x = random_vector(21, rng, 1.5, 0.5);
  auto gamma = random_vector(7, rng, 0.5, 1.0);
  const auto w = random_vector(21, rng);
  auto objective = [&] {
    std::vector<double> y(21);
    ref::rmsnorm_forward(shape, x.data(), gamma.data(), y.data(), nullptr);
    return weighted_sum(y, w);
  };
  std::vector<double> dx(21), dgamma(7);
  ref::rmsnorm_backward(shape, w.data(), x.data(), gamma.data(), dx.data(), dgamma.data());
  EXPECT_LE(relative_error(dx, numeric_gradient(x, objective)), kGradientTolerance);
  EXPECT_LE(relative_error(dgamma, numeric_gradient(gamma, objective)), kGradientTolerance);
}

TEST(OpReferenceGradientTest, RopeOnStridedRowsLeavesTheRestAlone) {
  std::mt19937 rng(22);
  const RopeShape shape{.rows = 3, .heads = 2, .head_dim = 6, .row_stride = 15};
  const std::vector<int32_t> positions{5, 0, 41};
  const std::vector<float> inv_freq{1.0f, 0.1f, 0.01f};
  auto x = random_vector(45, rng);
  const auto w = random_vector(45, rng);
  auto objective = [&] {
    std::vector<double> y(45, 0.0);
    ref::rope_forward(shape, positions.data(), inv_freq.data(), x.data(), y.data());
    return weighted_sum(y, w);
  };
  std::vector<double> dx(45, 0.0);
  ref::rope_backward(shape, positions.data(), inv_freq.data(), w.data(), dx.data());
  EXPECT_LE(relative_error(dx, numeric_gradient(x, objective)), kGradientTolerance);
  // Position 0 is the identity; the last three elements of each row are not rotated.
  std::vector<double> y(45, 7.0);
  ref::rope_forward(shape, positions.data(), inv_freq.data(), x.data(), y.data());
  for (size_t c = 0; c < 12; ++c) EXPECT_DOUBLE_EQ(y[15 + c], x[15 + c]) << c;
  for (size_t r = 0; r < 3; ++r) {
    for (size_t c = 12; c < 15; ++c) EXPECT_EQ(y[r * 15 + c], 7.0);
  }
}

TEST(OpReferenceGradientTest, SwiGlu) {
  std::mt19937 rng(23);
  auto gate = random_vector(11, rng, 2.0);
  auto up = random_vector(11, rng);
  const auto w = random_vector(11, rng);
  auto objective = [&] {
    std::vector<double> out(11);
    ref::swiglu_forward(gate.data(), up.data(), out.data(), 11);
    return weighted_sum(out, w);
  };
  std::vector<double> dgate(11), dup(11);
  ref::swiglu_backward(w.data(), gate.data(), up.data(), dgate.data(), dup.data(), 11);
  EXPECT_LE(relative_error(dgate, numeric_gradient(gate, objective)), kGradientTolerance);
  EXPECT_LE(relative_error(dup, numeric_gradient(up, objective)), kGradientTolerance);
}

TEST(OpReferenceGradientTest, GroupedQueryAttentionOnStridedRows) {
  for (const auto& [heads, kv_heads] : {std::pair<size_t, size_t>{4, 2}, {3, 1}, {2, 2}}) {
    std::mt19937 rng(24);
    const size_t hd = 3;
    const GqaAttentionShape shape{.batch = 2, .seq_len = 4, .heads = heads, .kv_heads = kv_heads, .head_dim = hd,
                                  .q_stride = heads * hd + 2, .k_stride = kv_heads * hd + 1, .v_stride = 0};
    const size_t rows = 2 * 4;
    auto q = random_vector(rows * shape.q_stride, rng);
    auto k = random_vector(rows * shape.k_stride, rng);
    auto v = random_vector(rows * kv_heads * hd, rng);
    const auto w = random_vector(rows * heads * hd, rng);
    auto objective = [&] {
      std::vector<double> out(w.size()), lse(2 * shape.heads * 4);  // not `heads`: clang 14 cannot capture a structured binding
      ref::gqa_attention_forward(shape, q.data(), k.data(), v.data(), out.data(), lse.data());
      return weighted_sum(out, w);
    };
    std::vector<double> dq(q.size(), 0.0), dk(k.size(), 0.0), dv(v.size(), 0.0);
    ref::gqa_attention_backward(shape, w.data(), q.data(), k.data(), v.data(), dq.data(), dk.data(), dv.data());
    const std::string context = std::to_string(heads) + "/" + std::to_string(kv_heads);
    EXPECT_LE(relative_error(dq, numeric_gradient(q, objective)), kGradientTolerance) << context;
    EXPECT_LE(relative_error(dk, numeric_gradient(k, objective)), kGradientTolerance) << context;
    EXPECT_LE(relative_error(dv, numeric_gradient(v, objective)), kGradientTolerance) << context;
  }
}

// With kv_heads == heads on GPT-2's fused qkv, the GQA reference is the GPT-2 one.
TEST(OpReferenceGradientTest, GroupedQueryAttentionOfFusedQkvIsGpt2Attention) {
  std::mt19937 rng(25);
  const kernels::AttentionShape gpt2{.batch = 2, .seq_len = 5, .heads = 3, .head_dim = 4};
  const GqaAttentionShape shape = kernels::gqa_shape_of_fused_qkv(gpt2);
  const size_t channels = 12;
  const size_t rows = 10;
  const auto qkv = random_vector(rows * 3 * channels, rng);
  const auto dout = random_vector(rows * channels, rng);
  std::vector<double> want_out(rows * channels), want_lse(30), want_dqkv(qkv.size());
  ref::attention_forward(gpt2, qkv.data(), want_out.data(), want_lse.data());
  ref::attention_backward(gpt2, dout.data(), qkv.data(), want_dqkv.data());
  std::vector<double> out(rows * channels), lse(30), dqkv(qkv.size());
  ref::gqa_attention_forward(shape, qkv.data(), qkv.data() + channels, qkv.data() + 2 * channels, out.data(), lse.data());
  ref::gqa_attention_backward(shape, dout.data(), qkv.data(), qkv.data() + channels, qkv.data() + 2 * channels,
                              dqkv.data(), dqkv.data() + channels, dqkv.data() + 2 * channels);
  EXPECT_LE(relative_error(out, want_out), 1e-14);
  EXPECT_LE(relative_error(lse, want_lse), 1e-14);
  EXPECT_LE(relative_error(dqkv, want_dqkv), 1e-14);
}

// Inverse frequencies ---------------------------------------------------------------

// transformers 4.44's inv_freq (_compute_default_rope_parameters,
// _compute_linear_scaling_rope_parameters, _compute_llama3_parameters), computed with
// torch 1.13 in float32 by their steps written out in Python:
//   inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
//   linear: inv /= factor
//   llama3: wl = 2 * math.pi / inv
//           out = torch.where(wl > old / low, inv / factor, inv)
//           s = (old / wl - low) / (high - low)
//           smooth = (1 - s) * out / factor + s * out
//           out = torch.where(~(wl < old / high) * ~(wl > old / low), smooth, out)
//   printed with "%.9e" (round-trips float32).
// Our float32 evaluation follows the same operations and matches these bit for bit with
// glibc; the tolerance is 2 ulp (relative 2.4e-7) because another libm's powf, or
// torch's vectorized pow elsewhere, may round the last bit differently.
constexpr double kTwoUlp = 2.4e-7;

void expect_within_ulps(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], kTwoUlp * std::fabs(want[i])) << what << " index " << i;
  }
}

TEST(RopeInverseFrequenciesTest, Llama3ScalingMatchesTransformers) {
  // Llama 3.2: theta 500000, factor 32, low 1, high 4, original 8192, head_dim 64.
  // Indices 15-17 have wavelengths between 2048 and 8192 (the blended band).
  const std::vector<float> want{
      1.000000000e+00f, 6.636012793e-01f, 4.403666258e-01f, 2.922278345e-01f, 1.939227581e-01f, 1.286873817e-01f,
      8.539710194e-02f, 5.666961893e-02f, 3.760603070e-02f, 2.495540865e-02f, 1.656044088e-02f, 1.098952908e-02f,
      7.292665076e-03f, 4.839421250e-03f, 3.211446106e-03f, 1.290548011e-03f, 4.295567051e-04f, 9.708286234e-05f,
      1.946163866e-05f, 1.291476747e-05f, 8.570255886e-06f, 5.687232260e-06f, 3.774054449e-06f, 2.504467147e-06f,
      1.661967417e-06f, 1.102883630e-06f, 7.318749340e-07f, 4.856731266e-07f, 3.222932889e-07f, 2.138742303e-07f,
      1.419272024e-07f, 9.418306490e-08f};
  const RopeScaling llama3{.kind = RopeScaling::Kind::kLlama3, .factor = 32.0, .low_freq_factor = 1.0,
                           .high_freq_factor = 4.0, .original_max_position_embeddings = 8192};
  STRATA_ASSERT_OK_AND_ASSIGN(const auto got, kernels::rope_inverse_frequencies(64, 500000.0, llama3));
  expect_within_ulps(got, want, "llama3");

  // And from the definition in double, by hand: f_i = theta^(-2i/64); wavelength
  // 2 pi / f_i; below 2048 kept, above 8192 divided by 32, between blended with
  // s = (8192 / wavelength - 1) / 3: f (1 - s) / 32 + f s.
  for (size_t i = 0; i < 32; ++i) {
    const double f = std::pow(500000.0, -2.0 * static_cast<double>(i) / 64.0);
    const double wavelength = 2.0 * std::numbers::pi / f;
    double expected = f;
    if (wavelength > 8192.0) {
      expected = f / 32.0;
    } else if (wavelength >= 2048.0) {
      const double s = (8192.0 / wavelength - 1.0) / 3.0;
      expected = f * (1.0 - s) / 32.0 + f * s;
    }
    EXPECT_NEAR(got[i], expected, 2e-6 * expected) << "index " << i;  // float32 vs double: a few ulp of theta^x
  }
}

TEST(RopeInverseFrequenciesTest, DefaultAndLinearScalingMatchTransformers) {
  STRATA_ASSERT_OK_AND_ASSIGN(const auto plain, kernels::rope_inverse_frequencies(10, 10000.0, RopeScaling{}));
  expect_within_ulps(plain, {1.000000000e+00f, 1.584893167e-01f, 2.511886321e-02f, 3.981070593e-03f, 6.309573073e-04f},
                     "default");
  const RopeScaling linear{.kind = RopeScaling::Kind::kLinear, .factor = 4.0};
  STRATA_ASSERT_OK_AND_ASSIGN(const auto scaled, kernels::rope_inverse_frequencies(16, 10000.0, linear));
  expect_within_ulps(scaled,
                     {2.500000000e-01f, 7.905694097e-02f, 2.500000037e-02f, 7.905694656e-03f, 2.499999944e-03f,
                      7.905694656e-04f, 2.500000119e-04f, 7.905694656e-05f},
                     "linear");
}

TEST(RopeInverseFrequenciesTest, BadArgumentsAreRefused) {
  EXPECT_EQ(kernels::rope_inverse_frequencies(7, 10000.0, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(kernels::rope_inverse_frequencies(0, 10000.0, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(kernels::rope_inverse_frequencies(8, -1.0, {}).status().code(), StatusCode::kInvalidArgument);
  const RopeScaling zero_factor{.kind = RopeScaling::Kind::kLinear, .factor = 0.0};
  EXPECT_EQ(kernels::rope_inverse_frequencies(8, 10000.0, zero_factor).status().code(), StatusCode::kInvalidArgument);
  const RopeScaling inverted{.kind = RopeScaling::Kind::kLlama3, .factor = 8.0, .low_freq_factor = 4.0,
                             .high_freq_factor = 1.0};
  const auto status = kernels::rope_inverse_frequencies(8, 10000.0, inverted).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.to_string().find("low_freq_factor"), std::string::npos) << status.to_string();
}

// Every device ------------------------------------------------------------------------

#define EXPECT_CLOSE(got, want, tolerance, what) \
  EXPECT_LE(relative_error(got, want), tolerance) << (what) << " on " << context_

class NormRopeSwigluAttentionTest : public ::testing::TestWithParam<Target> {
 protected:
  void SetUp() override {
    if (GetParam().kind == DeviceKind::kCuda && !gpu_available()) {
      GTEST_SKIP() << "no GPU: " << discover_gpus().reason;
    }
    harness_ = std::make_unique<Harness>(GetParam());
  }
  Harness& h() { return *harness_; }
  DType dtype() const { return GetParam().dtype; }

  std::unique_ptr<Harness> harness_;
  std::string context_;
};

TEST_P(NormRopeSwigluAttentionTest, RmsNorm) {
  std::mt19937 rng(31);
  for (const size_t rows : {1, 7, 22, 55}) {
    for (const size_t channels : {6, 55, 64}) {
      context_ = "rows " + std::to_string(rows) + " channels " + std::to_string(channels);
      const RmsNormShape shape{.rows = rows, .channels = channels, .epsilon = 1e-5f};
      const size_t n = rows * channels;
      const auto x = rounded(random_vector(n, rng, 2.0, 0.5), dtype());
      const auto gamma = rounded(random_vector(channels, rng, 0.5, 1.0), dtype());
      const auto dy = rounded(random_vector(n, rng), dtype());
      std::vector<double> want_y(n), want_rstd(rows), want_dx(n), want_dgamma(channels);
      ref::rmsnorm_forward(shape, x.data(), gamma.data(), want_y.data(), want_rstd.data());
      ref::rmsnorm_backward(shape, dy.data(), x.data(), gamma.data(), want_dx.data(), want_dgamma.data());

      auto d_x = h().put(x);
      auto d_gamma = h().put(gamma);
      auto d_y = h().nans(n);
      auto d_rstd = h().nans(rows, DType::kFloat32);
      STRATA_ASSERT_OK(kernels::rmsnorm_forward(h().stream(), shape, dtype(), d_x.data(), d_gamma.data(), d_y.data(),
                                                d_rstd.as<float>()));
      EXPECT_CLOSE(h().get(d_y, n), want_y, h().tolerance(), "rmsnorm y");
      EXPECT_CLOSE(h().get(d_rstd, rows, DType::kFloat32), want_rstd, 1e-5, "rmsnorm rstd");

      auto d_dy = h().put(dy);
      for (GradWrite mode : {GradWrite::kOverwrite, GradWrite::kAccumulate}) {
        const bool accumulate = mode == GradWrite::kAccumulate;
        const auto init_dx = rounded(random_vector(n, rng), dtype());
        const auto init_dgamma = random_vector(channels, rng);
        auto d_dx = accumulate ? h().put(init_dx) : h().nans(n);
        auto d_dgamma = accumulate ? h().put(init_dgamma, DType::kFloat32) : h().nans(channels, DType::kFloat32);
        STRATA_ASSERT_OK(kernels::rmsnorm_backward(h().stream(), shape, dtype(), d_dy.data(), d_x.data(), d_gamma.data(),
                                                   d_rstd.as<float>(), d_dx.data(), d_dgamma.as<float>(),
                                                   GradOptions{.input_grad = mode, .param_grad = mode}));
        EXPECT_CLOSE(h().get(d_dx, n), accumulate ? plus(init_dx, want_dx) : want_dx, h().tolerance(), "rmsnorm dx");
        EXPECT_CLOSE(h().get(d_dgamma, channels, DType::kFloat32), accumulate ? plus(init_dgamma, want_dgamma) : want_dgamma,
                     h().fp32_tolerance(), "rmsnorm dgamma");
      }
    }
  }
}

TEST_P(NormRopeSwigluAttentionTest, RopeOnStridedRowsInPlaceAndAccumulated) {
  std::mt19937 rng(32);
  struct Case {
    size_t rows, heads, head_dim, extra;  // extra: elements past the heads in each row
  };
  for (const Case& c : {Case{1, 1, 6, 0}, Case{7, 4, 10, 3}, Case{22, 3, 64, 0}, Case{55, 2, 6, 5}}) {
    context_ = "rows " + std::to_string(c.rows) + " heads " + std::to_string(c.heads) + " head_dim " +
               std::to_string(c.head_dim) + " extra " + std::to_string(c.extra);
    const size_t stride = c.heads * c.head_dim + c.extra;
    const RopeShape shape{.rows = c.rows, .heads = c.heads, .head_dim = c.head_dim, .row_stride = c.extra > 0 ? stride : 0};
    const size_t n = c.rows * stride;
    std::vector<int32_t> positions(c.rows);
    for (size_t r = 0; r < c.rows; ++r) positions[r] = static_cast<int32_t>((r * 37) % 101);  // packed: restarts
    STRATA_ASSERT_OK_AND_ASSIGN(auto inv_freq, kernels::rope_inverse_frequencies(c.head_dim, 10000.0, {}));
    const auto x = rounded(random_vector(n, rng), dtype());
    std::vector<double> want_y = x, want_dx = x;  // the elements past the heads stay as they are
    ref::rope_forward(shape, positions.data(), inv_freq.data(), x.data(), want_y.data());
    ref::rope_backward(shape, positions.data(), inv_freq.data(), x.data(), want_dx.data());

    auto d_positions = h().put_ints(positions);
    auto d_inv_freq = h().put(std::vector<double>(inv_freq.begin(), inv_freq.end()), DType::kFloat32);
    auto d_x = h().put(x);
    auto d_y = h().put(x);
    STRATA_ASSERT_OK(kernels::rope_forward(h().stream(), shape, dtype(), d_positions.as<int32_t>(), d_inv_freq.as<float>(),
                                           d_x.data(), d_y.data()));
    EXPECT_CLOSE(h().get(d_y, n), want_y, h().tolerance(), "rope y");
    // In place (y aliases x), as a model rotates q and k inside its qkv buffer.
    auto d_inplace = h().put(x);
    STRATA_ASSERT_OK(kernels::rope_forward(h().stream(), shape, dtype(), d_positions.as<int32_t>(), d_inv_freq.as<float>(),
                                           d_inplace.data(), d_inplace.data()));
    EXPECT_EQ(h().get_bytes(d_inplace), h().get_bytes(d_y)) << "rope in place on " << context_;

    // Backward: the transpose, in place and accumulated.
    auto d_dx = h().put(x);
    STRATA_ASSERT_OK(kernels::rope_backward(h().stream(), shape, dtype(), d_positions.as<int32_t>(),
                                            d_inv_freq.as<float>(), d_dx.data(), d_dx.data(), GradWrite::kOverwrite));
    EXPECT_CLOSE(h().get(d_dx, n), want_dx, h().tolerance(), "rope dx");
    const auto init = rounded(random_vector(n, rng), dtype());
    std::vector<double> want_accumulated = init;
    for (size_t r = 0; r < c.rows; ++r) {
      for (size_t i = 0; i < c.heads * c.head_dim; ++i) want_accumulated[r * stride + i] += want_dx[r * stride + i];
    }
    auto d_acc = h().put(init);
    STRATA_ASSERT_OK(kernels::rope_backward(h().stream(), shape, dtype(), d_positions.as<int32_t>(),
                                            d_inv_freq.as<float>(), d_x.data(), d_acc.data(), GradWrite::kAccumulate));
    EXPECT_CLOSE(h().get(d_acc, n), want_accumulated, h().tolerance(), "rope dx accumulated");
  }
}

TEST_P(NormRopeSwigluAttentionTest, SwiGlu) {
  std::mt19937 rng(33);
  for (const size_t count : {1, 7, 22, 55, 4097}) {
    context_ = "count " + std::to_string(count);
    const auto gate = rounded(random_vector(count, rng, 3.0), dtype());
    const auto up = rounded(random_vector(count, rng), dtype());
    const auto dout = rounded(random_vector(count, rng), dtype());
    std::vector<double> want_out(count), want_dgate(count), want_dup(count);
    ref::swiglu_forward(gate.data(), up.data(), want_out.data(), count);
    ref::swiglu_backward(dout.data(), gate.data(), up.data(), want_dgate.data(), want_dup.data(), count);

    auto d_gate = h().put(gate);
    auto d_up = h().put(up);
    auto d_out = h().nans(count);
    STRATA_ASSERT_OK(kernels::swiglu_forward(h().stream(), dtype(), d_gate.data(), d_up.data(), d_out.data(), count));
    EXPECT_CLOSE(h().get(d_out, count), want_out, h().tolerance(), "swiglu out");

    auto d_dout = h().put(dout);
    for (GradWrite mode : {GradWrite::kOverwrite, GradWrite::kAccumulate}) {
      const bool accumulate = mode == GradWrite::kAccumulate;
      const auto init_dgate = rounded(random_vector(count, rng), dtype());
      const auto init_dup = rounded(random_vector(count, rng), dtype());
      auto d_dgate = accumulate ? h().put(init_dgate) : h().nans(count);
      auto d_dup = accumulate ? h().put(init_dup) : h().nans(count);
      STRATA_ASSERT_OK(kernels::swiglu_backward(h().stream(), dtype(), d_dout.data(), d_gate.data(), d_up.data(),
                                                d_dgate.data(), d_dup.data(), count, mode));
      EXPECT_CLOSE(h().get(d_dgate, count), accumulate ? plus(init_dgate, want_dgate) : want_dgate, h().tolerance(),
                   "swiglu dgate");
      EXPECT_CLOSE(h().get(d_dup, count), accumulate ? plus(init_dup, want_dup) : want_dup, h().tolerance(), "swiglu dup");
    }
  }
}

struct AttentionCase {
  size_t batch, seq_len, heads, kv_heads, head_dim;
  bool fused;  // q, k, v inside one row of (heads + 2 kv_heads) head_dim, as a fused qkv projection writes them
};

std::string describe(const AttentionCase& c) {
  return "B=" + std::to_string(c.batch) + " T=" + std::to_string(c.seq_len) + " H=" + std::to_string(c.heads) +
         " KV=" + std::to_string(c.kv_heads) + " hd=" + std::to_string(c.head_dim) + (c.fused ? " fused" : " separate");
}

TEST_P(NormRopeSwigluAttentionTest, GroupedQueryAttention) {
  std::mt19937 rng(34);
  for (const AttentionCase& c : {AttentionCase{2, 7, 4, 2, 6, false}, AttentionCase{1, 22, 6, 3, 10, true},
                                AttentionCase{2, 97, 4, 1, 10, false}, AttentionCase{1, 55, 3, 3, 64, true},
                                AttentionCase{1, 1, 4, 2, 6, false}}) {
    context_ = describe(c);
    const size_t rows = c.batch * c.seq_len;
    const size_t q_width = c.heads * c.head_dim;
    const size_t kv_width = c.kv_heads * c.head_dim;
    // Fused: one buffer with rows q | k | v; separate: three dense buffers.
    const size_t row = c.fused ? q_width + 2 * kv_width : 0;
    const GqaAttentionShape shape{.batch = c.batch, .seq_len = c.seq_len, .heads = c.heads, .kv_heads = c.kv_heads,
                                  .head_dim = c.head_dim, .q_stride = row, .k_stride = row, .v_stride = row};
    const size_t q_count = c.fused ? rows * row : rows * q_width;
    const size_t kv_count = c.fused ? 0 : rows * kv_width;
    const auto q = rounded(random_vector(q_count, rng), dtype());  // the whole fused buffer when fused
    const auto k = rounded(random_vector(kv_count, rng), dtype());
    const auto v = rounded(random_vector(kv_count, rng), dtype());
    const auto dout = rounded(random_vector(rows * q_width, rng), dtype());
    const double* q_ptr = q.data();
    const double* k_ptr = c.fused ? q.data() + q_width : k.data();
    const double* v_ptr = c.fused ? q.data() + q_width + kv_width : v.data();
    std::vector<double> want_out(rows * q_width), want_lse(c.batch * c.heads * c.seq_len);
    ref::gqa_attention_forward(shape, q_ptr, k_ptr, v_ptr, want_out.data(), want_lse.data());
    std::vector<double> want_dq(q_count, 0.0), want_dk(kv_count, 0.0), want_dv(kv_count, 0.0);
    double* dk_ptr = c.fused ? want_dq.data() + q_width : want_dk.data();
    double* dv_ptr = c.fused ? want_dq.data() + q_width + kv_width : want_dv.data();
    ref::gqa_attention_backward(shape, dout.data(), q_ptr, k_ptr, v_ptr, want_dq.data(), dk_ptr, dv_ptr);

    const size_t workspace_bytes = kernels::gqa_attention_workspace_bytes(shape, dtype(), h().device().kind());
    DeviceBuffer workspace;
    if (workspace_bytes > 0) {
      STRATA_ASSERT_OK_AND_ASSIGN(workspace, h().device().allocate(workspace_bytes, "attention workspace"));
    }
    const size_t element = dtype_size(dtype());
    auto d_q = h().put(q);
    auto d_k = h().put(k.empty() ? std::vector<double>(1) : k);
    auto d_v = h().put(v.empty() ? std::vector<double>(1) : v);
    auto in_q = [&](size_t offset) { return static_cast<char*>(d_q.data()) + offset * element; };
    const void* k_in = c.fused ? in_q(q_width) : d_k.data();
    const void* v_in = c.fused ? in_q(q_width + kv_width) : d_v.data();
    auto d_out = h().nans(rows * q_width);
    auto d_lse = h().nans(want_lse.size(), DType::kFloat32);
    STRATA_ASSERT_OK(kernels::gqa_attention_forward(h().stream(), h().blas(), shape, dtype(), d_q.data(), k_in, v_in,
                                                    d_out.data(), d_lse.as<float>(), workspace.data(), workspace_bytes));
    EXPECT_CLOSE(h().get(d_out, want_out.size()), want_out, h().tolerance(), "attention out");
    EXPECT_CLOSE(h().get(d_lse, want_lse.size(), DType::kFloat32), want_lse, h().fp32_tolerance(), "attention lse");

    auto d_dout = h().put(dout);
    for (GradWrite mode : {GradWrite::kOverwrite, GradWrite::kAccumulate}) {
      const bool accumulate = mode == GradWrite::kAccumulate;
      // Fused gradients start from random values everywhere (overwrite must still write
      // every element, accumulate add to every one); separate ones from NaN on overwrite.
      const auto init_q = rounded(random_vector(q_count, rng), dtype());
      const auto init_k = rounded(random_vector(std::max<size_t>(kv_count, 1), rng), dtype());
      const auto init_v = rounded(random_vector(std::max<size_t>(kv_count, 1), rng), dtype());
      auto d_dq = (accumulate || c.fused) ? h().put(init_q) : h().nans(q_count);
      auto d_dk = accumulate ? h().put(init_k) : h().nans(init_k.size());
      auto d_dv = accumulate ? h().put(init_v) : h().nans(init_v.size());
      auto in_dq = [&](size_t offset) { return static_cast<char*>(d_dq.data()) + offset * element; };
      void* dk_out = c.fused ? in_dq(q_width) : d_dk.data();
      void* dv_out = c.fused ? in_dq(q_width + kv_width) : d_dv.data();
      STRATA_ASSERT_OK(kernels::gqa_attention_backward(h().stream(), h().blas(), shape, dtype(), d_dout.data(),
                                                       d_q.data(), k_in, v_in, d_lse.as<float>(), d_dq.data(), dk_out,
                                                       dv_out, workspace.data(), workspace_bytes, mode));
      const char* what = accumulate ? "attention grads accumulated" : "attention grads";
      EXPECT_CLOSE(h().get(d_dq, q_count), accumulate ? plus(init_q, want_dq) : want_dq, h().tolerance(), what);
      if (!c.fused) {
        EXPECT_CLOSE(h().get(d_dk, kv_count), accumulate ? plus(init_k, want_dk) : want_dk, h().tolerance(), what);
        EXPECT_CLOSE(h().get(d_dv, kv_count), accumulate ? plus(init_v, want_dv) : want_dv, h().tolerance(), what);
      }
      if (!accumulate) {
        auto again = (c.fused) ? h().put(init_q) : h().nans(q_count);
        auto again_k = h().nans(init_k.size());
        auto again_v = h().nans(init_v.size());
        auto in_again = [&](size_t offset) { return static_cast<char*>(again.data()) + offset * element; };
        STRATA_ASSERT_OK(kernels::gqa_attention_backward(
            h().stream(), h().blas(), shape, dtype(), d_dout.data(), d_q.data(), k_in, v_in, d_lse.as<float>(),
            again.data(), c.fused ? in_again(q_width) : again_k.data(), c.fused ? in_again(q_width + kv_width) : again_v.data(),
            workspace.data(), workspace_bytes, mode));
        EXPECT_EQ(h().get_bytes(again), h().get_bytes(d_dq)) << "attention backward is deterministic on " << context_;
      }
    }
  }
}

// Fused-qkv rows hold the fused layout above: the fused case of GroupedQueryAttention
// checks that q | k | v slices written by the backward leave nothing unwritten. Here the
// elements around strided rows must survive: q rows with padding past the heads.
TEST_P(NormRopeSwigluAttentionTest, AttentionLeavesPaddingOfStridedRowsAlone) {
  std::mt19937 rng(35);
  const GqaAttentionShape shape{.batch = 1, .seq_len = 9, .heads = 4, .kv_heads = 2, .head_dim = 6, .q_stride = 29,
                                .k_stride = 0, .v_stride = 0};
  const size_t q_count = 9 * 29;
  const size_t kv_count = 9 * 12;
  const auto q = rounded(random_vector(q_count, rng), dtype());
  const auto k = rounded(random_vector(kv_count, rng), dtype());
  const auto v = rounded(random_vector(kv_count, rng), dtype());
  const auto dout = rounded(random_vector(9 * 24, rng), dtype());
  const size_t workspace_bytes = kernels::gqa_attention_workspace_bytes(shape, dtype(), h().device().kind());
  DeviceBuffer workspace;
  if (workspace_bytes > 0) {
    STRATA_ASSERT_OK_AND_ASSIGN(workspace, h().device().allocate(workspace_bytes, "attention workspace"));
  }
  auto d_q = h().put(q);
  auto d_k = h().put(k);
  auto d_v = h().put(v);
  auto d_out = h().nans(9 * 24);
  auto d_lse = h().nans(36, DType::kFloat32);
  STRATA_ASSERT_OK(kernels::gqa_attention_forward(h().stream(), h().blas(), shape, dtype(), d_q.data(), d_k.data(),
                                                  d_v.data(), d_out.data(), d_lse.as<float>(), workspace.data(),
                                                  workspace_bytes));
  auto d_dout = h().put(dout);
  const std::vector<double> sentinel(q_count, 3.0);
  auto d_dq = h().put(sentinel);
  auto d_dk = h().nans(kv_count);
  auto d_dv = h().nans(kv_count);
  STRATA_ASSERT_OK(kernels::gqa_attention_backward(h().stream(), h().blas(), shape, dtype(), d_dout.data(), d_q.data(),
                                                   d_k.data(), d_v.data(), d_lse.as<float>(), d_dq.data(), d_dk.data(),
                                                   d_dv.data(), workspace.data(), workspace_bytes, GradWrite::kOverwrite));
  const auto dq = h().get(d_dq, q_count);
  for (size_t t = 0; t < 9; ++t) {
    for (size_t c = 24; c < 29; ++c) EXPECT_EQ(dq[t * 29 + c], 3.0) << "padding of row " << t;
  }
}

TEST_P(NormRopeSwigluAttentionTest, EmbeddingWithoutPositionTable) {
  std::mt19937 rng(36);
  const kernels::EmbeddingShape shape{.batch = 2, .seq_len = 7, .channels = 22, .vocab_size = 13, .max_positions = 0};
  std::vector<int32_t> tokens(14);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 5) % 13);
  const auto wte = rounded(random_vector(13 * 22, rng), dtype());
  const auto dout = rounded(random_vector(14 * 22, rng), dtype());
  std::vector<double> want_out(14 * 22), want_dwte(13 * 22);
  ref::embedding_forward(shape, tokens.data(), wte.data(), nullptr, want_out.data());
  ref::embedding_backward(shape, tokens.data(), dout.data(), want_dwte.data(), nullptr);
  auto d_tokens = h().put_ints(tokens);
  auto d_wte = h().put(wte);
  auto d_out = h().nans(want_out.size());
  STRATA_ASSERT_OK(kernels::embedding_forward(h().stream(), shape, dtype(), d_tokens.as<int32_t>(), d_wte.data(), nullptr,
                                              d_out.data()));
  EXPECT_EQ(h().get(d_out, want_out.size()), want_out);  // a copy of the rows, exactly
  auto d_dout = h().put(dout);
  auto d_dwte = h().nans(want_dwte.size(), DType::kFloat32);
  STRATA_ASSERT_OK(kernels::embedding_backward(h().stream(), shape, dtype(), d_tokens.as<int32_t>(), d_dout.data(),
                                               d_dwte.as<float>(), nullptr, GradWrite::kOverwrite));
  EXPECT_LE(relative_error(h().get(d_dwte, want_dwte.size(), DType::kFloat32), want_dwte), h().fp32_tolerance());
}

TEST_P(NormRopeSwigluAttentionTest, BadShapesAreRefusedBeforeAnythingIsEnqueued) {
  Harness& harness = h();
  STRATA_ASSERT_OK_AND_ASSIGN(auto buffer, harness.device().allocate(4096, "scratch"));
  const GqaAttentionShape uneven{.batch = 1, .seq_len = 4, .heads = 3, .kv_heads = 2, .head_dim = 4};
  const size_t workspace_bytes = kernels::gqa_attention_workspace_bytes(uneven, dtype(), GetParam().kind);
  Status status = kernels::gqa_attention_forward(harness.stream(), harness.blas(), uneven, dtype(), buffer.data(),
                                                 buffer.data(), buffer.data(), buffer.data(), buffer.as<float>(),
                                                 buffer.data(), std::max<size_t>(workspace_bytes, 4096));
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.to_string();
  EXPECT_NE(status.to_string().find("not a multiple of kv_heads"), std::string::npos) << status.to_string();
  const GqaAttentionShape narrow{.batch = 1, .seq_len = 4, .heads = 2, .kv_heads = 1, .head_dim = 4, .q_stride = 7};
  status = kernels::gqa_attention_forward(harness.stream(), harness.blas(), narrow, dtype(), buffer.data(), buffer.data(),
                                          buffer.data(), buffer.data(), buffer.as<float>(), buffer.data(), 4096);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.to_string();
  // The CUDA attention kernels stop at head_dim 128; the CPU twin has no limit.
  if (GetParam().kind == DeviceKind::kCuda) {
    const GqaAttentionShape wide{.batch = 1, .seq_len = 1, .heads = 1, .kv_heads = 1, .head_dim = 256};
    status = kernels::gqa_attention_forward(harness.stream(), harness.blas(), wide, dtype(), buffer.data(), buffer.data(),
                                            buffer.data(), buffer.data(), buffer.as<float>(), buffer.data(), 4096);
    EXPECT_EQ(status.code(), StatusCode::kUnimplemented) << status.to_string();
    EXPECT_NE(status.to_string().find("head_dim 256"), std::string::npos) << status.to_string();
  }
  const RopeShape odd{.rows = 2, .heads = 1, .head_dim = 5};
  status = kernels::rope_forward(harness.stream(), odd, dtype(), buffer.as<int32_t>(), buffer.as<float>(), buffer.data(),
                                 buffer.data());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.to_string();
  status = kernels::swiglu_backward(harness.stream(), dtype(), buffer.data(), buffer.data(), buffer.data(), buffer.data(),
                                    nullptr, 8, GradWrite::kOverwrite);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.to_string();
  STRATA_EXPECT_OK(harness.stream().synchronize());
}

INSTANTIATE_TEST_SUITE_P(Targets, NormRopeSwigluAttentionTest,
                         ::testing::Values(Target{DeviceKind::kCpu, DType::kFloat32},
                                           Target{DeviceKind::kCuda, DType::kFloat32},
                                           Target{DeviceKind::kCuda, DType::kBFloat16}),
                         target_name);

// The CPU twins give the same bits whatever the executor's thread count.
TEST(NormRopeSwigluAttentionCpuTest, ResultsDoNotDependOnTheThreadCount) {
  std::mt19937 rng(37);
  auto floats = [&](size_t n) {
    std::vector<float> v(n);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (auto& x : v) x = dist(rng);
    return v;
  };
  // 194 rows of 200: rmsnorm and rope split into 3 chunks of rows; swiglu's 38800
  // elements into 3 chunks; attention into (batch, head) and (batch, KV head) tasks on
  // q rows strided inside x.
  const size_t rows = 2 * 97;
  const size_t width = 200;
  const RmsNormShape norm{.rows = rows, .channels = width};
  const RopeShape rope{.rows = rows, .heads = 10, .head_dim = 20, .row_stride = 0};
  const GqaAttentionShape attention{.batch = 2, .seq_len = 97, .heads = 6, .kv_heads = 2, .head_dim = 12,
                                    .q_stride = width, .k_stride = 0, .v_stride = 0};
  const auto x = floats(rows * width);
  const auto dy = floats(rows * width);
  const auto gamma = floats(width);
  const auto k = floats(rows * 24);
  const auto v = floats(rows * 24);
  std::vector<int32_t> positions(rows);
  for (size_t r = 0; r < rows; ++r) positions[r] = static_cast<int32_t>(r % 97);
  STRATA_ASSERT_OK_AND_ASSIGN(const auto inv_freq, kernels::rope_inverse_frequencies(20, 10000.0, {}));

  struct Results {
    std::vector<float> y, rstd, dx, dgamma, rope_y, rope_dx, swiglu, dgate, dup, out, lse, dq, dk, dv;
  };
  auto run = [&](int threads) {
    auto executor = make_executor({.threads = threads});
    STRATA_CHECK_OK(executor);
    Executor& ex = **executor;
    const size_t n = x.size();
    Results r{.y = std::vector<float>(n), .rstd = std::vector<float>(rows), .dx = std::vector<float>(n),
              .dgamma = std::vector<float>(width), .rope_y = std::vector<float>(n), .rope_dx = std::vector<float>(n),
              .swiglu = std::vector<float>(n), .dgate = std::vector<float>(n), .dup = std::vector<float>(n),
              .out = std::vector<float>(rows * 72), .lse = std::vector<float>(2 * 6 * 97), .dq = std::vector<float>(n),
              .dk = std::vector<float>(k.size()), .dv = std::vector<float>(v.size())};
    kernels::cpu::rmsnorm_forward(ex, norm, x.data(), gamma.data(), r.y.data(), r.rstd.data());
    kernels::cpu::rmsnorm_backward(ex, norm, dy.data(), x.data(), gamma.data(), r.rstd.data(), r.dx.data(), r.dgamma.data(),
                                   {});
    kernels::cpu::rope_forward(ex, rope, positions.data(), inv_freq.data(), x.data(), r.rope_y.data());
    kernels::cpu::rope_backward(ex, rope, positions.data(), inv_freq.data(), dy.data(), r.rope_dx.data(),
                                GradWrite::kOverwrite);
    kernels::cpu::swiglu_forward(ex, x.data(), dy.data(), r.swiglu.data(), n);
    kernels::cpu::swiglu_backward(ex, dy.data(), x.data(), dy.data(), r.dgate.data(), r.dup.data(), n,
                                  GradWrite::kOverwrite);
    kernels::cpu::gqa_attention_forward(ex, attention, x.data(), k.data(), v.data(), r.out.data(), r.lse.data());
    kernels::cpu::gqa_attention_backward(ex, attention, dy.data(), x.data(), k.data(), v.data(), r.lse.data(), r.dq.data(),
                                         r.dk.data(), r.dv.data(), GradWrite::kOverwrite);
    return r;
  };
  const Results one = run(1);
  const Results three = run(3);
  auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same_bits(one.y, three.y));
  EXPECT_TRUE(same_bits(one.rstd, three.rstd));
  EXPECT_TRUE(same_bits(one.dx, three.dx));
  EXPECT_TRUE(same_bits(one.dgamma, three.dgamma));
  EXPECT_TRUE(same_bits(one.rope_y, three.rope_y));
  EXPECT_TRUE(same_bits(one.rope_dx, three.rope_dx));
  EXPECT_TRUE(same_bits(one.swiglu, three.swiglu));
  EXPECT_TRUE(same_bits(one.dgate, three.dgate));
  EXPECT_TRUE(same_bits(one.dup, three.dup));
  EXPECT_TRUE(same_bits(one.out, three.out));
  EXPECT_TRUE(same_bits(one.lse, three.lse));
  EXPECT_TRUE(same_bits(one.dq, three.dq));
  EXPECT_TRUE(same_bits(one.dk, three.dk));
  EXPECT_TRUE(same_bits(one.dv, three.dv));
}

}  // namespace
}  // namespace strata
