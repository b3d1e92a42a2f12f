#include <cstdio>
#include <cstdlib>
#include <string>

#include "engine/core/log.h"
#include "tests/fuzz/fuzz_targets.h"

namespace strata::fuzz {

void fuzz_invariant_failed(std::string_view what) {
  std::fprintf(stderr, "fuzz invariant broken: %s\n", std::string(what).c_str());
  std::abort();
}

void fuzz_quiet_logs() { set_log_level(LogLevel::kError); }

}  // namespace strata::fuzz
