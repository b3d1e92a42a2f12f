// The gradient path's kernels: every ISA's accumulate span against a scalar reference at
// sizes that are not multiples of any vector width, every source dtype and both modes;
// the parallel driver's bits for every thread count and chunk size; statistics equal to
// the bit to CpuAdam::gradient_stats; inf/NaN detection; two threads on one executor.
#include "optim/gradient_ops.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/core/check.h"
#include "optim/cpu_adam.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

// 3 statistics chunks and a few more: the last chunk is short.
constexpr size_t kOddSizes[] = {1, 7, 22, 55, 4097, 3 * kGradientStatsChunkElements + 5};
constexpr DType kDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
constexpr AccumulateMode kModes[] = {AccumulateMode::kAssign, AccumulateMode::kAdd};

std::vector<CpuIsa> supported_isas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (cpu_isa_supported(isa)) isas.push_back(isa);
  return isas;
}

const char* mode_name(AccumulateMode mode) { return mode == AccumulateMode::kAssign ? "assign" : "add"; }

std::string describe(CpuIsa isa, DType type, AccumulateMode mode, size_t count) {
  return std::string(cpu_isa_name(isa)) + " " + std::string(dtype_name(type)) + " " + mode_name(mode) + " n=" + std::to_string(count);
}

// A counter-based generator: values of either sign in [-1, 1).
float uniform(uint64_t i, uint64_t seed) {
  uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed * 0xbf58476d1ce4e5b9ull;
  x ^= x >> 31;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<double>(x >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

// A gradient of `type` over five decades, with the edge values of each dtype: zeros of
// both signs, subnormals (which the widening must keep exactly) and the largest finite.
std::vector<uint8_t> random_gradient(size_t count, DType type, uint64_t seed) {
  std::vector<uint8_t> data(count * dtype_size(type));
  static constexpr float kDecades[] = {1e-4f, 1e-3f, 1e-2f, 1e-1f, 1.0f, 10.0f};
  for (size_t i = 0; i < count; ++i) {
    const float scale = kDecades[static_cast<size_t>((uniform(i, seed + 1) + 1.0f) * 3.0f) % 6];
    store_from_float(data.data(), type, i, uniform(i, seed) * scale);
  }
  const float subnormal = type == DType::kFloat16 ? 3e-6f : type == DType::kBFloat16 ? 5e-39f : 1e-42f;
  const float largest = type == DType::kFloat16 ? 65504.0f : 1e30f;
  const float edges[] = {0.0f, -0.0f, subnormal, -subnormal, largest};
  for (size_t k = 0; k < std::size(edges); ++k)
    if (count > 3 * k + 2) store_from_float(data.data(), type, 3 * k + 2, edges[k]);
  return data;
}

std::vector<float> random_accumulator(size_t count, uint64_t seed) {
  std::vector<float> accum(count);
  for (size_t i = 0; i < count; ++i) accum[i] = uniform(i, seed) * 4.0f;
  if (count > 4) accum[4] = -0.0f;
  return accum;
}

// The scalar reference, written out here rather than taken from the library.
std::vector<float> reference_accumulate(std::vector<float> accum, const std::vector<uint8_t>& src, DType type, AccumulateMode mode) {
  for (size_t i = 0; i < accum.size(); ++i) {
    const float value = load_as_float(src.data(), type, i);
    accum[i] = mode == AccumulateMode::kAssign ? value : accum[i] + value;
  }
  return accum;
}

// Bit equality of float arrays (EXPECT_EQ on floats would call -0 and +0 equal).
::testing::AssertionResult same_bits(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "sizes " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i]))
      return ::testing::AssertionFailure() << "element " << i << ": " << got[i] << " vs " << want[i];
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same_stats(const GradientStats& got, const GradientStats& want) {
  if (std::bit_cast<uint64_t>(got.sum_of_squares) != std::bit_cast<uint64_t>(want.sum_of_squares) ||
      got.non_finite != want.non_finite || got.elements != want.elements)
    return ::testing::AssertionFailure() << "sum " << got.sum_of_squares << " vs " << want.sum_of_squares << ", non_finite "
                                         << got.non_finite << " vs " << want.non_finite << ", elements " << got.elements << " vs "
                                         << want.elements;
  return ::testing::AssertionSuccess();
}

TEST(GradientSpanTest, EveryIsaMatchesTheScalarReferenceAtOddSizes) {
  for (CpuIsa isa : supported_isas()) {
    STRATA_ASSERT_OK_AND_ASSIGN(GradientSpanKernels kernels, gradient_span_kernels(isa));
    for (size_t count : kOddSizes)
      for (DType type : kDTypes)
        for (AccumulateMode mode : kModes) {
          const std::vector<uint8_t> src = random_gradient(count, type, 11);
          std::vector<float> accum = random_accumulator(count, 12);
          const std::vector<float> want = reference_accumulate(accum, src, type, mode);
          kernels.accumulate(accum.data(), src.data(), type, count, mode);
          EXPECT_TRUE(same_bits(accum, want)) << describe(isa, type, mode, count);
        }
  }
}

TEST(GradientSpanTest, SpansStartingAtAnyElementGiveTheSameBits) {
  // The driver hands out chunks at multiples of 64, but a span must not care: start at
  // every offset up to 17 elements in (misaligned for every vector width).
  constexpr size_t kCount = 300;
  for (CpuIsa isa : supported_isas()) {
    STRATA_ASSERT_OK_AND_ASSIGN(GradientSpanKernels kernels, gradient_span_kernels(isa));
    for (DType type : kDTypes) {
      const std::vector<uint8_t> src = random_gradient(kCount, type, 21);
      const std::vector<float> start = random_accumulator(kCount, 22);
      const std::vector<float> want = reference_accumulate(start, src, type, AccumulateMode::kAdd);
      for (size_t offset = 0; offset <= 17; ++offset) {
        std::vector<float> accum = start;
        kernels.accumulate(accum.data(), src.data(), type, offset, AccumulateMode::kAdd);
        kernels.accumulate(accum.data() + offset, src.data() + offset * dtype_size(type), type, kCount - offset, AccumulateMode::kAdd);
        EXPECT_TRUE(same_bits(accum, want)) << describe(isa, type, AccumulateMode::kAdd, kCount) << " split at " << offset;
      }
    }
  }
}

class GradientOpsTest : public ::testing::TestWithParam<ExecutorKind> {
 protected:
  void SetUp() override {
    if (GetParam() == ExecutorKind::kTbb && built_with_thread_sanitizer()) GTEST_SKIP() << "oneTBB is not built into TSan builds";
  }
  std::unique_ptr<Executor> executor(int threads) {
    auto made = make_executor({.threads = threads, .kind = GetParam()});
    STRATA_CHECK_OK(made);
    return std::move(made).value();
  }
  CpuAdam adam(int threads, CpuIsa isa) {
    auto made = CpuAdam::create({.threads = threads, .executor = GetParam(), .isa = isa});
    STRATA_CHECK_OK(made);
    return std::move(made).value();
  }
  static GradientOps ops(Executor& executor, GradientOpsOptions options) {
    auto made = GradientOps::create(executor, options);
    STRATA_CHECK_OK(made);
    return std::move(made).value();
  }
};

TEST_P(GradientOpsTest, AccumulationMatchesTheScalarReferenceOnEveryIsa) {
  std::unique_ptr<Executor> workers = executor(2);
  for (CpuIsa isa : supported_isas()) {
    // Chunks of 64 elements: many parallel tasks even at the small sizes.
    GradientOps gradient_ops = ops(*workers, {.isa = isa, .chunk_elements = 64});
    EXPECT_EQ(gradient_ops.isa(), isa);
    for (size_t count : kOddSizes)
      for (DType type : kDTypes)
        for (AccumulateMode mode : kModes) {
          const std::vector<uint8_t> src = random_gradient(count, type, 31);
          const std::vector<float> start = random_accumulator(count, 32);
          const std::vector<float> want = reference_accumulate(start, src, type, mode);
          std::vector<float> accum = start;
          STRATA_ASSERT_OK(gradient_ops.accumulate(accum.data(), src.data(), type, count, mode));
          EXPECT_TRUE(same_bits(accum, want)) << describe(isa, type, mode, count);
          std::vector<float> fused = start;
          STRATA_ASSERT_OK_AND_ASSIGN(GradientStats stats, gradient_ops.accumulate_with_stats(fused.data(), src.data(), type, count, mode));
          EXPECT_TRUE(same_bits(fused, want)) << "fused " << describe(isa, type, mode, count);
          EXPECT_EQ(stats.elements, count);
          EXPECT_FALSE(stats.non_finite);
        }
  }
}

// The engine's gradient-norm bits depend on this: same ISA, same values -> same sum.
TEST_P(GradientOpsTest, StatsAreBitEqualToCpuAdamGradientStats) {
  for (CpuIsa isa : supported_isas()) {
    CpuAdam cpu_adam = adam(2, isa);
    GradientOps gradient_ops = ops(cpu_adam.executor(), {.isa = isa});
    for (size_t count : kOddSizes)
      for (DType type : kDTypes) {
        const std::vector<uint8_t> grad = random_gradient(count, type, 41);
        STRATA_ASSERT_OK_AND_ASSIGN(GradientStats want, cpu_adam.gradient_stats(grad.data(), type, count));
        STRATA_ASSERT_OK_AND_ASSIGN(GradientStats got, gradient_ops.stats(grad.data(), type, count));
        EXPECT_TRUE(same_stats(got, want)) << describe(isa, type, AccumulateMode::kAssign, count);
        // And the fused pass: the statistics of the fp32 result, as CpuAdam computes them
        // on the accumulator afterwards.
        for (AccumulateMode mode : kModes) {
          std::vector<float> accum = random_accumulator(count, 42);
          STRATA_ASSERT_OK_AND_ASSIGN(GradientStats fused, gradient_ops.accumulate_with_stats(accum.data(), grad.data(), type, count, mode));
          STRATA_ASSERT_OK_AND_ASSIGN(GradientStats of_result, cpu_adam.gradient_stats(accum.data(), DType::kFloat32, count));
          EXPECT_TRUE(same_stats(fused, of_result)) << "fused " << describe(isa, type, mode, count);
        }
      }
  }
}

TEST_P(GradientOpsTest, ResultsAreBitIdenticalForEveryThreadCountAndChunkSize) {
  constexpr size_t kCount = 5 * kGradientStatsChunkElements + 77;
  for (DType type : kDTypes) {
    const std::vector<uint8_t> src = random_gradient(kCount, type, 51);
    const std::vector<float> start = random_accumulator(kCount, 52);
    std::optional<std::vector<float>> first_accum;
    std::optional<GradientStats> first_stats, first_fused;
    for (int threads : {1, 2, 3}) {
      std::unique_ptr<Executor> workers = executor(threads);
      for (size_t chunk : {size_t{64}, size_t{4096}, size_t{1} << 16, size_t{3} << 16}) {
        GradientOps gradient_ops = ops(*workers, {.chunk_elements = chunk});
        const std::string where = std::string(dtype_name(type)) + ", " + std::to_string(threads) + " threads, chunk " + std::to_string(chunk);
        std::vector<float> accum = start;
        STRATA_ASSERT_OK(gradient_ops.accumulate(accum.data(), src.data(), type, kCount, AccumulateMode::kAdd));
        STRATA_ASSERT_OK_AND_ASSIGN(GradientStats stats, gradient_ops.stats(src.data(), type, kCount));
        std::vector<float> fused_accum = start;
        STRATA_ASSERT_OK_AND_ASSIGN(GradientStats fused,
                                    gradient_ops.accumulate_with_stats(fused_accum.data(), src.data(), type, kCount, AccumulateMode::kAdd));
        EXPECT_TRUE(same_bits(fused_accum, accum)) << where;
        if (!first_accum) {
          first_accum = accum;
          first_stats = stats;
          first_fused = fused;
          continue;
        }
        EXPECT_TRUE(same_bits(accum, *first_accum)) << where;
        EXPECT_TRUE(same_stats(stats, *first_stats)) << where;
        EXPECT_TRUE(same_stats(fused, *first_fused)) << where;
      }
    }
  }
}

// Micro-batches as the engine lands them: assign the first, add the rest.
TEST_P(GradientOpsTest, MicroBatchAccumulationEqualsTheReferenceSum) {
  std::unique_ptr<Executor> workers = executor(2);
  GradientOps gradient_ops = ops(*workers, {.chunk_elements = 4096});
  constexpr size_t kCount = 100003;
  std::vector<float> accum(kCount, std::numeric_limits<float>::quiet_NaN());  // garbage the assign must overwrite
  std::vector<float> want(kCount);
  for (int micro = 0; micro < 4; ++micro) {
    const std::vector<uint8_t> grad = random_gradient(kCount, DType::kBFloat16, 60 + micro);
    const AccumulateMode mode = micro == 0 ? AccumulateMode::kAssign : AccumulateMode::kAdd;
    want = reference_accumulate(want, grad, DType::kBFloat16, mode);
    STRATA_ASSERT_OK_AND_ASSIGN(GradientStats stats, gradient_ops.accumulate_with_stats(accum.data(), grad.data(), DType::kBFloat16, kCount, mode));
    EXPECT_FALSE(stats.non_finite) << "micro-batch " << micro;
  }
  EXPECT_TRUE(same_bits(accum, want));
}

TEST_P(GradientOpsTest, InfAndNanAreFlaggedOnEveryIsa) {
  std::unique_ptr<Executor> workers = executor(2);
  constexpr size_t kCount = 2 * kGradientStatsChunkElements + 9;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (CpuIsa isa : supported_isas()) {
    GradientOps gradient_ops = ops(*workers, {.isa = isa, .chunk_elements = 4096});
    for (DType type : kDTypes) {
      std::vector<uint8_t> grad = random_gradient(kCount, type, 71);
      const std::vector<float> start = random_accumulator(kCount, 72);
      STRATA_ASSERT_OK_AND_ASSIGN(GradientStats clean, gradient_ops.stats(grad.data(), type, kCount));
      EXPECT_FALSE(clean.non_finite);
      for (float bad : {kInf, -kInf, std::numeric_limits<float>::quiet_NaN()})
        for (size_t where : {size_t{0}, kGradientStatsChunkElements + 3, kCount - 1}) {
          const std::string what = std::string(cpu_isa_name(isa)) + " " + std::string(dtype_name(type)) + " " + std::to_string(bad) +
                                   " at " + std::to_string(where);
          const float saved = load_as_float(grad.data(), type, where);
          store_from_float(grad.data(), type, where, bad);
          STRATA_ASSERT_OK_AND_ASSIGN(GradientStats stats, gradient_ops.stats(grad.data(), type, kCount));
          EXPECT_TRUE(stats.non_finite) << what;
          for (AccumulateMode mode : kModes) {
            std::vector<float> accum = start;
            STRATA_ASSERT_OK_AND_ASSIGN(GradientStats fused, gradient_ops.accumulate_with_stats(accum.data(), grad.data(), type, kCount, mode));
            EXPECT_TRUE(fused.non_finite) << what << " " << mode_name(mode);
            EXPECT_TRUE(std::isnan(bad) ? std::isnan(accum[where]) : accum[where] == bad) << what << " " << mode_name(mode);
          }
          store_from_float(grad.data(), type, where, saved);
        }
    }
    // An overflow in the sum itself: two finite values whose fp32 sum is inf.
    std::vector<float> accum(33, 3e38f);
    const std::vector<float> src(33, 3e38f);
    STRATA_ASSERT_OK_AND_ASSIGN(GradientStats overflow,
                                gradient_ops.accumulate_with_stats(accum.data(), src.data(), DType::kFloat32, 33, AccumulateMode::kAdd));
    EXPECT_TRUE(overflow.non_finite) << cpu_isa_name(isa);
    EXPECT_EQ(accum[32], kInf);
    // The largest finite values do not flag (the squares are summed in double).
    STRATA_ASSERT_OK_AND_ASSIGN(GradientStats large, gradient_ops.stats(src.data(), DType::kFloat32, 33));
    EXPECT_FALSE(large.non_finite) << cpu_isa_name(isa);
  }
}

TEST_P(GradientOpsTest, RejectsBadOptionsAndArgumentsWithReasons) {
  std::unique_ptr<Executor> workers = executor(2);
  for (size_t chunk : {size_t{0}, size_t{100}}) {
    auto made = GradientOps::create(*workers, {.chunk_elements = chunk});
    ASSERT_FALSE(made.ok()) << chunk;
    EXPECT_EQ(made.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(made.status().message().find("chunk_elements"), std::string::npos) << made.status().to_string();
  }
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (cpu_isa_supported(isa)) continue;
    auto made = GradientOps::create(*workers, {.isa = isa});
    ASSERT_FALSE(made.ok()) << cpu_isa_name(isa);
    EXPECT_EQ(made.status().code(), StatusCode::kUnavailable) << made.status().to_string();
  }
  GradientOps gradient_ops = ops(*workers, {});
  std::vector<float> accum(64, 1.0f);
  std::vector<uint16_t> src(64, 0);
  EXPECT_FALSE(gradient_ops.accumulate(accum.data(), nullptr, DType::kBFloat16, 64, AccumulateMode::kAdd).ok());
  EXPECT_FALSE(gradient_ops.accumulate(nullptr, src.data(), DType::kBFloat16, 64, AccumulateMode::kAdd).ok());
  EXPECT_FALSE(gradient_ops.stats(nullptr, DType::kFloat32, 1).ok());
  EXPECT_FALSE(gradient_ops.accumulate(accum.data(), src.data(), static_cast<DType>(7), 64, AccumulateMode::kAdd).ok());
  EXPECT_FALSE(gradient_ops.accumulate(accum.data(), src.data(), DType::kBFloat16, 64, static_cast<AccumulateMode>(9)).ok());
  // Overlapping arrays: the source starts halfway into the accumulator; right after it is fine.
  auto overlap = gradient_ops.accumulate_with_stats(accum.data(), accum.data() + 16, DType::kFloat32, 32, AccumulateMode::kAdd);
  ASSERT_FALSE(overlap.ok());
  EXPECT_NE(overlap.status().message().find("overlap"), std::string::npos) << overlap.status().to_string();
  STRATA_EXPECT_OK(gradient_ops.accumulate(accum.data(), accum.data() + 32, DType::kFloat32, 32, AccumulateMode::kAdd));
  // Empty spans are fine, null or not, and touch nothing.
  STRATA_EXPECT_OK(gradient_ops.accumulate(nullptr, nullptr, DType::kFloat16, 0, AccumulateMode::kAssign));
  STRATA_ASSERT_OK_AND_ASSIGN(GradientStats empty, gradient_ops.stats(nullptr, DType::kFloat16, 0));
  EXPECT_EQ(empty.elements, 0u);
  EXPECT_EQ(empty.sum_of_squares, 0.0);
  EXPECT_FALSE(empty.non_finite);
}

// Two threads, two GradientOps, one executor (as the landing thread and the optimizer
// share CpuAdam's): each thread's results are those it gets alone.
TEST_P(GradientOpsTest, TwoThreadsShareOneExecutor) {
  std::unique_ptr<Executor> workers = executor(2);
  constexpr size_t kCount = 3 * kGradientStatsChunkElements + 5;
  constexpr int kRounds = 20;
  struct Lane {
    std::vector<uint8_t> src;
    std::vector<float> start, want_accum, got_accum;
    GradientStats want_stats, got_stats;
    Status status;
  };
  Lane lanes[2];
  for (int k = 0; k < 2; ++k) {
    Lane& lane = lanes[k];
    lane.src = random_gradient(kCount, DType::kBFloat16, 80 + k);
    lane.start = random_accumulator(kCount, 90 + k);
    lane.want_accum = lane.start;
    GradientOps alone = ops(*workers, {.chunk_elements = 4096});
    for (int round = 0; round < kRounds; ++round) {
      auto stats = alone.accumulate_with_stats(lane.want_accum.data(), lane.src.data(), DType::kBFloat16, kCount, AccumulateMode::kAdd);
      STRATA_ASSERT_OK(stats);
      lane.want_stats = *stats;
    }
  }
  GradientOps first = ops(*workers, {.chunk_elements = 4096});
  GradientOps second = ops(*workers, {.chunk_elements = 4096});
  auto run = [&](GradientOps& gradient_ops, Lane& lane) {
    lane.got_accum = lane.start;
    for (int round = 0; round < kRounds && lane.status.ok(); ++round) {
      auto stats = gradient_ops.accumulate_with_stats(lane.got_accum.data(), lane.src.data(), DType::kBFloat16, kCount, AccumulateMode::kAdd);
      if (!stats.ok()) lane.status = stats.status();
      else lane.got_stats = *stats;
    }
  };
  std::thread other([&] { run(second, lanes[1]); });
  run(first, lanes[0]);
  other.join();
  for (const Lane& lane : lanes) {
    STRATA_EXPECT_OK(lane.status);
    EXPECT_TRUE(same_bits(lane.got_accum, lane.want_accum));
    EXPECT_TRUE(same_stats(lane.got_stats, lane.want_stats));
  }
}

INSTANTIATE_TEST_SUITE_P(Executors, GradientOpsTest, ::testing::Values(ExecutorKind::kTbb, ExecutorKind::kThreads),
                         [](const ::testing::TestParamInfo<ExecutorKind>& info) { return info.param == ExecutorKind::kTbb ? "tbb" : "threads"; });

}  // namespace
}  // namespace strata
