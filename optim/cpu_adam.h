// The CPU Adam/AdamW: the parallel driver over the SIMD span kernels (optim/adam_span.h).
//
// It steps one shard per call (the engine calls it as each group's gradients land) in
// its own executor (plain threads of its own by default, with a settable thread count and
// affinity; a oneTBB task_arena on request). A shard is cut into chunks of `chunk_elements`; each
// worker streams a contiguous run of chunks, so its pages stay together and its hardware
// prefetchers see long streams.
//
// The update is element-wise with no reduction, so results are bit-identical for every
// thread count and chunk size; with the operations of kernels::adam_update_element they
// are also bit-identical across ISAs. The gradient sum of squares is reduced per fixed
// chunk (kGradStatsChunkElements, whatever the thread count) and the chunk sums are added
// in chunk order, so it too is deterministic.
//
// Modes of the state (kernels::AdamBuffers):
//   - gradients bf16, fp16 or fp32 (still multiplied by the loss scale; the step unscales);
//   - the parameter copy written as bf16 or fp16 (round to nearest even), fp32, or not at
//     all; by default with non-temporal stores, since nobody on this core reads it again
//     and the next host-to-device copy reads it from memory anyway;
//   - moments fp32 (exact Adam), or bf16: exp_avg and exp_avg_sq are rounded to bf16
//     after every update, which halves the optimizer-state bytes (28 -> 20 bytes per
//     parameter moved per step with bf16 gradients and parameters; 12 -> 8 on NVMe) at
//     the cost of an 8-bit mantissa on the moments. Master weights stay fp32 either way.
//
// One optimizer step over many groups (ZeRO's exact mode):
//   1. as each group's gradient shard lands: stats += adam.gradient_stats(grad shard)
//   2. at the end of backward: all-reduce stats over ranks (sum_of_squares adds up,
//      non_finite ORs), then plan = plan_adam_step(hyper, step, stats, {loss_scale, max_norm})
//   3. if plan.skip (fp16 overflow): touch nothing, do not count the step, shrink the loss scale
//      else for each group: adam.step(group buffers, plan), in any order, on any thread
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "engine/core/executor.h"
#include "kernels/adam.h"
#include "optim/adam_span.h"
#include "optim/gradient_stats.h"  // GradientStats

namespace strata {

struct AdamStepPlanOptions {
  float loss_scale = 1.0f;     // what the loss was multiplied by (LossScaler::scale()), 1 without loss scaling
  double max_grad_norm = 0.0;  // clip the global norm of the unscaled gradients to this; 0 = no clipping
};

// What one optimizer step does, decided once the global gradient statistics are known.
struct AdamStepPlan {
  bool skip = false;               // non-finite gradients: leave all state untouched, do not count the step
  double grad_norm = 0.0;          // global L2 norm of the unscaled gradients (inf when non-finite)
  float clip_coefficient = 1.0f;   // min(1, max_grad_norm / (grad_norm + 1e-6)), as torch.nn.utils.clip_grad_norm_
  kernels::AdamStepScalars scalars;  // the per-element scalars (unused when skip)
};

// `step` is the number of this update counting only applied steps (1 for the first).
// Errors name the bad hyperparameter or option.
StatusOr<AdamStepPlan> plan_adam_step(const kernels::AdamHyperparams& hyper, int64_t step, const GradientStats& global,
                                      const AdamStepPlanOptions& options = {});

struct CpuAdamOptions {
  int threads = 0;                               // workers; 0 = every core this process may use
  std::vector<int> cpu_affinity;                 // cores to pin the workers to; empty = no pinning
  // Plain threads of its own by default, not oneTBB's workers, which every arena in the
  // process shares: the CPU device lowers their priority (CpuDeviceOptions::thread_nice),
  // and CPU Adam and the gradient path (on this executor) are host stages that run first.
  ExecutorKind executor = ExecutorKind::kThreads;
  std::optional<CpuIsa> isa;                     // force a path; unset = the best this CPU has
  AdamSpanKernelOptions span;                    // e.g. whether to use AVX512-BF16 conversions
  size_t chunk_elements = size_t{1} << 16;       // elements per parallel chunk; a multiple of 64
  AdamSpanStores stores;                         // non-temporal stores for the parameter copy by default
};

class CpuAdam {
 public:
  // The chunk of the gradient sum of squares; fixed so the sum does not depend on options.
  static constexpr size_t kGradStatsChunkElements = kGradientStatsChunkElements;

  static StatusOr<CpuAdam> create(const CpuAdamOptions& options);
  CpuAdam(CpuAdam&&) noexcept = default;
  CpuAdam& operator=(CpuAdam&&) noexcept = default;
  CpuAdam(const CpuAdam&) = delete;
  CpuAdam& operator=(const CpuAdam&) = delete;
  ~CpuAdam() = default;

  CpuIsa isa() const { return kernels_.isa; }
  // True when fp32 -> bf16 conversions use AVX512-BF16 instructions.
  bool native_bf16() const { return kernels_.native_bf16; }
  int threads() const { return executor_->concurrency(); }
  Executor& executor() { return *executor_; }
  const CpuAdamOptions& options() const { return options_; }

  // Steps every element of one shard (host memory) with `scalars`, fanned out over the
  // workers; returns when done. Safe to call from one thread at a time per CpuAdam.
  Status step(const kernels::AdamBuffers& buffers, const kernels::AdamStepScalars& scalars);
  // As above with a plan: a skipped plan returns at once and leaves every buffer untouched.
  Status step(const kernels::AdamBuffers& buffers, const AdamStepPlan& plan);
  // Steps [begin, end) of a shard on the calling thread only (for a caller that already
  // runs on a worker of its own, e.g. a pipeline stage).
  Status step_on_this_thread(const kernels::AdamBuffers& buffers, const kernels::AdamStepScalars& scalars, size_t begin,
                             size_t end);

  // The fused sum of squares and inf/NaN check of one gradient shard, fanned out over the
  // workers and reduced in a fixed chunk order (reduce_gradient_chunks, so GradientOps::stats
  // gives the same bits). One call at a time per CpuAdam (it keeps its per-chunk sums in a
  // scratch vector).
  StatusOr<GradientStats> gradient_stats(const void* grad, DType grad_type, size_t count);

 private:
  CpuAdam(CpuAdamOptions options, AdamSpanKernels kernels, std::unique_ptr<Executor> executor)
      : options_(std::move(options)), kernels_(kernels), executor_(std::move(executor)) {}

  CpuAdamOptions options_;
  AdamSpanKernels kernels_;
  std::unique_ptr<Executor> executor_;
  std::vector<double> chunk_sums_;  // scratch for gradient_stats, one per chunk
};

}  // namespace strata
