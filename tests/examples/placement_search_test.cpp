// --placement auto's search (examples/profile/placement_search) with a made-up evaluator:
// it never picks a candidate whose plan fails its checks, picks the most predicted tokens/s
// (ties: block inputs on the device, then the deeper prefetch, then less device memory), names the runner-up and why it lost, and says clearly when
// nothing fits.
#include "examples/profile/placement_search.h"

#include <gtest/gtest.h>

namespace strata::profile {
namespace {

PlacementSpace small_space() {
  PlacementSpace s;
  s.params = {Tier::kDevice, Tier::kPinned, Tier::kNvme};
  s.optimizer = {Tier::kPinned, Tier::kNvme};
  s.prefetch_depths = {0, 1, 2};
  s.batches = batch_splits(4);
  s.checkpointing = {lm::ActivationCheckpointing::kOff, lm::ActivationCheckpointing::kDevice};
  s.overlaps = {OverlapMode::kExact, OverlapMode::kDelayed};
  return s;
}

// Parameters on the device are fastest but do not fit; deeper prefetch and delayed overlap
// are faster; larger micro-batches are faster; checkpointing off needs more device memory.
StatusOr<PlacementOutcome> made_up(const Placement& p) {
  PlacementOutcome out;
  out.placement = p;
  out.tokens_per_step = 4;
  out.device_bytes = (p.params == Tier::kDevice ? 1000.0 : 100.0) + (p.checkpointing == lm::ActivationCheckpointing::kOff ? 50.0 : 0.0) +
                     10.0 * p.prefetch_depth;
  out.host_bytes = p.optimizer == Tier::kPinned ? 100.0 : 10.0;
  if (p.params == Tier::kDevice) {
    out.checks = OutOfMemoryError("the device budget cannot hold it");
    return out;
  }
  StepPrediction prediction;
  prediction.step_seconds = 10.0 - p.prefetch_depth - (p.overlap == OverlapMode::kDelayed ? 1.0 : 0.0) - 0.5 * static_cast<double>(p.micro_batch) +
                            (p.params == Tier::kNvme ? 2.0 : 0.0) + (p.optimizer == Tier::kNvme ? 1.0 : 0.0);
  prediction.bound = "compute";
  out.prediction = prediction;
  return out;
}

TEST(PlacementSearch, NeverPicksACandidateWhosePlanFailsItsChecks) {
  auto choice = search_placements(small_space(), made_up);
  ASSERT_TRUE(choice.ok()) << choice.status().to_string();
  EXPECT_NE(choice->best.placement.params, Tier::kDevice);
  EXPECT_TRUE(choice->best.checks.ok());
  ASSERT_TRUE(choice->runner_up.has_value());
  EXPECT_NE(choice->runner_up->placement.params, Tier::kDevice);
  EXPECT_EQ(choice->candidates, 3 * 2 * 3 * 3 * 2 * 2);
  EXPECT_EQ(choice->rejected, 1 * 2 * 3 * 3 * 2 * 2);
}

TEST(PlacementSearch, PicksTheMostPredictedTokensPerSecondThenTheLeastDeviceMemory) {
  auto choice = search_placements(small_space(), made_up);
  ASSERT_TRUE(choice.ok());
  const Placement& p = choice->best.placement;
  EXPECT_EQ(p.params, Tier::kPinned);
  EXPECT_EQ(p.optimizer, Tier::kPinned);
  EXPECT_EQ(p.prefetch_depth, 2);
  EXPECT_EQ(p.micro_batch, 4);
  EXPECT_EQ(p.accumulation, 1);
  EXPECT_EQ(p.overlap, OverlapMode::kDelayed);
  EXPECT_EQ(p.checkpointing, lm::ActivationCheckpointing::kDevice);  // as fast as off, and less device memory
  EXPECT_DOUBLE_EQ(choice->best.prediction->step_seconds, 5.0);
  // The runner-up, the best other placement: checkpointing off, as fast but more device memory.
  EXPECT_EQ(choice->runner_up->placement.checkpointing, lm::ActivationCheckpointing::kOff);
  EXPECT_EQ(choice->runner_up->placement.prefetch_depth, 2);
  const std::string text = placement_choice_text(*choice);
  EXPECT_NE(text.find("chosen: params cpu, optimizer cpu, prefetch depth 2, micro-batch 4 x 1, checkpointing device, overlap delayed"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("runner-up"), std::string::npos) << text;
  EXPECT_NE(text.find("more device memory"), std::string::npos) << text;
}

TEST(PlacementSearch, TheRunnerUpIsAnotherTuningOnlyWhenNoOtherPlacementFits) {
  PlacementSpace s = small_space();
  s.params = {Tier::kPinned};
  s.optimizer = {Tier::kPinned};
  s.checkpointing = {lm::ActivationCheckpointing::kDevice};
  s.overlaps = {OverlapMode::kDelayed};
  auto choice = search_placements(s, made_up);
  ASSERT_TRUE(choice.ok());
  ASSERT_TRUE(choice->runner_up.has_value());
  // 6.0 s against the choice's 5.0 s; of the 6.0 s tunings (depth 1 x micro-batch 4, depth 2
  // x micro-batch 2), the deeper prefetch.
  EXPECT_DOUBLE_EQ(choice->runner_up->prediction->step_seconds, 6.0);
  EXPECT_EQ(choice->runner_up->placement.prefetch_depth, 2);
  EXPECT_EQ(choice->runner_up->placement.micro_batch, 2);
  EXPECT_NE(placement_choice_text(*choice).find("fewer predicted tokens/s"), std::string::npos);
}

TEST(PlacementSearch, BetweenEqualPredictionsKeepsBlockInputsOnTheDevice) {
  PlacementSpace s = small_space();
  s.checkpointing = {lm::ActivationCheckpointing::kPinnedHost, lm::ActivationCheckpointing::kDevice};
  auto choice = search_placements(s, made_up);  // the same prediction and device memory either way
  ASSERT_TRUE(choice.ok());
  EXPECT_EQ(choice->best.placement.checkpointing, lm::ActivationCheckpointing::kDevice);
  ASSERT_TRUE(choice->runner_up.has_value());
  EXPECT_EQ(choice->runner_up->placement.checkpointing, lm::ActivationCheckpointing::kPinnedHost);
  EXPECT_NE(placement_choice_text(*choice).find("copies its block inputs out to pinned memory and back"), std::string::npos)
      << placement_choice_text(*choice);
}

TEST(PlacementSearch, SaysClearlyWhenNothingFits) {
  PlacementSpace s = small_space();
  s.params = {Tier::kDevice};
  auto choice = search_placements(s, made_up);
  ASSERT_FALSE(choice.ok());
  EXPECT_EQ(choice.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(choice.status().message().find("none of the 72 placements fits"), std::string::npos) << choice.status().message();
  EXPECT_NE(choice.status().message().find("device budget cannot hold it"), std::string::npos);
}

TEST(PlacementSearch, AnEvaluatorErrorStopsTheSearch) {
  auto choice = search_placements(small_space(), [](const Placement&) -> StatusOr<PlacementOutcome> { return InternalError("broken"); });
  ASSERT_FALSE(choice.ok());
  EXPECT_NE(choice.status().message().find("broken"), std::string::npos);
}

TEST(PlacementSearch, AnEmptyDimensionIsRefused) {
  PlacementSpace s = small_space();
  s.overlaps.clear();
  EXPECT_FALSE(search_placements(s, made_up).ok());
}

TEST(PlacementSearch, BatchSplitsKeepTheBatchPerRank) {
  using Splits = std::vector<std::pair<int64_t, int>>;
  EXPECT_EQ(batch_splits(1), (Splits{{1, 1}}));
  EXPECT_EQ(batch_splits(8), (Splits{{1, 8}, {2, 4}, {4, 2}, {8, 1}}));
  EXPECT_EQ(batch_splits(12), (Splits{{1, 12}, {2, 6}, {4, 3}, {12, 1}}));
  EXPECT_TRUE(batch_splits(0).empty());
}

}  // namespace
}  // namespace strata::profile
