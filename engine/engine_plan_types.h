// The plan's record (EnginePlan): bytes per tier and state kind, and the sizing every
// stage allocates from. engine/engine_plan.h computes it; it lives below the facade
// (engine/engine.h) so that a stage needs neither the API nor the planner.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "offload/tier.h"

namespace strata {

// Bytes per tier and state kind, as planned at start().
struct PlanLine {
  std::string what;   // "parameters (bf16)", "master weights (fp32)", "gather buffers", ...
  Tier tier;
  size_t bytes;
};
struct EnginePlan {
  std::vector<PlanLine> lines;
  size_t device_bytes = 0;        // everything the engine allocates on the device + declared activations
  size_t device_budget_bytes = 0;
  size_t pinned_bytes = 0;        // the pinned arena's size
  size_t host_bytes = 0;          // pageable host memory
  size_t nvme_bytes = 0;          // this rank's NVMe file
  size_t state_bytes = 0;         // the model's full training state over all ranks: params + master + moments + grads (frozen groups: params)
  int prefetch_depth = 0;         // after the caps
  bool prefetch_depth_chosen = false;  // the engine picked it (no explicit setting)
  int gather_slots = 0;

  // The sizing every stage allocates from (engine/engine_plan.h computes all of it).
  std::vector<char> persistent;   // per group: stays gathered on the device
  size_t max_gather_elements = 0; // the largest group that takes a gather slot (padded)
  size_t max_gather_shard = 0;    // its shard
  size_t max_padded_elements = 0; // the largest group (padded), persistent or not
  size_t max_shard_elements = 0;  // the largest shard
  // The largest trainable shard: what gradient and optimizer buffers are sized by (frozen
  // groups have neither; 0 when every group is frozen).
  size_t max_trainable_shard_elements = 0;
  int gradient_slots = 0;         // device gradient buffers
  // One buffer beyond those the model holds, not two: two did not fit the device budget.
  bool single_gradient_buffer = false;
  // Elements (padded) each gradient slot holds: the first fits the largest group, the
  // others the largest of the rest (a vocabulary-sized group takes the big one).
  std::vector<size_t> gradient_slot_elements;
  size_t reduce_bucket_elements = 0;  // reduce-scatter pieces per rank (reduce_bucket_size); 0 = a group at a time
  // Gradient shards go to NVMe beside the optimizer state, through a ring of host landing
  // buffers, instead of a host buffer per group (optimizer state on NVMe).
  bool gradients_spilled = false;
  int landing_buffers = 0;        // the ring's size when spilled
  size_t state_piece_elements = 0;  // NVMe optimizer state: elements per chunk of the ring
  int state_ring_slots = 0;
  size_t state_ring_bytes = 0;
  size_t pinned_budget_bytes = 0; // the budget the plan was fitted to (0 = none)
  std::string text;               // the plan as printed at start-up
};

}  // namespace strata
