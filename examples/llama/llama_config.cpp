#include "examples/llama/llama_config.h"

#include <cmath>
#include <filesystem>
#include <iomanip>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine/core/file.h"
#include "examples/lm/config_problems.h"
#include "examples/lm/presets.h"

namespace strata::llama {
namespace {

using nlohmann::json;

std::string json_kind(const json& value) {
  if (value.is_null()) return "null";
  if (value.is_boolean()) return "a boolean";
  if (value.is_number_integer() || value.is_number_unsigned()) return "an integer";
  if (value.is_number_float()) return "a number";
  if (value.is_string()) return "a string";
  if (value.is_array()) return "an array";
  return "an object";
}

// Reads config.json's keys with errors that name the file, the key and what it holds.
class Keys {
 public:
  Keys(const json& object, std::string_view where) : object_(object), where_(where) {}

  Status error(const std::string& key, const std::string& problem) const {
    return InvalidArgumentError(std::string(where_) + ": \"" + key + "\" " + problem);
  }
  const json* find(const std::string& key) const {
    auto it = object_.find(key);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }
  StatusOr<int64_t> integer(const std::string& key) const {
    const json* value = find(key);
    if (value == nullptr) return error(key, "is missing (a positive integer is required)");
    return integer_value(key, *value);
  }
  StatusOr<int64_t> integer_or(const std::string& key, int64_t fallback) const {
    const json* value = find(key);
    return value == nullptr ? StatusOr<int64_t>(fallback) : integer_value(key, *value);
  }
  StatusOr<double> number_or(const std::string& key, double fallback) const {
    const json* value = find(key);
    if (value == nullptr) return fallback;
    if (!value->is_number()) return error(key, "is " + json_kind(*value) + ", expected a number");
    return value->get<double>();
  }
  StatusOr<bool> boolean_or(const std::string& key, bool fallback) const {
    const json* value = find(key);
    if (value == nullptr) return fallback;
    if (!value->is_boolean()) return error(key, "is " + json_kind(*value) + ", expected true or false");
    return value->get<bool>();
  }
  StatusOr<std::string> string_or(const std::string& key, const std::string& fallback) const {
    const json* value = find(key);
    if (value == nullptr) return fallback;
    if (!value->is_string()) return error(key, "is " + json_kind(*value) + ", expected a string");
    return value->get<std::string>();
  }

 private:
  StatusOr<int64_t> integer_value(const std::string& key, const json& value) const {
    if (value.is_number_integer() || value.is_number_unsigned()) return value.get<int64_t>();
    // 8192.0 is an integer written as a float (some exporters do that).
    if (value.is_number_float() && std::floor(value.get<double>()) == value.get<double>() && std::abs(value.get<double>()) < 9e15)
      return static_cast<int64_t>(value.get<double>());
    return error(key, "is " + (value.is_number() ? value.dump() : json_kind(value)) + ", expected an integer");
  }

  const json& object_;
  std::string_view where_;
};

StatusOr<LlamaFamily> family_from(const json& root, const Keys& keys) {
  STRATA_ASSIGN_OR_RETURN(std::string model_type, keys.string_or("model_type", ""));
  if (model_type == "llama") return LlamaFamily::kLlama;
  if (model_type == "mistral") return LlamaFamily::kMistral;
  if (model_type == "qwen2") return LlamaFamily::kQwen2;
  if (!model_type.empty())
    return keys.error("model_type", "is \"" + model_type + "\"; supported: \"llama\", \"mistral\", \"qwen2\"");
  const json* architectures = keys.find("architectures");
  if (architectures != nullptr && architectures->is_array()) {
    for (const json& name : *architectures) {
      if (name == "LlamaForCausalLM") return LlamaFamily::kLlama;
      if (name == "MistralForCausalLM") return LlamaFamily::kMistral;
      if (name == "Qwen2ForCausalLM") return LlamaFamily::kQwen2;
    }
    return keys.error("architectures", "is " + architectures->dump() +
                                           " with no model_type; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM");
  }
  (void)root;
  return keys.error("model_type", "is missing and there is no \"architectures\" list: cannot tell the model family");
}

StatusOr<kernels::RopeScaling> rope_scaling_from(const Keys& keys, std::string_view where) {
  kernels::RopeScaling scaling;
  const json* value = keys.find("rope_scaling");
  if (value == nullptr) return scaling;
  if (!value->is_object()) return keys.error("rope_scaling", "is " + json_kind(*value) + ", expected an object or null");
  const std::string inner_where = std::string(where) + " rope_scaling";
  const Keys inner(*value, inner_where);
  // transformers writes "rope_type"; older files "type".
  STRATA_ASSIGN_OR_RETURN(std::string type, inner.string_or("rope_type", ""));
  if (type.empty()) {
    STRATA_ASSIGN_OR_RETURN(type, inner.string_or("type", ""));
  }
  if (type.empty() || type == "default") return scaling;
  if (type != "linear" && type != "llama3")
    return keys.error("rope_scaling", "has rope_type \"" + type + "\"; Strata supports \"linear\" and \"llama3\" (and \"default\")");
  scaling.kind = type == "linear" ? kernels::RopeScaling::Kind::kLinear : kernels::RopeScaling::Kind::kLlama3;
  if (inner.find("factor") == nullptr) return inner.error("factor", "is missing (required by rope_type \"" + type + "\")");
  STRATA_ASSIGN_OR_RETURN(scaling.factor, inner.number_or("factor", 1.0));
  if (scaling.kind == kernels::RopeScaling::Kind::kLlama3) {
    for (const char* key : {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
      if (inner.find(key) == nullptr) return inner.error(key, "is missing (required by rope_type \"llama3\")");
    STRATA_ASSIGN_OR_RETURN(scaling.low_freq_factor, inner.number_or("low_freq_factor", 1.0));
    STRATA_ASSIGN_OR_RETURN(scaling.high_freq_factor, inner.number_or("high_freq_factor", 4.0));
    STRATA_ASSIGN_OR_RETURN(scaling.original_max_position_embeddings, inner.integer("original_max_position_embeddings"));
  }
  return scaling;
}

LlamaConfig make_preset(int64_t layers, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t mlp, int64_t vocab,
                        int64_t max_positions, double theta, bool tied, kernels::RopeScaling scaling) {
  LlamaConfig c;
  c.num_hidden_layers = layers;
  c.hidden_size = hidden;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = head_dim;
  c.intermediate_size = mlp;
  c.vocab_size = vocab;
  c.max_position_embeddings = max_positions;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = theta;
  c.tie_word_embeddings = tied;
  c.rope_scaling = scaling;
  return c;
}

kernels::RopeScaling llama3_scaling(double factor) {
  kernels::RopeScaling s;
  s.kind = kernels::RopeScaling::Kind::kLlama3;
  s.factor = factor;
  s.low_freq_factor = 1.0;
  s.high_freq_factor = 4.0;
  s.original_max_position_embeddings = 8192;
  return s;
}

std::vector<lm::Preset<LlamaConfig>> presets() {
  return {
      {"llama-tiny", make_preset(2, 64, 4, 2, 16, 160, 256, 256, 10000.0, true, {})},
      {"llama-1b", make_preset(16, 2048, 32, 8, 64, 8192, 128256, 131072, 500000.0, true, llama3_scaling(32.0))},
      {"llama-3b", make_preset(28, 3072, 24, 8, 128, 8192, 128256, 131072, 500000.0, true, llama3_scaling(32.0))},
      {"llama-8b", make_preset(32, 4096, 32, 8, 128, 14336, 128256, 131072, 500000.0, false, llama3_scaling(8.0))},
  };
}

}  // namespace

std::string_view llama_family_name(LlamaFamily family) {
  switch (family) {
    case LlamaFamily::kLlama: return "llama";
    case LlamaFamily::kMistral: return "mistral";
    case LlamaFamily::kQwen2: return "qwen2";
  }
  return "?";
}

StatusOr<LlamaConfig> parse_llama_config(std::string_view json_text, std::string_view where) {
  json root = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return InvalidArgumentError(std::string(where) + ": not valid JSON");
  if (!root.is_object()) return InvalidArgumentError(std::string(where) + ": expected a JSON object, got " + json_kind(root));
  const Keys keys(root, where);
  LlamaConfig c;
  STRATA_ASSIGN_OR_RETURN(c.family, family_from(root, keys));
  STRATA_ASSIGN_OR_RETURN(c.hidden_size, keys.integer("hidden_size"));
  STRATA_ASSIGN_OR_RETURN(c.intermediate_size, keys.integer("intermediate_size"));
  STRATA_ASSIGN_OR_RETURN(c.num_hidden_layers, keys.integer("num_hidden_layers"));
  STRATA_ASSIGN_OR_RETURN(c.num_attention_heads, keys.integer("num_attention_heads"));
  STRATA_ASSIGN_OR_RETURN(c.num_key_value_heads, keys.integer_or("num_key_value_heads", c.num_attention_heads));
  const int64_t default_head_dim = c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  STRATA_ASSIGN_OR_RETURN(c.head_dim, keys.integer_or("head_dim", default_head_dim));
  STRATA_ASSIGN_OR_RETURN(c.vocab_size, keys.integer("vocab_size"));
  STRATA_ASSIGN_OR_RETURN(c.max_position_embeddings, keys.integer("max_position_embeddings"));
  STRATA_ASSIGN_OR_RETURN(c.rms_norm_eps, keys.number_or("rms_norm_eps", 1e-6));
  STRATA_ASSIGN_OR_RETURN(c.rope_theta, keys.number_or("rope_theta", 10000.0));
  STRATA_ASSIGN_OR_RETURN(c.rope_scaling, rope_scaling_from(keys, where));
  STRATA_ASSIGN_OR_RETURN(c.tie_word_embeddings, keys.boolean_or("tie_word_embeddings", false));
  STRATA_ASSIGN_OR_RETURN(c.initializer_range, keys.number_or("initializer_range", 0.02));
  STRATA_ASSIGN_OR_RETURN(std::string activation, keys.string_or("hidden_act", "silu"));
  if (activation != "silu") return keys.error("hidden_act", "is \"" + activation + "\"; the Llama family's SwiGLU MLP needs \"silu\"");
  switch (c.family) {
    case LlamaFamily::kLlama: {
      STRATA_ASSIGN_OR_RETURN(bool attention_bias, keys.boolean_or("attention_bias", false));
      c.qkv_bias = c.o_proj_bias = attention_bias;
      STRATA_ASSIGN_OR_RETURN(c.mlp_bias, keys.boolean_or("mlp_bias", false));
      break;
    }
    case LlamaFamily::kMistral: {
      STRATA_ASSIGN_OR_RETURN(c.sliding_window, keys.integer_or("sliding_window", 0));
      break;
    }
    case LlamaFamily::kQwen2: {
      c.qkv_bias = true;  // Qwen2Attention: bias on q, k, v, none on o_proj
      STRATA_ASSIGN_OR_RETURN(bool sliding, keys.boolean_or("use_sliding_window", false));
      if (sliding) {
        STRATA_ASSIGN_OR_RETURN(c.sliding_window, keys.integer_or("sliding_window", 0));
      }
      break;
    }
  }
  STRATA_RETURN_IF_ERROR(validate_llama_config(c).with_context(std::string(where)));
  return c;
}

StatusOr<LlamaConfig> read_llama_config(const std::string& path) {
  std::string file = path;
  if (std::filesystem::is_directory(path)) file = (std::filesystem::path(path) / "config.json").string();
  STRATA_ASSIGN_OR_RETURN(File handle, File::open(file));
  STRATA_ASSIGN_OR_RETURN(std::string text, handle.read_to_end());
  return parse_llama_config(text, file);
}

Status validate_llama_config(const LlamaConfig& c) {
  lm::ConfigProblems problems;
  problems.all_positive({{"hidden_size", c.hidden_size}, {"intermediate_size", c.intermediate_size},
                         {"num_hidden_layers", c.num_hidden_layers}, {"num_attention_heads", c.num_attention_heads},
                         {"num_key_value_heads", c.num_key_value_heads}, {"head_dim", c.head_dim},
                         {"vocab_size", c.vocab_size}, {"max_position_embeddings", c.max_position_embeddings}});
  if (c.num_attention_heads > 0 && c.num_key_value_heads > 0 && c.num_attention_heads % c.num_key_value_heads != 0)
    problems.add("num_attention_heads (" + std::to_string(c.num_attention_heads) + ") must be a multiple of num_key_value_heads (" +
                 std::to_string(c.num_key_value_heads) + ")");
  if (c.head_dim > 0 && c.head_dim % 2 != 0) problems.add("head_dim (" + std::to_string(c.head_dim) + ") must be even for rotary embeddings");
  problems.vocab_fits_token_ids(c.vocab_size);
  if (!(c.rms_norm_eps > 0.0)) problems.add("rms_norm_eps must be positive");
  if (!(c.rope_theta > 0.0)) problems.add("rope_theta must be positive");
  if (!(c.initializer_range >= 0.0)) problems.add("initializer_range must be >= 0");
  if (c.sliding_window < 0) problems.add("sliding_window must be >= 0");
  const kernels::RopeScaling& s = c.rope_scaling;
  if (s.kind != kernels::RopeScaling::Kind::kNone && !(s.factor > 0.0))
    problems.add("rope_scaling.factor must be positive, got " + std::to_string(s.factor));
  if (s.kind == kernels::RopeScaling::Kind::kLlama3) {
    if (!(s.high_freq_factor > s.low_freq_factor) || !(s.low_freq_factor > 0.0))
      problems.add("rope_scaling needs 0 < low_freq_factor < high_freq_factor");
    if (s.original_max_position_embeddings <= 0) problems.add("rope_scaling.original_max_position_embeddings must be positive");
  }
  return problems.status("Llama config");
}

Status check_sequence_length(const LlamaConfig& c, int64_t seq_len) {
  if (seq_len > c.max_position_embeddings)
    return InvalidArgumentError("seq_len (" + std::to_string(seq_len) + ") is longer than max_position_embeddings (" +
                                std::to_string(c.max_position_embeddings) + ")");
  if (c.sliding_window > 0 && c.sliding_window < seq_len)
    return InvalidArgumentError("seq_len (" + std::to_string(seq_len) + ") is longer than the model's sliding_window (" +
                                std::to_string(c.sliding_window) + "); Strata computes full causal attention, which equals " +
                                std::string(llama_family_name(c.family)) + "'s windowed attention only for sequences within the window: use --seq-len <= " +
                                std::to_string(c.sliding_window));
  return {};
}

StatusOr<LlamaConfig> llama_preset(std::string_view name) {
  const std::vector<lm::Preset<LlamaConfig>> entries = presets();
  return lm::find_preset<LlamaConfig>(entries, name, "Llama");
}

std::vector<std::string> llama_preset_names() { return lm::preset_names<LlamaConfig>(presets()); }

int64_t llama_parameter_count(const LlamaConfig& c) {
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.intermediate_size;
  const int64_t q = c.num_attention_heads * D, kv = c.num_key_value_heads * D;
  int64_t block = 2 * H;                              // the two RMSNorm gains
  block += H * q + 2 * H * kv + q * H;                // q, k, v, o
  if (c.qkv_bias) block += q + 2 * kv;
  if (c.o_proj_bias) block += H;
  block += 3 * H * I;                                 // gate, up, down
  if (c.mlp_bias) block += 2 * I + H;
  const int64_t embeddings = c.vocab_size * H * (c.tie_word_embeddings ? 1 : 2);
  return embeddings + c.num_hidden_layers * block + H;
}

std::string describe_llama_config(const LlamaConfig& c) {
  std::ostringstream out;
  out << llama_family_name(c.family) << ": " << c.num_hidden_layers << " layers, hidden " << c.hidden_size << ", " << c.num_attention_heads
      << " heads (" << c.num_key_value_heads << " kv) x " << c.head_dim << ", MLP " << c.intermediate_size << ", vocabulary " << c.vocab_size
      << (c.tie_word_embeddings ? ", tied" : ", untied") << ", rope " << c.rope_theta;
  if (c.rope_scaling.kind == kernels::RopeScaling::Kind::kLinear) out << " linear x" << c.rope_scaling.factor;
  if (c.rope_scaling.kind == kernels::RopeScaling::Kind::kLlama3) out << " llama3 x" << c.rope_scaling.factor;
  if (c.qkv_bias) out << ", qkv bias";
  if (c.mlp_bias) out << ", mlp bias";
  if (c.sliding_window > 0) out << ", sliding window " << c.sliding_window << " (sequences must fit it)";
  out << " (" << std::fixed << std::setprecision(2) << double(llama_parameter_count(c)) / 1e6 << "M parameters)";
  return out.str();
}

}  // namespace strata::llama
