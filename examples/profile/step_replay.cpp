#include "examples/profile/step_replay.h"

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace strata::profile {

namespace {

constexpr int kReplayedSteps = 4;

// A worker that takes one job at a time. A job starts in the first idle gap at or after
// it is ready that holds it, so a job given later may run in a gap earlier ones left (the
// engine's queues serve whoever is ready); callers that must keep an order (a stream) say
// so through `ready`.
class Worker {
 public:
  double run(double ready, double seconds) {
    if (seconds <= 0) return ready;
    double start = ready;
    size_t at = 0;
    while (at < busy_.size() && busy_[at].second <= start) ++at;
    for (; at < busy_.size(); ++at) {
      if (busy_[at].first >= start + seconds) break;  // fits before this job
      start = std::max(start, busy_[at].second);
    }
    busy_.insert(busy_.begin() + static_cast<std::ptrdiff_t>(at), {start, start + seconds});
    return start + seconds;
  }

  // When `seconds` of work started at `start` ends if it shares this worker's resource:
  // at half speed while the worker is busy, at full speed in its gaps.
  double shared_finish(double start, double seconds) const {
    double t = start, left = seconds;
    for (const auto& [begin, end] : busy_) {
      if (end <= t) continue;
      if (begin > t) {
        if (left <= begin - t) return t + left;
        left -= begin - t;
        t = begin;
      }
      if (left <= (end - t) / 2) return t + 2 * left;
      left -= (end - t) / 2;
      t = end;
    }
    return t + left;
  }

 private:
  std::vector<std::pair<double, double>> busy_;  // sorted, disjoint
};

double seconds_of(double amount, double rate) { return amount > 0 ? amount / rate : 0.0; }

class Replay {
 public:
  Replay(const StepWork& w, const PipelineShape& shape, const ReplayRates& r) : w_(w), shape_(shape), r_(r) {
    const size_t n = w.uses.size();
    double forward_numel = 0, backward_numel = 0;
    for (size_t i = 0; i < n; ++i) (i < n / 2 ? forward_numel : backward_numel) += group(i).numel;
    const double k = static_cast<double>(shape.micro_batches);
    for (size_t i = 0; i < n; ++i) {
      const bool forward = i < n / 2;
      const double share = group(i).numel / std::max(forward ? forward_numel : backward_numel, 1.0);
      compute_.push_back((forward ? r.forward_seconds : r.backward_seconds) / k * share);
    }
    last_use_.assign(w.groups.size(), -1);
    first_use_.assign(w.groups.size(), -1);
    for (size_t i = 0; i < n; ++i) {
      const size_t g = static_cast<size_t>(w.uses[i]);
      last_use_[g] = static_cast<int>(i);
      if (first_use_[g] < 0) first_use_[g] = static_cast<int>(i);
    }
    updated_.assign(kReplayedSteps, std::vector<double>(w.groups.size(), 0.0));
  }

  double run() {
    const size_t n = w_.uses.size();
    const size_t per_step = n * static_cast<size_t>(shape_.micro_batches);
    const size_t total = per_step * kReplayedSteps;
    fetched_.assign(total, 0.0);
    computed_.assign(total, 0.0);
    std::vector<double> step_end(kReplayedSteps, 0.0);
    for (size_t u = 0; u <= std::min<size_t>(static_cast<size_t>(shape_.prefetch_depth), total - 1); ++u) fetch(u, 0.0);
    for (size_t t = 0; t < total; ++t) {
      // Use t - 1 has released its slot: the fetch `prefetch_depth` uses ahead of t goes out.
      const size_t ahead = t + static_cast<size_t>(shape_.prefetch_depth);
      if (t > 0 && ahead < total) fetch(ahead, computed_[t - 1]);
      compute(t);
      step_end[t / per_step] = computed_[t];
      if ((t + 1) % per_step == 0) flush_updates(t / per_step, computed_[t]);
    }
    return step_end[kReplayedSteps - 1] - step_end[kReplayedSteps - 2];
  }

 private:
  // On the CPU device the host's cores run the compute, the copies, the landing and Adam:
  // one worker for all of them. On a GPU the landing pass runs on CPU Adam's executor, one
  // worker with Adam unless Adam runs on the device.
  Worker& cores(Worker& own) { return r_.shared_host_cores ? host_cores_ : own; }
  Worker& lander() { return shape_.adam_on_device ? cores(landing_) : cores(optimizer_); }
  const GroupWork& group(size_t use) const { return w_.groups[static_cast<size_t>(w_.uses[use])]; }
  size_t use_of(size_t t) const { return t % w_.uses.size(); }
  int step_of(size_t t) const { return static_cast<int>(t / (w_.uses.size() * static_cast<size_t>(shape_.micro_batches))); }
  int micro_of(size_t t) const { return static_cast<int>(t / w_.uses.size()) % shape_.micro_batches; }

  // Checksums on the host's cores (ReplayRates::checksum_bytes_per_s): a read's bytes are
  // usable once verified there; a write is done once both the disk and its hashing are.
  double verified(double read_done, double bytes) {
    if (r_.checksum_bytes_per_s <= 0 || bytes <= 0) return read_done;
    return host_cores_.run(read_done, bytes / r_.checksum_bytes_per_s);
  }
  double written(double submitted, double disk_done, double bytes) {
    if (r_.checksum_bytes_per_s <= 0 || bytes <= 0) return disk_done;
    return std::max(disk_done, host_cores_.run(submitted, bytes / r_.checksum_bytes_per_s));
  }

  // A group's first use in a step waits for the update `lag` steps back.
  double update_wait(size_t t) const {
    const size_t i = use_of(t);
    const size_t g = static_cast<size_t>(w_.uses[i]);
    const int lag = shape_.overlap == OverlapMode::kExact ? 1 : 2;
    const int from = step_of(t) - lag;
    if (micro_of(t) != 0 || first_use_[g] != static_cast<int>(i) || from < 0 || !w_.groups[g].trainable) return 0.0;
    return updated_[static_cast<size_t>(from)][g];
  }

  void fetch(size_t u, double slot_free) {
    const size_t i = use_of(u);
    const GroupWork& g = group(i);
    const bool fetches = !g.persistent || (micro_of(u) == 0 && first_use_[static_cast<size_t>(w_.uses[i])] == static_cast<int>(i));
    if (!fetches) return;
    const double ready = std::max(slot_free, update_wait(u));
    double read = ready;
    if (g.fetch_read_bytes > 0) {  // the fetches one after another, each sharing the disk with the updates' traffic
      read = disk_.shared_finish(std::max(ready, fetch_disk_free_), seconds_of(g.fetch_read_bytes, r_.disk_read_bytes_per_s));
      fetch_disk_free_ = read;
      read = verified(read, g.fetch_read_bytes);
    }
    fetched_[u] = g.fetch_h2d_bytes > 0 ? cores(h2d_).run(read, seconds_of(g.fetch_h2d_bytes, r_.h2d_bytes_per_s)) : read;
  }

  void compute(size_t t) {
    const size_t i = use_of(t);
    const double in_order = t == 0 ? 0.0 : computed_[t - 1];  // the compute stream runs its uses in order
    computed_[t] = cores(compute_stream_).run(std::max({fetched_[t], update_wait(t), in_order}), compute_[i]);
    const size_t g = static_cast<size_t>(w_.uses[i]);
    if (!w_.groups[g].trainable || last_use_[g] != static_cast<int>(i)) return;
    const GroupWork& part = w_.groups[g];
    const double copied = cores(gradients_).run(computed_[t], seconds_of(part.gradient_out_bytes, r_.d2h_bytes_per_s));
    double landed = lander().run(copied, seconds_of(part.landing_bytes, r_.landing_bytes_per_s));
    if (part.spill_bytes > 0) landed = written(landed, disk_.run(landed, seconds_of(part.spill_bytes, r_.disk_write_bytes_per_s)), part.spill_bytes);
    if (micro_of(t) != shape_.micro_batches - 1) return;
    pending_.push_back({g, landed});
    if (shape_.adam_during_backward) flush_updates(step_of(t), 0.0);
  }

  // The waiting updates, in the order their gradients landed, none before `not_before`.
  void flush_updates(int step, double not_before) {
    for (const auto& [g, landed] : pending_) {
      const GroupWork& part = w_.groups[g];
      // The update's disk time as the disk bound prices it (step_cost.h: disk_seconds): its
      // reads before Adam, its writes after; moved together, the time split by bytes.
      const double read = part.update_read_bytes, write = part.update_write_bytes;
      const double disk = disk_seconds(read, write, r_.disk_read_bytes_per_s, r_.disk_write_bytes_per_s, r_.disk_mixed_bytes_per_s);
      const double reading = r_.disk_mixed_bytes_per_s > 0 && read > 0 ? disk * read / (read + write) : seconds_of(read, r_.disk_read_bytes_per_s);
      double at = std::max(landed, not_before);
      if (read > 0) at = verified(disk_.run(at, reading), read);
      at = cores(optimizer_).run(at, seconds_of(part.adam_elements, r_.adam_elements_per_s));
      if (write > 0) at = written(at, disk_.run(at, disk - reading), write);
      updated_[static_cast<size_t>(step)][g] = at;
    }
    pending_.clear();
  }

  struct Pending {
    size_t group;
    double landed;
  };
  const StepWork& w_;
  const PipelineShape& shape_;
  const ReplayRates& r_;
  std::vector<double> compute_;                // per use of a micro-batch
  std::vector<int> first_use_, last_use_;      // per group: its first and last use in a micro-batch
  std::vector<std::vector<double>> updated_;   // per step and group: its update done
  std::vector<double> fetched_, computed_;     // per use of the replay
  std::vector<Pending> pending_;
  // The disk serves the fetches' requests beside the updates' (both are in its queue at
  // once, a few requests deep each): a fetch shares the disk with the update traffic placed
  // on `disk_` rather than waiting for a whole update. The disk's total time is bounded
  // apart (examples/profile/step_cost.h).
  double fetch_disk_free_ = 0;
  Worker disk_, h2d_, compute_stream_, gradients_, landing_, optimizer_, host_cores_;
};

bool rates_cover(const StepWork& w, const ReplayRates& r) {
  bool reads = false, writes = false, h2d = false, adam = false;
  for (const GroupWork& g : w.groups) {
    reads |= g.fetch_read_bytes > 0 || g.update_read_bytes > 0;
    writes |= g.update_write_bytes > 0 || g.spill_bytes > 0;
    h2d |= g.fetch_h2d_bytes > 0;
    adam |= g.adam_elements > 0;
  }
  return (!reads || r.disk_read_bytes_per_s > 0) && (!writes || r.disk_write_bytes_per_s > 0) && (!h2d || r.h2d_bytes_per_s > 0) &&
         (!adam || r.adam_elements_per_s > 0) && r.d2h_bytes_per_s > 0 && r.landing_bytes_per_s > 0;
}

}  // namespace

double replay_step_seconds(const StepWork& work, const PipelineShape& shape, const ReplayRates& rates) {
  if (work.uses.empty() || work.groups.empty() || shape.micro_batches < 1 || !rates_cover(work, rates)) return 0.0;
  for (const int g : work.uses)
    if (g < 0 || static_cast<size_t>(g) >= work.groups.size()) return 0.0;  // a use of no group: nothing to replay
  return Replay(work, shape, rates).run();
}

}  // namespace strata::profile
