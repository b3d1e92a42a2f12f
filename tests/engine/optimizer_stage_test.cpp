// The optimizer stage's order within a pass over NVMe-resident state: the jobs it holds are
// stepped by step, and within a step in the next forward's order.
#include "engine/optimizer_stage.h"

#include <gtest/gtest.h>

#include <vector>

namespace strata::engine_internal {
namespace {

OptimizerJob early_update(int64_t step, int group, int forward_position) {
  OptimizerJob job;
  job.step_index = step;
  job.order = {group};
  job.forward_position = forward_position;
  return job;
}

std::vector<int> groups_of(const std::vector<OptimizerJob>& jobs) {
  std::vector<int> groups;
  for (const OptimizerJob& job : jobs) groups.insert(groups.end(), job.order.begin(), job.order.end());
  return groups;
}

TEST(OptimizerStageTest, EarlyUpdatesQueuedInLandingOrderAreSteppedInTheNextForwardsOrder) {
  // Backward lands group 5 first and group 0 (the first the next forward uses) last.
  std::vector<OptimizerJob> jobs;
  for (int g = 5; g >= 0; --g) jobs.push_back(early_update(3, g, g));
  order_for_the_next_forward(jobs);
  EXPECT_EQ(groups_of(jobs), (std::vector<int>{0, 1, 2, 3, 4, 5}));
}

TEST(OptimizerStageTest, TheForwardsOrderIsTheScheduleNotTheGroupNumbers) {
  // A schedule that uses group 4 first (an embedding declared last, say).
  const int position_of_group[] = {1, 2, 3, 4, 0};
  std::vector<OptimizerJob> jobs;
  for (int g = 0; g < 5; ++g) jobs.push_back(early_update(0, g, position_of_group[g]));
  order_for_the_next_forward(jobs);
  EXPECT_EQ(groups_of(jobs), (std::vector<int>{4, 0, 1, 2, 3}));
}

TEST(OptimizerStageTest, AnEarlierStepsJobsComeFirstWhateverTheirPositions) {
  std::vector<OptimizerJob> jobs = {early_update(8, 0, 0), early_update(7, 3, 3), early_update(8, 2, 2), early_update(7, 1, 1)};
  order_for_the_next_forward(jobs);
  EXPECT_EQ(groups_of(jobs), (std::vector<int>{1, 3, 0, 2}));
  EXPECT_EQ(jobs[0].step_index, 7);
  EXPECT_EQ(jobs[3].step_index, 8);
}

TEST(OptimizerStageTest, WholeStepJobsKeepTheirOrder) {
  // Jobs of equal position (plan_update's whole-step jobs carry 0) are not reordered.
  OptimizerJob first;
  first.step_index = 2;
  first.order = {0, 1, 2};
  OptimizerJob second = first;
  second.order = {3, 4};
  std::vector<OptimizerJob> jobs = {first, second};
  order_for_the_next_forward(jobs);
  EXPECT_EQ(groups_of(jobs), (std::vector<int>{0, 1, 2, 3, 4}));
}

}  // namespace
}  // namespace strata::engine_internal
