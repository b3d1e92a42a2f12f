#include "examples/profile/step_replay.h"

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "examples/profile/shared_lanes.h"

namespace strata::profile {

namespace {

// Six steps replayed; the step is the mean of the last two, each stage's time in flight the
// mean over the two before the last (so work on both sides of that window is replayed). Two
// steps, since with delayed overlap a disk-bound step can alternate long and short (a
// forward waits for the update two steps back, whose traffic the one between shares).
constexpr int kReplayedSteps = 6;
constexpr int kMeasuredSteps = 2;

// The engine's streams and queues, each one job at a time (docs/profile.md).
enum Lane : int { kFetchDisk, kStateRead, kStateWrite, kChecksums, kToDevice, kCompute, kCast, kToHost, kLanding, kOptimizer, kLanes };

// A group's update streams through at most this many ring chunks in the replay (more
// chunks change its overlap of reads and writes by under 3%).
constexpr int kMaxReplayedPieces = 32;

using Jobs = std::vector<int>;  // the jobs a piece of work waits for

double seconds_of(double amount, double rate) { return amount > 0 && rate > 0 ? amount / rate : 0.0; }

Jobs joined(Jobs a, const Jobs& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Builds the replayed steps' jobs in the engine's order, then runs them.
class Replay {
 public:
  // `flushed[c]`: the state ring's call c starts once every write-back of the call before
  // it is done (the executor found no update waiting and flushed); absent = false.
  Replay(const StepWork& w, const PipelineShape& shape, const ReplayRates& r, std::vector<bool> flushed)
      : w_(w),
        shape_(shape),
        r_(r),
        lanes_(kLanes, std::max(r.host_cores, 0),
               DiskSharing::from_rates(r.disk_read_bytes_per_s, r.disk_write_bytes_per_s, r.disk_mixed_bytes_per_s)),
        flushed_(std::move(flushed)) {
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

  // The replayed step, and per call of the state ring whether the executor was idle when it
  // came (its updates ready only after the call before had stepped its last chunk).
  std::pair<ReplayResult, std::vector<bool>> run() {
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
    const int last = kReplayedSteps - 1;
    result.step_seconds = (step_end(last) - step_end(last - kMeasuredSteps)) / kMeasuredSteps;
    result.in_flight = busy_within(lanes_, spans, step_end(last - 1 - kMeasuredSteps), step_end(last - 1));
    for (double& seconds : result.in_flight) seconds /= kMeasuredSteps;
    auto done_at = [&](const Jobs& jobs) {
      double at = 0;
      for (const int id : jobs) at = std::max(at, spans[static_cast<size_t>(id)].end);
      return at;
    };
    std::vector<bool> idle(calls_.size(), false);
    for (size_t c = 1; c < calls_.size(); ++c) idle[c] = done_at(calls_[c].ready) > done_at(calls_[c - 1].stepped);
    return {result, idle};
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
  // disk lanes' jobs move their bytes on the disk, each lane one way.
  int job(Lane lane, std::optional<Stage> stage, double seconds, int wanted_cores, Jobs after) {
    const DiskUse disk = lane == kFetchDisk || lane == kStateRead ? DiskUse::kRead : lane == kStateWrite ? DiskUse::kWrite : DiskUse::kNone;
    return lanes_.add({.lane = lane, .seconds = seconds, .cores = wanted_cores, .disk = disk, .stage = stage, .after = std::move(after)});
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
    return joined(then(kStateWrite, stage, disk_seconds, 0, after), checksums_priced() ? hashed(bytes, after) : Jobs{});
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

  // The waiting updates, in the order their gradients landed, none before `not_before`:
  // one call of the optimizer stage.
  void flush_updates(size_t step, const Jobs& not_before) {
    if (pending_.empty()) return;
    for (Pending& p : pending_) p.landed = joined(std::move(p.landed), not_before);
    const bool ring = w_.groups[pending_.front().group].update_pieces > 0;  // optimizer state on NVMe
    for (auto& [g, done] : ring ? through_ring() : in_memory()) updated_[step][g] = std::move(done);
    pending_.clear();
  }

  using Updated = std::vector<std::pair<size_t, Jobs>>;  // per group: its update done for the next forward

  // State in host memory: each update reads what it has on NVMe (a spilled gradient), steps
  // Adam and writes what it writes back.
  Updated in_memory() {
    Updated done;
    for (Pending& p : pending_) {
      const GroupWork& part = w_.groups[p.group];
      Jobs at = std::move(p.landed);
      const double read = part.update_read_bytes, write = part.update_write_bytes;
      if (read > 0) at = hashed(read, then(kStateRead, Stage::kNvmeRead, seconds_of(read, r_.disk_read_bytes_per_s), 0, std::move(at)));
      at = then(kOptimizer, Stage::kOptimizer, seconds_of(part.adam_elements, r_.adam_elements_per_s), cores(r_.adam_threads), std::move(at));
      if (write > 0) at = written(Stage::kNvmeWrite, write, seconds_of(write, r_.disk_write_bytes_per_s), at);
      done.emplace_back(p.group, std::move(at));
    }
    return done;
  }

  // State on NVMe: the call streams every update's chunks through the state ring as
  // NvmeAdamState::step_groups does (optim/nvme_adam_state.cpp). With S slots it reads
  // S - 2 chunks ahead: before stepping chunk i it issues the read of chunk i + S - 2 into
  // the slot of chunk i - 2, waiting first for that slot's write-back, then waits for chunk
  // i's read (and verification), steps it and issues its write-back. A group's update is
  // done for the next forward once its last chunk is stepped (its new parameters are in
  // host memory), or once its writes are done where its parameters live on NVMe.
  Updated through_ring() {
    struct Chunk {
      size_t pending = 0;  // which update
      double read = 0, write = 0, adam_seconds = 0;
    };
    std::vector<Chunk> chunks;
    for (size_t u = 0; u < pending_.size(); ++u) {
      const GroupWork& part = w_.groups[pending_[u].group];
      const int pieces = std::clamp(part.update_pieces, 1, kMaxReplayedPieces);
      for (int k = 0; k < pieces; ++k)
        chunks.push_back({u, part.update_read_bytes / pieces, part.update_write_bytes / pieces,
                          seconds_of(part.adam_elements / pieces, r_.adam_elements_per_s)});
    }
    const size_t slots = static_cast<size_t>(std::max(shape_.state_ring_slots, 3)), ahead = slots - 2;
    const size_t first = written_back_.size();  // the ring's count of chunks before this call
    auto slot_free = [&](size_t i) { return first + i >= slots ? written_back_[first + i - slots] : Jobs{}; };
    std::vector<Jobs> read(chunks.size());
    auto issue_read = [&](size_t i, Jobs after) {
      const double bytes = chunks[i].read;
      read[i] = bytes > 0 ? hashed(bytes, then(kStateRead, Stage::kNvmeRead, seconds_of(bytes, r_.disk_read_bytes_per_s), 0,
                                               joined(std::move(after), slot_free(i))))
                          : joined(std::move(after), slot_free(i));
    };
    // The call starts once its first update's gradient has landed and the executor's last
    // call has stepped its last chunk (the calls run one after another on one thread), or
    // has had its write-backs done too when the executor went idle in between (it flushes
    // the ring then: engine/optimizer_stage.cpp).
    const size_t call = calls_.size();
    calls_.push_back({pending_.front().landed, {}});
    Jobs stepped = joined(pending_.front().landed, call < flushed_.size() && flushed_[call] ? last_written_ : last_stepped_);
    for (size_t i = 0; i < std::min(ahead, chunks.size()); ++i) issue_read(i, stepped);
    std::vector<Jobs> writes(pending_.size());
    Updated done;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const Chunk& c = chunks[i];
      Jobs before = joined(joined(read[i], stepped), pending_[c.pending].landed);
      if (i + ahead < chunks.size()) {
        issue_read(i + ahead, stepped);
        before = joined(std::move(before), slot_free(i + ahead));
      }
      stepped = then(kOptimizer, Stage::kOptimizer, c.adam_seconds, cores(r_.adam_threads), std::move(before));
      Jobs back = c.write > 0 ? written(Stage::kNvmeWrite, c.write, seconds_of(c.write, r_.disk_write_bytes_per_s), stepped) : stepped;
      writes[c.pending] = joined(std::move(writes[c.pending]), back);
      written_back_.push_back(std::move(back));
      if (i + 1 < chunks.size() && chunks[i + 1].pending == c.pending) continue;
      const GroupWork& part = w_.groups[pending_[c.pending].group];
      done.emplace_back(pending_[c.pending].group, part.fetch_read_bytes > 0 ? joined(stepped, writes[c.pending]) : stepped);
    }
    last_stepped_ = stepped;
    calls_[call].stepped = stepped;
    last_written_ = stepped;
    for (const Jobs& back : writes) last_written_ = joined(std::move(last_written_), back);
    return done;
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
  struct RingCall {
    Jobs ready;    // its first update's gradient landed
    Jobs stepped;  // its last chunk stepped
  };
  std::vector<bool> flushed_;                // per call of the state ring: it waits for the last call's write-backs
  std::vector<RingCall> calls_;              // the state ring's calls, in order
  Jobs last_stepped_;                        // the last call's last chunk stepped
  Jobs last_written_;                        // ... and its write-backs done
  std::vector<Jobs> written_back_;           // the state ring's chunks written back, in the order they went out
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
  // Whether the executor went idle between two calls of the state ring (and so flushed its
  // write-backs before the next) depends on when the updates come: replayed once without
  // flushes, then again with the idle calls found flushing, until the idle calls stay the
  // same (at most kPasses replays).
  constexpr int kPasses = 3;
  std::vector<bool> flushed;
  ReplayResult result;
  for (int pass = 0; pass < kPasses; ++pass) {
    auto [replayed, idle] = Replay(work, shape, rates, flushed).run();
    result = replayed;
    if (idle == flushed) break;
    flushed = std::move(idle);
  }
  return result;
}

}  // namespace strata::profile
