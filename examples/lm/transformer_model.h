// What every transformer family's model holds the same way (GPT-2, the Llama family): the
// engine it runs on, its options and groups, the activation plan, the two BLAS contexts
// (the blocks' and the vocabulary head's), the gradients tests capture, and the group
// registration. A family derives its model from TransformerModel<Options, Groups> and
// writes only its blocks, its buffers and its passes.
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "engine/engine.h"
#include "examples/lm/causal_lm.h"
#include "examples/lm/model_memory.h"
#include "examples/lm/transformer_layout.h"
#include "kernels/blas_context.h"

namespace strata::lm {

// Registers `specs` with `engine` in order; each must get the id of its place (the model's
// groups are registered first). Errors start with `family` ("GPT model").
Status register_model_groups(Engine& engine, std::span<const GroupSpec> specs, std::string_view family);

// Options: a family's model options (ModelRunOptions and capture_gradients); Groups: its
// group ids.
template <class Options, class Groups>
class TransformerModel : public CausalLm {
 public:
  TransformerModel(const TransformerModel&) = delete;
  TransformerModel& operator=(const TransformerModel&) = delete;

  const Options& options() const { return options_; }
  const TransformerActivationPlan& activation_plan() const { return plan_; }
  const Groups& groups() const { return groups_; }
  DType compute_dtype() const { return plan_.compute_dtype; }
  // options.capture_gradients: the last captured full gradient (numel floats) per group id.
  const std::map<int, std::vector<float>>& captured_gradients() const { return captured_; }

 protected:
  TransformerModel(Engine& engine, const Options& options, const Groups& groups)
      : engine_(engine), options_(options), groups_(groups) {}

  // Copies the group's full gradient to the host when options.capture_gradients asks.
  Status capture(int group, const GroupView& grads) {
    if (!options_.capture_gradients) return {};
    return copy_gradient_to_host(engine_, group, grads, captured_[group]);
  }

  Engine& engine_;
  Options options_;
  TransformerActivationPlan plan_;
  Groups groups_;
  std::unique_ptr<kernels::BlasContext> blas_;       // the blocks: strata.matmul_precision
  std::unique_ptr<kernels::BlasContext> head_blas_;  // the vocabulary head: IEEE fp32 (ModelBlas)
  std::map<int, std::vector<float>> captured_;
};

// The two Architecture entries every transformer family answers the same way: the plan and
// the model, each from the family's model options for the run (model_options). Model:
// the family's TransformerModel with a static create(Engine&, const Options&); plan: its
// plan function (options, device) -> TransformerActivationPlan.
template <class Model, class Options, StatusOr<TransformerActivationPlan> (*plan)(const Options&, DeviceKind)>
class TransformerArchitecture : public Architecture {
 public:
  StatusOr<ActivationPlan> plan_activations(const ModelRunOptions& options, DeviceKind device) const override {
    STRATA_ASSIGN_OR_RETURN(const Options model, model_options(options));
    STRATA_ASSIGN_OR_RETURN(const TransformerActivationPlan planned, plan(model, device));
    return planned.summary();
  }
  StatusOr<std::unique_ptr<CausalLm>> create(Engine& engine, const ModelRunOptions& options) const override {
    STRATA_ASSIGN_OR_RETURN(const Options model, model_options(options));
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Model> created, Model::create(engine, model));
    return std::unique_ptr<CausalLm>(std::move(created));
  }

 protected:
  // The family's model options for a run (its config, the run's fields).
  virtual StatusOr<Options> model_options(const ModelRunOptions& options) const = 0;
};

}  // namespace strata::lm
