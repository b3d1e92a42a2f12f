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

StatusOr<MicroBatchLosses> CausalLm::run_micro_batch(const TokenBatch* train, const TokenBatch* eval, float grad_scale) {
  STRATA_ASSIGN_OR_RETURN(const QueuedMicroBatch queued, queue_micro_batch(train, eval, grad_scale));
  return collect(queued);
}

}  // namespace strata::lm
