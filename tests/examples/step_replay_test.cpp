// The schedule's replay (examples/profile/step_replay) at hand-computed cases: a group
// that is first in forward and last in backward puts its whole update between two steps
// in exact overlap and none in delayed; fetches ahead of the compute overlap it; fetches
// share the disk with the updates' traffic, and an update's reads and writes go both ways
// at once at the mixed rate; on the CPU device the compute and the host's stages share the
// cores (each stage then in flight longer than its work), on a GPU the landing pass and
// Adam take turns on CPU Adam's executor; a gradient is cast before its copy to the host.
#include "examples/profile/step_replay.h"

#include <gtest/gtest.h>

namespace strata::profile {
namespace {

double seconds(const StepWork& w, const PipelineShape& shape, const ReplayRates& r) { return replay_step(w, shape, r).step_seconds; }

// One group, used once forward and once backward, its update 1 s of reads and 1 s of writes.
StepWork one_group_on_nvme() {
  StepWork w;
  w.groups = {{.numel = 1, .trainable = true, .update_read_bytes = 1e9, .update_write_bytes = 2e9}};
  w.uses = {0, 0};
  return w;
}

ReplayRates rates(double forward_s, double backward_s) {
  return {.disk_read_bytes_per_s = 1e9, .disk_write_bytes_per_s = 2e9, .h2d_bytes_per_s = 1e9, .d2h_bytes_per_s = 1e9,
          .landing_bytes_per_s = 1e9, .adam_elements_per_s = 1e9, .forward_seconds = forward_s, .backward_seconds = backward_s};
}

TEST(StepReplay, InExactOverlapTheNextForwardWaitsForTheWholeUpdate) {
  PipelineShape shape;
  shape.overlap = OverlapMode::kExact;
  shape.adam_during_backward = true;
  // forward 1 s, backward 1 s, then the update's 2 s of disk before the next forward.
  EXPECT_DOUBLE_EQ(seconds(one_group_on_nvme(), shape, rates(1.0, 1.0)), 4.0);
}

TEST(StepReplay, InDelayedOverlapTheUpdateRunsBesideTheNextStep) {
  PipelineShape shape;
  shape.overlap = OverlapMode::kDelayed;
  EXPECT_DOUBLE_EQ(seconds(one_group_on_nvme(), shape, rates(1.0, 1.0)), 2.0);
  // An update longer than a step: the disk sets the pace.
  EXPECT_DOUBLE_EQ(seconds(one_group_on_nvme(), shape, rates(0.5, 0.5)), 2.0);
}

// Four groups used forward then backward, each fetch 0.5 s of NVMe read, each use 1 s of compute.
StepWork four_fetched_groups() {
  StepWork w;
  for (int g = 0; g < 4; ++g) w.groups.push_back({.numel = 1, .fetch_read_bytes = 0.5e9});
  w.uses = {0, 1, 2, 3, 3, 2, 1, 0};
  return w;
}

TEST(StepReplay, FetchesAheadOfTheComputeOverlapIt) {
  PipelineShape serial;
  serial.prefetch_depth = 0;  // each fetch after the use before it: 8 x (0.5 + 1) s
  EXPECT_DOUBLE_EQ(seconds(four_fetched_groups(), serial, rates(4.0, 4.0)), 12.0);
  PipelineShape ahead;
  ahead.prefetch_depth = 2;  // every fetch hidden but the step's first
  EXPECT_DOUBLE_EQ(seconds(four_fetched_groups(), ahead, rates(4.0, 4.0)), 8.0);
}

TEST(StepReplay, FetchesShareTheDiskWithTheUpdatesTrafficInsteadOfWaitingForIt) {
  StepWork w = four_fetched_groups();
  for (GroupWork& g : w.groups) {
    g.trainable = true;
    g.update_read_bytes = 2e9;  // 2 s each on the disk, queued as each backward ends
  }
  PipelineShape shape;
  shape.prefetch_depth = 0;  // every fetch on the path: 12 s without the updates (above)
  shape.overlap = OverlapMode::kDelayed;
  const double step = seconds(w, shape, rates(4.0, 4.0));
  // The step's 8 s of update reads queue as it ends and run beside the next step's fetches:
  // while both are on the disk each goes at half speed, so each fetch takes 1 s and each
  // fetch-and-compute moves the updates 1.5 s on. The first 6 fetches share the disk, 0.5 s
  // more each, where waiting for whole updates would cost 8 s.
  EXPECT_DOUBLE_EQ(step, 15.0);
}

TEST(StepReplay, OnTheCpuDeviceComputeAndAdamTakeTurnsOnTheCores) {
  StepWork w;
  for (int g = 0; g < 2; ++g) w.groups.push_back({.numel = 1, .trainable = true, .adam_elements = 1e9});  // 1 s of Adam each
  w.uses = {0, 1, 1, 0};
  PipelineShape shape;
  shape.overlap = OverlapMode::kDelayed;
  ReplayRates own = rates(2.0, 2.0);
  EXPECT_DOUBLE_EQ(seconds(w, shape, own), 4.0);  // Adam beside the compute
  ReplayRates shared = own;
  shared.host_cores = 1;
  EXPECT_DOUBLE_EQ(seconds(w, shape, shared), 6.0);  // after it
}

// Two cores: the compute wants both, Adam one thread. While Adam runs beside the compute
// each goes at 2/3 of its pace: Adam's 2 s a step take 3 s, in which the compute does 2 of
// its 4 s; the step is 5 s, and the stages are in flight 5 s and 3 s.
TEST(StepReplay, OnTheCpuDeviceAStageSharingTheCoresIsInFlightLongerThanItsWork) {
  StepWork w;
  for (int g = 0; g < 2; ++g) w.groups.push_back({.numel = 1, .trainable = true, .adam_elements = 1e9});
  w.uses = {0, 1, 1, 0};
  PipelineShape shape;
  shape.overlap = OverlapMode::kDelayed;
  ReplayRates two_cores = rates(2.0, 2.0);
  two_cores.host_cores = 2;
  two_cores.adam_threads = 1;
  const ReplayResult one_thread = replay_step(w, shape, two_cores);
  EXPECT_DOUBLE_EQ(one_thread.step_seconds, 5.0);
  EXPECT_DOUBLE_EQ(one_thread.in_flight[static_cast<size_t>(Stage::kCompute)], 5.0);
  EXPECT_DOUBLE_EQ(one_thread.in_flight[static_cast<size_t>(Stage::kOptimizer)], 3.0);
  two_cores.adam_threads = 2;  // Adam on both cores: 4 wanted, each at half its pace
  const ReplayResult both = replay_step(w, shape, two_cores);
  EXPECT_DOUBLE_EQ(both.step_seconds, 6.0);
  EXPECT_DOUBLE_EQ(both.in_flight[static_cast<size_t>(Stage::kOptimizer)], 4.0);
}

// The gradient's cast (the reduce stream's) comes before its copy to the host, the landing
// and the update: 1 s each after a 1 s backward, in exact overlap with Adam during the
// backward, so the next forward waits for all of them.
TEST(StepReplay, AGradientIsCastBeforeItsCopyToTheHost) {
  StepWork w;
  w.groups = {{.numel = 1, .trainable = true, .gradient_cast_bytes = 1e9, .gradient_out_bytes = 1e9, .landing_bytes = 1e9,
               .adam_elements = 1e9}};
  w.uses = {0, 0};
  PipelineShape shape;
  shape.overlap = OverlapMode::kExact;
  shape.adam_during_backward = true;
  ReplayRates r = rates(1.0, 1.0);
  r.cast_bytes_per_s = 1e9;
  const ReplayResult replay = replay_step(w, shape, r);
  EXPECT_DOUBLE_EQ(replay.step_seconds, 6.0);
  EXPECT_DOUBLE_EQ(replay.in_flight[static_cast<size_t>(Stage::kReduceScatter)], 1.0);
  EXPECT_DOUBLE_EQ(replay.in_flight[static_cast<size_t>(Stage::kD2H)], 1.0);
  r.cast_bytes_per_s = 0;  // no rate for the cast: not priced
  EXPECT_DOUBLE_EQ(seconds(w, shape, r), 5.0);
}

// An update that reads and writes its state keeps the disk busy both ways at once: with a
// mixed rate of 3e9 B/s the 1e9 bytes each way move together in 2/3 s and the other 1e9
// written bytes alone in 0.5 s, not 1 s of reads and then 1 s of writes.
// With checksums on the CPU device, each fetched shard is verified on the cores before its
// compute: 8 x (0.5 s read + 0.5 s verify + 1 s compute), where the verify cannot overlap
// the compute that waits for it.
TEST(StepReplay, OnTheCpuDeviceAReadIsVerifiedOnTheCoresBeforeItsBytesAreUsed) {
  PipelineShape serial;
  serial.prefetch_depth = 0;
  ReplayRates hashing = rates(4.0, 4.0);
  hashing.host_cores = 1;
  hashing.checksum_bytes_per_s = 1e9;
  EXPECT_DOUBLE_EQ(seconds(four_fetched_groups(), serial, hashing), 16.0);
  hashing.checksum_bytes_per_s = 0;  // not priced
  EXPECT_DOUBLE_EQ(seconds(four_fetched_groups(), serial, hashing), 12.0);
}

TEST(StepReplay, AnUpdateReadingAndWritingMovesBothWaysAtTheMixedRate) {
  PipelineShape shape;
  shape.overlap = OverlapMode::kExact;
  shape.adam_during_backward = true;
  ReplayRates mixed = rates(1.0, 1.0);
  mixed.disk_mixed_bytes_per_s = 3e9;
  EXPECT_DOUBLE_EQ(seconds(one_group_on_nvme(), shape, mixed), 2.0 + 2.0 / 3.0 + 0.5);
}

// On a GPU the landing pass runs on CPU Adam's executor: 1.5 s of landing and 1.5 s of
// Adam per group are 6 s of executor work a step, over the 4 s of compute.
TEST(StepReplay, OnAGpuTheLandingAndAdamTakeTurnsOnCpuAdamsExecutor) {
  StepWork w;
  for (int g = 0; g < 2; ++g)
    w.groups.push_back({.numel = 1, .trainable = true, .landing_bytes = 1.5e9, .adam_elements = 1.5e9});
  w.uses = {0, 1, 1, 0};
  PipelineShape shape;
  shape.overlap = OverlapMode::kDelayed;
  const double shared = seconds(w, shape, rates(2.0, 2.0));
  EXPECT_DOUBLE_EQ(shared, 6.0);  // the executor sets the pace
  shape.adam_on_device = true;  // Adam on the GPU: the landing has the executor to itself
  EXPECT_DOUBLE_EQ(seconds(w, shape, rates(2.0, 2.0)), 4.0);
}

TEST(StepReplay, WithoutAScheduleAGroupOrARateItNeedsThereIsNoReplay) {
  EXPECT_DOUBLE_EQ(seconds(StepWork{}, PipelineShape{}, rates(1.0, 1.0)), 0.0);
  ReplayRates no_disk = rates(1.0, 1.0);
  no_disk.disk_read_bytes_per_s = 0;
  EXPECT_DOUBLE_EQ(seconds(one_group_on_nvme(), PipelineShape{}, no_disk), 0.0);
  StepWork stray = one_group_on_nvme();
  stray.uses = {0, 1};  // group 1 does not exist
  EXPECT_DOUBLE_EQ(seconds(stray, PipelineShape{}, rates(1.0, 1.0)), 0.0);
}

}  // namespace
}  // namespace strata::profile
