#include "examples/lm/causal_lm.h"

namespace strata::lm {

std::string_view activation_checkpointing_name(ActivationCheckpointing mode) {
  switch (mode) {
    case ActivationCheckpointing::kOff: return "off";
    case ActivationCheckpointing::kDevice: return "device";
    case ActivationCheckpointing::kPinnedHost: return "pinned";
  }
  return "?";
}

}  // namespace strata::lm
