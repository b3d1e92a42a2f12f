// The step's cost model (examples/profile/step_cost, step_work) at hand-computed cases:
// each stage's seconds are its work over the profile's rate, the step is the longer of the
// busiest stage and the chain that cannot overlap (compute, the fill or every fetch with
// prefetch depth 0, the optimizer beyond the next forward in exact overlap), and the plan's
// bytes per stage follow the tiers.
#include "examples/profile/step_cost.h"

#include <gtest/gtest.h>

#include <vector>

#include "examples/profile/step_work.h"

namespace strata::profile {
namespace {

MachineProfile round_profile() {
  MachineProfile p;
  p.nvme = {{.block_bytes = 1 << 20, .queue_depth = 32, .checksums = true, .read_bytes_per_s = 2e9, .write_bytes_per_s = 1e9},
            {.block_bytes = 128 << 10, .queue_depth = 8, .checksums = true, .read_bytes_per_s = 1e9, .write_bytes_per_s = 0.5e9},
            {.block_bytes = 1 << 20, .queue_depth = 32, .checksums = false, .read_bytes_per_s = 4e9, .write_bytes_per_s = 2e9}};
  p.copy = {.host_copy = true, .pinned = true, .h2d_bytes_per_s = 1e10, .d2h_bytes_per_s = 5e9};
  p.cpu_adam = {{.threads = 1, .grad_dtype = "bf16", .param_dtype = "bf16", .elements_per_s = 0.5e8},
                {.threads = 2, .grad_dtype = "bf16", .param_dtype = "bf16", .elements_per_s = 1e8},
                {.threads = 2, .grad_dtype = "fp32", .param_dtype = "fp32", .elements_per_s = 2e8}};
  // A device whose compute and copies take no host core (the CPU device's shared cores
  // have their own test).
  p.compute = {.device = "cuda", .dtype = "fp32", .scale = 1, .gemm_flops_per_s = 1e11, .attention_flops_per_s = 5e10,
               .memory_bytes_per_s = 2.8e10, .kernels = {}};
  p.communicator = {.world = 1, .all_gather_bytes_per_s = std::nullopt, .reduce_scatter_bytes_per_s = std::nullopt, .why_none = "world 1"};
  return p;
}

// 1 s of forward and 2 s of backward GEMMs.
StepWork three_seconds_of_compute() {
  StepWork w;
  w.forward_matmul_flops = 1e11;
  w.backward_matmul_flops = 2e11;
  return w;
}

double busy(const StepPrediction& p, Stage stage) { return p.busy[static_cast<size_t>(stage)]; }

TEST(StepCost, ComputeAloneIsTheStepAndBoundsIt) {
  auto p = predict_step(three_seconds_of_compute(), PipelineShape{}, round_profile());
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_DOUBLE_EQ(busy(*p, Stage::kCompute), 3.0);
  EXPECT_DOUBLE_EQ(p->step_seconds, 3.0);
  EXPECT_EQ(p->bound, "compute");
  EXPECT_TRUE(p->unknown.empty());
}

TEST(StepCost, ExactOverlapAddsTheOptimizerBeyondTheNextForward) {
  StepWork w = three_seconds_of_compute();
  w.adam_elements = 5e8;  // 5 s at 1e8 elements/s (bf16, the most threads)
  auto p = predict_step(w, PipelineShape{}, round_profile());
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(busy(*p, Stage::kOptimizer), 5.0);
  EXPECT_DOUBLE_EQ(p->pipeline_seconds, 5.0);
  EXPECT_DOUBLE_EQ(p->chain_seconds, 3.0 + (5.0 - 1.0));
  EXPECT_DOUBLE_EQ(p->step_seconds, 7.0);
  EXPECT_NE(p->bound.find("optimizer"), std::string::npos);
  EXPECT_EQ(p->bound.rfind("chain", 0), 0u);
}

TEST(StepCost, DelayedOverlapIsBoundByTheBusiestStage) {
  StepWork w = three_seconds_of_compute();
  w.adam_elements = 5e8;
  PipelineShape shape;
  shape.overlap = OverlapMode::kDelayed;
  auto p = predict_step(w, shape, round_profile());
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->step_seconds, 5.0);
  EXPECT_EQ(p->bound, "optimizer");
}

TEST(StepCost, AdamDuringBackwardOverlapsTheLastBackwardToo) {
  StepWork w = three_seconds_of_compute();
  w.adam_elements = 5e8;
  PipelineShape shape;
  shape.adam_during_backward = true;
  auto p = predict_step(w, shape, round_profile());
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->chain_seconds, 3.0 + (5.0 - 3.0));
  EXPECT_DOUBLE_EQ(p->step_seconds, 5.0);
  EXPECT_EQ(p->bound, "optimizer");
}

TEST(StepCost, MicroBatchesShrinkTheForwardTheOptimizerOverlaps) {
  StepWork w = three_seconds_of_compute();
  w.adam_elements = 2e8;  // 2 s
  PipelineShape shape;
  shape.micro_batches = 2;  // the next step's first forward is 0.5 s
  auto p = predict_step(w, shape, round_profile());
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->chain_seconds, 3.0 + 1.5);
}

TEST(StepCost, PrefetchDepthZeroSerializesEveryFetchWithCompute) {
  StepWork w = three_seconds_of_compute();
  w.param_read_bytes = 2e9;  // 1 s at 2 GB/s (1 MiB QD32, checksums on)
  w.h2d_bytes = 1e10;        // 1 s at 10 GB/s
  w.fetching_gathers = 4;
  PipelineShape shape;
  shape.prefetch_depth = 0;
  auto serial = predict_step(w, shape, round_profile());
  ASSERT_TRUE(serial.ok());
  EXPECT_DOUBLE_EQ(serial->chain_seconds, 5.0);
  EXPECT_DOUBLE_EQ(serial->step_seconds, 5.0);
  EXPECT_NE(serial->bound.find("prefetch depth 0"), std::string::npos);
  shape.prefetch_depth = 2;
  auto overlapped = predict_step(w, shape, round_profile());
  ASSERT_TRUE(overlapped.ok());
  EXPECT_DOUBLE_EQ(overlapped->chain_seconds, 3.0 + 2.0 / 4);  // the fill: one gather's fetch
  EXPECT_DOUBLE_EQ(overlapped->step_seconds, 3.5);
}

TEST(StepCost, UploadingNewParametersIsNotAFetchTheChainWaitsFor) {
  StepWork w = three_seconds_of_compute();
  w.h2d_update_bytes = 1e10;  // 1 s
  PipelineShape shape;
  shape.prefetch_depth = 0;
  MachineProfile gpu = round_profile();
  gpu.copy.host_copy = false;  // a real copy to a GPU
  auto p = predict_step(w, shape, gpu);
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(busy(*p, Stage::kH2D), 1.0);
  EXPECT_DOUBLE_EQ(p->chain_seconds, 3.0);
}

// With one gradient buffer the backward waits for each group's gradients to leave: their
// copy to the host is on the chain, not beside it.
TEST(StepCost, OneGradientBufferPutsTheGradientCopiesOnTheChain) {
  StepWork w = three_seconds_of_compute();
  w.d2h_bytes = 5e9;  // 1 s at 5 GB/s
  PipelineShape shape;
  auto two = predict_step(w, shape, round_profile());
  ASSERT_TRUE(two.ok());
  EXPECT_DOUBLE_EQ(two->chain_seconds, 3.0);
  shape.single_gradient_buffer = true;
  auto one = predict_step(w, shape, round_profile());
  ASSERT_TRUE(one.ok());
  EXPECT_DOUBLE_EQ(one->chain_seconds, 4.0);
  EXPECT_NE(one->bound.find("one gradient buffer"), std::string::npos) << one->bound;
}

// The CPU device's memory is the host's: CPU Adam writes its parameters in place.
TEST(StepCost, OnTheCpuDeviceNewParametersCostNoCopy) {
  StepWork w = three_seconds_of_compute();
  w.h2d_update_bytes = 1e10;
  MachineProfile cpu = round_profile();
  cpu.copy.host_copy = true;
  auto p = predict_step(w, PipelineShape{}, cpu);
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(busy(*p, Stage::kH2D), 0.0);
}

TEST(StepCost, TheDiskBoundsADiskHeavyStepByItsReadsAndWritesTogether) {
  StepWork w = three_seconds_of_compute();
  w.state_read_bytes = 8e9;   // 4 s
  w.state_write_bytes = 4e9;  // 4 s
  PipelineShape shape;
  shape.overlap = OverlapMode::kDelayed;
  auto p = predict_step(w, shape, round_profile());
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(busy(*p, Stage::kNvmeRead), 4.0);
  EXPECT_DOUBLE_EQ(busy(*p, Stage::kNvmeWrite), 4.0);
  EXPECT_DOUBLE_EQ(p->step_seconds, 8.0);  // one disk: the reads and the writes take turns
  EXPECT_EQ(p->bound, "the disk (nvme_read + nvme_write)");
}

// In exact overlap forward(g) waits for Adam(g), whose state streams through the disk; the
// state ring reads the next chunks while the last are written, so where the profile
// measured reads and writes at once the wait prices both directions together.
TEST(StepCost, TheExactWaitStreamsTheStateBothWaysAtOnceWhereMeasured) {
  StepWork w = three_seconds_of_compute();  // 1 s of forward
  w.state_read_bytes = 2e9;                 // 1 s alone at 2e9 B/s
  w.state_write_bytes = 2e9;                // 2 s alone at 1e9 B/s
  PipelineShape shape;
  shape.overlap = OverlapMode::kExact;
  auto apart = predict_step(w, shape, round_profile());
  ASSERT_TRUE(apart.ok());
  EXPECT_DOUBLE_EQ(apart->chain_seconds, 3.0 + (1.0 + 2.0 - 1.0));
  MachineProfile mixed = round_profile();
  mixed.nvme[0].mixed_bytes_per_s = 4e9;  // both directions' bytes: 4e9 B of traffic in 1 s
  auto together = predict_step(w, shape, mixed);
  ASSERT_TRUE(together.ok());
  EXPECT_DOUBLE_EQ(together->chain_seconds, 3.0);  // 1 s of state traffic hides behind the 1 s forward
  EXPECT_DOUBLE_EQ(together->step_seconds, 3.0);
}

// The engine measures a stage's busy time as the time it has work in flight. While an
// update moves its state both ways at once, both directions are in flight the whole time;
// fetches and what one direction moves beyond the other go at their own rates.
TEST(StepCost, BothDiskDirectionsAreInFlightWhileTheUpdateMovesStateBothWays) {
  StepWork w = three_seconds_of_compute();
  w.param_read_bytes = 1e9;    // 0.5 s of fetches at 2e9 B/s
  w.state_read_bytes = 3e9;    // 2e9 of it together with the writes, 1e9 more alone: 0.5 s
  w.state_write_bytes = 1.5e9;
  w.param_write_bytes = 0.5e9;  // the update's writes: 2e9 B
  MachineProfile mixed = round_profile();
  mixed.nvme[0].mixed_bytes_per_s = 4e9;  // 4e9 B of traffic both ways: 1 s
  auto p = predict_step(w, PipelineShape{}, mixed);
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->in_flight[static_cast<size_t>(Stage::kNvmeRead)], 1.0 + 0.5 + 0.5);
  EXPECT_DOUBLE_EQ(p->in_flight[static_cast<size_t>(Stage::kNvmeWrite)], 1.0);
  EXPECT_DOUBLE_EQ(busy(*p, Stage::kNvmeRead), 2.0);   // the work, each direction at its own rate
  EXPECT_DOUBLE_EQ(busy(*p, Stage::kNvmeWrite), 2.0);
  EXPECT_DOUBLE_EQ(p->in_flight[static_cast<size_t>(Stage::kCompute)], busy(*p, Stage::kCompute));
  auto apart = predict_step(w, PipelineShape{}, round_profile());  // no mixed figure: one after the other
  ASSERT_TRUE(apart.ok());
  EXPECT_DOUBLE_EQ(apart->in_flight[static_cast<size_t>(Stage::kNvmeRead)], 2.0);
  EXPECT_DOUBLE_EQ(apart->in_flight[static_cast<size_t>(Stage::kNvmeWrite)], 2.0);
}

TEST(StepCost, OnTheCpuDeviceComputeCopiesLandingAndAdamShareTheCores) {
  MachineProfile cpu = round_profile();
  cpu.compute.device = "cpu";
  StepWork w = three_seconds_of_compute();
  w.adam_elements = 1e8;  // 1 s at 1e8 elements/s (bf16)
  w.h2d_bytes = 1e10;     // 1 s
  PipelineShape shape;
  shape.overlap = OverlapMode::kDelayed;
  auto p = predict_step(w, shape, cpu);
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->step_seconds, 3.0 + 1.0 + 1.0);
  EXPECT_NE(p->bound.find("the host's cores"), std::string::npos) << p->bound;
  auto device = predict_step(w, shape, round_profile());  // a device of its own: the busiest stage or the chain
  ASSERT_TRUE(device.ok());
  EXPECT_LT(device->step_seconds, 5.0);
}

// The store hashes every byte it moves on the host's cores: on the CPU device that work
// shares them too. The cores' bound is core-seconds over the 2 cores: compute 3 s on both,
// Adam 1 s on its 2 threads, the copy 1 s on one, and 2e9 bytes hashed at 1e9 B/s a thread.
TEST(StepCost, OnTheCpuDeviceTheStoresChecksumsTakeTheCoresToo) {
  MachineProfile cpu = round_profile();
  cpu.compute.device = "cpu";
  cpu.nvme[0].checksum_bytes_per_s = 1e9;
  cpu.host.cores = 2;
  StepWork w = three_seconds_of_compute();
  w.adam_elements = 1e8;  // 1 s
  w.h2d_bytes = 1e10;     // 1 s
  w.state_read_bytes = 1e9;
  w.state_write_bytes = 1e9;  // 0.5 s of reading and 1 s of writing: less than the cores' 6 s
  PipelineShape shape;
  shape.overlap = OverlapMode::kDelayed;
  auto p = predict_step(w, shape, cpu);
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->pipeline_seconds, (2 * 3.0 + 2 * 1.0 + 1.0 + 2.0) / 2);
  shape.nvme_checksums = false;  // the profile's nearest shape still has checksums; the run does not hash
  auto plain = predict_step(w, shape, cpu);
  ASSERT_TRUE(plain.ok());
  EXPECT_DOUBLE_EQ(plain->pipeline_seconds, (2 * 3.0 + 2 * 1.0 + 1.0) / 2);
}

// The landing is its host pass; a spilled gradient's write is the store's (nvme_write), as
// the engine traces it.
TEST(StepCost, TheLandingStreamsAtTwiceTheCopyRateAndItsSpillCountsAsAnNvmeWrite) {
  StepWork w = three_seconds_of_compute();
  w.landing_bytes = 5e9;          // 0.5 s at twice the 5e9 B/s copy rate (a copy reads and writes each byte)
  w.state_write_bytes = 2e9;      // 2 s at 1e9 B/s (1 MiB QD32, checksums on), spilled gradients included
  auto p = predict_step(w, PipelineShape{}, round_profile());
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(busy(*p, Stage::kLanding), 0.5);
  EXPECT_DOUBLE_EQ(busy(*p, Stage::kNvmeWrite), 2.0);
}

// A measured landing pass replaces the copy-rate estimate: statistics alone with one
// micro-batch, accumulation into fp32 with several. On a GPU the copy's rate is the bus's.
TEST(StepCost, TheLandingTakesTheProfilesLandingPassWhereMeasured) {
  MachineProfile profile = round_profile();
  profile.landing = LandingRate{.threads = 2, .stats_bytes_per_s = 2e9, .accumulate_bytes_per_s = 4e9};
  StepWork w = three_seconds_of_compute();
  w.landing_bytes = 4e9;
  auto one = predict_step(w, PipelineShape{.micro_batches = 1}, profile);
  ASSERT_TRUE(one.ok());
  EXPECT_DOUBLE_EQ(busy(*one, Stage::kLanding), 2.0);
  auto several = predict_step(w, PipelineShape{.micro_batches = 2}, profile);
  ASSERT_TRUE(several.ok());
  EXPECT_DOUBLE_EQ(busy(*several, Stage::kLanding), 1.0);
}

// On a GPU the landing pass runs on CPU Adam's executor: the two take turns there, so their
// sum bounds the step though each alone is shorter than the compute.
TEST(StepCost, OnAGpuTheLandingAndAdamShareCpuAdamsExecutor) {
  MachineProfile profile = round_profile();
  profile.landing = LandingRate{.threads = 2, .stats_bytes_per_s = 1e9, .accumulate_bytes_per_s = 1e9};
  StepWork w = three_seconds_of_compute();
  w.landing_bytes = 2e9;   // 2 s
  w.adam_elements = 2e8;   // 2 s at 1e8 elements/s (bf16, 2 threads)
  PipelineShape shape;
  shape.overlap = OverlapMode::kDelayed;
  auto p = predict_step(w, shape, profile);
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->step_seconds, 4.0);
  EXPECT_EQ(p->bound, "CPU Adam's executor (the landing pass and the optimizer)");
  shape.adam_on_device = true;  // Adam on the GPU: the landing has the executor to itself
  auto device = predict_step(w, shape, profile);
  ASSERT_TRUE(device.ok());
  EXPECT_DOUBLE_EQ(device->step_seconds, 3.0);
  EXPECT_EQ(device->bound, "compute");
}

TEST(StepCost, AStageWithoutARateIsNamedAndLeftOut) {
  StepWork w = three_seconds_of_compute();
  w.allgather_bytes = 1e9;
  PipelineShape shape;
  shape.world = 2;  // the profile measured world 1 only
  auto p = predict_step(w, shape, round_profile());
  ASSERT_TRUE(p.ok());
  ASSERT_EQ(p->unknown.size(), 1u);
  EXPECT_NE(p->unknown[0].find("allgather"), std::string::npos);
  EXPECT_DOUBLE_EQ(p->step_seconds, 3.0);
  EXPECT_NE(format_prediction(*p, "test").find("no rate"), std::string::npos);
}

TEST(StepCost, DeviceAdamRunsAtTheDevicesMemoryRate) {
  StepWork w;
  w.adam_elements = 1e9;  // 28 GB at 28 GB/s
  PipelineShape shape;
  shape.adam_on_device = true;
  auto p = predict_step(w, shape, round_profile());
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(busy(*p, Stage::kOptimizer), 1.0);
}

TEST(StepCost, TheHostsGemmsStreamTheirWeightsFromMemoryAndAGpusDoNot) {
  StepWork w = three_seconds_of_compute();
  w.forward_weight_elements = 1e9;   // fp32: 4 GB at the host stream rate (the copy's 5e9 B/s), 0.8 s
  w.backward_weight_elements = 2e9;  // 1.6 s
  MachineProfile cpu = round_profile();
  cpu.compute.device = "cpu";
  auto host = predict_step(w, PipelineShape{}, cpu);
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  EXPECT_DOUBLE_EQ(busy(*host, Stage::kCompute), 3.0 + 0.8 + 1.6);
  cpu.compute.weight_stream_bytes_per_s = 2e10;  // measured: the streaming mostly hides behind the FLOPs
  auto measured = predict_step(w, PipelineShape{}, cpu);
  ASSERT_TRUE(measured.ok());
  EXPECT_DOUBLE_EQ(busy(*measured, Stage::kCompute), 3.0 + 0.2 + 0.4);
  MachineProfile gpu = round_profile();
  gpu.copy.host_copy = false;  // a GPU reads its weights within the measured GEMM rate
  auto device = predict_step(w, PipelineShape{}, gpu);
  ASSERT_TRUE(device.ok());
  EXPECT_DOUBLE_EQ(busy(*device, Stage::kCompute), 3.0);
}

TEST(StepCost, EachMemoryBoundOpIsPricedAtItsOwnRateOrTheMedian) {
  StepWork w;
  w.forward_memory = {{"gelu fwd", 1e8}, {"residual add", 7e8}};  // 2 x 4e8 B at 1e9 B/s; 3 x 2.8e9 B at the median 2.8e10
  w.backward_memory = {{"gelu bwd", 1e8}};                         // 3 x 4e8 B at the median
  MachineProfile p = round_profile();
  p.copy.host_copy = false;  // a GPU: untimed ops stream at the memory-bound median
  p.compute.kernels = {{.model = "m", .op = "gelu fwd", .shape = "", .kind = "memory", .rate_per_s = 1e9}};
  auto prediction = predict_step(w, PipelineShape{}, p);
  ASSERT_TRUE(prediction.ok()) << prediction.status().to_string();
  EXPECT_NEAR(busy(*prediction, Stage::kCompute), 0.8 + 0.3 + 1.2e9 / 2.8e10, 1e-12);
  EXPECT_DOUBLE_EQ(prediction->chain_seconds, busy(*prediction, Stage::kCompute));
}

TEST(StepCost, TheEnginesGradientZeroingAndCastAreCounted) {
  StepWork w;
  w.gradient_zero_bytes = 2.8e10;  // 1 s at the memory-bound median, on the compute stream
  w.gradient_cast_bytes = 1.4e10;  // no "grad cast to bf16" figure: the median, 0.5 s
  MachineProfile gpu = round_profile();
  gpu.copy.host_copy = false;
  auto p = predict_step(w, PipelineShape{}, gpu);
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(busy(*p, Stage::kCompute), 1.0);
  EXPECT_DOUBLE_EQ(busy(*p, Stage::kReduceScatter), 0.5);
  // On the CPU device both are streams through host memory, at the copy rate (5e9 B/s).
  auto host = predict_step(w, PipelineShape{}, round_profile());
  ASSERT_TRUE(host.ok());
  EXPECT_DOUBLE_EQ(busy(*host, Stage::kCompute), 5.6);
  EXPECT_DOUBLE_EQ(busy(*host, Stage::kReduceScatter), 2.8);
}

TEST(StepCost, AnUnknownMemoryBoundOpIsRefused) {
  StepWork w;
  w.forward_memory = {{"softplus fwd", 10}};
  auto p = predict_step(w, PipelineShape{}, round_profile());
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("softplus fwd"), std::string::npos);
}

TEST(StepCost, NegativeWorkIsRefused) {
  StepWork w;
  w.h2d_bytes = -1;
  EXPECT_FALSE(predict_step(w, PipelineShape{}, round_profile()).ok());
  PipelineShape shape;
  shape.micro_batches = 0;
  EXPECT_FALSE(predict_step(StepWork{}, shape, round_profile()).ok());
}

TEST(StepCost, TheNearestNvmeShapeAndTheMatchingAdamAreChosen) {
  const MachineProfile p = round_profile();
  EXPECT_EQ(nearest_nvme_rate(p, 1 << 20, 32, true)->read_bytes_per_s, 2e9);
  EXPECT_EQ(nearest_nvme_rate(p, 256 << 10, 4, true)->read_bytes_per_s, 1e9);
  EXPECT_EQ(nearest_nvme_rate(p, 1 << 20, 32, false)->read_bytes_per_s, 4e9);
  EXPECT_EQ(matching_adam_rate(p, "fp32", "fp32")->elements_per_s, 2e8);
  EXPECT_EQ(matching_adam_rate(p, "bf16", "bf16")->threads, 2);
  EXPECT_EQ(matching_adam_rate(p, "fp16", "fp16")->elements_per_s, 1e8);  // no match: the most threads of the first kind
}

TEST(StepCost, PredictedBusyHasEveryStageByName) {
  auto p = predict_step(three_seconds_of_compute(), PipelineShape{}, round_profile());
  ASSERT_TRUE(p.ok());
  const auto json = predicted_busy_json(*p);
  EXPECT_EQ(json.size(), kStageCount);
  EXPECT_DOUBLE_EQ(json.at("compute").get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(json.at("landing").get<double>(), 0.0);
}

// Two groups of 1000 elements (one shard each at world 1), bf16, used twice per micro-batch.
std::vector<GroupLayout> two_groups() {
  std::vector<GroupLayout> layouts(2);
  for (int i = 0; i < 2; ++i) {
    layouts[static_cast<size_t>(i)].id = i;
    layouts[static_cast<size_t>(i)].numel = layouts[static_cast<size_t>(i)].padded_numel = layouts[static_cast<size_t>(i)].shard_numel = 1000;
  }
  return layouts;
}

TEST(StepWorkFromPlan, EverythingOnNvmeReadsAndWritesWhatTheTiersSay) {
  EngineOptions o;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kNvme;
  EnginePlan plan;
  plan.persistent = {0, 0};
  plan.gradients_spilled = true;
  plan.prefetch_depth = 2;
  const auto layouts = two_groups();
  auto s = planned_step({.options = &o, .plan = &plan, .layouts = layouts, .schedule = {}, .model = {}});
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  const StepWork& w = s->work;
  EXPECT_EQ(w.fetching_gathers, 4);
  EXPECT_DOUBLE_EQ(w.param_read_bytes, 4 * 4096.0);  // 2000 B shards, 4 KiB-rounded
  EXPECT_DOUBLE_EQ(w.h2d_bytes, 4 * 2000.0);
  EXPECT_DOUBLE_EQ(w.allgather_bytes, 0.0);
  EXPECT_DOUBLE_EQ(w.d2h_bytes, 2 * 2000.0);
  EXPECT_DOUBLE_EQ(w.landing_bytes, 2 * 2000.0);
  EXPECT_DOUBLE_EQ(w.adam_elements, 2000.0);
  // Spilled bf16 gradients (written, read by Adam) and master + moments (12 B/element), both ways.
  EXPECT_DOUBLE_EQ(w.state_read_bytes, 2 * 4096.0 + 2 * 3 * 4096.0);
  EXPECT_DOUBLE_EQ(w.state_write_bytes, 2 * 4096.0 + 2 * 3 * 4096.0);
  double spilled = 0;
  for (const GroupWork& g : w.groups) spilled += g.spill_bytes;
  EXPECT_DOUBLE_EQ(spilled, 2 * 4096.0);  // the landing thread writes the spilled gradients
  EXPECT_DOUBLE_EQ(w.param_write_bytes, 2 * 4096.0);
  EXPECT_EQ(s->shape.prefetch_depth, 2);
  EXPECT_TRUE(s->shape.adam_during_backward);
}

// Parameters on the device, optimizer state pinned, two micro-batches.
EngineOptions device_parameters_two_micro_batches() {
  EngineOptions o;
  o.param_tier = Tier::kDevice;
  o.optimizer_tier = Tier::kPinned;
  o.gradient_accumulation_steps = 2;
  return o;
}

// 100 matmul weights (10 on the data, 40 in the head), 3 tokens of 4 per micro-batch,
// activation checkpointing on.
ModelWork small_model(int64_t attention_layers, int64_t attention_width) {
  ModelWork model;
  model.flops = {.matmul_weights = 100, .data_input_weights = 10, .attention_layers = attention_layers, .attention_width = attention_width};
  model.seq_len = 4;
  model.tokens = 3;
  model.head_weights = 40;
  model.recompute = true;
  return model;
}

TEST(StepWorkFromPlan, DeviceParametersAtWorldOneFetchNothingAndTheFlopsFollowTheShape) {
  EngineOptions o = device_parameters_two_micro_batches();
  o.overlap = OverlapMode::kDelayed;
  EnginePlan plan;
  plan.persistent = {0, 0};
  const auto layouts = two_groups();
  const ModelWork model = small_model(2, 8);
  auto s = planned_step({.options = &o, .plan = &plan, .layouts = layouts, .schedule = {}, .model = model});
  ASSERT_TRUE(s.ok());
  const StepWork& w = s->work;
  EXPECT_EQ(w.fetching_gathers, 0);
  EXPECT_DOUBLE_EQ(w.h2d_bytes, 0.0);  // nothing is fetched ...
  EXPECT_DOUBLE_EQ(w.h2d_update_bytes, 2 * 2000.0);  // ... only the new parameters go up
  EXPECT_DOUBLE_EQ(w.landing_bytes, 2 * (2 * 2000.0 + 2 * 1000 * 8.0));  // read + fp32 accumulation, 2 micro-batches
  const double tokens = 6;  // 3 per micro-batch x 2
  EXPECT_DOUBLE_EQ(w.forward_matmul_flops, 200 * tokens);
  EXPECT_DOUBLE_EQ(w.backward_matmul_flops, (400 - 20) * tokens);
  EXPECT_DOUBLE_EQ(w.forward_attention_flops, 4 * 2 * 4 * 8 * tokens);
  EXPECT_DOUBLE_EQ(w.backward_attention_flops, 8 * 2 * 4 * 8 * tokens);
  EXPECT_DOUBLE_EQ(w.recompute_matmul_flops, 2 * 60 * tokens);
  // Forward + backward equal the model FLOPs of examples/lm/model_flops.h.
  EXPECT_DOUBLE_EQ(w.forward_matmul_flops + w.backward_matmul_flops + w.forward_attention_flops + w.backward_attention_flops,
                   lm::training_step_flops(model.flops, model.seq_len, 6));
  EXPECT_FALSE(s->shape.adam_during_backward);
}

TEST(StepWorkFromPlan, TheModelsMemoryBoundOpsWeightsAndTheEnginesGradientPassesFollowThePlan) {
  EngineOptions o = device_parameters_two_micro_batches();
  o.grad_transfer_dtype = DType::kBFloat16;
  EnginePlan plan;
  plan.persistent = {0, 0};
  const auto layouts = two_groups();
  ModelWork model = small_model(0, 0);
  model.memory.block_forward = {{"gelu fwd", 5}};
  model.memory.block_backward = {{"gelu bwd", 5}};
  model.memory.head_forward = {{"cross-entropy fwd", 7}};
  model.memory.head_backward = {{"cross-entropy bwd", 7}};
  model.memory.head_logits_recomputed = true;
  auto s = planned_step({.options = &o, .plan = &plan, .layouts = layouts, .schedule = {}, .model = model});
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  const StepWork& w = s->work;
  const double tokens = 6;
  EXPECT_DOUBLE_EQ(w.recompute_matmul_flops, 2 * (60 + 40) * tokens);  // the blocks and the head's logits
  EXPECT_DOUBLE_EQ(w.forward_weight_elements, 2 * 100.0);               // once per micro-batch
  EXPECT_DOUBLE_EQ(w.recompute_weight_elements, 2 * 100.0);
  EXPECT_DOUBLE_EQ(w.backward_weight_elements, 2 * (200.0 - 10));     // the input gradients read, the weight gradients written
  ASSERT_EQ(w.forward_memory.size(), 2u);
  EXPECT_EQ(w.forward_memory[1].op, "cross-entropy fwd");
  EXPECT_DOUBLE_EQ(w.forward_memory[1].elements, 7 * tokens);
  ASSERT_EQ(w.recompute_memory.size(), 1u);  // the blocks' forward again, not the loss
  EXPECT_DOUBLE_EQ(w.recompute_memory[0].elements, 5 * tokens);
  EXPECT_EQ(w.backward_memory.size(), 2u);
  EXPECT_DOUBLE_EQ(w.gradient_zero_bytes, 2 * 2 * 1000 * 4.0);            // each buffer, each micro-batch
  EXPECT_DOUBLE_EQ(w.gradient_cast_bytes, 2 * 2 * 1000 * (4.0 + 2.0));  // fp32 read, bf16 written

  model.gradient_buffers_zeroed = false;  // a caller that writes every element (the Python front end)
  model.memory.block_forward = {{"no such op", 1}};
  EXPECT_FALSE(planned_step({.options = &o, .plan = &plan, .layouts = layouts, .schedule = {}, .model = model}).ok());
  model.memory = {};
  auto unzeroed = planned_step({.options = &o, .plan = &plan, .layouts = layouts, .schedule = {}, .model = model});
  ASSERT_TRUE(unzeroed.ok());
  EXPECT_DOUBLE_EQ(unzeroed->work.gradient_zero_bytes, 0.0);
  EXPECT_DOUBLE_EQ(unzeroed->work.recompute_matmul_flops, 2 * 60 * tokens);
}

}  // namespace
}  // namespace strata::profile
