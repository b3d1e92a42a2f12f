#include "engine/core/config.h"


#include <algorithm>

#include "engine/core/gpu.h"

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

std::string_view overlap_mode_name(OverlapMode mode) { return mode == OverlapMode::kDelayed ? "delayed" : "exact"; }

std::string_view save_failure_policy_name(SaveFailurePolicy policy) {
  return policy == SaveFailurePolicy::kContinue ? "continue" : "stop";
}

StatusOr<OverlapMode> parse_overlap_mode(std::string_view text) {
  if (text == "exact") return OverlapMode::kExact;
  if (text == "delayed") return OverlapMode::kDelayed;
  return InvalidArgumentError("unknown optimizer overlap \"" + std::string(text) + "\": expected exact or delayed");
}

std::string_view io_engine_kind_name(IoEngineKind kind) {
  switch (kind) {
    case IoEngineKind::kAuto: return "auto";
    case IoEngineKind::kIoUring: return "io_uring";
    case IoEngineKind::kPsync: return "psync";
  }
  return "?";
}

StatusOr<IoEngineKind> parse_io_engine_kind(std::string_view text) {
  if (text == "auto") return IoEngineKind::kAuto;
  if (text == "io_uring" || text == "uring") return IoEngineKind::kIoUring;
  if (text == "psync" || text == "pread") return IoEngineKind::kPsync;
  return InvalidArgumentError("unknown I/O engine \"" + std::string(text) + "\": expected auto, io_uring or psync");
}

std::string_view optimizer_type_name(OptimizerType type) { return type == OptimizerType::kAdamW ? "AdamW" : "Adam"; }

std::string_view scheduler_type_name(SchedulerType type) {
  switch (type) {
    case SchedulerType::kNone: return "none";
    case SchedulerType::kWarmupLR: return "WarmupLR";
    case SchedulerType::kWarmupDecayLR: return "WarmupDecayLR";
    case SchedulerType::kWarmupCosineLR: return "WarmupCosineLR";
  }
  return "?";
}

std::string_view data_kind_name(DataKind kind) {
  switch (kind) {
    case DataKind::kSynthetic: return "synthetic";
    case DataKind::kText: return "text";
    case DataKind::kTokens: return "tokens";
  }
  return "?";
}

bool decoupled_weight_decay(const OptimizerConfig& optimizer) {
  return optimizer.type == OptimizerType::kAdamW || optimizer.adam_w_mode;
}

DeviceKind resolve_device(const StrataConfig& config) {
  if (config.strata.device.has_value()) return *config.strata.device;
  return gpu_available() ? DeviceKind::kCuda : DeviceKind::kCpu;
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
