#include "engine/trace.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/support/test_support.h"

namespace strata {
namespace {

using namespace std::chrono_literals;

TEST(TraceTest, BusyTimeIsTheUnionOfIntervals) {
  const auto t0 = TraceClock::now();
  // 32 overlapping reads of [0, 10ms) count once; a later one adds 5 ms; a gap adds nothing.
  std::vector<std::pair<TraceClock::time_point, TraceClock::time_point>> reads;
  for (int i = 0; i < 32; ++i) reads.emplace_back(t0 + std::chrono::microseconds(i * 100), t0 + 10ms);
  reads.emplace_back(t0 + 20ms, t0 + 25ms);
  EXPECT_NEAR(union_seconds(reads, t0, t0 + 1s), 0.015, 1e-9);
  // Clipping to the window.
  EXPECT_NEAR(union_seconds(reads, t0 + 5ms, t0 + 22ms), 0.007, 1e-9);
  EXPECT_EQ(union_seconds({}, t0, t0 + 1s), 0.0);
}

TEST(TraceTest, TracerSumsPerStageAndWritesChromeTrace) {
  Tracer tracer(2);
  const auto t0 = TraceClock::now();
  tracer.record(Stage::kNvmeRead, 1, t0, t0 + 4ms, "g1");
  tracer.record(Stage::kNvmeRead, 2, t0 + 2ms, t0 + 6ms, "g2");
  tracer.record(Stage::kCompute, 1, t0 + 6ms, t0 + 9ms, "g1 forward");
  const auto busy = tracer.busy_seconds(t0, t0 + 10ms);
  EXPECT_NEAR(busy[static_cast<size_t>(Stage::kNvmeRead)], 0.006, 1e-9);
  EXPECT_NEAR(busy[static_cast<size_t>(Stage::kCompute)], 0.003, 1e-9);
  EXPECT_EQ(busy[static_cast<size_t>(Stage::kOptimizer)], 0.0);

  testing::TempDir dir;
  const std::string path = (dir.path() / "trace.json").string();
  STRATA_ASSERT_OK(write_chrome_trace(path, {&tracer}));
  std::ifstream in(path);
  const auto doc = nlohmann::json::parse(in);
  int slices = 0;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "X") {
      ++slices;
      EXPECT_EQ(e["pid"], 2);
      EXPECT_GE(e["dur"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(slices, 3);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(TraceTest, APredictionNamesEachStagesTrackAndIsInTheFilesOtherData) {
  Tracer tracer(0);
  const auto t0 = TraceClock::now();
  tracer.record(Stage::kH2D, 3, t0, t0 + 2ms, "g3");
  TracePrediction prediction;
  prediction.step_seconds = 0.25;
  prediction.busy_seconds[static_cast<size_t>(Stage::kH2D)] = 0.125;
  tracer.set_prediction(prediction);

  testing::TempDir dir;
  const std::string path = (dir.path() / "trace.json").string();
  STRATA_ASSERT_OK(write_chrome_trace(path, {&tracer}));
  std::ifstream in(path);
  const auto doc = nlohmann::json::parse(in);
  EXPECT_DOUBLE_EQ(doc["otherData"]["predicted_step_s"].get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(doc["otherData"]["predicted_busy_s"]["h2d"].get<double>(), 0.125);
  EXPECT_DOUBLE_EQ(doc["otherData"]["predicted_busy_s"]["compute"].get<double>(), 0.0);
  std::vector<std::string> names;
  for (const auto& e : doc["traceEvents"])
    if (e["ph"] == "M" && (e["name"] == "thread_name" || e["name"] == "process_name")) names.push_back(e["args"]["name"]);
  EXPECT_NE(std::find(names.begin(), names.end(), "h2d (predicted 0.125 s a step)"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "rank 0 (predicted step 0.25 s)"), names.end());
}

TEST(TraceTest, WithoutAPredictionTheTraceHasNoOtherData) {
  Tracer tracer(0);
  testing::TempDir dir;
  const std::string path = (dir.path() / "trace.json").string();
  STRATA_ASSERT_OK(write_chrome_trace(path, {&tracer}));
  std::ifstream in(path);
  const auto doc = nlohmann::json::parse(in);
  EXPECT_FALSE(doc.contains("otherData"));
}

TEST(TraceTest, UnwritableTracePathIsAnError) {
  Tracer tracer(0);
  const Status status = write_chrome_trace("/nonexistent-dir/trace.json", {&tracer});
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.to_string().find("/nonexistent-dir/trace.json"), std::string::npos);
}

}  // namespace
}  // namespace strata
