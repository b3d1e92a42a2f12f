// The schedules against DeepSpeed's formulas (deepspeed.runtime.lr_schedules), computed
// here by hand at chosen iterations, plus DeepSpeed's counting (the update after k applied
// updates uses last_batch_iteration = k - 1), validation and checkpoint state.
#include "optim/lr_schedule.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "engine/core/config.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

constexpr double kTolerance = 1e-15;

SchedulerConfig warmup_lr(double min_lr, double max_lr, int64_t steps, WarmupType type) {
  SchedulerConfig config;
  config.type = SchedulerType::kWarmupLR;
  config.warmup_min_lr = min_lr;
  config.warmup_max_lr = max_lr;
  config.warmup_num_steps = steps;
  config.warmup_type = type;
  return config;
}

TEST(LrScheduleTest, NoneIsTheOptimizerRate) {
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule schedule, LrSchedule::create(SchedulerConfig{}, 3e-4));
  for (int64_t step : {0, 1, 7, 100000}) EXPECT_EQ(schedule.lr_at(step), 3e-4);
}

TEST(LrScheduleTest, WarmupLrLinear) {
  // min 0.001, max 0.01, W = 10, linear: lr(i) = 0.001 + 0.009 * i / 10 for 0 <= i < 10.
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule schedule, LrSchedule::create(warmup_lr(0.001, 0.01, 10, WarmupType::kLinear), 1.0));
  EXPECT_NEAR(schedule.lr_for_iteration(-1), 0.001, kTolerance);  // before the first scheduler step
  EXPECT_NEAR(schedule.lr_for_iteration(0), 0.001, kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(1), 0.0019, kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(5), 0.0055, kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(9), 0.0091, kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(10), 0.01, kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(12345), 0.01, kTolerance);
  // DeepSpeed's counting: update k+1 (after k applied) runs at iteration k - 1.
  EXPECT_NEAR(schedule.lr_at(0), 0.001, kTolerance);
  EXPECT_NEAR(schedule.lr_at(2), 0.0019, kTolerance);
  EXPECT_NEAR(schedule.lr_at(11), 0.01, kTolerance);
}

TEST(LrScheduleTest, WarmupLrLog) {
  // log warmup: gamma(i) = ln(i + 1) / ln(W).
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule schedule, LrSchedule::create(warmup_lr(0.0, 0.02, 100, WarmupType::kLog), 1.0));
  EXPECT_EQ(schedule.lr_for_iteration(0), 0.0);  // ln(1) = 0
  EXPECT_NEAR(schedule.lr_for_iteration(9), 0.02 * 0.5, kTolerance);  // ln(10) / ln(100) = 1/2
  EXPECT_NEAR(schedule.lr_for_iteration(3), 0.02 * std::log(4.0) / std::log(100.0), kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(98), 0.02 * std::log(99.0) / std::log(100.0), kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(100), 0.02, kTolerance);
  // The default type is log and the default max is the optimizer's lr.
  SchedulerConfig defaults;
  defaults.type = SchedulerType::kWarmupLR;
  defaults.warmup_num_steps = 100;
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule by_default, LrSchedule::create(defaults, 0.02));
  EXPECT_EQ(by_default.warmup_type(), WarmupType::kLog);
  EXPECT_EQ(by_default.warmup_max_lr(), 0.02);
  EXPECT_EQ(by_default.warmup_min_lr(), 0.0);
  for (int64_t i : {0, 3, 9, 50, 98, 99, 100, 5000}) EXPECT_EQ(by_default.lr_for_iteration(i), schedule.lr_for_iteration(i)) << i;
}

TEST(LrScheduleTest, WarmupNumStepsIsClampedToTwoAsDeepSpeedDoes) {
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule schedule, LrSchedule::create(warmup_lr(0.0, 1.0, 1, WarmupType::kLinear), 1.0));
  EXPECT_EQ(schedule.warmup_num_steps(), 2);
  EXPECT_EQ(schedule.lr_for_iteration(0), 0.0);
  EXPECT_EQ(schedule.lr_for_iteration(1), 0.5);
  EXPECT_EQ(schedule.lr_for_iteration(2), 1.0);
}

TEST(LrScheduleTest, WarmupDecayLr) {
  // min 0, max 0.1, W = 4, T = 12, linear. After warmup:
  // lr(i) = 0.1 * max(0, (12 - i) / max(1, 12 - 4)).
  SchedulerConfig config = warmup_lr(0.0, 0.1, 4, WarmupType::kLinear);
  config.type = SchedulerType::kWarmupDecayLR;
  config.total_num_steps = 12;
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule schedule, LrSchedule::create(config, 123.0));
  EXPECT_NEAR(schedule.lr_for_iteration(0), 0.0, kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(2), 0.05, kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(3), 0.075, kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(4), 0.1, kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(6), 0.075, kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(8), 0.05, kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(11), 0.0125, kTolerance);
  EXPECT_EQ(schedule.lr_for_iteration(12), 0.0);
  EXPECT_EQ(schedule.lr_for_iteration(40), 0.0);  // never negative
  // With a nonzero floor the decay ends at warmup_min_lr.
  config.warmup_min_lr = 0.02;
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule floored, LrSchedule::create(config, 1.0));
  EXPECT_NEAR(floored.lr_for_iteration(8), 0.02 + 0.08 * 0.5, kTolerance);
  EXPECT_NEAR(floored.lr_for_iteration(12), 0.02, kTolerance);
  // Its warmup_max_lr default is DeepSpeed's 0.001, not the optimizer's lr.
  SchedulerConfig defaults;
  defaults.type = SchedulerType::kWarmupDecayLR;
  defaults.total_num_steps = 50;
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule by_default, LrSchedule::create(defaults, 0.5));
  EXPECT_EQ(by_default.warmup_max_lr(), 0.001);
  EXPECT_EQ(by_default.warmup_num_steps(), 1000);
}

TEST(LrScheduleTest, WarmupCosineLr) {
  // base 0.5, T = 20, W = 5, warmup_min_ratio 0.1, cos_min_ratio 0.01, linear.
  SchedulerConfig config;
  config.type = SchedulerType::kWarmupCosineLR;
  config.total_num_steps = 20;
  config.warmup_num_steps = 5;
  config.warmup_min_ratio = 0.1;
  config.cos_min_ratio = 0.01;
  config.warmup_type = WarmupType::kLinear;
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule schedule, LrSchedule::create(config, 0.5));
  EXPECT_EQ(schedule.lr_for_iteration(-1), 0.0);  // DeepSpeed: ratio 0 before the first scheduler step
  EXPECT_NEAR(schedule.lr_for_iteration(0), 0.5 * 0.1, kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(2), 0.5 * (0.1 + 0.4 * 0.9), kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(4), 0.5 * (0.1 + 0.8 * 0.9), kTolerance);
  auto cosine = [](double progress) { return 0.5 * (0.01 + 0.99 * (1.0 + std::cos(std::numbers::pi * progress)) / 2.0); };
  // After warmup: progress = (i - W + 1) / (T - W).
  EXPECT_NEAR(schedule.lr_for_iteration(5), cosine(1.0 / 15.0), kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(12), cosine(8.0 / 15.0), kTolerance);
  EXPECT_NEAR(schedule.lr_for_iteration(19), 0.5 * 0.01, kTolerance);  // progress 1: the floor
  EXPECT_NEAR(schedule.lr_for_iteration(200), 0.5 * 0.01, kTolerance);  // clamped, does not rise again
  // Halfway (progress 1/2): the midpoint between 1 and cos_min_ratio.
  config.total_num_steps = 25;  // window 20, i = 14 gives progress 10/20
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule halfway, LrSchedule::create(config, 0.5));
  EXPECT_NEAR(halfway.lr_for_iteration(14), 0.5 * (0.01 + 0.99 * 0.5), 1e-12);
  // Counting: the first update (0 applied) runs at lr 0, as DeepSpeed's does.
  EXPECT_EQ(schedule.lr_at(0), 0.0);
  EXPECT_NEAR(schedule.lr_at(1), 0.05, kTolerance);
}

TEST(LrScheduleTest, WarmupCosineLogWarmupAndDefaults) {
  SchedulerConfig config;
  config.type = SchedulerType::kWarmupCosineLR;
  config.total_num_steps = 1000;
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule schedule, LrSchedule::create(config, 0.01));
  EXPECT_EQ(schedule.warmup_num_steps(), 1000);
  EXPECT_EQ(schedule.warmup_min_ratio(), 0.0);
  EXPECT_EQ(schedule.cos_min_ratio(), 0.0001);
  EXPECT_NEAR(schedule.lr_for_iteration(9), 0.01 * std::log(10.0) / std::log(1000.0), kTolerance);
  // total == warmup: no decay window; every step after warmup sits at the floor.
  EXPECT_NEAR(schedule.lr_for_iteration(1000), 0.01 * 0.0001, kTolerance);
}

TEST(LrScheduleTest, StatefulUseFollowsDeepSpeedsEngine) {
  SchedulerConfig config = warmup_lr(0.0, 1.0, 4, WarmupType::kLinear);
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule schedule, LrSchedule::create(config, 1.0));
  EXPECT_EQ(schedule.last_batch_iteration(), -1);
  std::vector<double> used;
  for (int update = 0; update < 6; ++update) {
    used.push_back(schedule.current_lr());
    EXPECT_EQ(used.back(), schedule.lr_at(update));
    schedule.step();
  }
  // Iterations -1, 0, 1, 2, 3, 4 -> 0, 0, 0.25, 0.5, 0.75, 1.
  EXPECT_EQ(used, (std::vector<double>{0.0, 0.0, 0.25, 0.5, 0.75, 1.0}));
  EXPECT_EQ(schedule.updates_applied(), 6);
}

TEST(LrScheduleTest, StateRoundTrip) {
  SchedulerConfig config;
  config.type = SchedulerType::kWarmupCosineLR;
  config.total_num_steps = 50;
  config.warmup_num_steps = 5;
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule schedule, LrSchedule::create(config, 0.1));
  for (int i = 0; i < 17; ++i) schedule.step();
  const std::string saved = schedule.state_json();
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule resumed, LrSchedule::create(config, 0.1));
  STRATA_ASSERT_OK(resumed.restore_json(saved));
  EXPECT_EQ(resumed.last_batch_iteration(), 16);
  EXPECT_EQ(resumed.current_lr(), schedule.current_lr());

  // Another type's state is refused, naming both.
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule other, LrSchedule::create(warmup_lr(0, 1, 3, WarmupType::kLog), 1.0));
  const Status mismatch = other.restore_json(saved);
  EXPECT_EQ(mismatch.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(mismatch.message().find("WarmupCosineLR"), std::string::npos) << mismatch.to_string();
  EXPECT_NE(mismatch.message().find("WarmupLR"), std::string::npos) << mismatch.to_string();
  EXPECT_FALSE(other.restore_json("{\"type\":\"WarmupLR\"}").ok());
  EXPECT_FALSE(other.restore_json("not json").ok());
  EXPECT_FALSE(other.restore(LrScheduleState{SchedulerType::kWarmupLR, -5}).ok());
}

void expect_invalid(const SchedulerConfig& config, double base_lr, const std::string& needle) {
  const auto schedule = LrSchedule::create(config, base_lr);
  ASSERT_FALSE(schedule.ok()) << "expected an error naming " << needle;
  EXPECT_EQ(schedule.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(schedule.status().message().find(needle), std::string::npos) << schedule.status().to_string();
}

TEST(LrScheduleTest, ValidationNamesTheParameter) {
  expect_invalid(warmup_lr(0.0, 1.0, 0, WarmupType::kLog), 1.0, "scheduler.params.warmup_num_steps = 0");
  expect_invalid(warmup_lr(-1.0, 1.0, 10, WarmupType::kLog), 1.0, "scheduler.params.warmup_min_lr");
  expect_invalid(warmup_lr(0.0, std::nan(""), 10, WarmupType::kLog), 1.0, "scheduler.params.warmup_max_lr");
  SchedulerConfig decay = warmup_lr(0.0, 1.0, 10, WarmupType::kLog);
  decay.type = SchedulerType::kWarmupDecayLR;
  expect_invalid(decay, 1.0, "scheduler.params.total_num_steps is required for scheduler WarmupDecayLR");
  decay.total_num_steps = -3;
  expect_invalid(decay, 1.0, "scheduler.params.total_num_steps = -3");
  SchedulerConfig cosine;
  cosine.type = SchedulerType::kWarmupCosineLR;
  cosine.total_num_steps = 10;
  cosine.warmup_num_steps = 5;
  cosine.cos_min_ratio = 1.5;
  expect_invalid(cosine, 1.0, "scheduler.params.cos_min_ratio = 1.5");
  cosine.cos_min_ratio = 0.1;
  cosine.warmup_min_ratio = -0.5;
  expect_invalid(cosine, 1.0, "scheduler.params.warmup_min_ratio");
  cosine.warmup_min_ratio = 0.0;
  cosine.warmup_max_lr = 0.1;  // not a WarmupCosineLR parameter
  expect_invalid(cosine, 1.0, "scheduler.params.warmup_max_lr does not apply to scheduler WarmupCosineLR");
  SchedulerConfig none;
  none.total_num_steps = 5;
  expect_invalid(none, 1.0, "scheduler.params.total_num_steps does not apply to scheduler none");
  expect_invalid(SchedulerConfig{}, -1.0, "optimizer.params.lr");
}

TEST(LrScheduleTest, BuildsFromAFinalizedConfig) {
  const char* text = R"({
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.0006}},
    "scheduler": {"type": "WarmupCosineLR",
                  "params": {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_type": "linear"}}
  })";
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig config, parse_config_json(text, "test.json"));
  STRATA_ASSERT_OK(finalize(config, 1));
  STRATA_ASSERT_OK_AND_ASSIGN(LrSchedule schedule, LrSchedule::create(config.scheduler, config.optimizer.lr));
  EXPECT_EQ(schedule.type(), SchedulerType::kWarmupCosineLR);
  EXPECT_EQ(schedule.cos_min_ratio(), 0.0001);  // filled by finalize (DeepSpeed's default)
  EXPECT_NEAR(schedule.lr_for_iteration(5), 0.0006 * 0.5, kTolerance);
  EXPECT_NE(schedule.describe().find("total_num_steps=100"), std::string::npos) << schedule.describe();
  STRATA_ASSERT_OK_AND_ASSIGN(SchedulerType parsed, parse_scheduler_type("WarmupDecayLR"));
  EXPECT_EQ(parsed, SchedulerType::kWarmupDecayLR);
  EXPECT_FALSE(parse_scheduler_type("OneCycle").ok());
}

}  // namespace
}  // namespace strata
