#include "examples/gpt/gpt_weights.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

namespace strata::gpt {
namespace {

// GPT2Config's sizes that the tensors also give: config.json is written with them, and a
// checkpoint's config.json is checked against its tensors with them (in this order).
constexpr hf::ConfigKey<GptConfig> kGpt2SizeKeys[] = {
    {"n_layer", &GptConfig::n_layer}, {"n_embd", &GptConfig::n_embd}, {"vocab_size", &GptConfig::vocab_size}, {"n_positions", &GptConfig::n_ctx}};

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
    for (const auto& [key, field] : kGpt2SizeKeys) {
      STRATA_RETURN_IF_ERROR(check(key, config.*field));
    }
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

hf::HfNameMap gpt2_name_map(const GptConfig& config, int64_t rows_per_chunk) {
  return [config, rows_per_chunk](const GroupLayout& group, const TensorLayout& tensor) {
    const int64_t chunk = lm::vocab_chunk_of_group(group.name, "wte");
    if (chunk < 0) return hf::HfTensorSlice{hf_tensor_name(group, tensor), 0, tensor.shape};
    // Rows [chunk * rows_per_chunk, ...) of wte.weight; the last chunk's padding rows are the model's own.
    const int64_t first = chunk * rows_per_chunk;
    const int64_t real_rows = std::clamp<int64_t>(config.vocab_size - first, 0, tensor.shape[0]);
    const uint64_t row = static_cast<uint64_t>(config.n_embd);
    return hf::HfTensorSlice{"wte.weight", static_cast<uint64_t>(first) * row, {config.vocab_size, config.n_embd}, static_cast<uint64_t>(real_rows) * row};
  };
}

hf::HfNameMap gpt2_name_map(const GptConfig& config) { return gpt2_name_map(config, gpt_vocab_chunks(config).rows_per_chunk); }

Status load_gpt2_weights(Engine& engine, int rank, const SafetensorsReader& reader, const GptConfig& config) {
  return load_gpt2_weights(engine, rank, hf::SafetensorsFileSource(reader), config);
}

namespace {

// Hugging Face's GPT2LMHeadModel saves its names with "transformer.", GPT2Model without:
// each tensor is read under the name `source` holds it by.
hf::HfNameMap gpt2_name_map_as_stored(const hf::HfTensorSource& source, hf::HfNameMap bare) {
  return [&source, bare = std::move(bare)](const GroupLayout& group, const TensorLayout& tensor) {
    hf::HfTensorSlice slice = bare(group, tensor);
    if (!source.find(slice.name) && source.find("transformer." + slice.name)) slice.name = "transformer." + slice.name;
    return slice;
  };
}

hf::HfLoadOptions gpt2_load_options() {
  hf::HfLoadOptions options;
  options.is_ignored = [](std::string_view name) { return is_gpt2_ignored_tensor(name); };
  return options;
}

}  // namespace

Status load_gpt2_weights(Engine& engine, int rank, const hf::HfTensorSource& source, const GptConfig& config) {
  // The engine's wte chunks (whatever GptModelOptions::vocab_chunk_bytes made them): group 0 is
  // chunk 0, whose rows are every chunk's but the last's.
  const int64_t rows_per_chunk = engine.group_count() > 0 && engine.layout(0).name == "wte.0" ? engine.layout(0).tensors[0].shape[0] : 0;
  const int groups = gpt_groups(config, static_cast<size_t>(std::max<int64_t>(rows_per_chunk, 1)) * static_cast<size_t>(config.n_embd) * 4).count();
  if (rows_per_chunk < 1 || engine.group_count() != groups)
    return InvalidArgumentError("load_gpt2_weights: the engine's " + std::to_string(engine.group_count()) + " groups are not those of a GPT-2 with n_layer " +
                                std::to_string(config.n_layer) + " and vocabulary " + std::to_string(config.vocab_size) +
                                " (register a GptModel of this config first)");
  return hf::load_hf_weights(engine, rank, source, gpt2_name_map_as_stored(source, gpt2_name_map(config, rows_per_chunk)), gpt2_load_options());
}

Status check_gpt2_weights(const hf::HfTensorSource& source, const GptConfig& config) {
  STRATA_ASSIGN_OR_RETURN(const std::vector<GroupLayout> layouts, hf::single_rank_layouts(gpt_group_specs(config)));
  return hf::check_hf_mapping(source, layouts, gpt2_name_map_as_stored(source, gpt2_name_map(config)), gpt2_load_options());
}

namespace {

StatusOr<std::vector<GroupLayout>> gpt2_export_layouts(const GptConfig& config) { return hf::single_rank_layouts(gpt_group_specs(config)); }

}  // namespace

Status write_gpt2_safetensors(const std::string& path, const GptConfig& config, const FullGroupSource& source,
                              const ExportOptions& options) {
  STRATA_ASSIGN_OR_RETURN(const std::vector<GroupLayout> layouts, gpt2_export_layouts(config));
  STRATA_ASSIGN_OR_RETURN(hf::HfGroupExport plan, hf::HfGroupExport::plan(layouts, gpt2_name_map(config), options.dtype));
  auto metadata = options.metadata;
  metadata.emplace("format", "pt");
  return hf::write_safetensors_file(
      path, plan.tensors(), [&](size_t index, uint64_t first, std::span<float> out) { return plan.fill(source, index, first, out); },
      std::move(metadata));
}

Status export_gpt2_checkpoint(const std::string& dir, const GptConfig& config, const FullGroupSource& source,
                              const ExportOptions& options) {
  STRATA_ASSIGN_OR_RETURN(const std::vector<GroupLayout> layouts, gpt2_export_layouts(config));
  hf::HfExportOptions hf_options;
  hf_options.shard_bytes = options.shard_bytes;
  hf_options.metadata = options.metadata;
  hf_options.tokenizer_source_dir = options.tokenizer_source_dir;
  nlohmann::json config_json = gpt2_config_json(config);
  config_json["torch_dtype"] = std::string(hf::torch_dtype_name(options.dtype));
  return hf::export_hf_from_groups(dir, config_json, layouts, gpt2_name_map(config), options.dtype, source, hf_options);
}

StatusOr<std::vector<int>> gpt2_export_group_order(const GptConfig& config) {
  STRATA_ASSIGN_OR_RETURN(const std::vector<GroupLayout> layouts, gpt2_export_layouts(config));
  return hf::export_group_order(layouts, gpt2_name_map(config));
}

nlohmann::json gpt2_config_json(const GptConfig& config) {
  nlohmann::json json = {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"n_head", config.n_head},
      {"n_ctx", config.n_ctx},
      {"activation_function", "gelu_new"},
      {"layer_norm_epsilon", 1e-5},
      {"n_inner", nullptr},
      {"tie_word_embeddings", true},
      {"torch_dtype", "float32"},
  };
  hf::put_config_keys(json, config, kGpt2SizeKeys);
  return json;
}

Status write_gpt2_config_json(const std::string& path, const GptConfig& config) {
  return hf::write_json_file(path, gpt2_config_json(config));
}

}  // namespace strata::gpt
