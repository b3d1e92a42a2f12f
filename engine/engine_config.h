// The engine options a config file asks for: one mapping from StrataConfig (the file's
// DeepSpeed keys and the "strata" section, engine/core/config.h) to EngineOptions, for
// every program that drives an Engine from a config. docs/config.md says which key sets
// which option; a key the engine has no field for is warned about or rejected by the
// loader, never accepted and dropped here.
//
//   STRATA_RETURN_IF_ERROR(finalize(config, world_size));
//   STRATA_ASSIGN_OR_RETURN(EngineOptions options, engine_options_from_config(config, rank));
//   options.activation_bytes = ...;   // the model's own device memory, not a config key
#pragma once

#include "engine/core/config.h"
#include "engine/core/status.h"
#include "engine/engine.h"

namespace strata {

// The options for rank `rank` of a finalized config (finalize() has resolved the batch
// sizes, the precision and the host tiers). activation_bytes is left 0. Errors: `rank`
// outside [0, world_size), a config that was not finalized, a size in MiB too large for
// this machine's size_t.
StatusOr<EngineOptions> engine_options_from_config(const StrataConfig& config, int rank);

}  // namespace strata
