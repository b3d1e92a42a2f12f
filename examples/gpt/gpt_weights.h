// GPT-2 weights in and out of the engine: Hugging Face safetensors files (examples/gpt/
// safetensors.h) and the config.json beside them.
//
// Loading streams: each rank reads, tensor by tensor, only the element ranges that fall
// into its own master shards, straight into a one-shard buffer, so the whole model is
// never in host memory. Exporting writes group by group from full fp32 groups a caller
// supplies (the trainer assembles each from all ranks' shards in turn).
#pragma once

#include <functional>
#include <map>
#include <span>
#include <string>

#include "engine/core/status.h"
#include "engine/engine.h"
#include "examples/gpt/gpt_model.h"
#include "examples/gpt/safetensors.h"
#include "examples/lm/causal_lm.h"

namespace strata::gpt {

// The model's shape as Hugging Face's GPT-2 code names it.
Gpt2Dims gpt2_dims(const GptConfig& config);

// The architecture of a GPT-2 safetensors file: n_layer, n_embd, vocab_size and n_ctx
// from its tensors; n_head from the config.json in the same directory when there is
// one ("n_head"), else from `fallback` (an error when neither gives one, or when
// config.json contradicts the tensors).
StatusOr<GptConfig> gpt_config_from_safetensors(const SafetensorsReader& reader, const GptConfig& fallback);

// Loads this rank's fp32 master shards of every group from `reader` (any dtype the
// reader converts), checking every tensor's presence and shape first (the error names
// each missing or misshapen tensor and the file), then refresh_parameters(). The
// optimizer moments are left as they are (zero on a fresh engine). Call after start(),
// between steps.
Status load_gpt2_weights(Engine& engine, int rank, const SafetensorsReader& reader, const GptConfig& config);

// Fills `out` (layout(group).numel floats) with the full, unpadded fp32 group.
using FullGroupSource = lm::FullGroupSource;

struct ExportOptions {
  SafetensorsDType dtype = SafetensorsDType::kF32;  // F32, BF16 or F16
  std::map<std::string, std::string> metadata;      // "__metadata__" strings
};

// Writes `path` with every parameter under its Hugging Face name, in Hugging Face's order
// (wte, wpe, h.0 ... h.{L-1}, ln_f), asking `source` for one group at a time.
Status write_gpt2_safetensors(const std::string& path, const GptConfig& config, const FullGroupSource& source,
                              const ExportOptions& options = {});
// Writes Hugging Face's GPT2Config JSON (model_type gpt2, n_layer, n_head, n_embd,
// n_positions, n_ctx, vocab_size, gelu_new, layer_norm_epsilon 1e-5, tied embeddings).
Status write_gpt2_config_json(const std::string& path, const GptConfig& config);

// A 64-bit checksum of every fp32 master weight: the sum over groups g and unpadded
// elements i of mix(g, i, bits of the value), so each rank can add up its own shards in
// any order and the total is the same for every world size and bit-identical weights
// give the same value. `shard` is rank `rank`'s master shard of `layout`.
uint64_t master_checksum_part(const GroupLayout& layout, int rank, std::span<const float> shard);
std::string checksum_hex(uint64_t checksum);  // 16 lowercase hex digits

}  // namespace strata::gpt
