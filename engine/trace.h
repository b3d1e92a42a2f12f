// What the engine was busy with, when: per-stage intervals for the step metrics and a
// Chrome-trace file (opens in Perfetto / chrome://tracing).
//
// Every stage of the pipeline reports the wall-clock interval each piece of work had in
// flight (an NVMe read from submission to completion, a copy from the moment its stream
// starts it to its end, a group's Adam from start to end). A stage's busy time over a
// window is the length of the union of its intervals clipped to the window, so 32 reads
// in flight at once count once. Work on device streams is traced from timing events
// (stream_trace.h), so tracing puts no host callback in a stream.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/status.h"

namespace strata {

enum class Stage : uint8_t {
  kCompute = 0,
  kNvmeRead,
  kNvmeWrite,
  kH2D,
  kAllGather,
  kReduceScatter,
  kD2H,
  kOptimizer,
  kLanding,  // gradient shards in host memory: accumulation, statistics, spilling
};
inline constexpr size_t kStageCount = 9;
// "compute", "nvme_read", "nvme_write", "h2d", "allgather", "reduce_scatter", "d2h", "optimizer", "landing".
std::string_view stage_name(Stage stage);

using TraceClock = std::chrono::steady_clock;

struct TraceInterval {
  Stage stage;
  int group;             // -1 when the work is not about one group
  TraceClock::time_point begin;
  TraceClock::time_point end;
  std::string label;     // e.g. "h.3 forward"
};

using StageSeconds = std::array<double, kStageCount>;

// What the plan's cost model predicts for one step (examples/profile/step_cost.h), for the
// trace to show beside what happened: each stage's track is named with its predicted busy
// seconds, the rank with its predicted step, and the file's "otherData" carries both.
struct TracePrediction {
  double step_seconds = 0;
  StageSeconds busy_seconds{};
};

// Thread-safe collector of intervals for one rank.
class Tracer {
 public:
  explicit Tracer(int rank) : rank_(rank), origin_(TraceClock::now()) {}

  void record(Stage stage, int group, TraceClock::time_point begin, TraceClock::time_point end, std::string label = {});

  // RAII: records [construction, destruction) for `stage`.
  class Scope {
   public:
    Scope(Tracer* tracer, Stage stage, int group, std::string label = {})
        : tracer_(tracer), stage_(stage), group_(group), label_(std::move(label)), begin_(TraceClock::now()) {}
    ~Scope() {
      if (tracer_ != nullptr) tracer_->record(stage_, group_, begin_, TraceClock::now(), std::move(label_));
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Tracer* tracer_;
    Stage stage_;
    int group_;
    std::string label_;
    TraceClock::time_point begin_;
  };

  // Busy seconds per stage within [window_begin, window_end): the union of intervals.
  StageSeconds busy_seconds(TraceClock::time_point window_begin, TraceClock::time_point window_end) const;
  // A copy of every interval recorded so far.
  std::vector<TraceInterval> intervals() const;
  // Drops intervals that ended before `cutoff` (keeps memory bounded on long runs when
  // no trace file is wanted).
  void forget_before(TraceClock::time_point cutoff);
  int rank() const { return rank_; }
  TraceClock::time_point origin() const { return origin_; }
  void set_prediction(const TracePrediction& prediction);
  std::optional<TracePrediction> prediction() const;

 private:
  const int rank_;
  const TraceClock::time_point origin_;
  mutable std::mutex mutex_;
  std::vector<TraceInterval> intervals_;
  std::optional<TracePrediction> prediction_;  // guarded by mutex_
};

// The length of the union of `intervals` (of one stage) clipped to the window.
double union_seconds(std::vector<std::pair<TraceClock::time_point, TraceClock::time_point>> intervals,
                     TraceClock::time_point window_begin, TraceClock::time_point window_end);

// Writes the intervals of all tracers as one Chrome-trace JSON file: one process per rank,
// one track (thread) per stage, one slice per interval; with a tracer's prediction, its
// tracks' names carry the predicted seconds and "otherData" the predicted figures. Written to a temporary name and
// renamed, so a reader never sees half a file.
Status write_chrome_trace(const std::string& path, const std::vector<const Tracer*>& tracers);

}  // namespace strata
