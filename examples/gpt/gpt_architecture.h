// GPT-2 as a family the trainer runs (examples/lm/causal_lm.h): the architecture from a
// GptConfig, GptModel as one rank's model, and Hugging Face GPT-2 safetensors in and out.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "examples/gpt/gpt_model.h"
#include "examples/lm/causal_lm.h"
#include "examples/lm/transformer_model.h"

namespace strata::gpt {

class GptArchitecture final : public lm::TransformerArchitecture<GptModel, GptModelOptions, plan_gpt_activations> {
 public:
  using TransformerArchitecture::create;
  // Checks the config (validate_gpt_config).
  static StatusOr<std::shared_ptr<const GptArchitecture>> create(const GptConfig& config);

  const GptConfig& config() const { return config_; }

  std::string family() const override { return "GPT-2"; }
  std::string describe() const override;
  std::string model_json() const override;
  int64_t parameter_count() const override;
  lm::FlopShape flop_shape() const override;
  lm::MemoryBoundWork memory_bound_work() const override;

  std::vector<GroupSpec> group_specs() const override;
  std::vector<int> schedule() const override;
  std::vector<int> forward_order() const override;

  // A single GPT-2 safetensors file (a directory: its model.safetensors).
  StatusOr<std::unique_ptr<lm::WeightSource>> open_weights(const std::string& path) const override;
  Status load_weights(Engine& engine, int rank, const lm::WeightSource& source) const override;
  // config.json and the weights (model.safetensors, or shards with their index past
  // settings.shard_bytes), with the tokenizer files of settings.source_dir.
  Status export_weights(const std::string& dir, const lm::FullGroupSource& source, const lm::ExportSettings& settings) const override;
  StatusOr<std::vector<int>> export_group_order() const override;

 private:
  explicit GptArchitecture(const GptConfig& config);
  StatusOr<GptModelOptions> model_options(const lm::ModelRunOptions& options) const override;

  GptConfig config_;
};

}  // namespace strata::gpt
