#include "engine/use_planner.h"

#include <algorithm>

#include "engine/core/log.h"

namespace strata::engine_internal {

void UsePlanner::declare(std::vector<int> schedule) {
  schedule_ = std::move(schedule);
  schedule_valid_ = !schedule_.empty();
}

int64_t UsePlanner::step_version(int64_t step) const {
  return options_.overlap == OverlapMode::kDelayed ? std::max<int64_t>(0, step - 1) : step;
}

int UsePlanner::slot_uses_ahead() const {
  int count = 0;
  for (const ExpectedUse& use : expected_)
    if (use.request != 0 && issuer_.takes_slot(use.group)) ++count;
  return count;
}

void UsePlanner::begin_micro_batch(int64_t step, int micro) {
  // A micro-batch that was being recorded becomes the schedule.
  if (recording_active_ && !recording_.empty()) {
    schedule_ = recording_;
    schedule_valid_ = true;
    recording_active_ = false;
    cursor_ = {step, micro, 0};
    STRATA_LOG(kDebug) << "recorded a schedule of " << schedule_.size() << " group uses";
  }
  use_index_ = 0;
  if (!schedule_valid_) {
    recording_.clear();
    recording_active_ = true;
  } else if (expected_.empty() && (cursor_.step < step || (cursor_.step == step && cursor_.micro < micro))) {
    cursor_ = {step, micro, 0};
  }
}

// Plans up to prefetch_depth slot uses beyond the use being gathered (at least one use
// when nothing is planned); uses that take no slot cost nothing.
void UsePlanner::issue_ahead(int64_t current_step) {
  if (!schedule_valid_ || schedule_.empty()) return;
  while (true) {
    // Never plan past the next step: its uses' versions exist once this step's update
    // runs, and finish() can then carry out every planned fetch.
    if (cursor_.step > current_step + 1) break;
    if (!expected_.empty() && slot_uses_ahead() >= options_.prefetch_depth && issuer_.takes_slot(schedule_[cursor_.index])) break;
    ExpectedUse use{cursor_.step, cursor_.micro, cursor_.index, schedule_[cursor_.index], 0};
    use.request = issuer_.plan_fetch(use.group, use.step, step_version(use.step));
    expected_.push_back(use);
    if (++cursor_.index >= schedule_.size()) {
      cursor_.index = 0;
      if (++cursor_.micro >= options_.micro_batches) {
        cursor_.micro = 0;
        ++cursor_.step;
      }
    }
  }
}

uint64_t UsePlanner::next_gather(int g, int64_t step, int micro) {
  uint64_t request = 0;
  bool planned = false;
  if (schedule_valid_) {
    if (expected_.empty()) issue_ahead(step);
    if (!expected_.empty()) {
      const ExpectedUse& use = expected_.front();
      if (use.step == step && use.micro == micro && use.index == use_index_ && use.group == g) {
        request = use.request;
        expected_.pop_front();
        planned = true;
        issue_ahead(step);
      }
    }
    if (!planned) {
      STRATA_LOG(kInfo) << "the model deviated from the recorded schedule at use " << use_index_ << " of step " << step
                        << " (gathered group " << g << "); prefetches in flight complete, and the schedule is recorded again";
      abandon_outstanding();
      schedule_valid_ = false;
      recording_active_ = false;  // record again from the next micro-batch
    }
  } else if (recording_active_) {
    recording_.push_back(g);
  }
  if (!planned) request = issuer_.plan_fetch(g, step, step_version(step));
  ++use_index_;
  return request;
}

void UsePlanner::abandon_outstanding() {
  for (const ExpectedUse& use : expected_)
    if (use.request != 0) issuer_.abandon(use.request);
  expected_.clear();
}

void UsePlanner::issue_forward_ahead(int64_t steps_done) {
  while (forward_cursor_ < forward_order_.size()) {
    const int next = forward_order_[forward_cursor_];
    if (!expected_.empty() && slot_uses_ahead() >= options_.prefetch_depth && issuer_.takes_slot(next)) break;
    ExpectedUse use{steps_done, 0, forward_cursor_, next, 0};
    use.request = issuer_.plan_fetch(next, steps_done, steps_done);
    expected_.push_back(use);
    ++forward_cursor_;
  }
}

void UsePlanner::begin_forward(std::span<const int> order, int64_t steps_done) {
  // The fetches planned for the next step carry an older version in delayed mode, and
  // their slots come before the pass's own in the ring: let them complete and free their
  // slots, and plan the next step again after the pass.
  abandon_outstanding();
  forward_order_.assign(order.begin(), order.end());
  forward_cursor_ = 0;
  forward_use_index_ = 0;
  issue_forward_ahead(steps_done);
}

uint64_t UsePlanner::next_forward_gather(int g, int64_t steps_done) {
  uint64_t request = 0;
  bool planned = false;
  if (!expected_.empty()) {
    const ExpectedUse& use = expected_.front();
    if (use.index == forward_use_index_ && use.group == g) {
      request = use.request;
      expected_.pop_front();
      planned = true;
      issue_forward_ahead(steps_done);
    } else {
      STRATA_LOG(kDebug) << "a forward-only pass left its declared order at gather " << forward_use_index_ << " (group " << g
                         << "); fetching on demand from here";
      abandon_outstanding();
      forward_order_.clear();
      forward_cursor_ = 0;
    }
  }
  ++forward_use_index_;
  if (!planned) request = issuer_.plan_fetch(g, steps_done, steps_done);
  return request;
}

void UsePlanner::end_forward(int64_t steps_done) {
  // Declared gathers the pass did not make: their fetches complete and free their slots.
  abandon_outstanding();
  forward_order_.clear();
  if (schedule_valid_) cursor_ = {steps_done, 0, 0};
}

void UsePlanner::restart(int64_t step) {
  abandon_outstanding();
  if (schedule_valid_) cursor_ = {step, 0, 0};
}

}  // namespace strata::engine_internal
