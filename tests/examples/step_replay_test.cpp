// The schedule's replay (examples/profile/step_replay) at hand-computed cases: a group
// that is first in forward and last in backward puts its whole update between two steps
// in exact overlap and none in delayed; fetches ahead of the compute overlap it; fetches
// share the disk with the updates' traffic; an update streams its state through the ring,
// so its reads and writes go both ways at once only where the ring has chunks of both in
// flight; on the CPU device the compute and the host's stages share the
// cores (each stage then in flight longer than its work), on a GPU the landing pass and
// Adam take turns on CPU Adam's executor; a gradient is cast before its copy to the host.
#include "examples/profile/step_replay.h"

#include <gtest/gtest.h>

namespace strata::profile {
namespace {

double seconds(const StepWork& w, const PipelineShape& shape, const ReplayRates& r) { return replay_step(w, shape, r).step_seconds; }

// One group, used once forward and once backward, its update 1 s of reads and 1 s of
// writes. Its parameters live on NVMe (a fetch of one 4 KiB block, 4.096 us), so the next
// forward waits for the update's writes.
constexpr double kFetch = 4096 / 1e9;
StepWork one_group_on_nvme() {
  StepWork w;
  w.groups = {{.numel = 1, .fetch_read_bytes = 4096, .trainable = true, .update_read_bytes = 1e9, .update_write_bytes = 2e9}};
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
  EXPECT_NEAR(seconds(one_group_on_nvme(), shape, rates(1.0, 1.0)), 4.0 + kFetch, 1e-9);
}

TEST(StepReplay, InDelayedOverlapTheUpdateRunsBesideTheNextStep) {
  PipelineShape shape;
  shape.overlap = OverlapMode::kDelayed;
  // (Within the fetches' microseconds, which the disk shares with the update.)
  EXPECT_NEAR(seconds(one_group_on_nvme(), shape, rates(1.0, 1.0)), 2.0, 1e-4);
  // An update longer than a step: the disk sets the pace.
  EXPECT_NEAR(seconds(one_group_on_nvme(), shape, rates(0.5, 0.5)), 2.0, 1e-4);
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

// An update of one chunk reads its state before it writes it back, whatever the disk's
// mixed rate: 1 s of reads, then 1 s of writes, after the 2 s of compute.
TEST(StepReplay, AnUpdateOfOneChunkReadsItsStateBeforeWritingIt) {
  PipelineShape shape;
  shape.overlap = OverlapMode::kExact;
  shape.adam_during_backward = true;
  ReplayRates mixed = rates(1.0, 1.0);
  mixed.disk_mixed_bytes_per_s = 3e9;
  StepWork w = one_group_on_nvme();
  w.groups[0].update_pieces = 1;
  EXPECT_NEAR(seconds(w, shape, mixed), 4.0 + kFetch, 1e-9);
}

// One group whose parameters live on NVMe, its update four chunks through a ring of three
// slots, each chunk 1 s of reads and 1 s of writes alone, each direction at 0.8 of its pace
// beside the other (mixed 1.6e9 B/s against 1e9 each way). After the 2 s of compute: chunk
// 0 is read alone (1 s), then each next chunk's read beside the last one's write (3 x 1.25
// s), then the last write alone (1 s): 5.75 s where one direction after the other takes 8.
// The next forward fetches the new parameters (a negligible read) once they are written.
TEST(StepReplay, AnUpdateOfManyChunksReadsAheadWhileEarlierChunksAreWritten) {
  StepWork w;
  w.groups = {{.numel = 1, .fetch_read_bytes = 1, .trainable = true, .update_read_bytes = 4e9, .update_write_bytes = 4e9,
               .update_pieces = 4}};
  w.uses = {0, 0};
  PipelineShape shape;
  shape.overlap = OverlapMode::kExact;
  shape.adam_during_backward = true;
  shape.prefetch_depth = 0;
  ReplayRates r = rates(1.0, 1.0);
  r.disk_write_bytes_per_s = 1e9;
  r.disk_mixed_bytes_per_s = 1.6e9;
  const ReplayResult ring = replay_step(w, shape, r);
  EXPECT_NEAR(ring.step_seconds, 2.0 + 5.75, 1e-6);
  EXPECT_NEAR(ring.in_flight[static_cast<size_t>(Stage::kNvmeWrite)], 1.25 * 3 + 1.0, 1e-6);
  w.groups[0].update_pieces = 1;  // one chunk: no overlap
  EXPECT_NEAR(seconds(w, shape, r), 2.0 + 8.0, 1e-6);
}

// Two groups with their state on NVMe, one chunk each (1 s of reads, 1 s of writes, each
// direction at 0.8 of its pace beside the other), used forward as 0 then 1 and backward as
// 1 then 0; group 0 has three times group 1's parameters, so of the 2 s of forward and of
// backward it computes 1.5 s and group 1 0.5 s. In exact overlap each update runs as its
// gradient lands, in a call of its own. Group 1's update finds the executor idle since
// group 0's stepped (at its Adam, 1 s after it landed): the executor has flushed the
// ring, so its read waits for group 0's write-back; group 0's update, landing 1.5 s after
// group 1's, finds it stepped 0.5 s before and waits for its write too. So a step is
// group 0's forward (1.5), group 1's (0.5), then 0.5 of backward, group 1's update (its
// read 1 s after group 0's write, its write 1 s), group 0's (1 s of read after it): 5.5 s.
// Were the calls back to back, group 0's read would overlap group 1's write from the end
// of the backward.
TEST(StepReplay, AnIdleExecutorFlushesTheRingsWriteBacksBeforeItsNextCall) {
  StepWork w;
  w.groups = {{.numel = 3, .trainable = true, .update_read_bytes = 1e9, .update_write_bytes = 1e9, .update_pieces = 1},
              {.numel = 1, .trainable = true, .update_read_bytes = 1e9, .update_write_bytes = 1e9, .update_pieces = 1}};
  w.uses = {0, 1, 1, 0};
  PipelineShape shape;
  shape.overlap = OverlapMode::kExact;
  shape.adam_during_backward = true;
  ReplayRates r = rates(2.0, 2.0);
  r.disk_write_bytes_per_s = 1e9;
  r.disk_mixed_bytes_per_s = 1.6e9;
  EXPECT_NEAR(seconds(w, shape, r), 5.5, 1e-9);
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
