// The Llama family (Llama, Mistral, Qwen2) as a family the trainer runs
// (examples/lm/causal_lm.h): LlamaModel as one rank's model, Hugging Face model
// directories (single or sharded safetensors) in and out through examples/hf, each
// engine tensor mapped to its rows of the checkpoint tensor (llama_tensor_source), so
// the vocabulary-chunked embedding and head stream like every other tensor.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "examples/hf/hf_weights.h"
#include "examples/llama/llama_config.h"
#include "examples/llama/llama_model.h"
#include "examples/lm/causal_lm.h"
#include "examples/lm/transformer_model.h"

namespace strata::llama {

// Hugging Face's config.json for `config` (LlamaConfig / MistralConfig / Qwen2Config
// keys as transformers 4.44 writes them), without torch_dtype.
nlohmann::json llama_config_json(const LlamaConfig& config);

class LlamaArchitecture final : public lm::TransformerArchitecture<LlamaModel, LlamaModelOptions, plan_llama_activations> {
 public:
  using TransformerArchitecture::create;
  // Checks the config (validate_llama_config). `vocab_chunk_bytes`: fp32 bytes per
  // embedding / lm_head group.
  static StatusOr<std::shared_ptr<const LlamaArchitecture>> create(const LlamaConfig& config,
                                                                   size_t vocab_chunk_bytes = kDefaultVocabChunkBytes);

  const LlamaConfig& config() const { return config_; }
  const VocabChunks& chunks() const { return chunks_; }
  // Where each engine tensor lies in a Hugging Face checkpoint.
  hf::HfNameMap name_map() const;

  std::string family() const override;
  std::string describe() const override { return describe_llama_config(config_); }
  std::string model_json() const override { return llama_config_json(config_).dump(); }
  int64_t parameter_count() const override { return llama_parameter_count(config_); }
  lm::FlopShape flop_shape() const override;
  lm::MemoryBoundWork memory_bound_work() const override;

  std::vector<GroupSpec> group_specs() const override { return llama_group_specs(config_, chunks_); }
  std::vector<int> schedule() const override { return llama_schedule(config_, chunks_); }
  std::vector<int> forward_order() const override { return llama_forward_order(config_, chunks_); }

  // A Hugging Face model directory (config.json + model.safetensors or shards and index).
  StatusOr<std::unique_ptr<lm::WeightSource>> open_weights(const std::string& path) const override;
  Status load_weights(Engine& engine, int rank, const lm::WeightSource& source) const override;
  // config.json (the source directory's, with torch_dtype set, else llama_config_json),
  // sharded safetensors with their index, and the source's tokenizer files.
  Status export_weights(const std::string& dir, const lm::FullGroupSource& source, const lm::ExportSettings& settings) const override;
  StatusOr<std::vector<int>> export_group_order() const override;

 private:
  LlamaArchitecture(const LlamaConfig& config, size_t vocab_chunk_bytes);
  StatusOr<LlamaModelOptions> model_options(const lm::ModelRunOptions& options) const override;
  StatusOr<std::vector<GroupLayout>> layouts() const;

  LlamaConfig config_;
  size_t vocab_chunk_bytes_;
  VocabChunks chunks_;
};

}  // namespace strata::llama
