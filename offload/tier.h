// The tiers bytes can live in, and the placement vocabulary of the config and command
// lines (`device|cpu|nvme`, where `cpu` means pinned host memory unless pin_memory is
// false, then pageable host memory).
#pragma once

#include <cstddef>
#include <string_view>

#include "engine/core/status.h"

namespace strata {

enum class Tier : uint8_t {
  kDevice,  // the compute device's memory (under its budget)
  kPinned,  // page-locked host memory: DMA-able by the GPU and registered with io_uring
  kHost,    // pageable host memory
  kNvme,    // a file under nvme_path, O_DIRECT, 4 KiB aligned
};

std::string_view tier_name(Tier tier);  // "device" | "pinned" | "host" | "nvme"
// True for tiers whose bytes the CPU can touch directly.
constexpr bool tier_is_host(Tier tier) { return tier == Tier::kPinned || tier == Tier::kHost; }
// The alignment a buffer of this tier needs for DMA / O_DIRECT.
constexpr size_t tier_alignment(Tier tier) { return tier == Tier::kDevice ? 256 : 4096; }

// Parses a placement (`device`, `cpu`, `nvme`; `none` is an alias of `device`, as in
// DeepSpeed's offload_*.device) into a tier; `pin_memory` picks pinned or pageable for `cpu`.
StatusOr<Tier> parse_placement(std::string_view text, bool pin_memory = true);

}  // namespace strata
