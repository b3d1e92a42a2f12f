// The tiers bytes live in, as configs and command lines name them (engine/core/config.h
// reads them from the file; offload/tier.h adds what the tiers' buffers need).
#pragma once

#include <cstdint>
#include <string_view>

#include "engine/core/status.h"

namespace strata {

// Where bytes live (the README's table of tiers; docs/architecture.md says where a tier
// is added). Configs and command lines name a placement with three words,
// `device|cpu|nvme` (DeepSpeed's offload device "none" is `device`); `cpu` is kPinned, or
// kHost when pin_memory is false (finalize() decides).
// offload/tier.h adds what the tiers' buffers need (alignment, host access).
enum class Tier : uint8_t {
  kDevice,  // the compute device's memory (under its budget)
  kPinned,  // page-locked host memory: DMA-able by the GPU and registered with io_uring
  kHost,    // pageable host memory
  kNvme,    // a file under nvme_path, O_DIRECT, 4 KiB aligned
};
std::string_view tier_name(Tier tier);       // "device" | "pinned" | "host" | "nvme"
std::string_view placement_name(Tier tier);  // "device" | "cpu" (kPinned and kHost) | "nvme"
// Parses a placement (`device`, `cpu`, `nvme`; `none` is an alias of `device`) into a
// tier; `pin_memory` picks kPinned or kHost for `cpu`.
StatusOr<Tier> parse_placement(std::string_view text, bool pin_memory = true);

}  // namespace strata
