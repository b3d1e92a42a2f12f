#include "examples/profile/shared_lanes.h"

#include <algorithm>
#include <cstddef>
#include <functional>
#include <limits>
#include <queue>
#include <utility>

namespace strata::profile {

DiskSharing DiskSharing::from_rates(double read_bytes_per_s, double write_bytes_per_s, double mixed_bytes_per_s) {
  if (!(read_bytes_per_s > 0) || !(write_bytes_per_s > 0) || !(mixed_bytes_per_s > 0)) return {};
  return {.mixed_gain = mixed_bytes_per_s / ((read_bytes_per_s + write_bytes_per_s) / 2)};
}

int SharedLanes::add(LaneJob job) {
  const int id = static_cast<int>(jobs_.size());
  std::erase_if(job.after, [id](int before) { return before < 0 || before >= id; });
  job.seconds = std::max(job.seconds, 0.0);
  job.lane = std::clamp(job.lane, 0, lanes_ - 1);
  jobs_.push_back(std::move(job));
  return id;
}

namespace {

using Ready = std::pair<double, int>;  // when it became ready, its id
using ReadyQueue = std::priority_queue<Ready, std::vector<Ready>, std::greater<>>;

// The pace of each disk job while `readers` and `writers` jobs run: an equal share of the
// disk's time, times the gain of mixed traffic while both directions are on it.
double disk_share(int readers, int writers, const DiskSharing& sharing) {
  const int users = std::max(readers + writers, 1);
  const double gain = readers > 0 && writers > 0 && sharing.mixed_gain > 0 ? sharing.mixed_gain : 1.0;
  return std::min(1.0, gain / users);
}

// The pace of each running job (its lane's), given what the running jobs want together.
std::vector<double> paces(const std::vector<LaneJob>& jobs, const std::vector<int>& running, int host_cores,
                          const DiskSharing& sharing) {
  int cores_wanted = 0, readers = 0, writers = 0;
  for (const int id : running) {
    if (id < 0) continue;
    const LaneJob& job = jobs[static_cast<size_t>(id)];
    cores_wanted += std::min(job.cores, std::max(host_cores, 1));
    readers += job.disk == DiskUse::kRead ? 1 : 0;
    writers += job.disk == DiskUse::kWrite ? 1 : 0;
  }
  const double disk = disk_share(readers, writers, sharing);
  std::vector<double> pace(running.size(), 0.0);
  for (size_t lane = 0; lane < running.size(); ++lane) {
    if (running[lane] < 0) continue;
    const LaneJob& job = jobs[static_cast<size_t>(running[lane])];
    double p = 1.0;
    if (host_cores > 0 && job.cores > 0 && cores_wanted > host_cores) p *= static_cast<double>(host_cores) / cores_wanted;
    if (job.disk != DiskUse::kNone) p *= disk;
    pace[lane] = p;
  }
  return pace;
}

}  // namespace

std::vector<JobSpan> SharedLanes::run() const {
  const size_t n = jobs_.size();
  std::vector<int> waiting(n, 0);
  std::vector<std::vector<int>> next(n);
  for (size_t id = 0; id < n; ++id)
    for (const int before : jobs_[id].after) {
      next[static_cast<size_t>(before)].push_back(static_cast<int>(id));
      ++waiting[id];
    }
  std::vector<ReadyQueue> ready(static_cast<size_t>(lanes_));
  std::vector<double> left(n);
  for (size_t id = 0; id < n; ++id) {
    left[id] = jobs_[id].seconds;
    if (waiting[id] == 0) ready[static_cast<size_t>(jobs_[id].lane)].push({0.0, static_cast<int>(id)});
  }
  std::vector<JobSpan> spans(n);
  std::vector<int> running(static_cast<size_t>(lanes_), -1);
  double now = 0;
  for (size_t done = 0; done < n;) {
    for (size_t lane = 0; lane < running.size(); ++lane) {
      if (running[lane] >= 0 || ready[lane].empty()) continue;
      running[lane] = ready[lane].top().second;
      ready[lane].pop();
      spans[static_cast<size_t>(running[lane])].start = now;
    }
    const std::vector<double> pace = paces(jobs_, running, host_cores_, disk_);
    double step = std::numeric_limits<double>::infinity();
    for (size_t lane = 0; lane < running.size(); ++lane)
      if (running[lane] >= 0) step = std::min(step, left[static_cast<size_t>(running[lane])] / pace[lane]);
    if (step == std::numeric_limits<double>::infinity()) break;  // nothing runs: every job left waits for one not done
    now += step;
    for (size_t lane = 0; lane < running.size(); ++lane) {
      if (running[lane] < 0) continue;
      const size_t id = static_cast<size_t>(running[lane]);
      // Done when its work ends with this step's (within rounding).
      if (left[id] / pace[lane] > step * (1 + 1e-12) + 1e-15) {
        left[id] -= pace[lane] * step;
        continue;
      }
      left[id] = 0;
      spans[id].end = now;
      running[lane] = -1;
      ++done;
      for (const int after : next[id])
        if (--waiting[static_cast<size_t>(after)] == 0) ready[static_cast<size_t>(jobs_[static_cast<size_t>(after)].lane)].push({now, after});
    }
  }
  return spans;
}

StageSeconds busy_within(const SharedLanes& lanes, const std::vector<JobSpan>& spans, double begin, double end) {
  std::vector<std::vector<JobSpan>> by_stage(kStageCount);
  for (size_t id = 0; id < lanes.size() && id < spans.size(); ++id) {
    const LaneJob& job = lanes.job(static_cast<int>(id));
    const double from = std::max(spans[id].start, begin), to = std::min(spans[id].end, end);
    if (job.stage && to > from) by_stage[static_cast<size_t>(*job.stage)].push_back({from, to});
  }
  StageSeconds busy{};
  for (size_t s = 0; s < kStageCount; ++s) {
    std::vector<JobSpan>& spans_of = by_stage[s];
    std::sort(spans_of.begin(), spans_of.end(), [](const JobSpan& a, const JobSpan& b) { return a.start < b.start; });
    double covered_to = begin;
    for (const JobSpan& span : spans_of) {
      const double from = std::max(span.start, covered_to);
      if (span.end > from) busy[s] += span.end - from;
      covered_to = std::max(covered_to, span.end);
    }
  }
  return busy;
}

}  // namespace strata::profile
