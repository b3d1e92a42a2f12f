// The use planner: which parameter fetches the model's gathers need, planned ahead.
//
// It knows the schedule (the group uses of one micro-batch, forward then backward:
// declared by the model, or recorded on the first micro-batch and replayed), keeps up to
// `prefetch_depth` slot-taking uses planned beyond the one being gathered, and notices a
// deviation (the model gathers something else): the uses planned ahead are abandoned and
// the schedule is recorded again. A forward-only pass plans along its declared order,
// and on demand from the first gather off it.
//
// Host logic only: no threads and no locks (the model's thread owns it). It asks a
// FetchIssuer (the parameter fetcher) for fetches, so it is unit-tested on its own.
#pragma once

#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "engine/core/config.h"
#include "engine/core/status.h"

namespace strata::engine_internal {

class FetchIssuer {
 public:
  virtual ~FetchIssuer() = default;
  // A fetch of group g's parameters at `version` for a use in step `step`; returns its
  // request id, or 0 when the use needs no fetch (a direct view, or a persistent group
  // whose fetch of that version is already planned).
  virtual uint64_t plan_fetch(int group, int64_t step, int64_t version) = 0;
  // A planned fetch the model will not use: it completes and frees its slot.
  virtual void abandon(uint64_t request) = 0;
  // Whether a use of g takes a gather slot (persistent groups and direct views do not).
  virtual bool takes_slot(int group) const = 0;
};

struct UsePlannerOptions {
  int prefetch_depth = 2;           // slot-taking uses planned beyond the one being gathered
  int micro_batches = 1;
  OverlapMode overlap = OverlapMode::kExact;
};

class UsePlanner {
 public:
  UsePlanner(const UsePlannerOptions& options, FetchIssuer& issuer) : options_(options), issuer_(issuer) {}

  void declare(std::vector<int> schedule);
  const std::vector<int>& schedule() const { return schedule_; }
  bool schedule_known() const { return schedule_valid_; }

  // The parameter version a use in step `step` reads: the step's own (exact), or one
  // update behind (delayed).
  int64_t step_version(int64_t step) const;

  // A micro-batch starts (a recorded micro-batch becomes the schedule here).
  void begin_micro_batch(int64_t step, int micro);
  // The fetch request for the model's next gather, of group g (0 = none needed).
  uint64_t next_gather(int g, int64_t step, int micro);

  // A forward-only pass after `steps_done` steps, along `order` (empty: on demand).
  void begin_forward(std::span<const int> order, int64_t steps_done);
  uint64_t next_forward_gather(int g, int64_t steps_done);
  void end_forward(int64_t steps_done);
  // Forgets every use planned ahead (their fetches complete and free their slots) and
  // plans from step `step` on next time (after the parameters were rewritten).
  void restart(int64_t step);

  size_t use_index() const { return use_index_; }
  size_t planned_ahead() const { return expected_.size(); }

 private:
  struct ExpectedUse {
    int64_t step;
    int micro;
    size_t index;
    int group;
    uint64_t request;  // 0 = no fetch needed
  };
  struct Cursor {
    int64_t step = 0;
    int micro = 0;
    size_t index = 0;
  };
  int slot_uses_ahead() const;
  void issue_ahead(int64_t current_step);
  void issue_forward_ahead(int64_t steps_done);
  void abandon_outstanding();

  UsePlannerOptions options_;
  FetchIssuer& issuer_;
  std::vector<int> schedule_;
  bool schedule_valid_ = false;
  std::vector<int> recording_;
  bool recording_active_ = false;
  Cursor cursor_;                   // the next program position to plan
  std::deque<ExpectedUse> expected_;  // uses planned ahead, in program order
  std::vector<int> forward_order_;
  size_t forward_cursor_ = 0;       // the next declared forward gather to plan
  size_t forward_use_index_ = 0;    // gathers so far in the pass
  size_t use_index_ = 0;            // gathers so far in this micro-batch
};

}  // namespace strata::engine_internal
