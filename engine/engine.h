// The ZeRO-3 offload engine: the API a model trains through.
//
// A model registers its parameter groups (one per layer/block), then, every step, runs
// forward and backward through the engine:
//
//   engine->begin_step();
//   for each micro-batch:
//     engine->begin_micro_batch();
//     for g in forward order:   p = engine->gather(g);  ...kernels on compute_stream()...;  engine->release(g);
//     for g in backward order:  p = engine->gather(g);  d = engine->gradient_buffer(g);
//                               ...backward kernels write (+=) into d...;  engine->release(g);
//                               engine->grads_ready(g);   // after the group's last use this micro-batch
//   report = engine->step(loss);
//
// A forward-only pass (evaluation between or after steps, generation) gathers with the
// weights of every step taken so far and takes no gradients:
//
//   engine->begin_forward();  ...gather(g) / release(g) in any order...;  engine->end_forward();
//
// gather() returns device pointers to the full (all-rank) parameters of the group in the
// parameter dtype, valid in compute_stream() order until release(). A group may be
// gathered more than once in a pass (a tied embedding); its gradient buffer is the same
// for every use of the micro-batch, so gradients add up until grads_ready(). Parameters
// are gathered again for every micro-batch; reduced gradient shards accumulate in fp32 in
// host memory (or device memory when the optimizer state lives there).
//
// A frozen group (GroupSpec::trainable false: PEFT base weights) is gathered and released
// like any other, and has nothing else: no gradient buffer (gradient_buffer() and
// grads_ready() are FailedPrecondition errors naming it), no master weights, moments or
// gradient shards in any tier, one parameter copy in either overlap mode, and no share in
// the gradient norm or the update.
//
// Behind the API: each group is flattened, padded and split across ranks (partition.h);
// each kind of shard state lives in the tier the options name; a prefetch pipeline
// follows the schedule (declared, or recorded on the first step and replayed) and moves
// each upcoming group NVMe -> pinned -> device -> all-gather ahead of compute, every stage
// bounded; backward's gradients are reduce-scattered as soon as they are ready, copied to
// pinned memory with their sum of squares and inf/NaN flag taken on the way; the
// optimizer steps each group's shard as soon as it may (see OverlapMode).
//
// One Engine per rank. Ranks of one process (CPU-device ranks as threads) each drive
// their own Engine from their own thread; all ranks must make the same calls in the same
// order (as every data-parallel rank does).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/core/communicator.h"
#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/engine_options.h"
#include "engine/engine_plan_types.h"
#include "engine/partition.h"
#include "engine/trace.h"
#include "optim/loss_scaler.h"

namespace strata {

// Device pointers to one group's tensors, in registration order.
struct GroupView {
  int group = -1;
  DType dtype = DType::kFloat32;
  std::vector<void*> tensors;     // tensors[i] points at tensor i's first element
  void* flat = nullptr;           // the whole flattened group
};

struct StepReport {
  int64_t step = 0;               // steps completed, including this one
  double loss = 0.0;              // what the model passed to step()
  // Wall time of the step's window: from the previous window's end (or begin_step of the
  // first) to the moment step() hands its optimizer job over, so a job submitted by step()
  // (clipping, fp16) counts whole in the next step's window.
  double step_seconds = 0.0;
  StageSeconds busy{};            // per stage, over the same window (union of in-flight intervals)
  double grad_norm = 0.0;         // global L2 norm of the (unscaled) gradient
  bool skipped = false;           // overflow: the update was skipped (fp16)
  float loss_scale = 1.0f;
  size_t device_high_water_bytes = 0;
  size_t device_budget_bytes = 0;
  size_t pinned_bytes = 0;
  uint64_t nvme_bytes_read = 0;   // this rank, since start
  uint64_t nvme_bytes_written = 0;
};

class Engine {
 public:
  // `device`, `gather_comm` and `reduce_comm` must outlive the engine. Two communicators,
  // because gathers (issued by the prefetcher) and reductions (issued as backward goes)
  // run concurrently and each communicator's calls must come in one order on every rank.
  static StatusOr<std::unique_ptr<Engine>> create(const EngineOptions& options, Device& device, Communicator& gather_comm,
                                                  Communicator& reduce_comm);
  virtual ~Engine() = default;

  // Before start(): registers a group; returns its id (0, 1, ... in registration order).
  virtual StatusOr<int> register_group(const GroupSpec& spec) = 0;
  // Optional, before start(): the order of gather() calls in one micro-batch (forward then
  // backward, a group listed once per use). Without it the first step records it.
  virtual Status declare_schedule(std::vector<int> group_uses) = 0;
  // Optional, before start(): the most gradient buffers the model keeps between uses of
  // their groups at any one time (GPT-2's tied head: wte's gradient from the head to the
  // embedding's backward is one). The plan gives the gradient path that many device slots
  // beyond the two that overlap reduction with backward. Without it: one per group used
  // more than twice in the declared schedule, or one when the schedule is recorded.
  virtual Status declare_held_gradients(int count) = 0;
  // Optional, before start(): the caller writes group `group`'s master weights
  // (write_state_shard) and calls refresh_parameters() before the group is first gathered
  // (a checkpoint load), so start() allocates its state and zeroes its optimizer moments
  // but draws and writes no initial values: a load into NVMe tiers does not first write
  // random weights it then overwrites. Until the caller's write the group's values are
  // undefined.
  virtual Status declare_loaded(int group) = 0;
  // Groups start() gave initial values (every group but those declared loaded).
  virtual int initialized_group_count() const = 0;
  // Plans placement, checks it against the machine (device budget, host memory, locked
  // memory, free NVMe space), allocates, and initializes the local shards. Errors name what
  // cannot hold its part, the bytes needed and the settings that would fit.
  virtual Status start() = 0;
  virtual const EnginePlan& plan() const = 0;
  virtual const GroupLayout& layout(int group) const = 0;
  virtual int group_count() const = 0;

  // The stream the model enqueues its kernels on.
  virtual Stream& compute_stream() = 0;
  virtual Device& device() = 0;

  // Starts a step. `learning_rate` >= 0 sets the rate this step's update uses (a
  // scheduler's value); it must be known before backward when the update may start
  // during backward (exact mode without clipping or loss scaling).
  virtual Status begin_step(double learning_rate = -1.0) = 0;
  virtual Status begin_micro_batch() = 0;
  virtual StatusOr<GroupView> gather(int group) = 0;
  // For a model that reads the gathered parameters on its own thread (a host computation
  // on the CPU device) rather than in compute_stream() order: blocks until what gather()
  // returned for the group is in memory. Waits on that group's fetch alone, not on the
  // work queued on the compute stream. An error for a group that is not gathered.
  virtual Status wait_gathered(int group) = 0;
  virtual Status release(int group) = 0;
  // The fp32 full-group gradient buffer for this micro-batch (on the first request of the
  // micro-batch: zeroed, or handed out as it is, see GradientStart); an error for a frozen
  // group, as is grads_ready().
  virtual StatusOr<GroupView> gradient_buffer(int group, GradientStart start = GradientStart::kZeroed) = 0;
  virtual Status grads_ready(int group) = 0;
  // What the model multiplies its loss by before backward (1 unless fp16 loss scaling).
  virtual float loss_scale() const = 0;
  // Finishes the step: reduces norm/overflow, clips, and runs (or schedules) the update.
  // `loss` is only reported. Writes the metrics line (rank 0).
  virtual StatusOr<StepReport> step(double loss) = 0;
  // Waits for all outstanding work (the last update included) and writes the trace.
  // Called between steps (not inside a step or a forward-only pass).
  virtual Status finish() = 0;

  // A forward-only pass, between steps: gather() and release() see the parameters after
  // every update of the steps taken (delayed mode included: it waits for the last one);
  // gradient_buffer(), grads_ready() and step() are errors inside it. Fetches planned
  // ahead for the next step are dropped first (they complete, and the next step plans
  // them again). With `order` (the groups the pass will gather, in order) the engine
  // prefetches along it as in a step; a gather off that order drops the rest of it and
  // fetches on demand from there. All ranks must make the same gathers, as in a step.
  virtual Status begin_forward(std::span<const int> order = {}) = 0;
  virtual Status end_forward() = 0;

  // State access (waits for pending updates of the group). Shards are this rank's.
  //
  // A frozen group's only state is its parameter copy: kMaster reads it widened to fp32
  // and writes it in the parameter dtype (rounded as refresh_parameters() rounds a master;
  // between steps, and at once: no refresh_parameters() is needed); the other kinds are
  // FailedPrecondition errors naming the group.
  //
  // kStaleParams exists in delayed overlap mode once a step was taken (has_stale_parameters()):
  // the parameter copy the next step computes with, one update behind the master, as fp32
  // (the parameter dtype's values, widened exactly). Written after refresh_parameters(),
  // it makes the next step compute with those values and the step after with the masters
  // (the next step's update then reads the masters as usual), so a run resumed from a
  // checkpoint takes the steps the saving run took. Writing it in exact mode is an error.
  using StateKind = strata::StateKind;  // engine/engine_options.h
  virtual Status read_state_shard(int group, StateKind kind, std::span<float> out) = 0;
  virtual Status write_state_shard(int group, StateKind kind, std::span<const float> in) = 0;
  // The same for elements [first, first + size) of the shard, so that a caller streams a
  // large group through a buffer of kStateChunkElements: `first` a multiple of
  // kStateRangeAlignment, the range ending on one or at the shard's end (engine_options.h).
  virtual Status read_state_range(int group, StateKind kind, size_t first, std::span<float> out) = 0;
  virtual Status write_state_range(int group, StateKind kind, size_t first, std::span<const float> in) = 0;
  // After write_state_shard(kMaster, ...) calls: refreshes every trainable group's
  // parameter copies from the masters (a stale copy included: write kStaleParams after this).
  virtual Status refresh_parameters() = 0;
  // Delayed overlap after at least one step (or a kStaleParams write): the next step's
  // parameters are one update behind the masters.
  virtual bool has_stale_parameters() const = 0;
  virtual OverlapMode overlap_mode() const = 0;
  virtual int64_t steps_taken() const = 0;
  virtual void set_steps_taken(int64_t steps) = 0;
  // The number the metrics give the next step() is this + 1 (a resumed run continues the
  // saved run's numbering; skipped steps count). Between steps.
  virtual void set_step_number(int64_t steps_done) = 0;
  // The dynamic loss scaler's state (scale, clean-step count, hysteresis, skipped steps),
  // for checkpoints; nullopt when the engine does not scale losses (fp32/bf16 training).
  virtual std::optional<LossScaler::State> loss_scaler_state() const = 0;
  // Restores it between steps; an error when the engine has no loss scaler.
  virtual Status restore_loss_scaler_state(const LossScaler::State& state) = 0;
  virtual const Tracer& tracer() const = 0;
  // The plan's predicted step and busy seconds per stage, for the trace file to show
  // beside what happened (engine/trace.h). Any time before finish().
  virtual void set_trace_prediction(const TracePrediction& prediction) = 0;
};

}  // namespace strata
