#include "examples/gpt/gpt_architecture.h"

#include <filesystem>
#include <system_error>

#include <nlohmann/json.hpp>

#include "examples/gpt/gpt_weights.h"
#include "examples/hf/safetensors.h"
#include "examples/hf/hf_checkpoint.h"
#include "examples/hf/hf_export.h"

namespace strata::gpt {
namespace {

// A model directory (single or sharded) or one safetensors file, opened once.
class Gpt2Weights final : public lm::WeightSource {
 public:
  static StatusOr<std::unique_ptr<Gpt2Weights>> open(const std::string& path) {
    auto weights = std::unique_ptr<Gpt2Weights>(new Gpt2Weights());
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {
      STRATA_ASSIGN_OR_RETURN(hf::HfCheckpoint checkpoint, hf::HfCheckpoint::open(path));
      weights->checkpoint_ = std::make_unique<hf::HfCheckpoint>(std::move(checkpoint));
    } else {
      STRATA_ASSIGN_OR_RETURN(SafetensorsReader reader, SafetensorsReader::open(path));
      weights->file_ = std::make_unique<SafetensorsReader>(std::move(reader));
      weights->file_source_ = std::make_unique<hf::SafetensorsFileSource>(*weights->file_);
    }
    return weights;
  }
  const hf::HfTensorSource& source() const {
    return checkpoint_ ? static_cast<const hf::HfTensorSource&>(*checkpoint_) : *file_source_;
  }
  std::string describe() const override { return source().where(); }
  DType stored_dtype() const override { return hf::checkpoint_engine_dtype(source()); }

 private:
  Gpt2Weights() = default;
  std::unique_ptr<hf::HfCheckpoint> checkpoint_;
  std::unique_ptr<SafetensorsReader> file_;
  std::unique_ptr<hf::SafetensorsFileSource> file_source_;
};

}  // namespace

// GPT-2's position table is indexed by place (no position ids); GptModel measures an
// evaluation batch in the training forward.
GptArchitecture::GptArchitecture(const GptConfig& config)
    : TransformerArchitecture({.vocab_size = config.vocab_size, .context_length = config.n_ctx, .hidden_size = config.n_embd,
                               .layers = config.n_layer, .takes_position_ids = false, .evaluates_while_training = true}),
      config_(config) {}

StatusOr<std::shared_ptr<const GptArchitecture>> GptArchitecture::create(const GptConfig& config) {
  STRATA_RETURN_IF_ERROR(validate_gpt_config(config));
  return std::shared_ptr<const GptArchitecture>(new GptArchitecture(config));
}

std::string GptArchitecture::describe() const { return describe_gpt_config(config_); }

std::string GptArchitecture::model_json() const {
  const GptConfig& c = config_;
  return nlohmann::json{{"n_layer", c.n_layer}, {"n_head", c.n_head}, {"n_embd", c.n_embd}, {"n_ctx", c.n_ctx}, {"vocab_size", c.vocab_size}}
      .dump();
}

int64_t GptArchitecture::parameter_count() const { return gpt_parameter_count(config_); }
lm::FlopShape GptArchitecture::flop_shape() const {
  const int64_t C = config_.n_embd;
  return lm::decoder_flop_shape({.layers = config_.n_layer, .hidden = C, .query_width = C, .kv_width = C, .mlp_width = 4 * C,
                                 .mlp_matrices = 2, .vocab = config_.vocab_size});
}
lm::MemoryBoundWork GptArchitecture::memory_bound_work() const {
  const int64_t C = config_.n_embd;
  return lm::decoder_memory_bound_work({.layers = config_.n_layer, .hidden = C, .query_width = C, .kv_width = C, .mlp_width = 4 * C,
                                        .vocab = config_.vocab_size},
                                       lm::DecoderOps::kGpt2);
}
std::vector<GroupSpec> GptArchitecture::group_specs() const { return gpt_group_specs(config_); }
std::vector<int> GptArchitecture::schedule() const { return gpt_schedule(config_); }
std::vector<int> GptArchitecture::forward_order() const { return gpt_forward_order(config_); }

StatusOr<GptModelOptions> GptArchitecture::model_options(const lm::ModelRunOptions& options) const {
  GptModelOptions model;
  static_cast<lm::ModelRunOptions&>(model) = options;
  model.config = config_;
  return model;
}

StatusOr<std::unique_ptr<lm::WeightSource>> GptArchitecture::open_weights(const std::string& path) const {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Gpt2Weights> weights, Gpt2Weights::open(path));
  STRATA_RETURN_IF_ERROR(check_gpt2_weights(weights->source(), config_));
  return std::unique_ptr<lm::WeightSource>(std::move(weights));
}

Status GptArchitecture::load_weights(Engine& engine, int rank, const lm::WeightSource& source) const {
  const auto* weights = dynamic_cast<const Gpt2Weights*>(&source);
  if (weights == nullptr) return InvalidArgumentError("GPT-2 weights: " + source.describe() + " was not opened by the GPT-2 architecture");
  return load_gpt2_weights(engine, rank, weights->source(), config_);
}

Status GptArchitecture::export_weights(const std::string& dir, const lm::FullGroupSource& source, const lm::ExportSettings& settings) const {
  ExportOptions options;
  STRATA_ASSIGN_OR_RETURN(options.dtype, hf::export_safetensors_dtype(settings.dtype, "GPT-2 export"));
  options.metadata = settings.metadata;
  if (settings.shard_bytes > 0) options.shard_bytes = settings.shard_bytes;
  options.tokenizer_source_dir = settings.source_dir;
  return export_gpt2_checkpoint(dir, config_, source, options);
}

StatusOr<std::vector<int>> GptArchitecture::export_group_order() const { return gpt2_export_group_order(config_); }

}  // namespace strata::gpt
