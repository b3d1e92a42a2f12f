// The trainer's plan before anything is opened, and its prediction: rank 0's engine plan
// made from the model's groups and the config alone (no engine, no device memory, no data,
// nothing under nvme_path), for --plan-only and --placement auto; the machine profile a
// run predicts with (--profile FILE, else the one kept on this host); and the predicted
// step (examples/profile/step_cost.h) of a plan, printed under it and reported beside the
// measured step.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/engine_options.h"
#include "engine/engine_plan_types.h"
#include "engine/partition.h"
#include "examples/lm/causal_lm.h"
#include "examples/profile/machine_profile.h"
#include "examples/profile/step_cost.h"
#include "examples/train/trainer.h"

namespace strata::train {

// Rank 0's plan as Engine::start() makes it (the plan alone: nothing is checked against the
// machine), from the model's groups, its schedule and the config.
struct PlanPreview {
  EngineOptions engine_options;
  lm::ModelRunOptions model_options;
  lm::ActivationPlan activations;
  std::vector<GroupLayout> layouts;
  EnginePlan plan;
};
// `eval_sequences`: the evaluation batch over all ranks when the caller has it
// (internal::evaluation_sequences); unset: computed here.
StatusOr<PlanPreview> preview_plan(const TrainerOptions& options, std::optional<int64_t> eval_sequences = std::nullopt);

// The prediction of rank 0's step for a plan; nullopt without a profile.
StatusOr<std::optional<profile::StepPrediction>> predict_plan_step(const lm::Architecture& model, const EngineOptions& engine_options,
                                                                   const EnginePlan& plan, std::span<const GroupLayout> layouts,
                                                                   const lm::ModelRunOptions& model_options, const RunProfile& profile);

// The lines printed under the plan: the prediction's table, or why there is none.
std::string prediction_text(const std::optional<profile::StepPrediction>& prediction, const RunProfile& profile);

// --plan-only: prints the model, rank 0's plan, its prediction (or why there is none) and
// the budget checks (device, pinned, host memory: engine_internal::check_plan_budgets) to
// `out`, then one JSON line: {"plan_only": true, "checks": "ok" | the error, the plan's bytes,
// "predicted_step_s", "predicted_busy_s"}. Opens no data, engine or device, and neither
// creates nor reads nvme_path. Returns whether the checks passed.
StatusOr<bool> print_plan_only(const TrainerOptions& options, std::ostream& out);

}  // namespace strata::train
