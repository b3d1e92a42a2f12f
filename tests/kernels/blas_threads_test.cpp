// The CPU BLAS runs no threads of its own once Strata has made it single-threaded: the
// matrix products are tiled over the executor's threads, and OpenBLAS's idle pool would
// spin in sched_yield beside them. Its own program, so no executor or device has started
// threads before the count.
#include <gtest/gtest.h>

#include <dirent.h>

#include <cmath>
#include <vector>

#include "kernels/transformer_ops_cpu.h"

#if __has_include(<cblas.h>)
#include <cblas.h>
#endif

namespace strata {
namespace {

// Threads of this process now (the entries of /proc/self/task).
int thread_count() {
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) return -1;
  int count = 0;
  while (const dirent* entry = readdir(tasks)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(tasks);
  return count;
}

TEST(BlasThreadsTest, MakingTheBlasSingleThreadedStopsOpenBlasPoolAndAProductStartsNoNewOne) {
  ASSERT_GT(thread_count(), 0) << "no /proc/self/task";
#if defined(OPENBLAS_VERSION)
  // The pool OpenBLAS started at load: one thread fewer than its thread count (the
  // caller is the other), none in a serial build.
  const int pool = openblas_get_parallel() == OPENBLAS_THREAD ? openblas_get_num_threads() - 1 : 0;
  const int before = thread_count();
  kernels::cpu::keep_blas_single_threaded();
  EXPECT_EQ(openblas_get_num_threads(), 1);
  const int after = thread_count();
  EXPECT_EQ(after, before - pool) << "OpenBLAS's pool threads are still running";
  kernels::cpu::keep_blas_single_threaded();  // idempotent
  EXPECT_EQ(thread_count(), after);

  // A product big enough that a threaded OpenBLAS would split it runs, right, on the
  // calling thread alone.
  const int n = 512;
  std::vector<float> a(n * n, 1.0f), b(n * n, 0.5f), c(n * n, std::nanf(""));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  EXPECT_EQ(c[0], 0.5f * n);
  EXPECT_EQ(c[n * n - 1], 0.5f * n);
  EXPECT_EQ(thread_count(), after) << "the product restarted a BLAS thread pool";
#else
  GTEST_SKIP() << "this build's CPU BLAS is not OpenBLAS (or there is none): no pool to stop";
#endif
}

}  // namespace
}  // namespace strata
