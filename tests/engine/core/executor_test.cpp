#include "engine/core/executor.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "tests/support/test_support.h"

namespace strata {
namespace {

class ExecutorTest : public ::testing::TestWithParam<ExecutorKind> {};

TEST_P(ExecutorTest, CoversEveryIndexOnceWithGrainAlignedChunks) {
  if (GetParam() == ExecutorKind::kTbb && built_with_thread_sanitizer()) GTEST_SKIP() << "oneTBB is not built into TSan builds";
  STRATA_ASSERT_OK_AND_ASSIGN(auto executor, make_executor({.threads = 3, .kind = GetParam()}));
  EXPECT_EQ(executor->concurrency(), 3);
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, size_t{100003}}) {
    std::vector<std::atomic<int>> hits(n);
    std::mutex mutex;
    std::vector<std::pair<size_t, size_t>> ranges;
    constexpr size_t kGrain = 1000;
    executor->parallel_for(0, n, kGrain, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) hits[i].fetch_add(1);
      std::lock_guard<std::mutex> lock(mutex);
      ranges.emplace_back(lo, hi);
    });
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "index " << i << " of " << n;
    for (auto [lo, hi] : ranges) {
      EXPECT_EQ(lo % kGrain, 0u);
      EXPECT_TRUE(hi == n || hi % kGrain == 0);
    }
  }
}

TEST_P(ExecutorTest, ConcurrentCallersAreServed) {
  if (GetParam() == ExecutorKind::kTbb && built_with_thread_sanitizer()) GTEST_SKIP() << "oneTBB is not built into TSan builds";
  STRATA_ASSERT_OK_AND_ASSIGN(auto executor, make_executor({.threads = 2, .kind = GetParam()}));
  std::atomic<size_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int r = 0; r < 20; ++r) executor->parallel_for(0, 10000, 64, [&](size_t lo, size_t hi) { total += hi - lo; });
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), size_t{4 * 20 * 10000});
}

INSTANTIATE_TEST_SUITE_P(Kinds, ExecutorTest, ::testing::Values(ExecutorKind::kThreads, ExecutorKind::kTbb, ExecutorKind::kDefault),
                         [](const auto& info) {
                           switch (info.param) {
                             case ExecutorKind::kThreads: return std::string("threads");
                             case ExecutorKind::kTbb: return std::string("tbb");
                             default: return std::string("default");
                           }
                         });

TEST(ExecutorOptionsTest, RejectsNegativeThreads) {
  auto executor = make_executor({.threads = -1});
  ASSERT_FALSE(executor.ok());
  EXPECT_NE(executor.status().message().find("threads must be >= 0"), std::string::npos);
}

}  // namespace
}  // namespace strata
