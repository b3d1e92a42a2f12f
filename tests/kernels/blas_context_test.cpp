// BlasContext: the GEMM precision policy (strata.matmul_precision, through the device) and
// the cuBLAS workspace it takes from the device budget.
#include "kernels/blas_context.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "engine/core/gpu.h"
#include "kernels/transformer_ops.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

using kernels::BlasContext;
using kernels::BlasOptions;

TEST(BlasContextTest, FollowsTheDevicePrecisionUnlessTheOptionsSetOne) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, create_cpu_device({.budget_bytes = size_t{8} << 20}));
  STRATA_ASSERT_OK_AND_ASSIGN(BlasContext from_device, BlasContext::create(*device));
  EXPECT_EQ(from_device.matmul_precision(), MatmulPrecision::kFp32);
  STRATA_ASSERT_OK_AND_ASSIGN(BlasContext pinned, BlasContext::create(*device, {.matmul_precision = MatmulPrecision::kTf32}));
  EXPECT_EQ(pinned.matmul_precision(), MatmulPrecision::kTf32);
}

// y = x . w at [256 x 512] . [512 x 384] in fp32 on a GPU of each precision, against a
// float64 product: IEEE fp32 lands near 1e-7, TF32 near 3e-4, bf16 operands near 2e-3, so
// each policy shows in the error (bf16 is a permission: cuBLAS may run it as TF32). The context also takes its 32 MiB cuBLAS workspace (NVIDIA's
// advice for Hopper) from the device budget.
class BlasPrecisionTest : public ::testing::TestWithParam<MatmulPrecision> {};

TEST_P(BlasPrecisionTest, Fp32GemmsRunAtTheDevicePrecision) {
  if (!gpu_available()) GTEST_SKIP() << "no GPU: " << discover_gpus().reason;
  const MatmulPrecision precision = GetParam();
  const size_t rows = 256, in = 512, out = 384;
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, create_cuda_device({.budget_bytes = size_t{256} << 20, .matmul_precision = precision}));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("gemm"));
  const size_t before = device->memory_stats().in_use_bytes;
  STRATA_ASSERT_OK_AND_ASSIGN(BlasContext blas, BlasContext::create(*device));
  EXPECT_GE(device->memory_stats().in_use_bytes - before, size_t{32} << 20) << "the cuBLAS workspace";
  EXPECT_EQ(blas.matmul_precision(), precision);

  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(rows * in), w(in * out), y(rows * out, std::nanf(""));
  for (auto& v : x) v = dist(rng);
  for (auto& v : w) v = dist(rng);
  STRATA_ASSERT_OK_AND_ASSIGN(auto dx, device->allocate(x.size() * 4, "x"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto dw, device->allocate(w.size() * 4, "w"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto dy, device->allocate(y.size() * 4, "y"));
  STRATA_ASSERT_OK(device->copy_async(dx.data(), x.data(), x.size() * 4, CopyKind::kHostToDevice, *stream));
  STRATA_ASSERT_OK(device->copy_async(dw.data(), w.data(), w.size() * 4, CopyKind::kHostToDevice, *stream));
  STRATA_ASSERT_OK(device->copy_async(dy.data(), y.data(), y.size() * 4, CopyKind::kHostToDevice, *stream));  // poison
  const kernels::MatmulShape shape{.rows = rows, .in_features = in, .out_features = out, .layout = kernels::WeightLayout::kInOut};
  STRATA_ASSERT_OK(kernels::matmul_forward(*stream, blas, shape, DType::kFloat32, dx.data(), dw.data(), nullptr, dy.data()));
  STRATA_ASSERT_OK(device->copy_async(y.data(), dy.data(), y.size() * 4, CopyKind::kDeviceToHost, *stream));
  STRATA_ASSERT_OK(stream->synchronize());

  double diff = 0.0, norm = 0.0;
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < out; ++c) {
      double want = 0.0;
      for (size_t k = 0; k < in; ++k) want += static_cast<double>(x[r * in + k]) * static_cast<double>(w[k * out + c]);
      const double got = y[r * out + c];
      ASSERT_TRUE(std::isfinite(got)) << "y[" << r << ", " << c << "] was not written";
      diff += (got - want) * (got - want);
      norm += want * want;
    }
  }
  const double error = std::sqrt(diff / norm);
  switch (precision) {
    case MatmulPrecision::kFp32: EXPECT_LT(error, 1e-5); break;
    case MatmulPrecision::kTf32: EXPECT_GT(error, 2e-5) << "TF32 was not used"; EXPECT_LT(error, 2e-3); break;
    // FAST_16BF permits bf16 operands; cuBLAS may still pick a TF32 kernel (it did at this
    // shape on an H200: 2.95e-4), so the test asks for reduced precision, not bf16's own.
    case MatmulPrecision::kBf16: EXPECT_GT(error, 2e-5) << "fp32 products were used"; EXPECT_LT(error, 2e-2); break;
  }
  RecordProperty("relative_error", std::to_string(error));
}

INSTANTIATE_TEST_SUITE_P(Precisions, BlasPrecisionTest,
                         ::testing::Values(MatmulPrecision::kFp32, MatmulPrecision::kTf32, MatmulPrecision::kBf16),
                         [](const ::testing::TestParamInfo<MatmulPrecision>& info) {
                           return std::string(matmul_precision_name(info.param));
                         });

}  // namespace
}  // namespace strata
