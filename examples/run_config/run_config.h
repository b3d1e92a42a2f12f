// strata-train's config: the engine's (engine/core/config.h) plus the keys of the programs
// that train a model in the same file: strata.model.*, strata.data.* and strata.steps
// (strata-train's), strata.placement and strata.profile (strata-train's and the Python
// front end's), parsed with the engine's keys and in the same messages (every unknown or
// ill-typed key rejected, naming it).
// Programs that train a model read their file here; the engine never sees these keys.
//
// Use:
//   STRATA_ASSIGN_OR_RETURN(RunConfig run, load_run_config(path));
//   STRATA_RETURN_IF_ERROR(apply_run_override(run, "strata.model.n_layer", "12"));
//   STRATA_RETURN_IF_ERROR(finalize_run_config(run, world_size));
//   run.engine goes to engine/engine_config.h; run.model, run.data and run.steps to the trainer.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/config.h"
#include "engine/core/status.h"

namespace strata {

enum class DataKind : uint8_t { kSynthetic, kText, kTokens };
std::string_view data_kind_name(DataKind kind);  // "synthetic" | "text" | "tokens"

// strata.model: the trainer's model. 0 means "take it from the preset".
struct ModelConfig {
  std::string preset;                          // a named model shape, defined by the trainer; empty = none
  int64_t n_layer = 0;
  int64_t n_head = 0;
  int64_t n_embd = 0;
  int64_t n_ctx = 0;                           // context length in tokens
  int64_t vocab_size = 0;
  bool activation_checkpointing = true;        // keep only each block's input; recompute the rest in backward
  bool checkpoints_in_pinned_memory = false;   // keep the block inputs saved for recompute in pinned host memory
};

// strata.data: what the trainer reads.
struct DataConfig {
  DataKind kind = DataKind::kSynthetic;
  std::string path;            // text file or token file; required unless kind is synthetic
  double eval_fraction = 0.0;  // share of the data held out for evaluation, in [0, 1)
  int64_t seq_len = 0;         // tokens per sample; 0 = model.n_ctx
};

// strata.placement: the config's own tiers, prefetch depth and overlap, or those the plan's
// search picks by the predicted step (examples/profile/placement_search.h).
enum class PlacementMode : uint8_t { kConfig, kAuto };

struct RunConfig {
  StrataConfig engine;  // every key the engine reads
  ModelConfig model;    // strata.model
  DataConfig data;      // strata.data
  int64_t steps = 0;    // strata.steps: optimizer steps to run; 0 = the trainer's default
  PlacementMode placement = PlacementMode::kConfig;  // strata.placement (strata-train --placement wins)
  std::string profile;  // strata.profile: the machine profile to predict with; empty = the one kept on this host
};

// As load_config_file / parse_config_json, with the trainer's keys.
StatusOr<RunConfig> load_run_config(const std::string& path);
StatusOr<RunConfig> parse_run_config_json(std::string_view text, std::string_view source_name);

// As apply_override, for the engine's keys and the trainer's.
Status apply_run_override(RunConfig& run, std::string_view dotted_key, std::string_view value);

// As config_key_for_flag, with the trainer's keys (--steps).
std::optional<std::string> run_config_key_for_flag(std::string_view flag);

// finalize() and the trainer's own checks (n_embd a multiple of n_head, seq_len within
// n_ctx, a path for text and token data), every problem in one Status.
Status finalize_run_config(RunConfig& run, int world_size);

// As to_json, the trainer's keys after the engine's.
std::string run_config_to_json(const RunConfig& run);

// As describe_config_keys, with the trainer's keys.
std::vector<ConfigKeyInfo> describe_run_config_keys();

}  // namespace strata
