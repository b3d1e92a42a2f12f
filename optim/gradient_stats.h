// Gradient statistics (sum of squares, inf/NaN) and the one driver that reduces them.
//
// The sum is cut into fixed chunks of kGradientStatsChunkElements whatever the thread
// count or the caller's own chunking; each chunk is summed by an ISA span function
// (AdamSpanKernels::grad_sum_of_squares, optim/adam_span.h) on whichever worker gets it,
// and the chunk sums are added in chunk order. So the bits depend on the ISA and the
// element count alone: CpuAdam::gradient_stats and GradientOps (optim/gradient_ops.h)
// give the same sum for the same values because both go through reduce_gradient_chunks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/core/executor.h"

namespace strata {

// The gradient statistics of one or more shards.
struct GradientStats {
  double sum_of_squares = 0.0;  // sum of g*g over the raw (still loss-scaled) gradient values
  bool non_finite = false;      // an inf or NaN among them (fp16 overflow): the step must be skipped
  uint64_t elements = 0;        // how many values were summed

  // Adds another shard's (or rank's) statistics.
  GradientStats& operator+=(const GradientStats& other);
};

// Elements per partial sum; fixed so the sum does not depend on options or threads.
inline constexpr size_t kGradientStatsChunkElements = size_t{1} << 16;

namespace internal {
// Statistics of `count` elements from their per-chunk sums, added in chunk order.
GradientStats gradient_stats_from_chunk_sums(size_t count, const std::vector<double>& chunk_sums);
}  // namespace internal

// The statistics of `count` elements. `chunk_sum(begin, end)` returns the sum of squares
// of elements [begin, end) of one statistics chunk (end - begin is kGradientStatsChunkElements
// except for the last chunk); it runs on any worker, for chunks in any order, and may do
// other element-wise work on its chunk first (GradientOps accumulates there). The chunks
// are fanned out over `executor` with `grain_chunks` of them per task (at least 1), the
// partial sums are kept in `chunk_sums` (resized; reuse it across calls so the hot path
// does not allocate) and added in chunk order. One call at a time per `chunk_sums`.
template <typename ChunkSum>  // double(size_t begin, size_t end)
GradientStats reduce_gradient_chunks(Executor& executor, size_t count, size_t grain_chunks, std::vector<double>& chunk_sums,
                                     const ChunkSum& chunk_sum) {
  const size_t chunks = (count + kGradientStatsChunkElements - 1) / kGradientStatsChunkElements;
  chunk_sums.assign(chunks, 0.0);  // reallocates only when a larger shard than before comes
  // The executor runs chunk indices, so each partial sum covers the same elements whichever
  // worker computes it. The body captures one pointer, which std::function keeps inline:
  // no allocation per call.
  struct Job {
    size_t count;
    double* sums;
    const ChunkSum* chunk_sum;
  } job{count, chunk_sums.data(), &chunk_sum};
  executor.parallel_for(0, chunks, grain_chunks == 0 ? 1 : grain_chunks, [job = &job](size_t first, size_t last) {
    for (size_t chunk = first; chunk < last; ++chunk) {
      const size_t begin = chunk * kGradientStatsChunkElements;
      const size_t end = begin + kGradientStatsChunkElements < job->count ? begin + kGradientStatsChunkElements : job->count;
      job->sums[chunk] = (*job->chunk_sum)(begin, end);
    }
  });
  return internal::gradient_stats_from_chunk_sums(count, chunk_sums);
}

}  // namespace strata
