#include "examples/train/auto_placement.h"

#include "engine/engine_plan.h"
#include "examples/train/plan_preview.h"
#include "examples/train/run_setup.h"

namespace strata::train {

namespace {

profile::PlacementSpace trainer_space(const TrainerOptions& options) {
  const StrataConfig& config = options.config;
  profile::PlacementSpace space = profile::config_space(config);
  const int64_t per_rank = config.train_micro_batch_size_per_gpu.value_or(1) * config.gradient_accumulation_steps.value_or(1);
  space.batches = profile::batch_splits(per_rank);
  space.checkpointing = {lm::ActivationCheckpointing::kOff, lm::ActivationCheckpointing::kDevice, lm::ActivationCheckpointing::kPinnedHost};
  return space;
}

// The checks a candidate's run would meet before step 1, short of touching anything.
Status check_candidate(const PlanPreview& preview, std::optional<double> nvme_free) {
  const EngineOptions& o = preview.engine_options;
  STRATA_RETURN_IF_ERROR(engine_internal::check_plan_budgets(preview.plan, o));
  const size_t host = preview.plan.pinned_bytes + preview.plan.host_bytes + preview.activations.pinned_bytes;
  if (o.pinned_budget_bytes > 0 && host > o.pinned_budget_bytes)
    return OutOfMemoryError("the pinned budget of " + engine_internal::format_bytes(o.pinned_budget_bytes) + " cannot hold the plan's " +
                            engine_internal::format_bytes(host) + " with the model's pinned block inputs");
  return profile::check_nvme_room(preview.plan.nvme_bytes, o.nvme_path, nvme_free);
}

}  // namespace

void apply_placement(const profile::Placement& p, TrainerOptions& options) {
  StrataConfig& config = options.config;
  config.zero.offload_param.device = p.params;
  config.zero.offload_optimizer.device = p.optimizer;
  config.strata.prefetch_depth = p.prefetch_depth;
  config.train_micro_batch_size_per_gpu = p.micro_batch;
  config.gradient_accumulation_steps = p.accumulation;
  config.strata.optimizer_overlap = p.overlap;
  options.checkpointing = p.checkpointing;
}

StatusOr<profile::PlacementChoice> choose_placement(const TrainerOptions& options) {
  if (!options.profile.profile)
    return FailedPreconditionError("--placement auto chooses by the predicted step and needs a machine profile: " + options.profile.why_none);
  STRATA_ASSIGN_OR_RETURN(const internal::RunShape shape, internal::run_shape(options));
  const int64_t eval_sequences = internal::evaluation_sequences(options, shape);
  const std::optional<double> nvme_free = options.config.strata.nvme_path.empty() ? std::nullopt : profile::nvme_room_bytes(options.config.strata.nvme_path, 0);
  TrainerOptions candidate = options;
  auto evaluate = [&](const profile::Placement& p) -> StatusOr<profile::PlacementOutcome> {
    apply_placement(p, candidate);
    profile::PlacementOutcome outcome;
    outcome.placement = p;
    STRATA_ASSIGN_OR_RETURN(const PlanPreview preview, preview_plan(candidate, eval_sequences));
    outcome.device_bytes = static_cast<double>(preview.plan.device_bytes);
    outcome.host_bytes = static_cast<double>(preview.plan.pinned_bytes + preview.plan.host_bytes + preview.activations.pinned_bytes);
    outcome.tokens_per_step = static_cast<double>(p.micro_batch * p.accumulation * shape.seq_len);
    outcome.checks = check_candidate(preview, nvme_free);
    if (!outcome.checks.ok()) return outcome;
    STRATA_ASSIGN_OR_RETURN(outcome.prediction, predict_plan_step(*options.model, preview.engine_options, preview.plan, preview.layouts,
                                                                  preview.model_options, options.profile));
    return outcome;
  };
  return profile::search_placements(trainer_space(options), evaluate);
}

}  // namespace strata::train
