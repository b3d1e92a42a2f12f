// The gradient path's kernels: fp32 accumulation of gradient shards over micro-batches
// and their statistics (sum of squares, inf/NaN), the parallel driver over the SIMD span
// layer (optim/gradient_span.h).
//
// Determinism:
//   - accumulation is element-wise (an exact widening of bf16/fp16 and at most one fp32
//     add, no FMA), so it gives the same bits for every thread count, chunk size and ISA;
//   - the sum of squares goes through reduce_gradient_chunks (optim/gradient_stats.h) with
//     the CPU Adam's span function, so stats(g) and accumulate_with_stats give exactly the
//     bits of CpuAdam::gradient_stats(g) for the same ISA, whatever the thread count or
//     chunk_elements.
//
// Sharing an executor: GradientOps runs its loops on an Executor it does not own (e.g.
// CpuAdam::executor(), so the gradient path and the optimizer share the cores). Two
// threads may call into one Executor at the same time: the oneTBB executor enters its
// task_arena from each caller (task_arena::execute is thread-safe; a caller that finds no
// free slot has its work run by the arena's threads while it waits), and the plain-thread
// executor runs one parallel_for at a time, queueing the other caller on a mutex. So two
// GradientOps (or a GradientOps and a CpuAdam) on one executor may run from two threads.
// What a caller must not do: call into an executor from inside one of its own
// parallel_for bodies (the plain-thread executor would deadlock), or use one GradientOps
// from two threads at once (it keeps one scratch vector of per-chunk sums).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/core/executor.h"
#include "engine/core/status.h"
#include "optim/cpu_isa.h"
#include "optim/gradient_span.h"   // AccumulateMode
#include "optim/gradient_stats.h"  // GradientStats

namespace strata {

struct GradientOpsOptions {
  std::optional<CpuIsa> isa;                // force a path; unset = the best this CPU has
  size_t chunk_elements = size_t{1} << 16;  // elements per parallel task; a positive multiple of 64
};

class GradientOps {
 public:
  // Errors name the bad option, or the ISA this CPU cannot run.
  static StatusOr<GradientOps> create(Executor& executor, const GradientOpsOptions& options = {});
  GradientOps(GradientOps&&) noexcept = default;
  GradientOps& operator=(GradientOps&&) noexcept = default;
  GradientOps(const GradientOps&) = delete;
  GradientOps& operator=(const GradientOps&) = delete;
  ~GradientOps() = default;

  CpuIsa isa() const { return kernels_.isa; }
  const GradientOpsOptions& options() const { return options_; }

  // accum[i] = src[i] (kAssign) or accum[i] += src[i] (kAdd) for i < count, src fp32, bf16
  // or fp16 widened exactly to fp32. accum and src must not overlap.
  Status accumulate(float* accum, const void* src, DType src_type, size_t count, AccumulateMode mode);
  // The same, and in the same pass (per statistics chunk, while it is in cache) the
  // statistics of the result in accum: equal to stats(accum, kFloat32, count) afterwards.
  StatusOr<GradientStats> accumulate_with_stats(float* accum, const void* src, DType src_type, size_t count,
                                                AccumulateMode mode);
  // The sum of squares and inf/NaN check of a gradient (fp32, bf16 or fp16).
  StatusOr<GradientStats> stats(const void* grad, DType grad_type, size_t count);

 private:
  GradientOps(Executor& executor, GradientSpanKernels kernels, GradientOpsOptions options)
      : executor_(&executor), kernels_(kernels), options_(std::move(options)) {}

  // Statistics chunks per parallel task: chunk_elements in whole chunks, at least one.
  size_t stats_grain_chunks() const;

  Executor* executor_;  // not owned; outlives this
  GradientSpanKernels kernels_;
  GradientOpsOptions options_;
  std::vector<double> chunk_sums_;  // scratch of the statistics, one per chunk; grows, never shrinks
};

}  // namespace strata
