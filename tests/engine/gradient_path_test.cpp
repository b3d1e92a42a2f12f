// The gradient path on its own (one rank, the CPU device): the test plays the model
// (writes each micro-batch's gradient into the buffer it is given and hands it over) and
// reads what the path publishes: the final gradient on the GradientBoard, its statistics
// from wait_step_landed, and the `landed` hook. Landing, accumulation across
// micro-batches in fp32, the spill to NVMe beside the optimizer state, each step parity's
// own buffer in delayed mode, the device accumulator when the optimizer state lives on
// the device, and the statistics (sum of squares, the inf/NaN flag).
#include "engine/gradient_path.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "engine/core/self_communicator.h"
#include "optim/nvme_adam_state.h"
#include "tests/engine/stage_rig.h"
#include "tests/support/test_support.h"

namespace strata::engine_internal {
namespace {

constexpr int64_t kElements = 1000;

class GradientPathTest : public StageTest {
 protected:
  // Builds the path for `options` over two groups (and the NVMe state when the optimizer
  // state is on NVMe), allocates and starts it.
  void build(EngineOptions options) {
    if (options.optimizer_tier == Tier::kNvme) options.nvme_path = dir_.str();
    STRATA_ASSERT_OK_AND_ASSIGN(rig_, StageRig::create(options, {one_tensor_group("a", kElements), one_tensor_group("b", kElements / 2)}));
    comm_ = std::make_unique<SelfCommunicator>(*rig_->device);
    STRATA_ASSERT_OK_AND_ASSIGN(executor_, make_executor({.threads = 1, .kind = ExecutorKind::kThreads}));
    board_ = std::make_unique<GradientBoard>(rig_->layouts.size());
    if (rig_->plan.gradients_spilled) {
      std::vector<size_t> shards;
      for (const GroupLayout& layout : rig_->layouts) shards.push_back(layout.shard_numel);
      STRATA_ASSERT_OK_AND_ASSIGN(spill_, NvmeAdamState::create(*rig_->nvme, *rig_->arena, shards, state_ring_options(rig_->options, rig_->plan)));
    }
    GradientPathContext context{&rig_->options,       &rig_->plan,          rig_->device.get(), rig_->compute.get(), rig_->reduce.get(),
                                rig_->d2h.get(),      comm_.get(),          &rig_->tracer,      rig_->stream_trace.get(),
                                &rig_->layouts,       board_.get(),         rig_->arena.get(),  spill_.get(), executor_.get()};
    GradientPathHooks hooks;
    hooks.landed = [this](int g, int64_t step) {
      std::lock_guard<std::mutex> lock(mutex_);
      landed_.emplace_back(g, step);
    };
    hooks.failed = [this](Status status) {
      std::lock_guard<std::mutex> lock(mutex_);
      failure_ = std::move(status);
    };
    hooks.describe_engine = [] { return std::string("test"); };
    hooks.wait_for_update = [this](int g, int64_t version) {
      std::lock_guard<std::mutex> lock(mutex_);
      update_waits_.emplace_back(g, version);
      return Status();
    };
    STRATA_ASSERT_OK_AND_ASSIGN(path_, GradientPath::create(context, std::move(hooks)));
    STRATA_ASSERT_OK(path_->allocate());
    STRATA_ASSERT_OK(path_->start());
  }
  void TearDown() override {
    if (path_) path_->stop();
    path_.reset();
  }

  size_t shard(int g) const { return rig_->layouts[static_cast<size_t>(g)].shard_numel; }

  // The model's part: group g's gradient of this micro-batch is `values`.
  Status give(int g, int64_t step, int micro, const std::vector<float>& values) {
    STRATA_ASSIGN_OR_RETURN(float* buffer, path_->buffer(g, step));
    STRATA_RETURN_IF_ERROR(rig_->compute->synchronize());  // the zeroing is done: the CPU device's memory is the host's
    std::copy(values.begin(), values.end(), buffer);
    return path_->hand_over(g, step, micro);
  }
  // One step: every micro-batch gives each group ramp(shard, scale(micro)).
  StatusOr<GradientStats> run_step(int64_t step, const std::vector<float>& scales) {
    for (size_t micro = 0; micro < scales.size(); ++micro) {
      path_->begin_micro_batch();
      for (int g = 0; g < 2; ++g) STRATA_RETURN_IF_ERROR(give(g, step, static_cast<int>(micro), ramp(shard(g), scales[micro])));
    }
    return path_->wait_step_landed(step);
  }
  static double sum_of_squares(const std::vector<float>& v) {
    double sum = 0.0;
    for (float x : v) sum += static_cast<double>(x) * x;
    return sum;
  }
  std::vector<float> host_view(const GradientView& view, size_t n) const {
    EXPECT_NE(view.data, nullptr);
    EXPECT_EQ(view.dtype, DType::kFloat32);
    const float* data = static_cast<const float*>(view.data);
    return std::vector<float>(data, data + n);
  }

  std::unique_ptr<SelfCommunicator> comm_;
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<GradientBoard> board_;
  std::unique_ptr<NvmeAdamState> spill_;
  std::unique_ptr<GradientPath> path_;
  std::mutex mutex_;
  std::vector<std::pair<int, int64_t>> landed_, update_waits_;
  Status failure_;
};

TEST_F(GradientPathTest, AHandedOverGradientLandsOnTheBoardWithItsStatistics) {
  build(fp32_options());
  STRATA_ASSERT_OK_AND_ASSIGN(const GradientStats stats, run_step(0, {1.0f}));
  for (int g = 0; g < 2; ++g) {
    STRATA_ASSERT_OK_AND_ASSIGN(const GradientView view, board_->landed(g, 0));
    EXPECT_FALSE(view.on_device);
    EXPECT_EQ(host_view(view, shard(g)), ramp(shard(g), 1.0f)) << "group " << g;
  }
  EXPECT_NEAR(stats.sum_of_squares, sum_of_squares(ramp(shard(0), 1.0f)) + sum_of_squares(ramp(shard(1), 1.0f)), 1e-6 * stats.sum_of_squares);
  EXPECT_FALSE(stats.non_finite);
  EXPECT_EQ(stats.elements, shard(0) + shard(1));
  std::lock_guard<std::mutex> lock(mutex_);
  EXPECT_EQ(landed_, (std::vector<std::pair<int, int64_t>>{{0, 0}, {1, 0}}));
  EXPECT_TRUE(failure_.ok()) << failure_.to_string();
}

TEST_F(GradientPathTest, TheBoardRefusesAStepThatHasNotLanded) {
  build(fp32_options());
  EXPECT_FALSE(board_->landed(0, 0).ok());
  STRATA_ASSERT_OK(run_step(0, {1.0f}).status());
  EXPECT_TRUE(board_->landed(0, 0).ok());
  EXPECT_FALSE(board_->landed(0, 1).ok());
}

TEST_F(GradientPathTest, MicroBatchesAccumulateInFp32AndOnlyTheLastIsAnnounced) {
  EngineOptions o = fp32_options();
  o.gradient_accumulation_steps = 3;
  build(o);
  STRATA_ASSERT_OK_AND_ASSIGN(const GradientStats stats, run_step(0, {1.0f, 2.0f, 0.5f}));
  STRATA_ASSERT_OK_AND_ASSIGN(const GradientView view, board_->landed(0, 0));
  EXPECT_EQ(host_view(view, shard(0)), ramp(shard(0), 3.5f));
  EXPECT_NEAR(stats.sum_of_squares, sum_of_squares(ramp(shard(0), 3.5f)) + sum_of_squares(ramp(shard(1), 3.5f)), 1e-6 * stats.sum_of_squares);
  std::lock_guard<std::mutex> lock(mutex_);
  EXPECT_EQ(landed_.size(), 2u) << "one announcement per group and step, after its last micro-batch";
}

TEST_F(GradientPathTest, DelayedModeLandsEachStepParityInItsOwnBuffer) {
  EngineOptions o = fp32_options();
  o.overlap = OverlapMode::kDelayed;
  build(o);
  STRATA_ASSERT_OK(run_step(0, {1.0f}).status());
  STRATA_ASSERT_OK(run_step(1, {-2.0f}).status());
  STRATA_ASSERT_OK_AND_ASSIGN(const GradientView even, board_->landed(0, 0));
  STRATA_ASSERT_OK_AND_ASSIGN(const GradientView odd, board_->landed(0, 1));
  EXPECT_NE(even.data, odd.data);
  EXPECT_EQ(host_view(even, shard(0)), ramp(shard(0), 1.0f)) << "step 1 did not overwrite step 0's gradient";
  EXPECT_EQ(host_view(odd, shard(0)), ramp(shard(0), -2.0f));
}

TEST_F(GradientPathTest, SpilledGradientsAreStoredOnNvmeBesideTheOptimizerState) {
  EngineOptions o = fp32_options();
  o.optimizer_tier = Tier::kNvme;
  o.gradient_accumulation_steps = 2;
  build(o);
  ASSERT_TRUE(rig_->plan.gradients_spilled);
  STRATA_ASSERT_OK_AND_ASSIGN(const GradientStats stats, run_step(0, {1.0f, 0.25f}));
  for (int g = 0; g < 2; ++g) {
    STRATA_ASSERT_OK_AND_ASSIGN(const GradientView view, board_->landed(g, 0));
    EXPECT_EQ(view.data, nullptr) << "the optimizer reads it from NVMe";
    EXPECT_EQ(view.dtype, DType::kFloat32);
    std::vector<float> stored(shard(g));
    STRATA_ASSERT_OK(spill_->load_gradient(static_cast<size_t>(g), view.stored_copy, stored.data(), stored.size() * sizeof(float)));
    EXPECT_EQ(stored, ramp(shard(g), 1.25f)) << "group " << g;
  }
  EXPECT_NEAR(stats.sum_of_squares, sum_of_squares(ramp(shard(0), 1.25f)) + sum_of_squares(ramp(shard(1), 1.25f)), 1e-6 * stats.sum_of_squares);
}

TEST_F(GradientPathTest, DeviceOptimizerStateKeepsTheGradientInTheDeviceAccumulator) {
  EngineOptions o = fp32_options();
  o.optimizer_tier = Tier::kDevice;
  o.gradient_accumulation_steps = 2;
  build(o);
  STRATA_ASSERT_OK_AND_ASSIGN(const GradientStats stats, run_step(0, {1.0f, 1.0f}));
  STRATA_ASSERT_OK_AND_ASSIGN(const GradientView view, board_->landed(0, 0));
  EXPECT_TRUE(view.on_device);
  STRATA_ASSERT_OK(rig_->device->synchronize());
  EXPECT_EQ(host_view(view, shard(0)), ramp(shard(0), 2.0f));  // the CPU device's memory is readable
  EXPECT_NEAR(stats.sum_of_squares, sum_of_squares(ramp(shard(0), 2.0f)) + sum_of_squares(ramp(shard(1), 2.0f)), 1e-6 * stats.sum_of_squares);
  std::lock_guard<std::mutex> lock(mutex_);
  EXPECT_EQ(update_waits_, (std::vector<std::pair<int, int64_t>>{{0, 0}, {1, 0}}))
      << "the first micro-batch waits for the update that reads the accumulator";
}

TEST_F(GradientPathTest, AnInfOrNanGradientIsFlaggedInTheStatistics) {
  build(fp32_options());
  path_->begin_micro_batch();
  std::vector<float> bad = ramp(shard(0), 1.0f);
  bad[17] = std::numeric_limits<float>::quiet_NaN();
  STRATA_ASSERT_OK(give(0, 0, 0, bad));
  STRATA_ASSERT_OK(give(1, 0, 0, ramp(shard(1), 1.0f)));
  STRATA_ASSERT_OK_AND_ASSIGN(const GradientStats stats, path_->wait_step_landed(0));
  EXPECT_TRUE(stats.non_finite);
}

// A model that writes every element from its own thread takes the buffer unwritten:
// nothing is queued on the compute stream, it holds an earlier gradient, and what the
// model writes is what lands. Returns the buffers handed out in step 1.
std::vector<float*> write_unwritten_step(GradientPath& path, const std::vector<size_t>& shards) {
  std::vector<float*> buffers;
  path.begin_micro_batch();
  for (int g = 0; g < 2; ++g) {
    StatusOr<float*> buffer = path.buffer(g, 1, GradientStart::kUnwritten);
    EXPECT_TRUE(buffer.ok()) << buffer.status().to_string();
    if (!buffer.ok()) return buffers;
    const std::vector<float> held(*buffer, *buffer + shards[static_cast<size_t>(g)]);
    EXPECT_TRUE(std::any_of(held.begin(), held.end(), [](float x) { return x != 0.0f; })) << "group " << g << ": not zeroed";
    const std::vector<float> values = ramp(shards[static_cast<size_t>(g)], -3.0f);
    std::copy(values.begin(), values.end(), *buffer);
    EXPECT_TRUE(path.hand_over(g, 1, 0).ok());
    buffers.push_back(*buffer);
  }
  EXPECT_TRUE(path.wait_step_landed(1).ok());
  return buffers;
}

// On the CPU device with one rank, fp32 and host optimizer state, the buffer is the
// group's landing buffer itself (no slot, no copy), handed out once the update that read
// the previous step's gradient there is done.
TEST_F(GradientPathTest, AnUnwrittenBufferOnTheCpuDeviceIsTheLandingBufferItself) {
  build(fp32_options());
  ASSERT_TRUE(path_->lands_in_place());
  STRATA_ASSERT_OK(run_step(0, {1.0f}).status());
  const std::vector<float*> buffers = write_unwritten_step(*path_, {shard(0), shard(1)});
  ASSERT_EQ(buffers.size(), 2u);
  for (int g = 0; g < 2; ++g) {
    STRATA_ASSERT_OK_AND_ASSIGN(const GradientView view, board_->landed(g, 1));
    EXPECT_EQ(view.data, buffers[static_cast<size_t>(g)]) << "group " << g;
    EXPECT_EQ(host_view(view, shard(g)), ramp(shard(g), -3.0f)) << "group " << g;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  EXPECT_EQ(update_waits_, (std::vector<std::pair<int, int64_t>>{{0, 1}, {1, 1}}));
}

// Elsewhere (here: optimizer state on the device) it is a slot, reduced and copied as a
// zeroed one is.
TEST_F(GradientPathTest, AnUnwrittenBufferElsewhereIsASlotThatLandsWhatTheModelWrote) {
  EngineOptions o = fp32_options();
  o.optimizer_tier = Tier::kDevice;
  build(o);
  ASSERT_FALSE(path_->lands_in_place());
  STRATA_ASSERT_OK(run_step(0, {1.0f}).status());
  ASSERT_EQ(write_unwritten_step(*path_, {shard(0), shard(1)}).size(), 2u);
  STRATA_ASSERT_OK(rig_->device->synchronize());
  for (int g = 0; g < 2; ++g) {
    STRATA_ASSERT_OK_AND_ASSIGN(const GradientView view, board_->landed(g, 1));
    EXPECT_EQ(host_view(view, shard(g)), ramp(shard(g), -3.0f)) << "group " << g;
  }
}

// Micro-batches add up from a buffer written in place as from a slot.
TEST_F(GradientPathTest, UnwrittenBuffersAccumulateMicroBatchesInFp32) {
  EngineOptions o = fp32_options();
  o.gradient_accumulation_steps = 2;
  build(o);
  ASSERT_TRUE(path_->lands_in_place());
  for (int micro = 0; micro < 2; ++micro) {
    path_->begin_micro_batch();
    for (int g = 0; g < 2; ++g) {
      STRATA_ASSERT_OK_AND_ASSIGN(float* buffer, path_->buffer(g, 0, GradientStart::kUnwritten));
      const std::vector<float> values = ramp(shard(g), micro == 0 ? 1.0f : 0.5f);
      std::copy(values.begin(), values.end(), buffer);
      STRATA_ASSERT_OK(path_->hand_over(g, 0, micro));
    }
  }
  STRATA_ASSERT_OK(path_->wait_step_landed(0).status());
  STRATA_ASSERT_OK_AND_ASSIGN(const GradientView view, board_->landed(0, 0));
  EXPECT_EQ(host_view(view, shard(0)), ramp(shard(0), 1.5f));
}

TEST_F(GradientPathTest, ASecondHandOverInOneMicroBatchIsRefused) {
  build(fp32_options());
  path_->begin_micro_batch();
  STRATA_ASSERT_OK(give(0, 0, 0, ramp(shard(0), 1.0f)));
  EXPECT_EQ(path_->hand_over(0, 0, 0).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(path_->buffer(0, 0).status().code(), StatusCode::kFailedPrecondition);
  STRATA_ASSERT_OK(path_->wait_drained());
}

}  // namespace
}  // namespace strata::engine_internal
