// The step's cost model: from the work of one step on one rank, stage by stage (bytes
// moved, FLOPs computed, elements updated: examples/profile/step_work.h derives them from
// the plan) and a machine profile (examples/profile/machine_profile.h), each stage's
// predicted busy seconds and the predicted step as the pipeline's critical path.
//
// Each stage is a worker of its own, so the step takes at least its busiest stage's
// time. It also takes at least the chain that cannot overlap: the compute stream's
// forward, recompute and backward, plus
// - the parameter fetch (NVMe read, H2D, all-gather) of every gather with prefetch depth
//   0, or of the first gather alone (the pipeline's fill) with a deeper prefetch;
// - in exact overlap, the optimizer's time beyond the next step's first forward (forward(g)
//   waits for Adam(g), and Adam starts after backward; with clipping and loss scaling off
//   it may start during the last micro-batch's backward, which it overlaps too).
// In delayed overlap the optimizer overlaps the whole next step and joins the chain only
// through its own busy time. Where the work carries its groups and their order, the
// schedule is also replayed group by group (examples/profile/step_replay.h), which sees a
// resource wait on the order of the work (an update the next forward needs first, queued
// behind the others). The step is the longest of the bounds; the prediction names the
// stage, shared resource, chain or replay that bounds it. docs/profile.md describes the model.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/core/overlap_mode.h"
#include "engine/core/status.h"
#include "engine/trace.h"
#include "examples/profile/machine_profile.h"

namespace strata::profile {

// A memory-bound kernel's elements in one phase of the step, named as the profile names
// it (examples/profile/kernel_ops.h gives the bytes per element).
struct MemoryPass {
  std::string op;
  double elements = 0;
};

// One group's part of the step, for the replay of its schedule (examples/profile/step_replay.h).
struct GroupWork {
  double numel = 0;                // its parameters: its share of the compute
  bool persistent = false;         // fetched once per step
  double fetch_read_bytes = 0;     // per fetch: its shard from NVMe
  double fetch_h2d_bytes = 0;      // per fetch: host to device
  bool trainable = false;
  double gradient_cast_bytes = 0;  // per micro-batch: its fp32 gradient read and cast to the transfer dtype written
  double gradient_out_bytes = 0;   // per micro-batch: its gradient shard to the host
  double landing_bytes = 0;        // per micro-batch: what the landing pass moves
  double spill_bytes = 0;          // per micro-batch: its gradient written to NVMe by the landing
  double update_read_bytes = 0;    // per step: optimizer state and the spilled gradient read
  double update_write_bytes = 0;   // per step: optimizer state and new parameters written
  int update_pieces = 0;           // optimizer state on NVMe: the state ring's chunks its update takes; 0: no ring
  double adam_elements = 0;
};

// One rank's work in one optimizer step (all its micro-batches).
struct StepWork {
  double param_read_bytes = 0;       // parameter shards read from NVMe for gathers
  double state_read_bytes = 0;       // optimizer state and spilled gradients read from NVMe
  double param_write_bytes = 0;      // new parameters written back to NVMe
  double state_write_bytes = 0;      // optimizer state and spilled gradients written to NVMe
  double h2d_bytes = 0;              // parameter shards to the device for gathers
  double h2d_update_bytes = 0;       // new parameters to the device (parameters there, optimizer on the host)
  double allgather_bytes = 0;        // full buffers gathered (world > 1)
  double reduce_scatter_bytes = 0;   // full gradient buffers reduced (world > 1)
  double d2h_bytes = 0;              // gradient shards to the host
  double landing_bytes = 0;          // host bytes the landing pass reads and writes
  double forward_matmul_flops = 0;
  double forward_attention_flops = 0;
  double backward_matmul_flops = 0;
  double backward_attention_flops = 0;
  double recompute_matmul_flops = 0;    // activation checkpointing: each block's forward again
  double recompute_attention_flops = 0;
  std::vector<MemoryPass> forward_memory;    // the model's memory-bound kernels, by phase
  std::vector<MemoryPass> recompute_memory;
  std::vector<MemoryPass> backward_memory;
  double forward_weight_elements = 0;    // matmul weights the products stream from memory, by phase
  double recompute_weight_elements = 0;
  double backward_weight_elements = 0;
  double gradient_zero_bytes = 0;        // gradient buffers the engine zeroes on the compute stream
  double gradient_cast_bytes = 0;        // fp32 gradients read and cast to the transfer dtype written
  double adam_elements = 0;          // optimizer elements stepped (this rank's trainable shards)
  std::vector<GroupWork> groups;     // by group id (empty: no replay of the schedule)
  std::vector<int> uses;             // group ids in the order one micro-batch uses them
  int fetching_gathers = 0;          // gathers per step that fetch (the fill is one of them)
};

// The pipeline the work runs through.
struct PipelineShape {
  int prefetch_depth = 1;
  OverlapMode overlap = OverlapMode::kExact;
  int micro_batches = 1;
  int world = 1;
  bool adam_during_backward = false;  // exact overlap without clipping or loss scaling
  bool adam_on_device = false;        // optimizer state on the device: Adam at the device's memory rate
  // One gradient buffer (the plan's fallback): each group's backward waits for the previous
  // group's gradients to leave the device, so their reduce-scatter and copy join the chain.
  bool single_gradient_buffer = false;
  std::string grad_dtype = "bf16";    // what the CPU Adam reads ("fp32" | "bf16" | "fp16")
  std::string param_dtype = "bf16";   // the parameter copy it writes
  uint64_t nvme_block_bytes = uint64_t{1} << 20;
  int nvme_queue_depth = 32;
  int state_ring_slots = 3;           // optimizer state on NVMe: the state ring's slots (chunks in flight)
  bool nvme_checksums = true;
};

// One line of the printed table.
struct CostRow {
  std::string stage;    // the engine stage's name (engine/trace.h), e.g. "nvme_read"
  std::string what;     // e.g. "parameter shards", "forward (GEMM)"
  double amount = 0;    // bytes, FLOPs or elements
  std::string unit;     // "B" | "FLOP" | "elements"
  double rate = 0;      // amount per second; 0 when the profile has none
  std::string rate_source;  // which figure of the profile
  std::optional<double> seconds;  // unset when the profile has no rate for it
};

struct StepPrediction {
  std::vector<CostRow> rows;
  StageSeconds busy{};          // per engine stage: the sum of its rows' seconds
  // Per engine stage, the time it has work in flight (what the engine's busy_s measures):
  // the replay's (the stage's jobs stretched by what shares the host's cores with them),
  // plus its rows the replay leaves out (collectives, new parameters uploaded to a GPU),
  // else busy; the disk's two directions are both in flight while an update moves its
  // state both ways at once (at the profile's mixed rate, where measured).
  StageSeconds in_flight{};
  double pipeline_seconds = 0;  // the busiest stage's, or a shared resource's (the disk, the CPU device's cores) when more
  double chain_seconds = 0;     // the chain that cannot overlap
  double replay_seconds = 0;    // the schedule replayed group by group (examples/profile/step_replay.h); 0 without one
  double step_seconds = 0;      // the larger
  std::string bound;            // what bounds the step: a stage's name or the chain's description
  std::vector<std::string> unknown;  // rows with work but no rate (left out of the step)
};

// Fails when the work is negative or the pipeline shape is out of range.
StatusOr<StepPrediction> predict_step(const StepWork& work, const PipelineShape& shape, const MachineProfile& profile);

// The table the printed plan shows: stage, work, rate, predicted seconds, and the bound.
// `origin` names the profile (its path, or "datasheet ...").
std::string format_prediction(const StepPrediction& prediction, std::string_view origin);

// {"compute": s, "nvme_read": s, ...}: the engine stages' names, as busy_s has them;
// each stage's in-flight time (StepPrediction::in_flight).
nlohmann::ordered_json predicted_busy_json(const StepPrediction& prediction);

// The profile's figure nearest the engine's NVMe shape (block size and queue depth, on a
// log scale; the checksum setting first).
const NvmeRate* nearest_nvme_rate(const MachineProfile& profile, uint64_t block_bytes, int queue_depth, bool checksums);
// The disk's seconds for `read` and `write` bytes in flight together: the bytes both
// directions move together at `mixed_rate` (both directions' bytes per second), the rest
// of each direction at its own rate; without a mixed rate (0), one after the other.
double disk_seconds(double read, double write, double read_rate, double write_rate, double mixed_rate);
// The CPU Adam figure for the dtypes (most threads among those that match; any dtype when
// none does).
const AdamRate* matching_adam_rate(const MachineProfile& profile, std::string_view grad_dtype, std::string_view param_dtype);

}  // namespace strata::profile
