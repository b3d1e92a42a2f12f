#include "engine/core/scheduler_config.h"

#include <algorithm>
#include <utility>

namespace strata {

std::string_view scheduler_type_name(SchedulerType type) {
  switch (type) {
    case SchedulerType::kNone: return "none";
    case SchedulerType::kWarmupLR: return "WarmupLR";
    case SchedulerType::kWarmupDecayLR: return "WarmupDecayLR";
    case SchedulerType::kWarmupCosineLR: return "WarmupCosineLR";
  }
  return "?";
}

std::vector<std::string_view> scheduler_parameters(SchedulerType type) {
  switch (type) {
    case SchedulerType::kNone: return {};
    case SchedulerType::kWarmupLR: return {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"};
    case SchedulerType::kWarmupDecayLR:
      return {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"};
    case SchedulerType::kWarmupCosineLR:
      return {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"};
  }
  return {};
}

std::vector<std::string_view> misplaced_scheduler_parameters(const SchedulerConfig& config) {
  const std::pair<std::string_view, bool> given[] = {{"warmup_min_lr", config.warmup_min_lr.has_value()},
                                                     {"warmup_max_lr", config.warmup_max_lr.has_value()},
                                                     {"warmup_num_steps", config.warmup_num_steps.has_value()},
                                                     {"warmup_type", config.warmup_type.has_value()},
                                                     {"total_num_steps", config.total_num_steps.has_value()},
                                                     {"warmup_min_ratio", config.warmup_min_ratio.has_value()},
                                                     {"cos_min_ratio", config.cos_min_ratio.has_value()}};
  const std::vector<std::string_view> accepted = scheduler_parameters(config.type);
  std::vector<std::string_view> misplaced;
  for (const auto& [name, set] : given)
    if (set && std::find(accepted.begin(), accepted.end(), name) == accepted.end()) misplaced.push_back(name);
  return misplaced;
}

}  // namespace strata
