#include "offload/offload_util.h"

#include <cstdio>

namespace strata::offload_internal {

std::string format_bytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return std::to_string(bytes) + " bytes";
  char scaled[32];
  std::snprintf(scaled, sizeof(scaled), "%.1f %s", value, kUnits[unit]);
  return std::to_string(bytes) + " bytes (" + scaled + ")";
}

}  // namespace strata::offload_internal
