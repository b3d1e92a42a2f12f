// Learning-rate schedules: DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR
// (deepspeed.runtime.lr_schedules), with DeepSpeed's parameter names, defaults and
// formulas, so a user's `scheduler` section gives the rates DeepSpeed would.
//
// Counting, as DeepSpeed counts. DeepSpeed's scheduler starts at last_batch_iteration =
// -1 and its engine calls scheduler.step() after every update that was applied (an fp16
// step skipped for overflow does not advance it). So the update that follows
// `updates_applied` applied updates uses
//
//   lr_at(updates_applied) = lr_for_iteration(updates_applied - 1)
//
// where lr_for_iteration(i) is DeepSpeed's get_lr() with last_batch_iteration = i:
//
//   W = max(2, warmup_num_steps)        (DeepSpeed clamps it the same way)
//   warmup(i) = ln(i + 1) / ln(W)       warmup_type "log"
//             = i / W                   warmup_type "linear"
//
//   WarmupLR:       i < 0: warmup_min_lr
//                   i < W: warmup_min_lr + (warmup_max_lr - warmup_min_lr) * warmup(i)
//                   else:  warmup_max_lr
//   WarmupDecayLR:  as WarmupLR, but for i >= W the factor is
//                   max(0, (total_num_steps - i) / max(1, total_num_steps - W))
//   WarmupCosineLR: lr = base_lr * ratio(i), base_lr = the optimizer's lr
//                   i < 0: ratio 0  (so DeepSpeed's first update runs at lr 0)
//                   i < W: warmup_min_ratio + (1 - warmup_min_ratio) * warmup(i)
//                   else:  p = min(1, (i - W + 1) / max(1, total_num_steps - W))
//                          max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi p)) / 2)
//   none:           base_lr at every step
//
// Use, stateless:   double lr = schedule.lr_at(engine.steps_taken());
// or stateful, as DeepSpeed's engine does:
//   engine.begin_step(schedule.current_lr()); ...; if (!report.skipped) schedule.step();
// The state for a checkpoint is last_batch_iteration (DeepSpeed's state_dict); state()
// and restore() carry it with the type, so a resume under another type is refused.
#pragma once

#include <cstdint>
#include <string>

#include "engine/core/scheduler_config.h"
#include "engine/core/status.h"

namespace strata {

// What a checkpoint keeps of a schedule.
struct LrScheduleState {
  SchedulerType type = SchedulerType::kNone;
  int64_t last_batch_iteration = -1;  // DeepSpeed's counter: applied updates - 1
};

class LrSchedule {
 public:
  // A schedule from the config's scheduler section (finalize() may or may not have run:
  // unset parameters take DeepSpeed's defaults here too) and the optimizer's lr
  // (`base_lr`: the rate of type none, WarmupLR's default warmup_max_lr, and
  // WarmupCosineLR's scale). Errors (kInvalidArgument) name the bad parameter as
  // "scheduler.params.<name>", its value and what was expected; a parameter that the
  // type does not take is an error too. Starts at last_batch_iteration = -1.
  static StatusOr<LrSchedule> create(const SchedulerConfig& config, double base_lr);

  SchedulerType type() const { return type_; }
  std::string_view type_name() const { return scheduler_type_name(type_); }

  // DeepSpeed's get_lr() at last_batch_iteration = `iteration` (any value >= -1; values
  // below -1 act as -1).
  double lr_for_iteration(int64_t iteration) const;
  // The rate of the update that follows `updates_applied` applied updates.
  double lr_at(int64_t updates_applied) const { return lr_for_iteration(updates_applied - 1); }

  // Stateful use: the rate of the next update, and the advance after an applied update.
  double current_lr() const { return lr_for_iteration(last_batch_iteration_); }
  void step() { ++last_batch_iteration_; }
  int64_t last_batch_iteration() const { return last_batch_iteration_; }
  // Applied updates so far (last_batch_iteration + 1).
  int64_t updates_applied() const { return last_batch_iteration_ + 1; }
  void set_updates_applied(int64_t updates) { last_batch_iteration_ = updates - 1; }

  LrScheduleState state() const { return {type_, last_batch_iteration_}; }
  // Fails (kInvalidArgument) when the saved type differs from this schedule's or the
  // iteration is below -1.
  Status restore(const LrScheduleState& state);
  // {"type":"WarmupCosineLR","last_batch_iteration":41} and back; for the trainer's
  // checkpoint blob.
  std::string state_json() const;
  Status restore_json(std::string_view json);

  // One line for logs: "WarmupCosineLR(total_num_steps=100, warmup_num_steps=10, ...)".
  std::string describe() const;

  // The resolved parameters (after defaults and DeepSpeed's clamp of warmup_num_steps).
  double base_lr() const { return base_lr_; }
  double warmup_min_lr() const { return warmup_min_lr_; }
  double warmup_max_lr() const { return warmup_max_lr_; }
  int64_t warmup_num_steps() const { return warmup_num_steps_; }
  WarmupType warmup_type() const { return warmup_type_; }
  int64_t total_num_steps() const { return total_num_steps_; }
  double warmup_min_ratio() const { return warmup_min_ratio_; }
  double cos_min_ratio() const { return cos_min_ratio_; }

 private:
  LrSchedule() = default;
  // The warmup factor in [0, 1) for 0 <= iteration < W.
  double warmup_fraction(int64_t iteration) const;

  SchedulerType type_ = SchedulerType::kNone;
  double base_lr_ = 0.0;
  double warmup_min_lr_ = 0.0;
  double warmup_max_lr_ = 0.0;
  int64_t warmup_num_steps_ = 2;     // W, already max(2, configured)
  WarmupType warmup_type_ = WarmupType::kLog;
  int64_t total_num_steps_ = 0;
  double warmup_min_ratio_ = 0.0;
  double cos_min_ratio_ = 0.0001;
  int64_t last_batch_iteration_ = -1;
};

// Parses DeepSpeed's type name ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", or "none").
StatusOr<SchedulerType> parse_scheduler_type(std::string_view text);

}  // namespace strata
