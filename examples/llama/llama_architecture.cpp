#include "examples/llama/llama_architecture.h"

#include <filesystem>
#include <system_error>

#include "examples/hf/hf_checkpoint.h"
#include "examples/hf/hf_export.h"

namespace strata::llama {
namespace {

using nlohmann::json;

const char* architecture_name(LlamaFamily family) {
  switch (family) {
    case LlamaFamily::kLlama: return "LlamaForCausalLM";
    case LlamaFamily::kMistral: return "MistralForCausalLM";
    case LlamaFamily::kQwen2: return "Qwen2ForCausalLM";
  }
  return "LlamaForCausalLM";
}

json rope_scaling_json(const kernels::RopeScaling& s) {
  switch (s.kind) {
    case kernels::RopeScaling::Kind::kNone: return nullptr;
    case kernels::RopeScaling::Kind::kLinear: return json{{"rope_type", "linear"}, {"factor", s.factor}};
    case kernels::RopeScaling::Kind::kLlama3:
      return json{{"rope_type", "llama3"},
                  {"factor", s.factor},
                  {"low_freq_factor", s.low_freq_factor},
                  {"high_freq_factor", s.high_freq_factor},
                  {"original_max_position_embeddings", s.original_max_position_embeddings}};
  }
  return nullptr;
}

// The sizes config.json always carries (head_dim only when it is not hidden_size / heads).
constexpr hf::ConfigKey<LlamaConfig> kLlamaSizeKeys[] = {
    {"hidden_size", &LlamaConfig::hidden_size}, {"intermediate_size", &LlamaConfig::intermediate_size},
    {"num_hidden_layers", &LlamaConfig::num_hidden_layers}, {"num_attention_heads", &LlamaConfig::num_attention_heads},
    {"num_key_value_heads", &LlamaConfig::num_key_value_heads}, {"vocab_size", &LlamaConfig::vocab_size},
    {"max_position_embeddings", &LlamaConfig::max_position_embeddings}};

// A model directory opened once, shared read-only by every rank's load.
class LlamaWeights final : public lm::WeightSource {
 public:
  explicit LlamaWeights(hf::HfCheckpoint checkpoint) : checkpoint_(std::move(checkpoint)) {}
  const hf::HfCheckpoint& checkpoint() const { return checkpoint_; }
  std::string describe() const override { return checkpoint_.where(); }
  DType stored_dtype() const override { return hf::checkpoint_engine_dtype(checkpoint_); }

 private:
  hf::HfCheckpoint checkpoint_;
};

}  // namespace

json llama_config_json(const LlamaConfig& c) {
  json j = {{"architectures", json::array({architecture_name(c.family)})},
            {"model_type", std::string(llama_family_name(c.family))},
            {"rms_norm_eps", c.rms_norm_eps},
            {"rope_theta", c.rope_theta},
            {"rope_scaling", rope_scaling_json(c.rope_scaling)},
            {"tie_word_embeddings", c.tie_word_embeddings},
            {"hidden_act", "silu"},
            {"initializer_range", c.initializer_range}};
  hf::put_config_keys(j, c, kLlamaSizeKeys);
  if (c.head_dim != c.hidden_size / c.num_attention_heads) j["head_dim"] = c.head_dim;
  switch (c.family) {
    case LlamaFamily::kLlama:
      j["attention_bias"] = c.qkv_bias;
      j["mlp_bias"] = c.mlp_bias;
      break;
    case LlamaFamily::kMistral:
      j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
      break;
    case LlamaFamily::kQwen2:
      j["use_sliding_window"] = c.sliding_window > 0;
      j["sliding_window"] = c.sliding_window > 0 ? c.sliding_window : c.max_position_embeddings;
      break;
  }
  return j;
}

StatusOr<std::shared_ptr<const LlamaArchitecture>> LlamaArchitecture::create(const LlamaConfig& config, size_t vocab_chunk_bytes) {
  STRATA_RETURN_IF_ERROR(validate_llama_config(config));
  return std::shared_ptr<const LlamaArchitecture>(new LlamaArchitecture(config, vocab_chunk_bytes));
}

// Rotary positions honour position ids; LlamaModel does not measure an evaluation batch in
// a training forward.
LlamaArchitecture::LlamaArchitecture(const LlamaConfig& config, size_t vocab_chunk_bytes)
    : TransformerArchitecture({.vocab_size = config.vocab_size, .context_length = config.max_position_embeddings, .hidden_size = config.hidden_size,
                               .layers = config.num_hidden_layers, .takes_position_ids = true, .evaluates_while_training = false}),
      config_(config), vocab_chunk_bytes_(vocab_chunk_bytes), chunks_(vocab_chunks(config, vocab_chunk_bytes)) {}

lm::FlopShape LlamaArchitecture::flop_shape() const {
  const LlamaConfig& c = config_;
  return lm::decoder_flop_shape({.layers = c.num_hidden_layers, .hidden = c.hidden_size, .query_width = c.num_attention_heads * c.head_dim,
                                 .kv_width = c.num_key_value_heads * c.head_dim, .mlp_width = c.intermediate_size, .mlp_matrices = 3,
                                 .vocab = c.vocab_size});
}

lm::MemoryBoundWork LlamaArchitecture::memory_bound_work() const {
  const LlamaConfig& c = config_;
  return lm::decoder_memory_bound_work({.layers = c.num_hidden_layers, .hidden = c.hidden_size, .query_width = c.num_attention_heads * c.head_dim,
                                        .kv_width = c.num_key_value_heads * c.head_dim, .mlp_width = c.intermediate_size, .vocab = c.vocab_size},
                                       lm::DecoderOps::kLlama);
}

std::string LlamaArchitecture::family() const {
  switch (config_.family) {
    case LlamaFamily::kLlama: return "Llama";
    case LlamaFamily::kMistral: return "Mistral";
    case LlamaFamily::kQwen2: return "Qwen2";
  }
  return "Llama";
}

hf::HfNameMap LlamaArchitecture::name_map() const {
  return [config = config_, chunks = chunks_](const GroupLayout& group, const TensorLayout& tensor) {
    const HfTensorSlice slice = llama_tensor_source(config, chunks, group.name, tensor.name);
    uint64_t row_elements = 1;
    for (size_t d = 1; d < slice.hf_shape.size(); ++d) row_elements *= static_cast<uint64_t>(slice.hf_shape[d]);
    // A chunk's padding rows past slice.rows are not in the checkpoint.
    return hf::HfTensorSlice{slice.hf_name, static_cast<uint64_t>(slice.row_offset) * row_elements, slice.hf_shape,
                             static_cast<uint64_t>(slice.rows) * row_elements};
  };
}

StatusOr<LlamaModelOptions> LlamaArchitecture::model_options(const lm::ModelRunOptions& options) const {
  STRATA_RETURN_IF_ERROR(check_sequence_length(config_, options.seq_len));
  LlamaModelOptions model;
  static_cast<lm::ModelRunOptions&>(model) = options;
  model.config = config_;
  model.vocab_chunk_bytes = vocab_chunk_bytes_;
  return model;
}

StatusOr<std::vector<GroupLayout>> LlamaArchitecture::layouts() const { return hf::single_rank_layouts(group_specs()); }

StatusOr<std::unique_ptr<lm::WeightSource>> LlamaArchitecture::open_weights(const std::string& path) const {
  STRATA_ASSIGN_OR_RETURN(hf::HfCheckpoint checkpoint, hf::HfCheckpoint::open(path));
  STRATA_ASSIGN_OR_RETURN(const std::vector<GroupLayout> all, layouts());
  STRATA_RETURN_IF_ERROR(hf::check_hf_mapping(checkpoint, all, name_map()));
  return std::unique_ptr<lm::WeightSource>(new LlamaWeights(std::move(checkpoint)));
}

Status LlamaArchitecture::load_weights(Engine& engine, int rank, const lm::WeightSource& source) const {
  const auto* weights = dynamic_cast<const LlamaWeights*>(&source);
  if (weights == nullptr) return InvalidArgumentError("Llama weights: " + source.describe() + " was not opened by the Llama architecture");
  return hf::load_hf_weights(engine, rank, weights->checkpoint(), name_map());
}

Status LlamaArchitecture::export_weights(const std::string& dir, const lm::FullGroupSource& source, const lm::ExportSettings& settings) const {
  STRATA_ASSIGN_OR_RETURN(const hf::SafetensorsDType dtype, hf::export_safetensors_dtype(settings.dtype, "Llama export"));
  json config = llama_config_json(config_);
  // The source's own config.json keeps what Strata does not model (token ids, ...).
  std::error_code ec;
  const std::filesystem::path source_config = std::filesystem::path(settings.source_dir) / std::string(hf::kConfigFile);
  if (!settings.source_dir.empty() && std::filesystem::exists(source_config, ec)) {
    STRATA_ASSIGN_OR_RETURN(config, hf::read_json_object(source_config.string(), "the source model's config"));
  }
  config["torch_dtype"] = std::string(hf::torch_dtype_name(dtype));
  hf::HfExportOptions options;
  if (settings.shard_bytes > 0) options.shard_bytes = settings.shard_bytes;
  options.metadata = settings.metadata;
  options.tokenizer_source_dir = settings.source_dir;
  STRATA_ASSIGN_OR_RETURN(const std::vector<GroupLayout> all, layouts());
  return hf::export_hf_from_groups(dir, config, all, name_map(), dtype, source, options);
}

StatusOr<std::vector<int>> LlamaArchitecture::export_group_order() const {
  STRATA_ASSIGN_OR_RETURN(const std::vector<GroupLayout> all, layouts());
  return hf::export_group_order(all, name_map());
}

}  // namespace strata::llama
