#include "python/src/session_placement.h"

#include <vector>

#include "engine/engine_config.h"
#include "engine/engine_plan.h"
#include "examples/profile/step_work.h"

namespace strata::python {
namespace {

profile::PlacementSpace session_space(const StrataConfig& config, bool recompute) {
  profile::PlacementSpace space = profile::config_space(config);
  // The script's batches and the model's checkpointing, as they are.
  space.batches = {{config.train_micro_batch_size_per_gpu.value_or(1), static_cast<int>(config.gradient_accumulation_steps.value_or(1))}};
  space.checkpointing = {recompute ? lm::ActivationCheckpointing::kDevice : lm::ActivationCheckpointing::kOff};
  return space;
}

struct CandidatePlan {
  EngineOptions options;
  std::vector<GroupLayout> layouts;
  EnginePlan plan;
};

// This rank's plan for `config`, as Engine::start() makes it from the registered groups.
StatusOr<CandidatePlan> plan_candidate(const PlacementRequest& request, const StrataConfig& config) {
  CandidatePlan out;
  STRATA_ASSIGN_OR_RETURN(out.options, engine_options_from_config(config, request.rank));
  // As the engine's init() does: with optimizer state on the device, the host gets the
  // gradient's fp32 copy.
  if (out.options.optimizer_tier == Tier::kDevice) out.options.grad_transfer_dtype = DType::kFloat32;
  for (size_t g = 0; g < request.groups.size(); ++g) {
    STRATA_ASSIGN_OR_RETURN(GroupLayout layout, layout_group(request.groups[g], static_cast<int>(g), request.world_size));
    out.layouts.push_back(std::move(layout));
  }
  engine_internal::PlanInputs inputs;
  inputs.options = &out.options;
  inputs.layouts = out.layouts;
  inputs.held_gradients = request.held_gradients;
  inputs.device_budget_bytes = request.device_budget_bytes;
  STRATA_ASSIGN_OR_RETURN(out.plan, engine_internal::make_engine_plan(inputs));
  return out;
}

StatusOr<profile::StepPrediction> predict(const PlacementRequest& request, const CandidatePlan& candidate, int64_t tokens) {
  profile::PlannedStepInputs inputs;
  inputs.options = &candidate.options;
  inputs.plan = &candidate.plan;
  inputs.layouts = candidate.layouts;
  inputs.model.flops = request.work.flops;
  inputs.model.seq_len = request.work.seq_len;
  inputs.model.tokens = tokens;
  inputs.model.head_weights = request.work.head_weights;
  inputs.model.recompute = request.work.recompute;
  // The front end asks for unzeroed buffers and zeroes only what no gradient reaches; its
  // model's memory-bound ops are PyTorch's and not declared (not priced).
  inputs.model.gradient_buffers_zeroed = false;
  STRATA_ASSIGN_OR_RETURN(const profile::PlannedStep step, profile::planned_step(inputs));
  return profile::predict_step(step.work, step.shape, *request.profile->profile);
}

}  // namespace

void apply_session_placement(const profile::Placement& p, StrataConfig& config) {
  config.zero.offload_param.device = p.params;
  config.zero.offload_optimizer.device = p.optimizer;
  config.strata.prefetch_depth = p.prefetch_depth;
  config.strata.optimizer_overlap = p.overlap;
}

nlohmann::json session_placement_json(const profile::Placement& p) {
  return {{"params", tier_name(p.params)},
          {"optimizer", tier_name(p.optimizer)},
          {"prefetch_depth", p.prefetch_depth},
          {"overlap", overlap_mode_name(p.overlap)}};
}

StatusOr<profile::Placement> session_placement_from_json(const nlohmann::json& json) {
  if (!json.is_object()) return InvalidArgumentError("placement: not a JSON object");
  auto text = [&](const char* key) {
    const auto it = json.find(key);
    return it != json.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  auto tier = [&](const char* key) -> StatusOr<Tier> {
    const std::string name = text(key);
    for (const Tier t : {Tier::kDevice, Tier::kPinned, Tier::kHost, Tier::kNvme})
      if (tier_name(t) == name) return t;
    return InvalidArgumentError(std::string("placement: \"") + key + "\" is '" + name + "', not a tier");
  };
  profile::Placement p;
  STRATA_ASSIGN_OR_RETURN(p.params, tier("params"));
  STRATA_ASSIGN_OR_RETURN(p.optimizer, tier("optimizer"));
  const auto depth = json.find("prefetch_depth");
  if (depth == json.end() || !depth->is_number_integer() || depth->get<int>() < 0)
    return InvalidArgumentError("placement: no prefetch_depth >= 0");
  p.prefetch_depth = depth->get<int>();
  STRATA_ASSIGN_OR_RETURN(p.overlap, parse_overlap_mode(text("overlap")));
  return p;
}

StatusOr<profile::PlacementChoice> choose_session_placement(const PlacementRequest& request) {
  if (request.config == nullptr || request.profile == nullptr) return InvalidArgumentError("choose_session_placement: no config or profile");
  if (!request.profile->profile)
    return FailedPreconditionError("strata.placement \"auto\" chooses by the predicted step and needs a machine profile (strata.profile, "
                                   "or one kept by `strata-bench profile`): " + request.profile->why_none);
  const StrataConfig& config = *request.config;
  const std::optional<double> nvme_free = config.strata.nvme_path.empty() ? std::nullopt : profile::nvme_room_bytes(config.strata.nvme_path, request.rank);
  StrataConfig candidate_config = config;
  auto evaluate = [&](const profile::Placement& p) -> StatusOr<profile::PlacementOutcome> {
    apply_session_placement(p, candidate_config);
    STRATA_ASSIGN_OR_RETURN(const CandidatePlan candidate, plan_candidate(request, candidate_config));
    profile::PlacementOutcome outcome;
    outcome.placement = p;
    outcome.device_bytes = static_cast<double>(candidate.plan.device_bytes);
    outcome.host_bytes = static_cast<double>(candidate.plan.pinned_bytes + candidate.plan.host_bytes);
    const int64_t tokens = p.micro_batch * request.work.seq_len;
    outcome.tokens_per_step = static_cast<double>(tokens * p.accumulation);
    outcome.checks = engine_internal::check_plan_budgets(candidate.plan, candidate.options);
    if (outcome.checks.ok()) outcome.checks = profile::check_nvme_room(candidate.plan.nvme_bytes, candidate.options.nvme_path, nvme_free);
    if (!outcome.checks.ok()) return outcome;
    STRATA_ASSIGN_OR_RETURN(outcome.prediction, predict(request, candidate, tokens));
    return outcome;
  };
  return profile::search_placements(session_space(config, request.work.recompute), evaluate);
}

}  // namespace strata::python
