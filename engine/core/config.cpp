#include "engine/core/config.h"

#include "engine/core/gpu.h"

namespace strata {

std::string_view save_failure_policy_name(SaveFailurePolicy policy) {
  return policy == SaveFailurePolicy::kContinue ? "continue" : "stop";
}

std::string_view optimizer_type_name(OptimizerType type) { return type == OptimizerType::kAdamW ? "AdamW" : "Adam"; }

bool decoupled_weight_decay(const OptimizerConfig& optimizer) {
  return optimizer.type == OptimizerType::kAdamW || optimizer.adam_w_mode;
}

DeviceKind resolve_device(const StrataConfig& config) {
  if (config.strata.device.has_value()) return *config.strata.device;
  return gpu_available() ? DeviceKind::kCuda : DeviceKind::kCpu;
}

}  // namespace strata
