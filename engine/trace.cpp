#include "engine/trace.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

namespace strata {

std::string_view stage_name(Stage stage) {
  switch (stage) {
    case Stage::kCompute: return "compute";
    case Stage::kNvmeRead: return "nvme_read";
    case Stage::kNvmeWrite: return "nvme_write";
    case Stage::kH2D: return "h2d";
    case Stage::kAllGather: return "allgather";
    case Stage::kReduceScatter: return "reduce_scatter";
    case Stage::kD2H: return "d2h";
    case Stage::kOptimizer: return "optimizer";
    case Stage::kLanding: return "landing";
  }
  return "?";
}

void Tracer::record(Stage stage, int group, TraceClock::time_point begin, TraceClock::time_point end, std::string label) {
  if (end < begin) end = begin;
  std::lock_guard<std::mutex> lock(mutex_);
  intervals_.push_back({stage, group, begin, end, std::move(label)});
}

double union_seconds(std::vector<std::pair<TraceClock::time_point, TraceClock::time_point>> intervals,
                     TraceClock::time_point window_begin, TraceClock::time_point window_end) {
  for (auto& [b, e] : intervals) {
    b = std::max(b, window_begin);
    e = std::min(e, window_end);
  }
  std::erase_if(intervals, [](const auto& iv) { return iv.second <= iv.first; });
  std::sort(intervals.begin(), intervals.end());
  double total = 0.0;
  size_t i = 0;
  while (i < intervals.size()) {
    auto begin = intervals[i].first;
    auto end = intervals[i].second;
    for (++i; i < intervals.size() && intervals[i].first <= end; ++i) end = std::max(end, intervals[i].second);
    total += std::chrono::duration<double>(end - begin).count();
  }
  return total;
}

StageSeconds Tracer::busy_seconds(TraceClock::time_point window_begin, TraceClock::time_point window_end) const {
  std::array<std::vector<std::pair<TraceClock::time_point, TraceClock::time_point>>, kStageCount> per_stage;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& iv : intervals_) per_stage[static_cast<size_t>(iv.stage)].emplace_back(iv.begin, iv.end);
  }
  StageSeconds busy{};
  for (size_t s = 0; s < kStageCount; ++s) busy[s] = union_seconds(std::move(per_stage[s]), window_begin, window_end);
  return busy;
}

std::vector<TraceInterval> Tracer::intervals() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return intervals_;
}

void Tracer::forget_before(TraceClock::time_point cutoff) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::erase_if(intervals_, [&](const TraceInterval& iv) { return iv.end < cutoff; });
}

void Tracer::set_prediction(const TracePrediction& prediction) {
  std::lock_guard<std::mutex> lock(mutex_);
  prediction_ = prediction;
}

std::optional<TracePrediction> Tracer::prediction() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return prediction_;
}

namespace {

std::string seconds_label(double seconds) {
  char text[48];
  std::snprintf(text, sizeof(text), "%.4g s", seconds);
  return text;
}

// {"predicted_step_s": ..., "predicted_busy_s": {"compute": ..., ...}}
nlohmann::json prediction_json(const TracePrediction& prediction) {
  nlohmann::json busy = nlohmann::json::object();
  for (size_t s = 0; s < kStageCount; ++s) busy[std::string(stage_name(static_cast<Stage>(s)))] = prediction.busy_seconds[s];
  return {{"predicted_step_s", prediction.step_seconds}, {"predicted_busy_s", std::move(busy)}};
}

}  // namespace

Status write_chrome_trace(const std::string& path, const std::vector<const Tracer*>& tracers) {
  if (tracers.empty()) return InvalidArgumentError("write_chrome_trace: no tracers");
  const TraceClock::time_point origin = tracers.front()->origin();
  nlohmann::json events = nlohmann::json::array();
  for (const Tracer* tracer : tracers) {
    const int pid = tracer->rank();
    const std::optional<TracePrediction> prediction = tracer->prediction();
    std::string process = "rank " + std::to_string(pid);
    if (prediction) process += " (predicted step " + seconds_label(prediction->step_seconds) + ")";
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", process}}}});
    for (size_t s = 0; s < kStageCount; ++s) {
      std::string track(stage_name(static_cast<Stage>(s)));
      if (prediction) track += " (predicted " + seconds_label(prediction->busy_seconds[s]) + " a step)";
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", s}, {"args", {{"name", track}}}});
      events.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", s}, {"args", {{"sort_index", s}}}});
    }
    for (const auto& iv : tracer->intervals()) {
      const double ts = std::chrono::duration<double, std::micro>(iv.begin - origin).count();
      const double dur = std::chrono::duration<double, std::micro>(iv.end - iv.begin).count();
      nlohmann::json event = {{"name", iv.label.empty() ? std::string(stage_name(iv.stage)) : iv.label},
                              {"cat", std::string(stage_name(iv.stage))},
                              {"ph", "X"},
                              {"ts", ts},
                              {"dur", dur},
                              {"pid", pid},
                              {"tid", static_cast<int>(iv.stage)}};
      if (iv.group >= 0) event["args"] = {{"group", iv.group}};
      events.push_back(std::move(event));
    }
  }
  nlohmann::json doc = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  if (const std::optional<TracePrediction> prediction = tracers.front()->prediction()) doc["otherData"] = prediction_json(*prediction);
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    if (!out) return Status::FromErrno(errno, "open trace file " + temporary);
    out << doc.dump();
    out.flush();
    if (!out) return IoError("writing trace file " + temporary + " failed");
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  if (error) return IoError("renaming " + temporary + " to " + path + ": " + error.message());
  return {};
}

}  // namespace strata
