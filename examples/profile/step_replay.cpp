#include "examples/profile/step_replay.h"

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "examples/profile/shared_lanes.h"

namespace strata::profile {

namespace {

constexpr int kReplayedSteps = 4;

// The engine's streams and queues, each one job at a time (docs/profile.md).
enum Lane : int { kFetchDisk, kStateDisk, kChecksums, kToDevice, kCompute, kCast, kToHost, kLanding, kOptimizer, kLanes };

using Jobs = std::vector<int>;  // the jobs a piece of work waits for

double seconds_of(double amount, double rate) { return amount > 0 && rate > 0 ? amount / rate : 0.0; }

Jobs joined(Jobs a, const Jobs& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Builds the replayed steps' jobs in the engine's order, then runs them.
class Replay {
 public:
  Replay(const StepWork& w, const PipelineShape& shape, const ReplayRates& r)
      : w_(w), shape_(shape), r_(r), lanes_(kLanes, std::max(r.host_cores, 0)) {
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
    updated_.assign(kReplayedSteps, std::vector<Jobs>(w.groups.size()));
  }

  ReplayResult run() {
    const size_t per_step = w_.uses.size() * static_cast<size_t>(shape_.micro_batches);
    const size_t total = per_step * kReplayedSteps;
    fetched_.assign(total, {});
    computed_.assign(total, -1);
    for (size_t u = 0; u <= std::min<size_t>(static_cast<size_t>(shape_.prefetch_depth), total - 1); ++u) fetch(u, {});
    for (size_t t = 0; t < total; ++t) {
      // Use t - 1 has released its slot: the fetch `prefetch_depth` uses ahead of t goes out.
      const size_t ahead = t + static_cast<size_t>(shape_.prefetch_depth);
      if (t > 0 && ahead < total) fetch(ahead, {computed_[t - 1]});
      compute(t);
      if ((t + 1) % per_step == 0) flush_updates(t / per_step, {computed_[t]});
    }
    const std::vector<JobSpan> spans = lanes_.run();
    auto step_end = [&](int step) { return spans[static_cast<size_t>(computed_[per_step * static_cast<size_t>(step + 1) - 1])].end; };
    ReplayResult result;
    result.step_seconds = step_end(kReplayedSteps - 1) - step_end(kReplayedSteps - 2);
    result.in_flight = busy_within(lanes_, spans, step_end(kReplayedSteps - 3), step_end(kReplayedSteps - 2));
    return result;
  }

 private:
  const GroupWork& group(size_t use) const { return w_.groups[static_cast<size_t>(w_.uses[use])]; }
  size_t use_of(size_t t) const { return t % w_.uses.size(); }
  int step_of(size_t t) const { return static_cast<int>(t / (w_.uses.size() * static_cast<size_t>(shape_.micro_batches))); }
  int micro_of(size_t t) const { return static_cast<int>(t / w_.uses.size()) % shape_.micro_batches; }
  bool host_cores_shared() const { return r_.host_cores > 0; }
  // The host cores a job wants on the CPU device (none on a GPU, whose cores are not shared).
  int cores(int wanted) const { return host_cores_shared() ? std::clamp(wanted, 1, r_.host_cores) : 0; }
  int all_cores() const { return cores(r_.host_cores); }
  // The landing pass runs on CPU Adam's executor, a lane of its own when Adam is on the device.
  Lane lander() const { return shape_.adam_on_device ? kLanding : kOptimizer; }

  // A job that always exists (the compute stream's uses: the step's ends are theirs). The
  // disk lanes' jobs move their bytes on the disk.
  int job(Lane lane, std::optional<Stage> stage, double seconds, int wanted_cores, Jobs after) {
    return lanes_.add({.lane = lane, .seconds = seconds, .cores = wanted_cores, .disk = lane == kFetchDisk || lane == kStateDisk,
                       .stage = stage, .after = std::move(after)});
  }
  // Work of `seconds` after `after`: what waits for it next (`after` itself when there is none).
  Jobs then(Lane lane, std::optional<Stage> stage, double seconds, int wanted_cores, Jobs after) {
    if (seconds <= 0) return after;
    return {job(lane, stage, seconds, wanted_cores, std::move(after))};
  }
  // The store's checksums are priced on the CPU device with checksums on.
  bool checksums_priced() const { return r_.checksum_bytes_per_s > 0 && host_cores_shared(); }
  // The store's checksums of `bytes`, on its verifier threads.
  Jobs hashed(double bytes, Jobs after) {
    if (!checksums_priced()) return after;
    const int threads = cores(r_.checksum_threads);
    return then(kChecksums, std::nullopt, seconds_of(bytes, r_.checksum_bytes_per_s * threads), threads, std::move(after));
  }
  // A write is done once both the disk and its hashing are.
  Jobs written(Stage stage, double bytes, double disk_seconds, const Jobs& after) {
    return joined(then(kStateDisk, stage, disk_seconds, 0, after), checksums_priced() ? hashed(bytes, after) : Jobs{});
  }

  // A group's first use in a step waits for its update `lag` steps back.
  Jobs update_wait(size_t t) const {
    const size_t i = use_of(t);
    const size_t g = static_cast<size_t>(w_.uses[i]);
    const int lag = shape_.overlap == OverlapMode::kExact ? 1 : 2;
    const int from = step_of(t) - lag;
    if (micro_of(t) != 0 || first_use_[g] != static_cast<int>(i) || from < 0 || !w_.groups[g].trainable) return {};
    return updated_[static_cast<size_t>(from)][g];
  }

  void fetch(size_t u, Jobs slot_free) {
    const size_t i = use_of(u);
    const GroupWork& g = group(i);
    const bool fetches = !g.persistent || (micro_of(u) == 0 && first_use_[static_cast<size_t>(w_.uses[i])] == static_cast<int>(i));
    if (!fetches) return;
    Jobs at = joined(std::move(slot_free), update_wait(u));
    if (g.fetch_read_bytes > 0)  // read, then verified before its bytes are used
      at = hashed(g.fetch_read_bytes,
                  then(kFetchDisk, Stage::kNvmeRead, seconds_of(g.fetch_read_bytes, r_.disk_read_bytes_per_s), 0, std::move(at)));
    fetched_[u] = then(kToDevice, Stage::kH2D, seconds_of(g.fetch_h2d_bytes, r_.h2d_bytes_per_s), cores(1), std::move(at));
  }

  void compute(size_t t) {
    const size_t i = use_of(t);
    Jobs after = joined(fetched_[t], update_wait(t));
    if (t > 0) after.push_back(computed_[t - 1]);  // the compute stream runs its uses in order
    computed_[t] = job(kCompute, Stage::kCompute, compute_[i], all_cores(), std::move(after));
    const size_t g = static_cast<size_t>(w_.uses[i]);
    if (!w_.groups[g].trainable || last_use_[g] != static_cast<int>(i)) return;
    const GroupWork& part = w_.groups[g];
    Jobs at = then(kCast, Stage::kReduceScatter, seconds_of(part.gradient_cast_bytes, r_.cast_bytes_per_s), all_cores(), {computed_[t]});
    at = then(kToHost, Stage::kD2H, seconds_of(part.gradient_out_bytes, r_.d2h_bytes_per_s), cores(1), std::move(at));
    at = then(lander(), Stage::kLanding, seconds_of(part.landing_bytes, r_.landing_bytes_per_s), all_cores(), std::move(at));
    if (part.spill_bytes > 0) at = written(Stage::kNvmeWrite, part.spill_bytes, seconds_of(part.spill_bytes, r_.disk_write_bytes_per_s), at);
    if (micro_of(t) != shape_.micro_batches - 1) return;
    pending_.push_back({g, std::move(at)});
    if (shape_.adam_during_backward) flush_updates(step_of(t), {});
  }

  // The waiting updates, in the order their gradients landed, none before `not_before`.
  void flush_updates(size_t step, const Jobs& not_before) {
    for (auto& [g, landed] : pending_) {
      const GroupWork& part = w_.groups[g];
      // The update's disk time as the disk bound prices it (step_cost.h: disk_seconds): its
      // reads before Adam, its writes after; moved together, the time split by bytes.
      const double read = part.update_read_bytes, write = part.update_write_bytes;
      const double disk = disk_seconds(read, write, r_.disk_read_bytes_per_s, r_.disk_write_bytes_per_s, r_.disk_mixed_bytes_per_s);
      const double reading = r_.disk_mixed_bytes_per_s > 0 && read > 0 ? disk * read / (read + write) : seconds_of(read, r_.disk_read_bytes_per_s);
      Jobs at = joined(std::move(landed), not_before);
      if (read > 0) at = hashed(read, then(kStateDisk, Stage::kNvmeRead, reading, 0, std::move(at)));
      at = then(kOptimizer, Stage::kOptimizer, seconds_of(part.adam_elements, r_.adam_elements_per_s), cores(r_.adam_threads),
                std::move(at));
      if (write > 0) at = written(Stage::kNvmeWrite, write, disk - reading, at);
      updated_[step][g] = std::move(at);
    }
    pending_.clear();
  }

  struct Pending {
    size_t group;
    Jobs landed;
  };
  const StepWork& w_;
  const PipelineShape& shape_;
  const ReplayRates& r_;
  SharedLanes lanes_;
  std::vector<double> compute_;              // per use of a micro-batch
  std::vector<int> first_use_, last_use_;    // per group: its first and last use in a micro-batch
  std::vector<std::vector<Jobs>> updated_;   // per step and group: its update done
  std::vector<Jobs> fetched_;                // per use of the replay: its parameters there
  std::vector<int> computed_;                // per use of the replay: its compute job
  std::vector<Pending> pending_;
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

ReplayResult replay_step(const StepWork& work, const PipelineShape& shape, const ReplayRates& rates) {
  if (work.uses.empty() || work.groups.empty() || shape.micro_batches < 1 || !rates_cover(work, rates)) return {};
  for (const int g : work.uses)
    if (g < 0 || static_cast<size_t>(g) >= work.groups.size()) return {};  // a use of no group: nothing to replay
  return Replay(work, shape, rates).run();
}

}  // namespace strata::profile
