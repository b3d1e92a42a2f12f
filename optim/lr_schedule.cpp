#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/core/log.h"

namespace strata {

namespace {

std::string number_text(double value) {
  std::ostringstream out;
  out.precision(17);
  out << value;
  return out.str();
}

std::string_view warmup_type_text(WarmupType type) { return type == WarmupType::kLinear ? "linear" : "log"; }

Status parameter_error(std::string_view name, const std::string& value, std::string_view expected) {
  return InvalidArgumentError("scheduler.params." + std::string(name) + " = " + value + ": expected " +
                              std::string(expected));
}

}  // namespace

StatusOr<SchedulerType> parse_scheduler_type(std::string_view text) {
  if (text == "WarmupLR") return SchedulerType::kWarmupLR;
  if (text == "WarmupDecayLR") return SchedulerType::kWarmupDecayLR;
  if (text == "WarmupCosineLR") return SchedulerType::kWarmupCosineLR;
  if (text == "none" || text.empty()) return SchedulerType::kNone;
  return InvalidArgumentError("scheduler.type '" + std::string(text) +
                              "' is not one of WarmupLR, WarmupDecayLR, WarmupCosineLR (or none)");
}

StatusOr<LrSchedule> LrSchedule::create(const SchedulerConfig& config, double base_lr) {
  const std::string type_text(scheduler_type_name(config.type));
  if (!std::isfinite(base_lr) || base_lr < 0.0) {
    return InvalidArgumentError("scheduler " + type_text + ": the optimizer's lr (optimizer.params.lr) = " +
                                number_text(base_lr) + ": expected a finite number >= 0");
  }

  // The parameters each type takes (DeepSpeed's constructors): the config loader's table.
  const std::vector<std::string_view> misplaced = misplaced_scheduler_parameters(config);
  if (!misplaced.empty()) {
    std::string list;
    for (std::string_view name : scheduler_parameters(config.type)) list += (list.empty() ? "" : ", ") + std::string(name);
    return InvalidArgumentError("scheduler.params." + std::string(misplaced.front()) + " does not apply to scheduler " +
                                type_text + (list.empty() ? " (it takes no parameters)" : " (its parameters: " + list + ")"));
  }

  LrSchedule schedule;
  schedule.type_ = config.type;
  schedule.base_lr_ = base_lr;
  if (config.type == SchedulerType::kNone) return schedule;

  // warmup_num_steps: DeepSpeed requires a positive integer and then uses max(2, n).
  const int64_t warmup_steps = config.warmup_num_steps.value_or(1000);
  if (warmup_steps <= 0) return parameter_error("warmup_num_steps", std::to_string(warmup_steps), "a positive integer");
  schedule.warmup_num_steps_ = std::max<int64_t>(2, warmup_steps);
  schedule.warmup_type_ = config.warmup_type.value_or(WarmupType::kLog);

  auto check_rate = [](std::string_view name, double value) -> Status {
    if (!std::isfinite(value) || value < 0.0) return parameter_error(name, number_text(value), "a finite learning rate >= 0");
    return Status::Ok();
  };
  auto check_ratio = [](std::string_view name, double value) -> Status {
    if (!std::isfinite(value) || value < 0.0 || value > 1.0) return parameter_error(name, number_text(value), "a ratio in [0, 1]");
    return Status::Ok();
  };

  if (config.type == SchedulerType::kWarmupLR || config.type == SchedulerType::kWarmupDecayLR) {
    schedule.warmup_min_lr_ = config.warmup_min_lr.value_or(0.0);
    // WarmupLR's warmup_max_lr defaults to the optimizer's lr; WarmupDecayLR's to 0.001.
    schedule.warmup_max_lr_ =
        config.warmup_max_lr.value_or(config.type == SchedulerType::kWarmupLR ? base_lr : 0.001);
    STRATA_RETURN_IF_ERROR(check_rate("warmup_min_lr", schedule.warmup_min_lr_));
    STRATA_RETURN_IF_ERROR(check_rate("warmup_max_lr", schedule.warmup_max_lr_));
  }
  if (config.type == SchedulerType::kWarmupDecayLR || config.type == SchedulerType::kWarmupCosineLR) {
    if (!config.total_num_steps) {
      return InvalidArgumentError("scheduler.params.total_num_steps is required for scheduler " + type_text +
                                  " (the step count the decay ends at)");
    }
    schedule.total_num_steps_ = *config.total_num_steps;
    if (schedule.total_num_steps_ <= 0) {
      return parameter_error("total_num_steps", std::to_string(schedule.total_num_steps_), "a positive integer");
    }
    if (schedule.total_num_steps_ < schedule.warmup_num_steps_) {
      // DeepSpeed warns and carries on: the decay window is then empty.
      STRATA_LOG(kWarn) << "scheduler " << type_text << ": total_num_steps " << schedule.total_num_steps_
                        << " is less than warmup_num_steps " << schedule.warmup_num_steps_;
    }
  }
  if (config.type == SchedulerType::kWarmupCosineLR) {
    schedule.warmup_min_ratio_ = config.warmup_min_ratio.value_or(0.0);
    schedule.cos_min_ratio_ = config.cos_min_ratio.value_or(0.0001);
    STRATA_RETURN_IF_ERROR(check_ratio("warmup_min_ratio", schedule.warmup_min_ratio_));
    STRATA_RETURN_IF_ERROR(check_ratio("cos_min_ratio", schedule.cos_min_ratio_));
  }
  return schedule;
}

double LrSchedule::warmup_fraction(int64_t iteration) const {
  if (warmup_type_ == WarmupType::kLog) {
    return std::log(static_cast<double>(iteration) + 1.0) / std::log(static_cast<double>(warmup_num_steps_));
  }
  return static_cast<double>(iteration) / static_cast<double>(warmup_num_steps_);
}

double LrSchedule::lr_for_iteration(int64_t iteration) const {
  switch (type_) {
    case SchedulerType::kNone: return base_lr_;
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR: {
      if (iteration < 0) return warmup_min_lr_;
      double gamma = 1.0;
      if (iteration < warmup_num_steps_) {
        gamma = warmup_fraction(iteration);
      } else if (type_ == SchedulerType::kWarmupDecayLR) {
        const double remaining = static_cast<double>(total_num_steps_ - iteration);
        const double window = std::max(1.0, static_cast<double>(total_num_steps_ - warmup_num_steps_));
        gamma = std::max(0.0, remaining / window);
      }
      return warmup_min_lr_ + (warmup_max_lr_ - warmup_min_lr_) * gamma;
    }
    case SchedulerType::kWarmupCosineLR: {
      if (iteration < 0) return 0.0;
      double ratio;
      if (iteration < warmup_num_steps_) {
        ratio = warmup_min_ratio_ + warmup_fraction(iteration) * (1.0 - warmup_min_ratio_);
      } else {
        const double since_warmup = static_cast<double>(iteration - warmup_num_steps_ + 1);
        const double window = static_cast<double>(std::max<int64_t>(1, total_num_steps_ - warmup_num_steps_));
        const double progress = std::min(1.0, since_warmup / window);
        ratio = std::max(0.0, cos_min_ratio_ + (1.0 - cos_min_ratio_) * (1.0 + std::cos(std::numbers::pi * progress)) / 2.0);
      }
      return base_lr_ * ratio;
    }
  }
  return base_lr_;
}

Status LrSchedule::restore(const LrScheduleState& state) {
  if (state.type != type_) {
    return InvalidArgumentError("scheduler state was saved by " + std::string(scheduler_type_name(state.type)) +
                                " but the configured scheduler is " + std::string(type_name()));
  }
  if (state.last_batch_iteration < -1) {
    return InvalidArgumentError("scheduler state: last_batch_iteration " + std::to_string(state.last_batch_iteration) +
                                " is below -1");
  }
  last_batch_iteration_ = state.last_batch_iteration;
  return Status::Ok();
}

std::string LrSchedule::state_json() const {
  nlohmann::json json;
  json["type"] = std::string(type_name());
  json["last_batch_iteration"] = last_batch_iteration_;
  return json.dump();
}

Status LrSchedule::restore_json(std::string_view text) {
  nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return InvalidArgumentError("scheduler state is not a JSON object: '" + std::string(text.substr(0, 200)) + "'");
  }
  const auto type_it = json.find("type");
  const auto iteration_it = json.find("last_batch_iteration");
  if (type_it == json.end() || !type_it->is_string()) {
    return InvalidArgumentError("scheduler state: missing string field 'type' in '" + std::string(text.substr(0, 200)) + "'");
  }
  if (iteration_it == json.end() || !iteration_it->is_number_integer()) {
    return InvalidArgumentError("scheduler state: missing integer field 'last_batch_iteration' in '" +
                                std::string(text.substr(0, 200)) + "'");
  }
  STRATA_ASSIGN_OR_RETURN(const SchedulerType type, parse_scheduler_type(type_it->get<std::string>()));
  return restore(LrScheduleState{type, iteration_it->get<int64_t>()});
}

std::string LrSchedule::describe() const {
  std::ostringstream out;
  out << type_name() << "(";
  switch (type_) {
    case SchedulerType::kNone: out << "lr=" << base_lr_; break;
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR:
      out << "warmup_min_lr=" << warmup_min_lr_ << ", warmup_max_lr=" << warmup_max_lr_
          << ", warmup_num_steps=" << warmup_num_steps_ << ", warmup_type=" << warmup_type_text(warmup_type_);
      if (type_ == SchedulerType::kWarmupDecayLR) out << ", total_num_steps=" << total_num_steps_;
      break;
    case SchedulerType::kWarmupCosineLR:
      out << "lr=" << base_lr_ << ", total_num_steps=" << total_num_steps_ << ", warmup_num_steps=" << warmup_num_steps_
          << ", warmup_min_ratio=" << warmup_min_ratio_ << ", cos_min_ratio=" << cos_min_ratio_
          << ", warmup_type=" << warmup_type_text(warmup_type_);
      break;
  }
  out << ")";
  return out.str();
}

}  // namespace strata
