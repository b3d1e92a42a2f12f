// The work of one optimizer step on one rank, from the plan (engine/engine_plan.h), the
// engine's options, the group layouts and schedule, and the model's FLOP shape
// (examples/lm/model_flops.h): the input of the cost model (examples/profile/step_cost.h).
//
// Per micro-batch, every use of a group that takes a gather slot fetches its shard: from
// NVMe (4 KiB-rounded) when parameters live there, then host to device unless they live
// on the device, then the all-gather of the full group when world > 1. Persistent groups
// are fetched once per step. Every trainable group's gradient is reduce-scattered (world
// > 1), copied to the host and landed (read, and accumulated in fp32 with micro-batches)
// once per micro-batch, and written to NVMe when spilled. Per step, Adam steps every
// trainable shard element; with optimizer state on NVMe it reads and writes the master
// weights and both moments (12 bytes per element) and reads the spilled gradient; new
// parameters go back to NVMe (parameters there) or to the device (parameters there,
// optimizer on the host).
//
// FLOPs: forward 2 per matmul weight per token, backward 4 (2 for a weight whose input is
// the data), attention 4 x seq_len x width per layer forward and 8 backward; activation
// checkpointing recomputes each block's forward (the vocabulary head only when the model
// says its logits are made again in backward).
//
// Memory-bound work: the model's declared kernels per phase (forward, recompute, backward),
// and the weights the products stream from memory: each matmul weight is read once per
// forward and recompute, once more by the input gradient's product (not for a weight whose
// input is the data) and written once by the weight gradient's; the gradient buffers the
// engine zeroes for the model, and the fp32 gradients cast to a narrower transfer dtype.
#pragma once

#include <cstdint>
#include <span>

#include "engine/engine_options.h"
#include "engine/engine_plan_types.h"
#include "engine/partition.h"
#include "examples/lm/memory_bound_work.h"
#include "examples/lm/model_flops.h"
#include "examples/profile/step_cost.h"

namespace strata::profile {

// One rank's model work per micro-batch.
struct ModelWork {
  lm::FlopShape flops;
  int64_t seq_len = 1;            // tokens per sequence (attention's key count)
  int64_t tokens = 0;             // tokens per micro-batch on this rank (0: no compute, --compute none)
  int64_t head_weights = 0;       // matmul weights of the vocabulary head (not recomputed)
  bool recompute = false;         // activation checkpointing is on
  lm::MemoryBoundWork memory;     // its memory-bound kernels (none declared: not priced)
  bool gradient_buffers_zeroed = true;  // it takes each gradient buffer zeroed (the engine's memset on the compute stream)
};

struct PlannedStepInputs {
  const EngineOptions* options = nullptr;
  const EnginePlan* plan = nullptr;
  std::span<const GroupLayout> layouts;
  std::span<const int> schedule;  // group uses per micro-batch; empty: each group twice (forward, backward)
  ModelWork model;
};

struct PlannedStep {
  StepWork work;
  PipelineShape shape;
};

StatusOr<PlannedStep> planned_step(const PlannedStepInputs& inputs);

}  // namespace strata::profile
