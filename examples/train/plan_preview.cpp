#include "examples/train/plan_preview.h"

#include <algorithm>
#include <ostream>

#include <nlohmann/json.hpp>

#include "engine/engine_config.h"
#include "engine/engine_plan.h"
#include "examples/profile/step_work.h"
#include "examples/train/run_setup.h"

namespace strata::train {

namespace {

// The device budget rank 0's device will have (LocalCluster: strata.device_budget_mib, or
// 1 GiB on the CPU device). A CUDA device without a configured budget takes the GPU's free
// memory, which the preview does not ask the GPU for.
StatusOr<size_t> planned_device_budget(const TrainerOptions& options, DeviceKind device) {
  const int64_t mib = options.config.strata.device_budget_mib;
  if (mib > 0) return static_cast<size_t>(mib) << 20;
  if (device == DeviceKind::kCpu) return size_t{1} << 30;
  return InvalidArgumentError("planning a CUDA run before it starts needs its device budget: give --device-budget-mib");
}

}  // namespace

StatusOr<PlanPreview> preview_plan(const TrainerOptions& options, std::optional<int64_t> eval_sequences) {
  STRATA_ASSIGN_OR_RETURN(const internal::RunShape shape, internal::run_shape(options));
  const lm::Architecture& model = *options.model;
  PlanPreview out;
  STRATA_ASSIGN_OR_RETURN(out.engine_options, engine_options_from_config(options.config, 0));
  // As SharedRun::prepare and RankRun::start_engine set them.
  out.model_options.batch = shape.micro;
  out.model_options.seq_len = shape.seq_len;
  if (!eval_sequences) eval_sequences = internal::evaluation_sequences(options, shape);
  out.model_options.eval_batch = options.eval_only ? shape.micro : *eval_sequences / shape.world;
  out.model_options.checkpointing = options.checkpointing;
  out.model_options.head_chunk_rows = options.head_chunk_rows;
  out.model_options.param_dtype = out.engine_options.param_dtype;
  STRATA_ASSIGN_OR_RETURN(out.activations, model.plan_activations(out.model_options, shape.device_kind));
  out.engine_options.activation_bytes = out.activations.device_bytes;
  // As the engine's init() does: with optimizer state on the device, the host gets the
  // gradient's fp32 copy.
  if (out.engine_options.optimizer_tier == Tier::kDevice) out.engine_options.grad_transfer_dtype = DType::kFloat32;
  const std::vector<GroupSpec> specs = model.group_specs();
  for (size_t g = 0; g < specs.size(); ++g) {
    STRATA_ASSIGN_OR_RETURN(GroupLayout layout, layout_group(specs[g], static_cast<int>(g), shape.world));
    out.layouts.push_back(std::move(layout));
  }
  const std::vector<int> schedule = model.schedule();
  engine_internal::PlanInputs inputs;
  inputs.options = &out.engine_options;
  inputs.layouts = out.layouts;
  inputs.schedule = schedule;
  // Both families declare no gradients held between uses (their CausalLm's create()).
  inputs.held_gradients = 0;
  STRATA_ASSIGN_OR_RETURN(inputs.device_budget_bytes, planned_device_budget(options, shape.device_kind));
  STRATA_ASSIGN_OR_RETURN(out.plan, engine_internal::make_engine_plan(inputs));
  return out;
}

StatusOr<std::optional<profile::StepPrediction>> predict_plan_step(const lm::Architecture& model, const EngineOptions& engine_options,
                                                                   const EnginePlan& plan, std::span<const GroupLayout> layouts,
                                                                   const lm::ModelRunOptions& model_options, const RunProfile& profile) {
  if (!profile.profile) return std::optional<profile::StepPrediction>();
  const std::vector<int> schedule = model.schedule();
  profile::PlannedStepInputs inputs;
  inputs.options = &engine_options;
  inputs.plan = &plan;
  inputs.layouts = layouts;
  inputs.schedule = schedule;
  inputs.model.flops = model.flop_shape();
  inputs.model.seq_len = model_options.seq_len;
  inputs.model.tokens = model_options.batch * model_options.seq_len;
  inputs.model.head_weights = std::min(model.hidden_size() * model.vocab_size(), inputs.model.flops.matmul_weights);
  inputs.model.recompute = model_options.checkpointing != lm::ActivationCheckpointing::kOff;
  inputs.model.memory = model.memory_bound_work();
  STRATA_ASSIGN_OR_RETURN(const profile::PlannedStep step, profile::planned_step(inputs));
  STRATA_ASSIGN_OR_RETURN(profile::StepPrediction prediction, profile::predict_step(step.work, step.shape, *profile.profile));
  return std::optional<profile::StepPrediction>(std::move(prediction));
}

std::string prediction_text(const std::optional<profile::StepPrediction>& prediction, const RunProfile& profile) {
  if (!prediction) return "  predicted step: none (" + profile.why_none + ")";
  std::string origin = profile.origin;
  if (profile.profile && profile.profile->source == profile::ProfileSource::kDatasheet) origin += ", a datasheet profile";
  return profile::format_prediction(*prediction, origin);
}

StatusOr<bool> print_plan_only(const TrainerOptions& options, std::ostream& out) {
  STRATA_ASSIGN_OR_RETURN(const PlanPreview preview, preview_plan(options));
  STRATA_ASSIGN_OR_RETURN(const std::optional<profile::StepPrediction> prediction,
                          predict_plan_step(*options.model, preview.engine_options, preview.plan, preview.layouts, preview.model_options,
                                            options.profile));
  const Status checks = engine_internal::check_plan_budgets(preview.plan, preview.engine_options);
  out << "model: " << options.model->family() << ", " << options.model->describe() << "\n"
      << preview.plan.text << "\n"
      << prediction_text(prediction, options.profile) << "\n"
      << preview.activations.text << "activation checkpointing: " << activation_checkpointing_name(options.checkpointing) << "\n"
      << "plan checks (device, pinned and host memory; nvme_path not touched): " << (checks.ok() ? "ok" : checks.message()) << "\n";
  nlohmann::ordered_json j = {{"plan_only", true},
                              {"checks", checks.ok() ? std::string("ok") : checks.message()},
                              {"device_bytes", preview.plan.device_bytes},
                              {"device_budget_bytes", preview.plan.device_budget_bytes},
                              {"pinned_bytes", preview.plan.pinned_bytes},
                              {"host_bytes", preview.plan.host_bytes},
                              {"nvme_file_bytes", preview.plan.nvme_bytes},
                              {"state_bytes", preview.plan.state_bytes},
                              {"prefetch_depth", preview.plan.prefetch_depth}};
  j["predicted_step_s"] = prediction ? nlohmann::ordered_json(prediction->step_seconds) : nlohmann::ordered_json(nullptr);
  j["predicted_busy_s"] = prediction ? profile::predicted_busy_json(*prediction) : nlohmann::ordered_json(nullptr);
  j["predicted_bound"] = prediction ? nlohmann::ordered_json(prediction->bound) : nlohmann::ordered_json(nullptr);
  out << j.dump() << std::endl;
  return checks.ok();
}

}  // namespace strata::train
