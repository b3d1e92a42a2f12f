// What a tier's buffers need. The Tier enum itself, its names and the placement
// vocabulary of configs and command lines (`device|cpu|nvme`, where `cpu` means pinned
// host memory unless pin_memory is false, then pageable host memory) live in
// engine/core/tier_kind.h, the lowest floor that needs them.
#pragma once

#include <cstddef>

#include "engine/core/tier_kind.h"

namespace strata {

// True for tiers whose bytes the CPU can touch directly.
constexpr bool tier_is_host(Tier tier) { return tier == Tier::kPinned || tier == Tier::kHost; }
// The alignment a buffer of this tier needs for DMA / O_DIRECT.
constexpr size_t tier_alignment(Tier tier) { return tier == Tier::kDevice ? 256 : 4096; }

}  // namespace strata
