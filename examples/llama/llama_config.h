// The Llama family's architecture (Llama 2/3/3.1/3.2, Mistral, Qwen2): what a Hugging Face
// config.json says, checked, plus named shapes.
//
// One LlamaConfig covers the three families, which differ only in details:
//   llama    attention_bias puts a bias on q, k, v and o_proj; mlp_bias on gate, up, down.
//   mistral  no biases; sliding_window (an attention window) — Strata computes full causal
//            attention, which is the same thing as long as sequences are no longer than the
//            window (checked when a model is planned).
//   qwen2    q, k and v always have biases (o_proj never); use_sliding_window as Mistral.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/status.h"
#include "kernels/rope.h"

namespace strata::llama {

enum class LlamaFamily : uint8_t { kLlama, kMistral, kQwen2 };
std::string_view llama_family_name(LlamaFamily family);  // "llama" | "mistral" | "qwen2"

struct LlamaConfig {
  LlamaFamily family = LlamaFamily::kLlama;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;     // grouped-query attention; = num_attention_heads for plain MHA
  int64_t head_dim = 0;                // hidden_size / num_attention_heads unless config.json says
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  kernels::RopeScaling rope_scaling;   // kNone, kLinear or kLlama3
  bool tie_word_embeddings = false;    // the LM head reads the token embedding
  bool qkv_bias = false;               // q_proj, k_proj, v_proj carry a bias (Qwen2; Llama's attention_bias)
  bool o_proj_bias = false;            // o_proj carries a bias (Llama's attention_bias only)
  bool mlp_bias = false;               // gate_proj, up_proj, down_proj carry a bias (Llama's mlp_bias)
  int64_t sliding_window = 0;          // Mistral / Qwen2 attention window in tokens; 0 = none
  double initializer_range = 0.02;     // std of the normal initialization of every matrix
};

// Parses a Hugging Face config.json (its text; `where` names it in errors, e.g. the path).
// The family comes from "model_type" ("llama", "mistral", "qwen2") or else "architectures"
// (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM). Errors name the key, what it
// holds and what was expected; unsupported settings (another hidden_act, a rope_scaling
// type other than linear / llama3, ...) are errors that say so.
StatusOr<LlamaConfig> parse_llama_config(std::string_view json_text, std::string_view where);
// Reads and parses `path` (a config.json, or a directory holding one).
StatusOr<LlamaConfig> read_llama_config(const std::string& path);

// Positive sizes, heads a multiple of key/value heads, an even head_dim, rope fields in
// range; errors name the field.
Status validate_llama_config(const LlamaConfig& config);
// Mistral / Qwen2's sliding window is honoured only when sequences fit in it: an error
// naming both when seq_len is longer than the window.
Status check_sequence_length(const LlamaConfig& config, int64_t seq_len);

// Named shapes: "llama-tiny" (for tests), "llama-1b" (Llama-3.2-1B), "llama-3b"
// (Llama-3.2-3B), "llama-8b" (Llama-3.1-8B), with their real sizes. NotFound lists them.
StatusOr<LlamaConfig> llama_preset(std::string_view name);
std::vector<std::string> llama_preset_names();

// Parameters of the model (the embedding counted once when tied).
int64_t llama_parameter_count(const LlamaConfig& config);
// "llama: 16 layers, hidden 2048, 32 heads (8 kv) x 64, MLP 8192, vocabulary 128256, tied, rope 500000 llama3 x32 (1235.81M parameters)"
std::string describe_llama_config(const LlamaConfig& config);

}  // namespace strata::llama
