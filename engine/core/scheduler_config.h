// The learning-rate schedule's settings (the config's scheduler section, DeepSpeed's
// vocabulary): what the config loader fills and optim/lr_schedule.h runs.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace strata {

enum class SchedulerType : uint8_t { kNone, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR };
enum class WarmupType : uint8_t { kLog, kLinear };  // DeepSpeed's warmup_type "log" | "linear"
std::string_view scheduler_type_name(SchedulerType type);        // "none" | "WarmupLR" | ...

// scheduler: DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR. Parameters that a
// type does not take stay unset; finalize() fills the defaults of the chosen type and
// rejects parameters that do not belong to it.
struct SchedulerConfig {
  SchedulerType type = SchedulerType::kNone;
  std::optional<double> warmup_min_lr;        // WarmupLR, WarmupDecayLR (default 0)
  std::optional<double> warmup_max_lr;        // WarmupLR (default optimizer lr), WarmupDecayLR (default 0.001)
  std::optional<int64_t> warmup_num_steps;    // all three (default 1000)
  std::optional<WarmupType> warmup_type;      // all three (default log)
  std::optional<int64_t> total_num_steps;     // WarmupDecayLR, WarmupCosineLR (required)
  std::optional<double> warmup_min_ratio;     // WarmupCosineLR (default 0)
  std::optional<double> cos_min_ratio;        // WarmupCosineLR (default 0.0001)
};

// The scheduler.params keys a scheduler type takes (DeepSpeed's constructors), and those
// of `config` that are set but do not apply to its type. One table for the config loader
// and for optim/'s LrSchedule.
std::vector<std::string_view> scheduler_parameters(SchedulerType type);
std::vector<std::string_view> misplaced_scheduler_parameters(const SchedulerConfig& config);

}  // namespace strata
