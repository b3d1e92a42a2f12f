// libFuzzer's entry point for one harness of fuzz_targets.h, chosen at build time with
// -DSTRATA_FUZZ_ENTRY=<function> (tests/fuzz/CMakeLists.txt builds one executable each).
#include <cstddef>
#include <cstdint>

#include "tests/fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  strata::fuzz::fuzz_quiet_logs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return strata::fuzz::STRATA_FUZZ_ENTRY(data, size); }
