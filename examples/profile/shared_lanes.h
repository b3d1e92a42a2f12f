// Jobs on lanes that share the disk and the host's cores: the small discrete-event
// simulation under the step's replay (examples/profile/step_replay.h).
//
// A lane runs one job at a time: of its jobs whose predecessors are done, the one that
// became ready first (then the one added first), as a stream or a queue serves them. The
// lanes run at once. A job has its seconds alone, and while it runs it may want host cores
// and the disk:
// - the disk: while k running jobs want it, each goes at 1/k of its pace (an equal share of
//   the disk's time), times the gain of mixed traffic while both directions have jobs
//   running (DiskSharing, from the profile's mixed rate), at most its whole pace;
// - the host's cores: while the running jobs want W cores in all and the host has C < W,
//   each goes at C / W of its pace (the scheduler's fair share of the cores).
// A job that wants both goes at the product. With `host_cores` 0 the cores are not shared
// (a GPU computes and copies on its own engines).
#pragma once

#include <optional>
#include <vector>

#include "engine/trace.h"

namespace strata::profile {

enum class DiskUse { kNone, kRead, kWrite };

// What the disk gains from reads and writes at once over taking turns: a disk that reads R
// and writes W bytes per second alone moves (R + W) / 2 with one job of each direction
// sharing its time equally, and `mixed` when it serves them together: the gain is
// mixed / ((R + W) / 2). 0 = not measured (no gain).
struct DiskSharing {
  double mixed_gain = 0;
  static DiskSharing from_rates(double read_bytes_per_s, double write_bytes_per_s, double mixed_bytes_per_s);
};

struct LaneJob {
  int lane = 0;
  double seconds = 0;           // alone; 0 is done the moment it starts
  int cores = 0;                // host cores it wants while it runs
  DiskUse disk = DiskUse::kNone;  // the direction it moves its bytes on the disk
  std::optional<Stage> stage;   // what the engine traces it as (none: not a stage's work)
  std::vector<int> after;       // the jobs it waits for: ids added before it
};

struct JobSpan {
  double start = 0;
  double end = 0;
};

class SharedLanes {
 public:
  SharedLanes(int lanes, int host_cores, DiskSharing disk = {}) : lanes_(lanes), host_cores_(host_cores), disk_(disk) {}

  // The job's id. Predecessors that are not earlier jobs are left out (they cannot be
  // waited for without a cycle).
  int add(LaneJob job);
  const LaneJob& job(int id) const { return jobs_[static_cast<size_t>(id)]; }
  size_t size() const { return jobs_.size(); }

  // Every job's start and end, by id.
  std::vector<JobSpan> run() const;

 private:
  int lanes_;
  int host_cores_;
  DiskSharing disk_;
  std::vector<LaneJob> jobs_;
};

// Per engine stage, the seconds within [begin, end) that some job of the stage was running
// (the union of its jobs' spans, as the engine's busy_s measures a step).
StageSeconds busy_within(const SharedLanes& lanes, const std::vector<JobSpan>& spans, double begin, double end);

}  // namespace strata::profile
