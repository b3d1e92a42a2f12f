// The trainer's plan before it runs (examples/train/plan_preview), through the train_gpt
// binary: --plan-only prints the plan and its prediction and exits without creating the
// NVMe path, and fails (exit 1) on a plan that does not fit; --profile names a missing or
// damaged file; without one the kept profile is used, else the plan says it has none; a
// run's summary carries predicted_step_s beside step_s and predicted_busy_s beside busy_s.
// --placement auto (examples/train/auto_placement) picks a placement whose plan passes its
// checks (and that then trains), and says clearly when nothing fits or there is no profile.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/examples/train_gpt_runner.h"
#include "tests/support/test_support.h"

namespace strata::train {
namespace {

namespace fs = std::filesystem;
using testing::contains;
using testing::train_gpt;
using testing::TrainRun;

std::string datasheet_profile() {
  const char* source = std::getenv("STRATA_SOURCE_DIR");
  return (fs::path(source ? source : ".") / "examples" / "profiles" / "h200-datasheet.json").string();
}

// Every test runs with its own (empty) profile cache, so a profile kept on the machine
// running the tests does not leak in.
class PlanPreviewTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(dir_.path() / "cache");
    ::setenv("XDG_CACHE_HOME", (dir_.path() / "cache").c_str(), 1);
  }
  std::vector<std::string> tiny(std::vector<std::string> more) { return testing::tiny_train_gpt_args(std::move(more)); }
  testing::TempDir dir_;
};

using PlacementAutoTest = PlanPreviewTest;

TEST_F(PlanPreviewTest, PlanOnlyPrintsThePlanAndItsPredictionAndNeverCreatesTheNvmePath) {
  const fs::path nvme = dir_.path() / "nvme" / "deeper";
  const TrainRun run = train_gpt(dir_, tiny({"--offload-param", "nvme", "--offload-optimizer", "nvme", "--nvme-path", nvme.string(),
                                             "--profile", datasheet_profile(), "--plan-only"}));
  ASSERT_RAN(run);
  EXPECT_TRUE(contains(run.out, "Strata plan")) << run.out;
  EXPECT_TRUE(contains(run.out, "predicted step (profile")) << run.out;
  EXPECT_TRUE(contains(run.out, "bound by")) << run.out;
  EXPECT_FALSE(contains(run.out, "step 1/")) << run.out;
  EXPECT_EQ(run.summary.value("plan_only", false), true) << run.out;
  EXPECT_EQ(run.summary.value("checks", std::string()), "ok");
  EXPECT_GT(run.summary.at("nvme_file_bytes").get<double>(), 0.0);
  EXPECT_GT(run.summary.at("predicted_step_s").get<double>(), 0.0);
  EXPECT_TRUE(run.summary.at("predicted_busy_s").contains("nvme_read"));
  EXPECT_FALSE(fs::exists(dir_.path() / "nvme")) << "--plan-only created the NVMe path";
}

// The plan --plan-only makes without an engine is the one the engine makes at start: the
// same bytes in every tier, for both families.
TEST_F(PlanPreviewTest, PlanOnlysPlanIsTheEnginesPlan) {
  const fs::path nvme = dir_.path() / "nvme";
  const std::vector<std::string> placement = {"--offload-param", "nvme", "--offload-optimizer", "nvme", "--nvme-path", nvme.string()};
  std::vector<std::string> llama = {"--preset", "llama-tiny", "--seq-len", "16", "--eval-sequences", "0", "--set", "strata.compute_threads=1"};
  llama.insert(llama.end(), placement.begin(), placement.end());
  for (const std::vector<std::string>& args : {tiny(placement), llama}) {
    std::vector<std::string> plan_only = args;
    plan_only.push_back("--plan-only");
    const TrainRun planned = train_gpt(dir_, plan_only);
    ASSERT_RAN(planned);
    std::vector<std::string> trained = args;
    for (const char* more : {"--steps", "1"}) trained.push_back(more);
    const TrainRun run = train_gpt(dir_, trained);
    ASSERT_RAN(run);
    for (const char* key : {"pinned_bytes", "host_bytes", "nvme_file_bytes", "state_bytes"})
      EXPECT_EQ(planned.summary.at(key).get<uint64_t>(), run.summary.at(key).get<uint64_t>()) << key << "\n" << planned.out;
  }
}

TEST_F(PlanPreviewTest, PlanOnlyWithoutAProfileSaysItHasNoneAndPredictsNothing) {
  const TrainRun run = train_gpt(dir_, tiny({"--plan-only"}));
  ASSERT_RAN(run);
  EXPECT_TRUE(contains(run.out, "predicted step: none (no machine profile")) << run.out;
  EXPECT_TRUE(run.summary.at("predicted_step_s").is_null());
  EXPECT_TRUE(run.summary.at("predicted_busy_s").is_null());
}

TEST_F(PlanPreviewTest, PlanOnlyUsesTheProfileKeptForThisHost) {
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof(host) - 1), 0);
  const fs::path kept = dir_.path() / "cache" / "strata" / (std::string("profile-") + host + ".json");
  fs::create_directories(kept.parent_path());
  fs::copy_file(datasheet_profile(), kept);
  const TrainRun run = train_gpt(dir_, tiny({"--plan-only"}));
  ASSERT_RAN(run);
  EXPECT_TRUE(contains(run.out, kept.string())) << run.out;
  EXPECT_TRUE(run.summary.at("predicted_step_s").is_number());
}

TEST_F(PlanPreviewTest, PlanOnlyExitsOneWhenThePlanDoesNotFitItsBudget) {
  const TrainRun run = train_gpt(dir_, tiny({"--plan-only", "--device-budget-mib", "1", "--micro-batch", "256"}));
  EXPECT_EQ(run.exit_code, 1) << run.out << run.err;
  EXPECT_TRUE(contains(run.summary.value("checks", std::string()), "device budget")) << run.out;
}

TEST_F(PlanPreviewTest, AMissingProfileFileIsAnErrorNamingIt) {
  const std::string missing = (dir_.path() / "no-such-profile.json").string();
  const TrainRun run = train_gpt(dir_, tiny({"--plan-only", "--profile", missing}));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(contains(run.err, missing)) << run.err;
  EXPECT_TRUE(contains(run.err, "--profile")) << run.err;
}

TEST_F(PlanPreviewTest, ADamagedProfileFileIsAnErrorNamingIt) {
  const fs::path damaged = dir_.path() / "damaged.json";
  std::ofstream(damaged) << "{\"format\": \"strata-machine-profile\", \"version\": 1, ";
  const TrainRun run = train_gpt(dir_, tiny({"--steps", "2", "--profile", damaged.string()}));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(contains(run.err, damaged.string())) << run.err;
}

TEST_F(PlanPreviewTest, TheSummaryAndTheTraceCarryThePredictionBesideTheMeasuredStep) {
  const fs::path trace = dir_.path() / "trace.json";
  const TrainRun run = train_gpt(dir_, tiny({"--steps", "3", "--profile", datasheet_profile(), "--trace", trace.string()}));
  ASSERT_RAN(run);
  std::ifstream in(trace);
  const nlohmann::json doc = nlohmann::json::parse(in);
  ASSERT_TRUE(doc.contains("otherData")) << "the trace does not mark the prediction";
  EXPECT_DOUBLE_EQ(doc["otherData"]["predicted_step_s"].get<double>(), run.summary.at("predicted_step_s").get<double>());
  EXPECT_TRUE(contains(run.out, "predicted step (profile")) << run.out;
  ASSERT_TRUE(run.summary.at("step_s").is_number()) << run.out;
  ASSERT_TRUE(run.summary.at("predicted_step_s").is_number()) << run.out;
  EXPECT_GT(run.summary.at("step_s").get<double>(), 0.0);
  EXPECT_GT(run.summary.at("predicted_step_s").get<double>(), 0.0);
  for (const char* stage : {"compute", "nvme_read", "nvme_write", "h2d", "allgather", "reduce_scatter", "d2h", "optimizer", "landing"}) {
    EXPECT_TRUE(run.summary.at("busy_s").contains(stage)) << stage;
    EXPECT_TRUE(run.summary.at("predicted_busy_s").contains(stage)) << stage;
  }
  EXPECT_GT(run.summary.at("busy_s").at("compute").get<double>(), 0.0);
}

TEST_F(PlanPreviewTest, ARunWithoutAProfileHasNullPredictions) {
  const TrainRun run = train_gpt(dir_, tiny({"--steps", "2"}));
  ASSERT_RAN(run);
  EXPECT_TRUE(run.summary.at("step_s").is_number());
  EXPECT_TRUE(run.summary.at("predicted_step_s").is_null());
  EXPECT_TRUE(run.summary.at("predicted_busy_s").is_null());
}

TEST_F(PlacementAutoTest, PicksAPlacementWhosePlanPassesItsChecksAndTrains) {
  const fs::path nvme = dir_.path() / "nvme";
  const std::vector<std::string> auto_args = {"--micro-batch", "8", "--device-budget-mib", "1", "--nvme-path", nvme.string(),
                                              "--profile", datasheet_profile(), "--placement", "auto"};
  std::vector<std::string> plan_only = auto_args;
  plan_only.push_back("--plan-only");
  const TrainRun planned = train_gpt(dir_, tiny(plan_only));
  ASSERT_RAN(planned);
  EXPECT_TRUE(contains(planned.out, "placement auto: ")) << planned.out;
  EXPECT_TRUE(contains(planned.out, "  chosen: params ")) << planned.out;
  EXPECT_TRUE(contains(planned.out, "  runner-up: ")) << planned.out;
  EXPECT_EQ(planned.summary.value("checks", std::string()), "ok") << planned.out;
  EXPECT_FALSE(fs::exists(nvme)) << "--placement auto --plan-only created the NVMe path";
  std::vector<std::string> trained = auto_args;
  for (const char* more : {"--steps", "2"}) trained.push_back(more);
  const TrainRun run = train_gpt(dir_, tiny(trained));
  ASSERT_RAN(run);
  EXPECT_TRUE(run.summary.at("predicted_step_s").is_number());
}

TEST_F(PlacementAutoTest, TheConfigAsksForItWithStrataPlacementAndStrataProfile) {
  const fs::path config = dir_.path() / "auto.json";
  std::ofstream(config) << R"({"strata": {"placement": "auto", "profile": ")" << datasheet_profile() << R"("}})";
  const TrainRun run = train_gpt(dir_, tiny({"--config", config.string(), "--micro-batch", "8", "--device-budget-mib", "1", "--plan-only"}));
  ASSERT_RAN(run);
  EXPECT_TRUE(contains(run.out, "placement auto: ")) << run.out;
  EXPECT_TRUE(contains(run.out, "predicted step (profile " + datasheet_profile())) << run.out;
  // The flag wins over the key.
  const TrainRun flagged = train_gpt(dir_, tiny({"--config", config.string(), "--placement", "config", "--plan-only"}));
  ASSERT_RAN(flagged);
  EXPECT_FALSE(contains(flagged.out, "placement auto: ")) << flagged.out;
}

TEST_F(PlacementAutoTest, SaysClearlyWhenNothingFits) {
  const TrainRun run = train_gpt(dir_, tiny({"--micro-batch", "256", "--device-budget-mib", "1", "--profile", datasheet_profile(),
                                             "--placement", "auto", "--plan-only"}));
  EXPECT_EQ(run.exit_code, 2) << run.out;
  EXPECT_TRUE(contains(run.err, "--placement auto: none of the")) << run.err;
  EXPECT_TRUE(contains(run.err, "placements fits")) << run.err;
}

TEST_F(PlacementAutoTest, NeedsAMachineProfile) {
  const TrainRun run = train_gpt(dir_, tiny({"--placement", "auto", "--plan-only"}));
  EXPECT_EQ(run.exit_code, 2) << run.out;
  EXPECT_TRUE(contains(run.err, "needs a machine profile")) << run.err;
}

TEST_F(PlacementAutoTest, AnUnknownPlacementIsRefused) {
  const TrainRun run = train_gpt(dir_, tiny({"--placement", "fastest", "--plan-only"}));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(contains(run.err, "--placement fastest: strata.placement: expected one of \"config\", \"auto\"")) << run.err;
}

}  // namespace
}  // namespace strata::train
