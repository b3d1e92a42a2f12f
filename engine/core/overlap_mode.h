// When the optimizer runs relative to the next step: the engine's overlap modes, as
// strata.optimizer_overlap names them.
#pragma once

#include <cstdint>
#include <string_view>

#include "engine/core/status.h"

namespace strata {

// When the optimizer runs relative to the next step (docs/architecture.md, "One step,
// stage by stage").
enum class OverlapMode : uint8_t {
  // Global norm and overflow are reduced at the end of backward; then Adam runs group by
  // group in forward order while the next forward starts, forward(g) waiting only for
  // Adam(g). With clipping off and no loss scaling, Adam(g) starts as soon as g's last
  // gradients land, during backward.
  kExact,
  // Step t's update overlaps step t+1's forward and backward: the parameters a step uses
  // are one update stale.
  kDelayed,
};
std::string_view overlap_mode_name(OverlapMode mode);  // "exact" | "delayed"
StatusOr<OverlapMode> parse_overlap_mode(std::string_view text);

}  // namespace strata
