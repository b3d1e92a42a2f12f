// The engine's options (EngineOptions) and the kinds of per-group state the API reads and
// writes (StateKind): the settings every stage is built from, below the facade
// (engine/engine.h) so that a stage needs neither the API nor the other stages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/core/io_engine_kind.h"
#include "engine/core/overlap_mode.h"
#include "engine/core/tier_kind.h"
#include "engine/core/dtype.h"
#include "kernels/adam.h"
#include "offload/tier.h"
#include "optim/loss_scaler.h"

namespace strata {

// OverlapMode (exact | delayed), its name and its parser live in engine/core/overlap_mode.h.

class IoFaultInjector;

struct EngineOptions {
  int rank = 0;
  int world_size = 1;
  uint64_t seed = 1234;                      // initialization: values depend on (seed, group, element) only

  DType param_dtype = DType::kBFloat16;      // how parameters are stored, streamed and gathered
  DType grad_wire_dtype = DType::kBFloat16;  // reduce-scatter payload (accumulation is always fp32)
  // What crosses device->host for a gradient shard. kBFloat16 halves the bytes; use
  // kFloat32 for full-precision training (the default follows param_dtype: fp32 params
  // give fp32 gradients).
  DType grad_transfer_dtype = DType::kBFloat16;

  Tier param_tier = Tier::kPinned;           // kDevice, kPinned, kHost or kNvme
  Tier optimizer_tier = Tier::kPinned;       // fp32 master, exp_avg, exp_avg_sq
  std::string nvme_path;                     // required when either tier is kNvme

  // Groups with at most this many elements stay gathered on the device (DeepSpeed's
  // stage3_param_persistence_threshold).
  size_t persistence_threshold = 0;
  // Group uses fetched ahead of compute; kAutoDepth = the deepest that fits the device and
  // pinned budgets (the plan says which it picked). An explicit depth that does not fit is
  // an error at start naming the depth that would.
  static constexpr int kAutoDepth = -1;
  int prefetch_depth = kAutoDepth;
  size_t prefetch_bucket_elements = 0;       // stage3_prefetch_bucket_size: cap on elements fetched ahead (0 = none)
  size_t max_live_elements = 0;              // stage3_max_live_parameters: cap on gathered elements resident (0 = none)
  size_t activation_bytes = 0;               // device memory the model will allocate for itself (planned into the budget)
  size_t pinned_budget_bytes = 0;            // cap on this rank's pinned (or pageable) host memory; 0 = what the plan needs
  // zero_optimization.sub_group_size: elements per chunk of NVMe optimizer state streamed
  // through the optimizer ring; 0 = the largest chunk the pinned budget allows.
  size_t sub_group_elements = 0;
  // offload_optimizer.buffer_count: chunks in the optimizer-state ring (>= 3: read ahead,
  // step, write back); 0 = auto.
  int optimizer_buffer_count = 0;
  // offload_param.buffer_count: NVMe parameter read-staging buffers (>= 1); 0 = one per
  // gather slot.
  int param_buffer_count = 0;
  // reduce_bucket_size: elements per reduce-scatter call (a group's gradient is reduced in
  // pieces of at most this many elements per rank shard); 0 = a group at a time.
  size_t reduce_bucket_elements = 0;
  int steps_per_print = 0;                   // rank 0 logs a progress line every N steps; 0 = never
  bool wall_clock_breakdown = false;         // the progress line carries every stage's busy seconds
  bool pin_memory = true;                    // false: host tiers use pageable memory

  int gradient_accumulation_steps = 1;
  OverlapMode overlap = OverlapMode::kExact;
  float gradient_clipping = 0.0f;            // global-norm clipping; 0 = off
  bool fp16_loss_scaling = false;            // dynamic loss scaling (fp16 training)
  // true: no update starts before the step's global gradient statistics are known (exact
  // mode gives up starting Adam(g) as g lands), so a step whose gradient norm is NaN/inf is
  // skipped with every weight untouched, as an fp16 overflow is. The trainer sets it when
  // strata.max_nonfinite_steps lets it skip such steps.
  bool skip_non_finite_updates = false;
  LossScalerOptions loss_scaler;
  kernels::AdamHyperparams adam;             // lr here is the default; step() may override it
  int optimizer_threads = 0;                 // CPU Adam threads; 0 = available cores

  // NVMe tier.
  size_t nvme_block_bytes = size_t{1} << 20; // aio.block_size
  int nvme_queue_depth = 32;                 // aio.queue_depth
  bool nvme_checksum = true;
  IoEngineKind io_engine = IoEngineKind::kAuto;  // strata.io_engine: io_uring where the kernel allows it, else psync
  std::shared_ptr<IoFaultInjector> io_faults;   // tests only: faults the NVMe store's I/O engine injects (offload/io_engine.h)

  std::string metrics_path;                  // JSONL, one object per step (rank 0 writes it)
  std::string trace_path;                    // Chrome trace written by finish() (rank 0 writes all ranks' tracks it has)
};

// The per-group state Engine::read_state_shard and write_state_shard move (the optimizer
// stage keeps the first three; kStaleParams is the shard store's older parameter copy).
enum class StateKind : uint8_t { kMaster, kExpAvg, kExpAvgSq, kStaleParams };

// Ranged state access (Engine::read_state_range) moves elements [first, first + count) of a
// shard: `first` is a multiple of kStateRangeAlignment, and the range ends on a multiple of
// it or at the shard's end (so an NVMe range starts and ends on the store's checksum blocks
// in every dtype). Whoever streams a large shard through a buffer of its own takes
// kStateChunkElements at a time: 64 MiB of fp32 however large the group (a 3B model's
// tied embedding is a 1.6 GB shard on one rank).
inline constexpr size_t kStateRangeAlignment = size_t{1} << 20;
inline constexpr size_t kStateChunkElements = size_t{16} << 20;

// What a group's gradient buffer holds when gradient_buffer() first hands it out in a
// micro-batch.
enum class GradientStart : uint8_t {
  kZeroed,     // zeros, written in compute_stream() order: backward kernels add into it
  kUnwritten,  // whatever it held (earlier gradients): for a model that writes
               // every element, padding included, before grads_ready(). Nothing is
               // enqueued, so a model writing from its own thread need not wait for the
               // compute stream.
};

}  // namespace strata
