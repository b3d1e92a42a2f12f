// strata.placement "auto" in the Python front end: the search of
// examples/profile/placement_search.h over what the engine decides for a PyTorch model —
// parameter and optimizer tiers (device, cpu, and nvme when strata.nvme_path is given),
// prefetch depth 0, 1, 2 or 4, and optimizer overlap exact or delayed (only the configured
// one when strata.optimizer_overlap was given, or with fp16 loss scaling). The micro-batch
// and activation checkpointing are the calling script's (its batches, the model's own
// gradient checkpointing), so they are not searched: the prediction counts them as they are.
//
// Each candidate is this rank's engine plan from the registered groups (no engine, nothing
// under nvme_path), checked against the device and pinned budgets, the host's memory and
// the free space under nvme_path, and predicted with the machine profile (strata.profile,
// else the one kept on this host; auto needs one). The model's FLOPs come from the front
// end (SessionWork): PyTorch computes, so the prediction's compute row is the profile's
// GEMM rate standing in for PyTorch's.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/core/config.h"
#include "engine/partition.h"
#include "examples/lm/model_flops.h"
#include "examples/profile/machine_profile.h"
#include "examples/profile/placement_search.h"

namespace strata::python {

// What a step of the caller's model computes, as the front end measures its modules.
struct SessionWork {
  lm::FlopShape flops;
  int64_t seq_len = 0;       // tokens per sequence
  int64_t head_weights = 0;  // matmul weights of the output head (not recomputed)
  bool recompute = false;    // the model recomputes its blocks in backward (gradient checkpointing)
};

struct PlacementRequest {
  const StrataConfig* config = nullptr;  // finalized
  int rank = 0;
  int world_size = 1;
  std::span<const GroupSpec> groups;
  int held_gradients = -1;
  size_t device_budget_bytes = 0;
  SessionWork work;
  const profile::RunProfile* profile = nullptr;
};

StatusOr<profile::PlacementChoice> choose_session_placement(const PlacementRequest& request);

// The placement written into the config: tiers, prefetch depth and overlap.
void apply_session_placement(const profile::Placement& placement, StrataConfig& config);

// The part of a placement the front end decides, as JSON (what rank 0 hands the other
// ranks of a multi-process run) and back; an error names a field that is missing or wrong.
nlohmann::json session_placement_json(const profile::Placement& placement);
StatusOr<profile::Placement> session_placement_from_json(const nlohmann::json& json);

}  // namespace strata::python
