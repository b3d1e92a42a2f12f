// GPT-2 weights in and out of the engine: Hugging Face safetensors files (examples/hf/
// safetensors.h) and the config.json beside them.
//
// Both go through the family-independent Hugging Face code (examples/hf/hf_weights.h)
// with GPT-2's name map. Loading streams: each rank reads, tensor by tensor, only the
// element ranges that fall into its own master shards, straight into a one-shard buffer,
// so the whole model is never in host memory. Exporting writes group by group from full
// fp32 groups a caller supplies (the trainer assembles each from all ranks' shards in turn).
#pragma once

#include <functional>
#include <map>
#include <span>
#include <string>

#include "engine/core/status.h"
#include "engine/engine.h"
#include "examples/gpt/gpt_model.h"
#include "examples/gpt/gpt2_safetensors.h"
#include "examples/hf/safetensors.h"
#include "examples/lm/causal_lm.h"
#include "examples/hf/hf_checkpoint.h"
#include "examples/hf/hf_export.h"
#include "examples/hf/hf_weights.h"

namespace strata::gpt {

// The model's shape as Hugging Face's GPT-2 code names it.
Gpt2Dims gpt2_dims(const GptConfig& config);

// The architecture of a GPT-2 safetensors file: n_layer, n_embd, vocab_size and n_ctx
// from its tensors; n_head from the config.json in the same directory when there is
// one ("n_head"), else from `fallback` (an error when neither gives one, or when
// config.json contradicts the tensors).
StatusOr<GptConfig> gpt_config_from_safetensors(const SafetensorsReader& reader, const GptConfig& fallback);

// Each engine tensor of GPT-2 is the whole checkpoint tensor of its Hugging Face name
// (hf_tensor_name(), without the "transformer." prefix), but for wte's chunk groups
// "wte.<k>": rows [k * rows_per_chunk, ...) of "wte.weight", their padding rows past the
// vocabulary not in the checkpoint. Without rows_per_chunk: the default chunks
// (gpt_vocab_chunks(config)), the groups exports and GptArchitecture use.
hf::HfNameMap gpt2_name_map(const GptConfig& config, int64_t rows_per_chunk);
hf::HfNameMap gpt2_name_map(const GptConfig& config);

// Loads this rank's fp32 master shards of every group of the GPT-2 `config` from `reader`
// or `source` (a file or a model directory; any dtype the reader converts; names with or
// without "transformer."), checking every tensor's presence and shape first (the error
// names each missing or misshapen tensor and the file), then refresh_parameters(). The
// optimizer moments are left as they are (zero on a fresh engine). Call after start(),
// between steps. hf::load_hf_weights with gpt2_name_map().
Status load_gpt2_weights(Engine& engine, int rank, const SafetensorsReader& reader, const GptConfig& config);
Status load_gpt2_weights(Engine& engine, int rank, const hf::HfTensorSource& source, const GptConfig& config);
// The checks load_gpt2_weights makes before it writes anything (every tensor present with
// its shape), for a source opened once before the ranks load from it.
Status check_gpt2_weights(const hf::HfTensorSource& source, const GptConfig& config);

// Fills `out` (layout(group).numel floats) with the full, unpadded fp32 group.
using FullGroupSource = lm::FullGroupSource;

struct ExportOptions {
  hf::SafetensorsDType dtype = hf::SafetensorsDType::kF32;  // F32, BF16 or F16
  std::map<std::string, std::string> metadata;      // "__metadata__" strings
  // export_gpt2_checkpoint only:
  uint64_t shard_bytes = hf::kDefaultShardBytes;    // the most bytes in one weights file
  std::string tokenizer_source_dir;                 // its tokenizer files are copied along; empty: none
};

// Writes `path` with every parameter under its Hugging Face name, in Hugging Face's order
// (wte, wpe, h.0 ... h.{L-1}, ln_f), asking `source` for one group at a time.
Status write_gpt2_safetensors(const std::string& path, const GptConfig& config, const FullGroupSource& source,
                              const ExportOptions& options = {});
// Writes the model directory `dir` (hf::write_hf_checkpoint): config.json, the weights
// as model.safetensors or shards of at most options.shard_bytes with their index, the
// tokenizer files of options.tokenizer_source_dir; built beside `dir` and renamed into
// place. `source` is asked for the groups in gpt2_export_group_order()'s order.
Status export_gpt2_checkpoint(const std::string& dir, const GptConfig& config, const FullGroupSource& source,
                              const ExportOptions& options = {});
// The groups an export of `config` asks its source for, in order (each once): what the
// other ranks follow when they contribute their shards.
StatusOr<std::vector<int>> gpt2_export_group_order(const GptConfig& config);

// Hugging Face's GPT2Config as JSON (see write_gpt2_config_json).
nlohmann::json gpt2_config_json(const GptConfig& config);
// Writes Hugging Face's GPT2Config JSON (model_type gpt2, n_layer, n_head, n_embd,
// n_positions, n_ctx, vocab_size, gelu_new, layer_norm_epsilon 1e-5, tied embeddings).
Status write_gpt2_config_json(const std::string& path, const GptConfig& config);


}  // namespace strata::gpt
