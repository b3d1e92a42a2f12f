#include "examples/run_config/run_config.h"

#include <string>
#include <utility>
#include <vector>

#include "engine/core/config_codecs.h"
#include "engine/core/config_schema.h"

namespace strata {
namespace {

using namespace config_detail;

IntCodec non_negative() { return IntCodec{.min = 0}; }

// The trainer's keys, bound to `run`'s fields.
std::vector<KeySpec> trainer_keys(RunConfig& run) {
  std::vector<KeySpec> keys;
  auto add = [&keys](KeySpec spec) { keys.push_back(std::move(spec)); };
  add(bound_key("strata.steps", &run.steps, non_negative()));
  ModelConfig& model = run.model;
  add(bound_key("strata.model.preset", &model.preset, StringCodec{}));
  add(bound_key("strata.model.n_layer", &model.n_layer, non_negative()));
  add(bound_key("strata.model.n_head", &model.n_head, non_negative()));
  add(bound_key("strata.model.n_embd", &model.n_embd, non_negative()));
  add(bound_key("strata.model.n_ctx", &model.n_ctx, non_negative()));
  add(bound_key("strata.model.vocab_size", &model.vocab_size, non_negative()));
  add(bound_key("strata.model.activation_checkpointing", &model.activation_checkpointing, BoolCodec{}));
  add(bound_key("strata.model.checkpoints_in_pinned_memory", &model.checkpoints_in_pinned_memory, BoolCodec{}));
  DataConfig& data = run.data;
  add(bound_key("strata.data.kind", &data.kind,
                EnumCodec<DataKind>{.names = {{"synthetic", DataKind::kSynthetic}, {"text", DataKind::kText}, {"tokens", DataKind::kTokens}}}));
  add(bound_key("strata.data.path", &data.path, StringCodec{}));
  add(bound_key("strata.data.eval_fraction", &data.eval_fraction, DoubleCodec{.min = 0.0, .max = 1.0, .max_exclusive = true}));
  add(bound_key("strata.data.seq_len", &data.seq_len, non_negative()));
  add(bound_key("strata.placement", &run.placement,
                EnumCodec<PlacementMode>{.names = {{"config", PlacementMode::kConfig}, {"auto", PlacementMode::kAuto}}}));
  add(bound_key("strata.profile", &run.profile, StringCodec{}));
  return keys;
}

// The trainer's cross-field checks, after finalize()'s own.
void check_model_and_data(const RunConfig& run, const std::string& in, std::vector<std::string>& errors) {
  const ModelConfig& model = run.model;
  if (model.n_head > 0 && model.n_embd > 0 && model.n_embd % model.n_head != 0) {
    errors.push_back("strata.model.n_embd (" + std::to_string(model.n_embd) + ") is not a multiple of strata.model.n_head (" +
                     std::to_string(model.n_head) + ")" + in);
  }
  const DataConfig& data = run.data;
  if (data.seq_len > 0 && model.n_ctx > 0 && data.seq_len > model.n_ctx) {
    errors.push_back("strata.data.seq_len (" + std::to_string(data.seq_len) + ") is longer than strata.model.n_ctx (" +
                     std::to_string(model.n_ctx) + ")" + in);
  }
  if (data.kind != DataKind::kSynthetic && data.path.empty()) {
    errors.push_back("strata.data.kind is \"" + std::string(data_kind_name(data.kind)) + "\" but strata.data.path is not set" + in);
  }
}

// The extension for one RunConfig: its keys read and write `run`'s fields. `run` must
// outlive it (each function below makes its own).
ConfigExtension extension_for(RunConfig& run) {
  return make_config_extension(trainer_keys(run), [&run](const StrataConfig&, const std::string& in, std::vector<std::string>& errors) {
    check_model_and_data(run, in, errors);
  });
}

}  // namespace

std::string_view data_kind_name(DataKind kind) {
  switch (kind) {
    case DataKind::kSynthetic: return "synthetic";
    case DataKind::kText: return "text";
    case DataKind::kTokens: return "tokens";
  }
  return "?";
}

StatusOr<RunConfig> parse_run_config_json(std::string_view text, std::string_view source_name) {
  RunConfig run;
  const ConfigExtension extension = extension_for(run);
  STRATA_ASSIGN_OR_RETURN(run.engine, parse_config_json(text, source_name, &extension));
  return run;
}

StatusOr<RunConfig> load_run_config(const std::string& path) {
  RunConfig run;
  const ConfigExtension extension = extension_for(run);
  STRATA_ASSIGN_OR_RETURN(run.engine, load_config_file(path, &extension));
  return run;
}

Status apply_run_override(RunConfig& run, std::string_view dotted_key, std::string_view value) {
  const ConfigExtension extension = extension_for(run);
  return apply_override(run.engine, dotted_key, value, &extension);
}

std::optional<std::string> run_config_key_for_flag(std::string_view flag) {
  RunConfig scratch;
  const ConfigExtension extension = extension_for(scratch);
  return config_key_for_flag(flag, &extension);
}

Status finalize_run_config(RunConfig& run, int world_size) {
  const ConfigExtension extension = extension_for(run);
  return finalize(run.engine, world_size, &extension);
}

std::string run_config_to_json(const RunConfig& run) {
  RunConfig& readable = const_cast<RunConfig&>(run);  // the keys' get() only reads
  const ConfigExtension extension = extension_for(readable);
  return to_json(run.engine, &extension);
}

std::vector<ConfigKeyInfo> describe_run_config_keys() {
  RunConfig scratch;
  const ConfigExtension extension = extension_for(scratch);
  return describe_config_keys(&extension);
}

}  // namespace strata
