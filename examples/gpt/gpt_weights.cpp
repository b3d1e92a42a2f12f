#include "examples/gpt/gpt_weights.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

namespace strata::gpt {
namespace {

// splitmix64's finalizer: a bijective 64-bit mixer.
uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

}  // namespace

Gpt2Dims gpt2_dims(const GptConfig& config) {
  Gpt2Dims dims;
  dims.n_layer = config.n_layer;
  dims.n_embd = config.n_embd;
  dims.vocab_size = config.vocab_size;
  dims.n_ctx = config.n_ctx;
  return dims;
}

StatusOr<GptConfig> gpt_config_from_safetensors(const SafetensorsReader& reader, const GptConfig& fallback) {
  STRATA_ASSIGN_OR_RETURN(Gpt2Dims dims, infer_gpt2_dims(reader));
  GptConfig config;
  config.n_layer = dims.n_layer;
  config.n_embd = dims.n_embd;
  config.vocab_size = dims.vocab_size;
  config.n_ctx = dims.n_ctx;
  config.n_head = fallback.n_head;
  const std::filesystem::path json_path = std::filesystem::path(reader.path()).parent_path() / "config.json";
  std::error_code ec;
  if (std::filesystem::exists(json_path, ec)) {
    std::ifstream in(json_path);
    nlohmann::json json = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (json.is_discarded() || !json.is_object())
      return InvalidArgumentError(json_path.string() + " (next to " + reader.path() + ") is not a JSON object");
    auto check = [&](const char* key, int64_t from_tensors) -> Status {
      if (!json.contains(key)) return {};
      if (!json[key].is_number_integer())
        return InvalidArgumentError(json_path.string() + ": \"" + key + "\" must be an integer");
      const int64_t value = json[key].get<int64_t>();
      if (value != from_tensors)
        return InvalidArgumentError(json_path.string() + ": \"" + key + "\" is " + std::to_string(value) + " but the tensors of " +
                                    reader.path() + " give " + std::to_string(from_tensors));
      return {};
    };
    STRATA_RETURN_IF_ERROR(check("n_layer", config.n_layer));
    STRATA_RETURN_IF_ERROR(check("n_embd", config.n_embd));
    STRATA_RETURN_IF_ERROR(check("vocab_size", config.vocab_size));
    STRATA_RETURN_IF_ERROR(check("n_positions", config.n_ctx));
    if (json.contains("n_head")) {
      if (!json["n_head"].is_number_integer()) return InvalidArgumentError(json_path.string() + ": \"n_head\" must be an integer");
      config.n_head = json["n_head"].get<int64_t>();
    }
  }
  if (config.n_head <= 0)
    return InvalidArgumentError("the number of attention heads of " + reader.path() +
                                " is unknown: put Hugging Face's config.json (with \"n_head\") next to it, or give "
                                "strata.model.n_head / a preset");
  STRATA_RETURN_IF_ERROR(validate_gpt_config(config).with_context("the model in " + reader.path()));
  return config;
}

Status load_gpt2_weights(Engine& engine, int rank, const SafetensorsReader& reader, const GptConfig& config) {
  STRATA_RETURN_IF_ERROR(check_gpt2_file(reader, gpt2_dims(config)));
  std::vector<float> shard;
  for (int g = 0; g < engine.group_count(); ++g) {
    const GroupLayout& layout = engine.layout(g);
    shard.assign(layout.shard_numel, 0.0f);
    const size_t begin = layout.shard_begin(rank);
    const size_t end = begin + layout.shard_numel;
    for (const TensorLayout& t : layout.tensors) {
      const size_t lo = std::max(begin, t.offset), hi = std::min(end, t.offset + t.numel);
      if (lo >= hi) continue;
      const std::string name = hf_tensor_name(layout, t);
      STRATA_ASSIGN_OR_RETURN(const SafetensorsTensor* tensor, find_gpt2_tensor(reader, name, t.shape));
      STRATA_RETURN_IF_ERROR(reader.read_fp32(*tensor, lo - t.offset, std::span<float>(shard.data() + (lo - begin), hi - lo)));
    }
    STRATA_RETURN_IF_ERROR(engine.write_state_shard(g, Engine::StateKind::kMaster, shard));
  }
  return engine.refresh_parameters();
}

Status write_gpt2_safetensors(const std::string& path, const GptConfig& config, const FullGroupSource& source,
                              const ExportOptions& options) {
  const auto specs = gpt_group_specs(config);
  std::vector<GroupLayout> layouts;
  std::vector<SafetensorsTensorSpec> tensors;
  for (size_t g = 0; g < specs.size(); ++g) {
    STRATA_ASSIGN_OR_RETURN(GroupLayout layout, layout_group(specs[g], static_cast<int>(g), 1));
    for (const auto& t : layout.tensors) tensors.push_back({hf_tensor_name(layout, t), options.dtype, t.shape});
    layouts.push_back(std::move(layout));
  }
  auto metadata = options.metadata;
  metadata.emplace("format", "pt");
  STRATA_ASSIGN_OR_RETURN(SafetensorsWriter writer, SafetensorsWriter::create(path, std::move(tensors), std::move(metadata)));
  std::vector<float> full;
  for (const GroupLayout& layout : layouts) {
    full.assign(layout.numel, 0.0f);
    STRATA_RETURN_IF_ERROR(source(layout.id, full));
    for (const auto& t : layout.tensors)
      STRATA_RETURN_IF_ERROR(writer.append_fp32(hf_tensor_name(layout, t), std::span<const float>(full.data() + t.offset, t.numel)));
  }
  return writer.finish();
}

Status write_gpt2_config_json(const std::string& path, const GptConfig& config) {
  nlohmann::json json = {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"n_layer", config.n_layer},
      {"n_head", config.n_head},
      {"n_embd", config.n_embd},
      {"n_positions", config.n_ctx},
      {"n_ctx", config.n_ctx},
      {"vocab_size", config.vocab_size},
      {"activation_function", "gelu_new"},
      {"layer_norm_epsilon", 1e-5},
      {"n_inner", nullptr},
      {"tie_word_embeddings", true},
      {"torch_dtype", "float32"},
  };
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return IoError("cannot write " + tmp);
    out << json.dump(2) << "\n";
    out.flush();
    if (!out) return IoError("cannot write " + tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return IoError("cannot rename " + tmp + " to " + path + ": " + ec.message());
  return {};
}

uint64_t master_checksum_part(const GroupLayout& layout, int rank, std::span<const float> shard) {
  uint64_t sum = 0;
  const size_t begin = layout.shard_begin(rank);
  const uint64_t group_key = mix64(0x5354524154410000ull + static_cast<uint64_t>(layout.id));
  for (size_t i = 0; i < shard.size() && begin + i < layout.numel; ++i) {
    const uint64_t bits = std::bit_cast<uint32_t>(shard[i]);
    sum += mix64(group_key ^ mix64(static_cast<uint64_t>(begin + i)) ^ (bits * 0x9e3779b97f4a7c15ull));
  }
  return sum;
}

std::string checksum_hex(uint64_t checksum) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(checksum));
  return text;
}

}  // namespace strata::gpt
