#include "engine/core/overlap_mode.h"

#include <string>

namespace strata {

std::string_view overlap_mode_name(OverlapMode mode) { return mode == OverlapMode::kDelayed ? "delayed" : "exact"; }

StatusOr<OverlapMode> parse_overlap_mode(std::string_view text) {
  if (text == "exact") return OverlapMode::kExact;
  if (text == "delayed") return OverlapMode::kDelayed;
  return InvalidArgumentError("unknown optimizer overlap \"" + std::string(text) + "\": expected exact or delayed");
}

}  // namespace strata
