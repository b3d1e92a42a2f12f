// The lanes under the step's replay (examples/profile/shared_lanes) at hand-computed
// cases: a lane runs one job at a time in the order its jobs became ready, a job waits for
// the jobs it names, jobs on the disk share its time equally (with the gain of mixed
// traffic while reads and writes run together), and jobs that want more host cores than there
// are share them in proportion.
#include "examples/profile/shared_lanes.h"

#include <gtest/gtest.h>

namespace strata::profile {
namespace {

TEST(SharedLanes, ALaneRunsItsJobsOneAtATimeInTheOrderTheyBecameReady) {
  SharedLanes lanes(2, 0);
  const int slow = lanes.add({.lane = 1, .seconds = 3});
  const int waits = lanes.add({.lane = 0, .seconds = 1, .after = {slow}});  // ready at 3
  const int free = lanes.add({.lane = 0, .seconds = 2});                    // ready at 0, added later
  const auto spans = lanes.run();
  EXPECT_DOUBLE_EQ(spans[free].start, 0.0);
  EXPECT_DOUBLE_EQ(spans[free].end, 2.0);
  EXPECT_DOUBLE_EQ(spans[waits].start, 3.0);
  EXPECT_DOUBLE_EQ(spans[waits].end, 4.0);
}

TEST(SharedLanes, JobsOnTheDiskShareItEqually) {
  SharedLanes lanes(2, 0);
  const int a = lanes.add({.lane = 0, .seconds = 1, .disk = DiskUse::kRead});
  const int b = lanes.add({.lane = 1, .seconds = 2, .disk = DiskUse::kRead});
  const auto spans = lanes.run();
  EXPECT_DOUBLE_EQ(spans[a].end, 2.0);  // half its pace while b runs
  EXPECT_DOUBLE_EQ(spans[b].end, 3.0);  // 1 s of its work beside a, then 1 s alone
}

// A disk that reads at 1 GB/s and writes at 2 GB/s alone, so 1.5 GB/s taking turns, and
// moves 2.4 GB/s both ways together: mixed traffic gains 1.6x. A read and a write then go
// at 0.8 of their pace each; two reads, or a read without the gain, at half.
TEST(SharedLanes, WhileReadsAndWritesBothRunTheDiskGainsItsMixedRate) {
  const DiskSharing mixed = DiskSharing::from_rates(1e9, 2e9, 2.4e9);
  EXPECT_DOUBLE_EQ(mixed.mixed_gain, 1.6);
  SharedLanes lanes(3, 0, mixed);
  const int read = lanes.add({.lane = 0, .seconds = 1, .disk = DiskUse::kRead});
  const int write = lanes.add({.lane = 1, .seconds = 2, .disk = DiskUse::kWrite});
  const auto spans = lanes.run();
  EXPECT_DOUBLE_EQ(spans[read].end, 1.25);    // at 0.8 of its pace
  EXPECT_DOUBLE_EQ(spans[write].end, 2.25);   // 1 s of its work beside the read, 1 s alone
  SharedLanes unmeasured(3, 0);               // no mixed figure: each at 1/2
  unmeasured.add({.lane = 0, .seconds = 1, .disk = DiskUse::kRead});
  unmeasured.add({.lane = 1, .seconds = 1, .disk = DiskUse::kWrite});
  EXPECT_DOUBLE_EQ(unmeasured.run()[0].end, 2.0);
  SharedLanes two_reads(3, 0, mixed);         // one direction: no gain
  two_reads.add({.lane = 0, .seconds = 1, .disk = DiskUse::kRead});
  two_reads.add({.lane = 1, .seconds = 1, .disk = DiskUse::kRead});
  EXPECT_DOUBLE_EQ(two_reads.run()[0].end, 2.0);
  SharedLanes fast(3, 0, {.mixed_gain = 3.0});  // never faster than alone
  const int alone = fast.add({.lane = 0, .seconds = 1, .disk = DiskUse::kRead});
  fast.add({.lane = 1, .seconds = 1, .disk = DiskUse::kWrite});
  EXPECT_DOUBLE_EQ(fast.run()[alone].end, 1.0);
  EXPECT_EQ(DiskSharing::from_rates(1e9, 2e9, 0).mixed_gain, 0.0);  // not measured
}

TEST(SharedLanes, JobsWantingMoreCoresThanTheHostHasShareThemInProportion) {
  SharedLanes lanes(3, 2);
  const int both = lanes.add({.lane = 0, .seconds = 3, .cores = 2});
  const int one = lanes.add({.lane = 1, .seconds = 2, .cores = 1});
  const auto spans = lanes.run();
  EXPECT_DOUBLE_EQ(spans[one].end, 3.0);   // 3 cores wanted of 2: 2/3 of its pace
  EXPECT_DOUBLE_EQ(spans[both].end, 4.0);  // 2 s of its work by then, the last 1 s alone
  SharedLanes gpu(3, 0);                   // no host cores shared: each at its own pace
  gpu.add({.lane = 0, .seconds = 3, .cores = 2});
  EXPECT_DOUBLE_EQ(gpu.run()[0].end, 3.0);
}

TEST(SharedLanes, AJobOfNoSecondsIsDoneWhenItStartsAndStillHoldsItsOrder) {
  SharedLanes lanes(1, 0);
  const int first = lanes.add({.lane = 0, .seconds = 1});
  const int nothing = lanes.add({.lane = 0, .seconds = 0, .after = {first}});
  const int last = lanes.add({.lane = 0, .seconds = 1, .after = {nothing}});
  const auto spans = lanes.run();
  EXPECT_DOUBLE_EQ(spans[nothing].start, 1.0);
  EXPECT_DOUBLE_EQ(spans[nothing].end, 1.0);
  EXPECT_DOUBLE_EQ(spans[last].end, 2.0);
}

TEST(SharedLanes, AJobCannotWaitForItselfOrALaterJob) {
  SharedLanes lanes(1, 0);
  const int job = lanes.add({.lane = 0, .seconds = 1, .after = {0, 5, -1}});
  EXPECT_TRUE(lanes.job(job).after.empty());
  EXPECT_DOUBLE_EQ(lanes.run()[job].end, 1.0);
}

TEST(SharedLanes, AStagesBusyTimeIsTheUnionOfItsJobsWithinTheWindow) {
  SharedLanes lanes(2, 0);
  lanes.add({.lane = 0, .seconds = 2, .stage = Stage::kNvmeRead});
  lanes.add({.lane = 1, .seconds = 3, .stage = Stage::kNvmeRead});  // overlaps the first
  lanes.add({.lane = 0, .seconds = 4, .stage = Stage::kCompute});   // 2 to 6
  const auto spans = lanes.run();
  const StageSeconds busy = busy_within(lanes, spans, 1.0, 5.0);
  EXPECT_DOUBLE_EQ(busy[static_cast<size_t>(Stage::kNvmeRead)], 2.0);  // 1 to 3
  EXPECT_DOUBLE_EQ(busy[static_cast<size_t>(Stage::kCompute)], 3.0);   // 2 to 5
  EXPECT_DOUBLE_EQ(busy[static_cast<size_t>(Stage::kD2H)], 0.0);
}

}  // namespace
}  // namespace strata::profile
