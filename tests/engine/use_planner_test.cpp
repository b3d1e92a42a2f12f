// The use planner on its own, with a fetch issuer that records what it is asked: a
// schedule recorded on the first micro-batch and replayed with prefetch_depth slot uses
// planned ahead, never past the next step; a deviation abandons what was planned and
// records again; forward-only passes plan along their order and on demand after leaving
// it; uses that take no slot cost no depth.
#include "engine/use_planner.h"

#include <gtest/gtest.h>

#include <set>
#include <vector>

namespace strata::engine_internal {
namespace {

struct Fetch {
  int group;
  int64_t step;
  int64_t version;
  bool operator==(const Fetch&) const = default;
};

class RecordingIssuer : public FetchIssuer {
 public:
  uint64_t plan_fetch(int group, int64_t step, int64_t version) override {
    fetches.push_back({group, step, version});
    return fetches.size();
  }
  void abandon(uint64_t request) override { abandoned.insert(request); }
  bool takes_slot(int group) const override { return slotless.count(group) == 0; }

  std::vector<Fetch> fetches;       // request id i + 1 is fetches[i]
  std::set<uint64_t> abandoned;
  std::set<int> slotless;
};

// Runs one micro-batch of gathers and returns the request ids they got.
std::vector<uint64_t> run_micro_batch(UsePlanner& planner, const std::vector<int>& gathers, int64_t step, int micro) {
  planner.begin_micro_batch(step, micro);
  std::vector<uint64_t> requests;
  for (int g : gathers) requests.push_back(planner.next_gather(g, step, micro));
  return requests;
}

const std::vector<int> kSchedule = {0, 1, 2, 2, 1, 0};  // forward, then backward

TEST(UsePlannerTest, TheFirstMicroBatchIsRecordedOnDemandThenReplayedAhead) {
  RecordingIssuer issuer;
  UsePlanner planner({.prefetch_depth = 2, .micro_batches = 1}, issuer);
  const auto first = run_micro_batch(planner, kSchedule, 0, 0);
  EXPECT_EQ(first, (std::vector<uint64_t>{1, 2, 3, 4, 5, 6})) << "on demand, one fetch per gather";
  EXPECT_FALSE(planner.schedule_known());
  planner.begin_micro_batch(1, 0);
  EXPECT_TRUE(planner.schedule_known());
  EXPECT_EQ(planner.schedule(), kSchedule);
  // The first gather of step 1 plans it and `depth` uses beyond it.
  const uint64_t request = planner.next_gather(0, 1, 0);
  EXPECT_EQ(issuer.fetches[request - 1], (Fetch{0, 1, 1}));
  EXPECT_EQ(planner.planned_ahead(), 2u);
  for (size_t i = 1; i < kSchedule.size(); ++i) planner.next_gather(kSchedule[i], 1, 0);
  EXPECT_TRUE(issuer.abandoned.empty());
  // Never planned past the next step.
  for (const Fetch& fetch : issuer.fetches) EXPECT_LE(fetch.step, 2);
}

TEST(UsePlannerTest, ADeclaredScheduleIsFollowedFromTheFirstGatherAndSpansMicroBatches) {
  RecordingIssuer issuer;
  UsePlanner planner({.prefetch_depth = 3, .micro_batches = 2}, issuer);
  planner.declare(kSchedule);
  std::vector<uint64_t> requests = run_micro_batch(planner, kSchedule, 0, 0);
  const auto second = run_micro_batch(planner, kSchedule, 0, 1);
  requests.insert(requests.end(), second.begin(), second.end());
  // Every gather got a distinct planned fetch of its own group, in program order.
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_GT(requests[i], 0u);
    EXPECT_EQ(issuer.fetches[requests[i] - 1].group, kSchedule[i % kSchedule.size()]);
    if (i > 0) {
      EXPECT_GT(requests[i], requests[i - 1]);
    }
  }
  EXPECT_TRUE(issuer.abandoned.empty());
}

TEST(UsePlannerTest, ADeviationAbandonsThePlannedUsesAndRecordsAgain) {
  RecordingIssuer issuer;
  UsePlanner planner({.prefetch_depth = 2, .micro_batches = 1}, issuer);
  planner.declare(kSchedule);
  planner.begin_micro_batch(0, 0);
  planner.next_gather(0, 0, 0);
  const size_t planned = planner.planned_ahead();
  ASSERT_GT(planned, 0u);
  const uint64_t off_schedule = planner.next_gather(2, 0, 0);  // the schedule said 1
  EXPECT_EQ(issuer.abandoned.size(), planned);
  EXPECT_EQ(issuer.fetches[off_schedule - 1].group, 2) << "fetched on demand";
  EXPECT_FALSE(planner.schedule_known());
  // The next micro-batch is recorded and becomes the schedule.
  const std::vector<int> other = {0, 2, 2, 0};
  run_micro_batch(planner, other, 1, 0);
  planner.begin_micro_batch(2, 0);
  EXPECT_EQ(planner.schedule(), other);
}

TEST(UsePlannerTest, UsesWithoutASlotCostNoDepth) {
  RecordingIssuer issuer;
  issuer.slotless = {1};  // a persistent group
  UsePlanner planner({.prefetch_depth = 1, .micro_batches = 1}, issuer);
  planner.declare({0, 1, 1, 1, 2});
  planner.begin_micro_batch(0, 0);
  planner.next_gather(0, 0, 0);
  // Depth 1: the next slot use (group 2) is planned, with the three slotless uses between.
  EXPECT_EQ(planner.planned_ahead(), 4u);
  EXPECT_EQ(issuer.fetches.back().group, 2);
}

TEST(UsePlannerTest, DelayedOverlapFetchesTheVersionOneUpdateBehind) {
  RecordingIssuer issuer;
  UsePlanner planner({.prefetch_depth = 1, .micro_batches = 1, .overlap = OverlapMode::kDelayed}, issuer);
  planner.declare({0});
  for (int64_t step = 0; step < 3; ++step) run_micro_batch(planner, {0}, step, 0);
  for (const Fetch& fetch : issuer.fetches) EXPECT_EQ(fetch.version, std::max<int64_t>(0, fetch.step - 1));
  EXPECT_EQ(planner.step_version(0), 0);
  EXPECT_EQ(planner.step_version(5), 4);
}

TEST(UsePlannerTest, AForwardPassFollowsItsOrderThenGoesOnDemandAfterLeavingIt) {
  RecordingIssuer issuer;
  UsePlanner planner({.prefetch_depth = 2, .micro_batches = 1}, issuer);
  planner.declare(kSchedule);
  run_micro_batch(planner, kSchedule, 0, 0);
  const size_t before = issuer.fetches.size();
  const size_t planned_for_next_step = planner.planned_ahead();
  const std::vector<int> order = {2, 1, 0};
  planner.begin_forward(order, 1);
  EXPECT_EQ(issuer.abandoned.size(), planned_for_next_step) << "the next step's fetches are dropped";
  EXPECT_EQ(planner.planned_ahead(), 2u);
  const uint64_t first = planner.next_forward_gather(2, 1);
  EXPECT_EQ(issuer.fetches[first - 1], (Fetch{2, 1, 1})) << "a pass sees every update taken";
  EXPECT_GT(first, before);
  const uint64_t off = planner.next_forward_gather(0, 1);  // the order said 1
  EXPECT_EQ(issuer.fetches[off - 1].group, 0);
  EXPECT_EQ(planner.planned_ahead(), 0u);
  EXPECT_GT(planner.next_forward_gather(1, 1), off) << "on demand from here";
  planner.end_forward(1);
  // The step after the pass plans from its first use again.
  planner.begin_micro_batch(1, 0);
  const uint64_t resumed = planner.next_gather(0, 1, 0);
  EXPECT_EQ(issuer.fetches[resumed - 1], (Fetch{0, 1, 1}));
}

}  // namespace
}  // namespace strata::engine_internal
