#include <string>
#include <utility>
#include <vector>

#include "engine/core/config.h"
#include "engine/core/config_schema.h"
#include "engine/core/log.h"

namespace strata {

using namespace config_detail;

namespace {

// finalize()'s checks, one concern each: each adds what it finds wrong to `errors` (`in`
// names the source and overrides) and fills in what the others derive from.

void finalize_world_size(StrataConfig& config, int world_size, const std::string& in, std::vector<std::string>& errors) {
  if (world_size < 0) {
    errors.push_back("finalize: world_size must be >= 0 (0 = as configured), got " + std::to_string(world_size));
  } else if (world_size > 0) {
    if (config.was_given("strata.world_size") && config.strata.world_size != world_size) {
      errors.push_back("strata.world_size is " + std::to_string(config.strata.world_size) + in + " but the run has " +
                       std::to_string(world_size) + " ranks");
    } else {
      config.strata.world_size = world_size;
    }
  }
}

// train_batch_size = micro * accumulation * world_size (DeepSpeed's rule).
void finalize_batch_sizes(StrataConfig& config, const std::string& in, std::vector<std::string>& errors) {
  const int64_t ranks = config.strata.world_size;
  std::optional<int64_t>& total = config.train_batch_size;
  std::optional<int64_t>& micro = config.train_micro_batch_size_per_gpu;
  std::optional<int64_t>& accumulation = config.gradient_accumulation_steps;
  const std::string world = "world_size (" + std::to_string(ranks) + ")";
  auto show = [](const char* name, const std::optional<int64_t>& v) {
    return std::string(name) + " (" + (v ? std::to_string(*v) : std::string("not set")) + ")";
  };
  // numerator / (product of factors), or an error naming every number involved.
  auto derive = [&](const std::vector<std::pair<const char*, int64_t>>& factors, const char* derived_name,
                    const char* note) -> std::optional<int64_t> {
    int64_t denominator = 1;
    std::vector<std::string> shown;
    for (const auto& [name, value] : factors) {
      denominator *= value;
      shown.push_back(std::string(name) + " (" + std::to_string(value) + ")");
    }
    if (*total % denominator == 0) return *total / denominator;
    std::string product = join(shown, " * ");
    if (factors.size() > 1) product += " = " + std::to_string(denominator);
    errors.push_back(show("train_batch_size", total) + " is not a multiple of " + product + ", so " + derived_name +
                     " cannot be derived" + note + in);
    return std::nullopt;
  };
  if (total && micro && accumulation) {
    if (*total != *micro * *accumulation * ranks) {
      errors.push_back(show("train_batch_size", total) + " must equal " + show("train_micro_batch_size_per_gpu", micro) + " * " +
                       show("gradient_accumulation_steps", accumulation) + " * " + world + " = " +
                       std::to_string(*micro * *accumulation * ranks) + in);
    }
  } else if (total && micro) {
    accumulation = derive({{"train_micro_batch_size_per_gpu", *micro}, {"world_size", ranks}}, "gradient_accumulation_steps", "");
  } else if (total && accumulation) {
    micro = derive({{"gradient_accumulation_steps", *accumulation}, {"world_size", ranks}}, "train_micro_batch_size_per_gpu", "");
  } else if (micro && accumulation) {
    total = *micro * *accumulation * ranks;
  } else if (total) {
    micro = derive({{"world_size", ranks}}, "train_micro_batch_size_per_gpu",
                   " (gradient_accumulation_steps is not set and counts as 1)");
    if (micro) accumulation = 1;
  } else {
    // Only micro, only accumulation, or none: the missing ones default to 1.
    if (!micro) micro = 1;
    if (!accumulation) accumulation = 1;
    total = *micro * *accumulation * ranks;
  }
}

void finalize_precision(StrataConfig& config, const std::string& in, std::vector<std::string>& errors) {
  if (config.fp16.enabled && config.bf16.enabled) {
    errors.push_back("fp16.enabled and bf16.enabled are both true" + in + "; enable one of them");
  } else if (config.was_given("strata.param_dtype") && config.strata.param_dtype.has_value()) {
    const DType dtype = *config.strata.param_dtype;
    if ((config.bf16.enabled && dtype != DType::kBFloat16) || (config.fp16.enabled && dtype != DType::kFloat16)) {
      errors.push_back(std::string("strata.param_dtype is \"") + std::string(dtype_name(dtype)) + "\" but " +
                       (config.bf16.enabled ? "bf16.enabled" : "fp16.enabled") + " is true" + in);
    } else {
      config.bf16.enabled = dtype == DType::kBFloat16;
      config.fp16.enabled = dtype == DType::kFloat16;
    }
  } else {
    config.strata.param_dtype = config.bf16.enabled ? DType::kBFloat16 : config.fp16.enabled ? DType::kFloat16 : DType::kFloat32;
  }
}

void finalize_placements(StrataConfig& config, const std::string& in, std::vector<std::string>& errors) {
  // NVMe placement needs a directory.
  if (config.strata.nvme_path.empty()) {
    const std::pair<Tier, const char*> offloads[] = {
        {config.zero.offload_param.device, "zero_optimization.offload_param"},
        {config.zero.offload_optimizer.device, "zero_optimization.offload_optimizer"}};
    for (const auto& [placement, section] : offloads) {
      if (placement == Tier::kNvme) {
        errors.push_back(std::string(section) + ".device is \"nvme\" but " + section +
                         ".nvme_path is not set (nor strata.nvme_path or --nvme-path)" + in);
      }
    }
  }

  // Host placements: the engine keeps every host buffer in one arena, pinned or not.
  OffloadParamConfig& param = config.zero.offload_param;
  OffloadOptimizerConfig& optimizer = config.zero.offload_optimizer;
  const bool pinned = param.pin_memory && optimizer.pin_memory;
  if (param.pin_memory != optimizer.pin_memory) {
    STRATA_LOG(kWarn) << config.source << ": zero_optimization.offload_param.pin_memory is " << (param.pin_memory ? "true" : "false")
                      << " and zero_optimization.offload_optimizer.pin_memory is " << (optimizer.pin_memory ? "true" : "false")
                      << "; Strata keeps all host buffers in one arena, so all of them are pageable";
  }
  for (Tier* tier : {&param.device, &optimizer.device}) {
    if (*tier == Tier::kPinned || *tier == Tier::kHost) *tier = pinned ? Tier::kPinned : Tier::kHost;
  }
}

// Settings Strata runs differently from what they say, with a warning.
void warn_about_substitutions(StrataConfig& config) {
  // ZeRO stage.
  if (config.zero.stage != 3) {
    STRATA_LOG(kWarn) << config.source << ": zero_optimization.stage is " << config.zero.stage
                      << "; Strata implements stage 3 only and runs it (the same results, with parameters, gradients and "
                         "optimizer state all partitioned)";
    config.zero.stage = 3;
  }

  // Optimizer.
  if (config.optimizer.type == OptimizerType::kAdamW && !config.optimizer.adam_w_mode) {
    STRATA_LOG(kWarn) << config.source << ": optimizer.params.adam_w_mode is false but optimizer.type is AdamW; "
                         "weight decay stays decoupled, as in DeepSpeed";
  }
}

void finalize_scheduler(StrataConfig& config, const std::string& in, std::vector<std::string>& errors) {
  // Each type's parameters and defaults (DeepSpeed's).
  SchedulerConfig& sched = config.scheduler;
  std::vector<std::string> accepted;
  for (std::string_view name : scheduler_parameters(sched.type)) accepted.emplace_back(name);
  const std::vector<std::string_view> misplaced = misplaced_scheduler_parameters(sched);
  const bool params_ok = misplaced.empty();
  for (std::string_view name : misplaced) {
    if (sched.type == SchedulerType::kNone) {
      errors.push_back("scheduler.params." + std::string(name) + " is set but scheduler.type is not" + in);
    } else {
      errors.push_back("scheduler.params." + std::string(name) + " does not apply to " +
                       std::string(scheduler_type_name(sched.type)) + " (its parameters: " + join(accepted, ", ") + ")" + in);
    }
  }
  if (params_ok && sched.type != SchedulerType::kNone) {
    if (!sched.warmup_num_steps) sched.warmup_num_steps = 1000;
    if (!sched.warmup_type) sched.warmup_type = WarmupType::kLog;
    if (sched.type == SchedulerType::kWarmupLR || sched.type == SchedulerType::kWarmupDecayLR) {
      if (!sched.warmup_min_lr) sched.warmup_min_lr = 0.0;
      if (!sched.warmup_max_lr) sched.warmup_max_lr = sched.type == SchedulerType::kWarmupLR ? config.optimizer.lr : 0.001;
    }
    if (sched.type == SchedulerType::kWarmupCosineLR) {
      if (!sched.warmup_min_ratio) sched.warmup_min_ratio = 0.0;
      if (!sched.cos_min_ratio) sched.cos_min_ratio = 0.0001;
    }
    if (sched.type != SchedulerType::kWarmupLR && !sched.total_num_steps) {
      errors.push_back(std::string("scheduler.params.total_num_steps is required for ") +
                       std::string(scheduler_type_name(sched.type)) + in);
    }
  }
}

}  // namespace

Status finalize(StrataConfig& config, int world_size, const ConfigExtension* extension) {
  std::vector<std::string> errors;
  const std::string in = " in " + config.source + overrides_note(config);
  finalize_world_size(config, world_size, in, errors);
  finalize_batch_sizes(config, in, errors);
  finalize_precision(config, in, errors);
  finalize_placements(config, in, errors);
  warn_about_substitutions(config);
  finalize_scheduler(config, in, errors);
  if (extension != nullptr && extension->check) extension->check(config, in, errors);
  if (!errors.empty()) return combine_errors(errors, config.source + overrides_note(config));
  return {};
}

}  // namespace strata
