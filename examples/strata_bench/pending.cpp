// Subcommands whose implementation is not in this tree yet report so and fail.
#include <cstdio>

#include "examples/strata_bench/bench.h"

namespace strata::bench {
namespace {
[[maybe_unused]] int not_built(const char* name) {
  std::fprintf(stderr, "strata-bench %s: this subcommand is not part of this build yet\n", name);
  return 3;
}
}  // namespace
#if defined(STRATA_BENCH_PENDING_nvme)
int run_nvme(int, char**) { return not_built("nvme"); }
const char* const kNvmeUsage = "usage: strata-bench nvme (not part of this build yet)";
#endif
#if defined(STRATA_BENCH_PENDING_copy)
int run_copy(int, char**) { return not_built("copy"); }
const char* const kCopyUsage = "usage: strata-bench copy (not part of this build yet)";
#endif
#if defined(STRATA_BENCH_PENDING_adam)
int run_adam(int, char**) { return not_built("adam"); }
const char* const kAdamUsage = "usage: strata-bench adam (not part of this build yet)";
#endif
#if defined(STRATA_BENCH_PENDING_step)
int run_step(int, char**) { return not_built("step"); }
const char* const kStepUsage = "usage: strata-bench step (not part of this build yet)";
#endif
#if defined(STRATA_BENCH_PENDING_kernels)
int run_kernels(int, char**) { return not_built("kernels"); }
const char* const kKernelsUsage = "usage: strata-bench kernels (not part of this build yet)";
#endif
#if defined(STRATA_BENCH_PENDING_profile)
int run_profile(int, char**) { return not_built("profile"); }
const char* const kProfileUsage = "usage: strata-bench profile (not part of this build yet)";
#endif
}  // namespace strata::bench
