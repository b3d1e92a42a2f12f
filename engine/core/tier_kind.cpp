#include "engine/core/tier_kind.h"

#include <string>

namespace strata {

std::string_view tier_name(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kPinned: return "pinned";
    case Tier::kHost: return "host";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

std::string_view placement_name(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kPinned:
    case Tier::kHost: return "cpu";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

StatusOr<Tier> parse_placement(std::string_view text, bool pin_memory) {
  if (text == "device" || text == "none") return Tier::kDevice;
  if (text == "cpu") return pin_memory ? Tier::kPinned : Tier::kHost;
  if (text == "nvme") return Tier::kNvme;
  return InvalidArgumentError("unknown placement \"" + std::string(text) + "\": expected device (or none), cpu or nvme");
}

}  // namespace strata
