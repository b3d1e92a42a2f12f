// The CPU Adam: every SIMD path against the scalar reference (kernels::adam_step_cpu_range)
// on sizes that are and are not multiples of the vector width, every dtype combination
// and each weight-decay / scaling mode; the parallel driver's determinism across thread
// counts; the fused gradient statistics; the step plan and the skip-step path.
#include "optim/cpu_adam.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/core/check.h"
#include "tests/optim/adam_test_data.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

using testing::AdamShardData;
using testing::compare_shards;

// The SIMD paths perform the reference's operations with the same IEEE rounding, so
// they must agree to the bit (NaN payloads aside).
constexpr uint64_t kMaxUlps = 0;

#if defined(STRATA_SANITIZER_ADDRESS) || defined(STRATA_SANITIZER_THREAD)
constexpr size_t kLargeSize = size_t{1} << 17;
#else
constexpr size_t kLargeSize = (size_t{3} << 20) + 37;  // "a few million", not a multiple of any width
#endif

struct DecayCase {
  const char* name;
  kernels::AdamHyperparams hyper;
  kernels::GradientScaling scaling;
};

std::vector<DecayCase> decay_cases() {
  using kernels::AdamWeightDecay;
  return {
      {"adamw_plain", {.lr = 1e-3, .weight_decay = 0.0, .decay = AdamWeightDecay::kDecoupled}, {}},
      {"adamw_wd_scaled_clipped", {.lr = 3e-4, .beta1 = 0.8, .beta2 = 0.95, .weight_decay = 0.1, .decay = AdamWeightDecay::kDecoupled},
       {.loss_scale = 1024.0f, .clip_coefficient = 0.5f}},
      {"adam_l2", {.lr = 1e-2, .weight_decay = 0.01, .decay = AdamWeightDecay::kL2}, {}},
      {"adam_l2_scaled_clipped", {.lr = 2e-3, .eps = 1e-6, .weight_decay = 0.05, .decay = AdamWeightDecay::kL2},
       {.loss_scale = 65536.0f, .clip_coefficient = 0.25f}},
  };
}

// An ISA path to check: the ISA and whether AVX512-BF16 conversions are used.
struct IsaPath {
  CpuIsa isa;
  bool native_bf16;
  std::string name() const { return std::string(cpu_isa_name(isa)) + (native_bf16 ? "+bf16" : ""); }
};

std::vector<IsaPath> simd_paths() {
  std::vector<IsaPath> paths;
  if (cpu_isa_supported(CpuIsa::kAvx2)) paths.push_back({CpuIsa::kAvx2, false});
  if (cpu_isa_supported(CpuIsa::kAvx512)) {
    paths.push_back({CpuIsa::kAvx512, false});
    if (cpu_features().avx512_bf16) paths.push_back({CpuIsa::kAvx512, true});
  }
  return paths;
}

AdamSpanKernels span_kernels(const IsaPath& path) {
  auto kernels = adam_span_kernels(path.isa, {.use_avx512_bf16 = path.native_bf16});
  STRATA_CHECK_OK(kernels);
  return *kernels;
}

struct DtypeCombo {
  DType grad;
  DType moment;
  bool write_param;
  DType param;
};

std::vector<DtypeCombo> dtype_combos() {
  std::vector<DtypeCombo> combos;
  for (DType grad : {DType::kBFloat16, DType::kFloat16, DType::kFloat32})
    for (DType moment : {DType::kFloat32, DType::kBFloat16}) {
      combos.push_back({grad, moment, false, DType::kBFloat16});
      for (DType param : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) combos.push_back({grad, moment, true, param});
    }
  return combos;
}

std::string describe(const DtypeCombo& c) {
  return "grad " + std::string(dtype_name(c.grad)) + " moments " + std::string(dtype_name(c.moment)) + " param " +
         (c.write_param ? std::string(dtype_name(c.param)) : "none");
}

// Runs `kernels` and the reference on copies of one shard and returns the largest distance.
testing::ShardDiff run_against_reference(const AdamSpanKernels& kernels, const DtypeCombo& combo, const DecayCase& decay, size_t count,
                                         size_t offset, const AdamSpanStores& stores, uint32_t seed, int64_t step = 3) {
  AdamShardData got = AdamShardData::random(count, combo.grad, combo.moment, combo.write_param, combo.param, seed, offset);
  AdamShardData want = got;
  auto scalars = kernels::adam_step_scalars(decay.hyper, step, decay.scaling);
  STRATA_CHECK_OK(scalars);
  kernels.step(got.buffers(), *scalars, stores);
  kernels::adam_step_cpu_range(want.buffers(), *scalars, 0, count);
  return compare_shards(got, want);
}

TEST(CpuAdamSpanTest, EverySimdPathMatchesTheScalarReferenceOnSmallSizes) {
  const auto paths = simd_paths();
  if (paths.empty()) GTEST_SKIP() << "this CPU has neither AVX2+F16C nor AVX-512: only the scalar reference runs here";
  uint32_t seed = 1;
  for (const IsaPath& path : paths) {
    const AdamSpanKernels kernels = span_kernels(path);
    for (size_t count : {size_t{1}, size_t{7}, size_t{15}, size_t{16}, size_t{17}, size_t{55}, size_t{4097}})
      for (const DtypeCombo& combo : dtype_combos())
        for (const DecayCase& decay : decay_cases())
          for (size_t offset : {size_t{0}, size_t{1}}) {
            const AdamSpanStores stores = offset == 0 ? AdamSpanStores{StoreKind::kStreaming, StoreKind::kStreaming} : AdamSpanStores{};
            const auto diff = run_against_reference(kernels, combo, decay, count, offset, stores, seed++);
            ASSERT_LE(diff.max_ulps, kMaxUlps) << path.name() << " n=" << count << " offset " << offset << " " << describe(combo) << " "
                                               << decay.name << " at " << diff.where;
          }
  }
}

TEST(CpuAdamSpanTest, EverySimdPathMatchesTheScalarReferenceOnAFewMillion) {
  const auto paths = simd_paths();
  if (paths.empty()) GTEST_SKIP() << "this CPU has neither AVX2+F16C nor AVX-512: only the scalar reference runs here";
  const auto cases = decay_cases();
  const auto combos = dtype_combos();
  for (size_t c = 0; c < combos.size(); ++c) {
    const DtypeCombo& combo = combos[c];
    const DecayCase& decay = cases[c % cases.size()];
    const AdamShardData input =
        AdamShardData::random(kLargeSize, combo.grad, combo.moment, combo.write_param, combo.param, 1000 + static_cast<uint32_t>(c));
    auto scalars = kernels::adam_step_scalars(decay.hyper, 3, decay.scaling);
    STRATA_ASSERT_OK(scalars);
    AdamShardData want = input;
    kernels::adam_step_cpu_range(want.buffers(), *scalars, 0, kLargeSize);
    for (const IsaPath& path : paths) {
      AdamShardData got = input;
      span_kernels(path).step(got.buffers(), *scalars, AdamSpanStores{});
      const auto diff = compare_shards(got, want);
      ASSERT_LE(diff.max_ulps, kMaxUlps) << path.name() << " n=" << kLargeSize << " " << describe(combo) << " " << decay.name << " at "
                                         << diff.where;
    }
  }
}

TEST(CpuAdamSpanTest, NonFiniteGradientsPropagateAlikeOnEveryPath) {
  const auto paths = simd_paths();
  if (paths.empty()) GTEST_SKIP() << "no SIMD path on this CPU";
  for (const IsaPath& path : paths) {
    const AdamSpanKernels kernels = span_kernels(path);
    for (DType grad : {DType::kFloat16, DType::kFloat32}) {
      AdamShardData got = AdamShardData::random(40, grad, DType::kFloat32, true, DType::kBFloat16, 5);
      store_from_float(got.grad.data(), grad, 2, std::numeric_limits<float>::infinity());
      store_from_float(got.grad.data(), grad, 20, std::numeric_limits<float>::quiet_NaN());
      AdamShardData want = got;
      auto scalars = kernels::adam_step_scalars({}, 1);
      STRATA_ASSERT_OK(scalars);
      kernels.step(got.buffers(), *scalars, {});
      kernels::adam_step_cpu_range(want.buffers(), *scalars, 0, want.count);
      const auto diff = compare_shards(got, want);
      EXPECT_EQ(diff.max_ulps, 0u) << path.name() << " at " << diff.where;
      EXPECT_TRUE(std::isnan(got.master[2]) && std::isnan(got.master[20])) << path.name();
    }
  }
}

// Over several steps the kernels keep agreeing (errors would compound into drift).
TEST(CpuAdamSpanTest, TwentyStepsStayBitIdentical) {
  const auto paths = simd_paths();
  if (paths.empty()) GTEST_SKIP() << "no SIMD path on this CPU";
  for (const IsaPath& path : paths) {
    const AdamSpanKernels kernels = span_kernels(path);
    AdamShardData got = AdamShardData::random(1001, DType::kBFloat16, DType::kBFloat16, true, DType::kBFloat16, 11);
    AdamShardData want = got;
    for (int64_t step = 1; step <= 20; ++step) {
      auto scalars = kernels::adam_step_scalars({.lr = 1e-3 * static_cast<double>(step), .weight_decay = 0.01}, step);
      STRATA_ASSERT_OK(scalars);
      kernels.step(got.buffers(), *scalars, {});
      kernels::adam_step_cpu_range(want.buffers(), *scalars, 0, want.count);
    }
    const auto diff = compare_shards(got, want);
    EXPECT_EQ(diff.max_ulps, 0u) << path.name() << " at " << diff.where;
  }
}

// The reference itself against Adam written out in double precision (a check that the
// element function is Adam, independent of how it is rounded).
TEST(CpuAdamReferenceTest, ScalarReferenceIsAdamInDoublePrecisionWithinFloatRounding) {
  for (const DecayCase& decay : decay_cases()) {
    AdamShardData data = AdamShardData::random(257, DType::kFloat32, DType::kFloat32, false, DType::kFloat32, 21);
    std::vector<double> p(data.count), m(data.count), v(data.count);
    const kernels::AdamBuffers b = data.buffers();
    for (size_t i = 0; i < data.count; ++i) {
      p[i] = b.master[i];
      m[i] = static_cast<const float*>(b.exp_avg)[i];
      v[i] = static_cast<const float*>(b.exp_avg_sq)[i];
    }
    const auto& h = decay.hyper;
    const double grad_scale = decay.scaling.clip_coefficient / static_cast<double>(decay.scaling.loss_scale);
    for (int64_t step = 1; step <= 5; ++step) {
      auto scalars = kernels::adam_step_scalars(h, step, decay.scaling);
      STRATA_ASSERT_OK(scalars);
      kernels::adam_step_cpu_range(b, *scalars, 0, data.count);
      for (size_t i = 0; i < data.count; ++i) {
        double g = static_cast<const float*>(b.grad)[i] * grad_scale;
        if (h.decay == kernels::AdamWeightDecay::kL2) g += h.weight_decay * p[i];
        m[i] = h.beta1 * m[i] + (1 - h.beta1) * g;
        v[i] = h.beta2 * v[i] + (1 - h.beta2) * g * g;
        const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(step));
        const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(step));
        if (h.decay == kernels::AdamWeightDecay::kDecoupled) p[i] *= 1 - h.lr * h.weight_decay;
        p[i] -= h.lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + h.eps);
      }
    }
    for (size_t i = 0; i < data.count; ++i) {
      ASSERT_NEAR(b.master[i], p[i], 1e-5 * std::max(1.0, std::abs(p[i]))) << decay.name << " i=" << i;
      ASSERT_NEAR(static_cast<const float*>(b.exp_avg)[i], m[i], 1e-5 * std::max(1e-3, std::abs(m[i]))) << decay.name << " i=" << i;
    }
  }
}

class CpuAdamDriverTest : public ::testing::TestWithParam<ExecutorKind> {
 protected:
  void SetUp() override {
    if (GetParam() == ExecutorKind::kTbb && built_with_thread_sanitizer()) GTEST_SKIP() << "oneTBB is not built into TSan builds";
  }
  CpuAdam make(int threads, size_t chunk, std::optional<CpuIsa> isa = std::nullopt) {
    auto adam = CpuAdam::create({.threads = threads, .executor = GetParam(), .isa = isa, .chunk_elements = chunk});
    STRATA_CHECK_OK(adam);
    return std::move(adam).value();
  }
};

// fp32 results do not depend on the thread count or the chunking (no reductions in the update).
TEST_P(CpuAdamDriverTest, Fp32ResultsAreBitIdenticalAcrossThreadCountsAndChunks) {
  const size_t n = kLargeSize / 8 + 3;
  AdamShardData base = AdamShardData::random(n, DType::kFloat32, DType::kFloat32, true, DType::kFloat32, 31);
  std::optional<AdamShardData> first;
  for (auto [threads, chunk] : {std::pair{1, size_t{1} << 16}, std::pair{2, size_t{1} << 16}, std::pair{3, size_t{4096}},
                                std::pair{4, size_t{64}}}) {
    CpuAdam adam = make(threads, chunk);
    AdamShardData data = base;
    for (int64_t step = 1; step <= 3; ++step) {
      auto scalars = kernels::adam_step_scalars({.weight_decay = 0.01}, step, {.loss_scale = 8.0f});
      STRATA_ASSERT_OK(scalars);
      STRATA_ASSERT_OK(adam.step(data.buffers(), *scalars));
    }
    if (!first) {
      first = data;
      continue;
    }
    EXPECT_EQ(data.master, first->master) << threads << " threads, chunk " << chunk;
    EXPECT_EQ(data.exp_avg, first->exp_avg) << threads << " threads, chunk " << chunk;
    EXPECT_EQ(data.exp_avg_sq, first->exp_avg_sq) << threads << " threads, chunk " << chunk;
    EXPECT_EQ(data.param, first->param) << threads << " threads, chunk " << chunk;
  }
}

// Stepping a shard group by group (as the engine does) equals stepping it in one call,
// and equals the reference.
TEST_P(CpuAdamDriverTest, PerGroupStepsEqualOneCallAndTheReference) {
  CpuAdam adam = make(2, 1024);
  const size_t n = 100003;
  AdamShardData whole = AdamShardData::random(n, DType::kBFloat16, DType::kFloat32, true, DType::kBFloat16, 41);
  AdamShardData grouped = whole;
  AdamShardData reference = whole;
  auto scalars = kernels::adam_step_scalars({.weight_decay = 0.1}, 1);
  STRATA_ASSERT_OK(scalars);
  STRATA_ASSERT_OK(adam.step(whole.buffers(), *scalars));
  for (size_t begin = 0; begin < n; begin += 7919) STRATA_ASSERT_OK(adam.step(adam_buffers_slice(grouped.buffers(), begin, std::min(n, begin + 7919)), *scalars));
  kernels::adam_step_cpu_range(reference.buffers(), *scalars, 0, n);
  EXPECT_EQ(compare_shards(grouped, whole).max_ulps, 0u);
  EXPECT_EQ(compare_shards(whole, reference).max_ulps, 0u);
  // step_on_this_thread covers a sub-range only.
  AdamShardData partial = reference;
  STRATA_ASSERT_OK(adam.step_on_this_thread(partial.buffers(), *scalars, 10, 20));
  EXPECT_EQ(partial.master[9], reference.master[9]);
  EXPECT_NE(partial.master[10], reference.master[10]);
  EXPECT_EQ(partial.master[20], reference.master[20]);
  EXPECT_FALSE(adam.step_on_this_thread(partial.buffers(), *scalars, 5, n + 1).ok());
}

TEST_P(CpuAdamDriverTest, GradientStatsAreExactEnoughAndDeterministic) {
  const size_t n = kLargeSize / 4 + 5;
  for (DType type : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    AdamShardData data = AdamShardData::random(n, type, DType::kFloat32, false, DType::kFloat32, 51);
    long double want = 0;
    for (size_t i = 0; i < n; ++i) {
      const long double g = load_as_float(data.grad.data(), type, i);
      want += g * g;
    }
    std::optional<double> first;
    for (int threads : {1, 2, 3}) {
      CpuAdam adam = make(threads, 1 << 16);
      STRATA_ASSERT_OK_AND_ASSIGN(GradientStats stats, adam.gradient_stats(data.grad.data(), type, n));
      EXPECT_FALSE(stats.non_finite);
      EXPECT_EQ(stats.elements, n);
      EXPECT_NEAR(stats.sum_of_squares, static_cast<double>(want), 1e-10 * static_cast<double>(want)) << dtype_name(type);
      if (first) {
        EXPECT_EQ(stats.sum_of_squares, *first) << dtype_name(type) << " " << threads << " threads";
      }
      first = stats.sum_of_squares;
    }
  }
}

TEST_P(CpuAdamDriverTest, GradientStatsFlagInfAndNanOnEveryPath) {
  std::vector<std::optional<CpuIsa>> isas{CpuIsa::kScalar};
  for (const IsaPath& path : simd_paths()) isas.push_back(path.isa);
  for (auto isa : isas) {
    CpuAdam adam = make(2, 1 << 16, isa);
    for (DType type : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      constexpr size_t kCount = 140001;
      AdamShardData data = AdamShardData::random(kCount, type, DType::kFloat32, false, DType::kFloat32, 61);
      STRATA_ASSERT_OK_AND_ASSIGN(GradientStats clean, adam.gradient_stats(data.grad.data(), type, kCount));
      EXPECT_FALSE(clean.non_finite);
      for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()})
        for (size_t where : {size_t{0}, size_t{70000}, kCount - 1}) {
          const float saved = load_as_float(data.grad.data(), type, where);
          store_from_float(data.grad.data(), type, where, bad);
          STRATA_ASSERT_OK_AND_ASSIGN(GradientStats stats, adam.gradient_stats(data.grad.data(), type, kCount));
          EXPECT_TRUE(stats.non_finite) << cpu_isa_name(*isa) << " " << dtype_name(type) << " " << bad << " at " << where;
          store_from_float(data.grad.data(), type, where, saved);
        }
    }
    // fp16 values overflow in the backward pass as +-inf; the largest finite value does not flag.
    std::vector<uint16_t> largest(33, float_to_fp16_bits(65504.0f));
    STRATA_ASSERT_OK_AND_ASSIGN(GradientStats stats, adam.gradient_stats(largest.data(), DType::kFloat16, largest.size()));
    EXPECT_FALSE(stats.non_finite);
    EXPECT_DOUBLE_EQ(stats.sum_of_squares, 33.0 * 65504.0 * 65504.0);
  }
}

TEST_P(CpuAdamDriverTest, SkippedStepLeavesEveryBufferUntouched) {
  CpuAdam adam = make(2, 1024);
  AdamShardData data = AdamShardData::random(5000, DType::kFloat16, DType::kFloat32, true, DType::kFloat16, 71);
  store_from_float(data.grad.data(), DType::kFloat16, 123, std::numeric_limits<float>::infinity());
  const AdamShardData before = data;
  STRATA_ASSERT_OK_AND_ASSIGN(GradientStats stats, adam.gradient_stats(data.grad.data(), DType::kFloat16, data.count));
  ASSERT_TRUE(stats.non_finite);
  STRATA_ASSERT_OK_AND_ASSIGN(AdamStepPlan plan, plan_adam_step({}, 1, stats, {.loss_scale = 65536.0f, .max_grad_norm = 1.0}));
  EXPECT_TRUE(plan.skip);
  EXPECT_TRUE(std::isinf(plan.grad_norm));
  STRATA_ASSERT_OK(adam.step(data.buffers(), plan));
  EXPECT_EQ(data.master, before.master);
  EXPECT_EQ(data.exp_avg, before.exp_avg);
  EXPECT_EQ(data.exp_avg_sq, before.exp_avg_sq);
  EXPECT_EQ(data.param, before.param);
}

INSTANTIATE_TEST_SUITE_P(Executors, CpuAdamDriverTest, ::testing::Values(ExecutorKind::kTbb, ExecutorKind::kThreads),
                         [](const auto& info) { return info.param == ExecutorKind::kTbb ? "tbb" : "threads"; });

TEST(AdamStepPlanTest, ClipsTheUnscaledGlobalNormLikeTorch) {
  GradientStats a{.sum_of_squares = 9.0 * 1024 * 1024, .non_finite = false, .elements = 10};
  GradientStats b{.sum_of_squares = 16.0 * 1024 * 1024, .non_finite = false, .elements = 10};
  GradientStats total = a;
  total += b;
  EXPECT_EQ(total.elements, 20u);
  STRATA_ASSERT_OK_AND_ASSIGN(AdamStepPlan plan, plan_adam_step({}, 1, total, {.loss_scale = 1024.0f, .max_grad_norm = 1.0}));
  EXPECT_FALSE(plan.skip);
  EXPECT_DOUBLE_EQ(plan.grad_norm, 5.0);
  EXPECT_FLOAT_EQ(plan.clip_coefficient, static_cast<float>(1.0 / (5.0 + 1e-6)));
  EXPECT_FLOAT_EQ(plan.scalars.grad_scale, plan.clip_coefficient / 1024.0f);
  // Below the threshold (or with clipping off) the coefficient is 1.
  STRATA_ASSERT_OK_AND_ASSIGN(AdamStepPlan loose, plan_adam_step({}, 1, total, {.loss_scale = 1024.0f, .max_grad_norm = 10.0}));
  EXPECT_EQ(loose.clip_coefficient, 1.0f);
  STRATA_ASSERT_OK_AND_ASSIGN(AdamStepPlan off, plan_adam_step({}, 1, total, {.loss_scale = 1024.0f}));
  EXPECT_EQ(off.clip_coefficient, 1.0f);
  EXPECT_FLOAT_EQ(off.scalars.grad_scale, 1.0f / 1024.0f);
  // Bad options are errors that name the option.
  auto bad = plan_adam_step({}, 1, total, {.loss_scale = 0.0f});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("loss_scale"), std::string::npos);
  auto negative = plan_adam_step({}, 1, total, {.max_grad_norm = -1.0});
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.status().message().find("max_grad_norm"), std::string::npos);
}

TEST(CpuAdamTest, RejectsBadOptionsAndBuffersWithReasons) {
  auto chunk = CpuAdam::create({.chunk_elements = 100});
  ASSERT_FALSE(chunk.ok());
  EXPECT_NE(chunk.status().message().find("chunk_elements"), std::string::npos);
  STRATA_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::create({.threads = 1}));
  EXPECT_EQ(adam.isa(), best_cpu_isa());
  AdamShardData data = AdamShardData::random(10, DType::kFloat32, DType::kFloat32, false, DType::kFloat32, 1);
  kernels::AdamBuffers b = data.buffers();
  b.exp_avg_sq = nullptr;
  auto scalars = kernels::adam_step_scalars({}, 1);
  STRATA_ASSERT_OK(scalars);
  const Status status = adam.step(b, *scalars);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("exp_avg_sq"), std::string::npos);
  b = data.buffers();
  b.moment_type = DType::kFloat16;
  EXPECT_FALSE(adam.step(b, *scalars).ok());
}

TEST(CpuIsaTest, NamesParseAndTheBestIsSupported) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    STRATA_ASSERT_OK_AND_ASSIGN(CpuIsa parsed, parse_cpu_isa(cpu_isa_name(isa)));
    EXPECT_EQ(parsed, isa);
  }
  EXPECT_FALSE(parse_cpu_isa("sse9").ok());
  EXPECT_TRUE(cpu_isa_supported(CpuIsa::kScalar));
  EXPECT_TRUE(cpu_isa_supported(best_cpu_isa()));
  if (cpu_features().avx512) {
    EXPECT_TRUE(cpu_features().avx2_f16c);
  }
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    auto kernels = adam_span_kernels(isa);
    EXPECT_EQ(kernels.ok(), cpu_isa_supported(isa)) << cpu_isa_name(isa);
    if (!kernels.ok()) {
      EXPECT_EQ(kernels.status().code(), StatusCode::kUnavailable);
    }
  }
}

}  // namespace
}  // namespace strata
