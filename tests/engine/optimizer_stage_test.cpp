// The optimizer stage on its own (one rank, the CPU device). The test plays the gradient
// path: it places each group's gradient on a GradientBoard (host memory, or stored on
// NVMe) and publishes it; it reads the new versions on the VersionBoard, the parameter
// copies in the shard store and the state through read_state. An update equals CPU Adam
// run by hand on the same values (weight decay on the decayed runs), in exact mode and in
// delayed mode (the new parameters go to the other copy, the stale one is kept), and with
// the state on NVMe streamed in several chunks; a gradient that has not landed and a
// failed NVMe write stop the stage with an error.
#include "engine/optimizer_stage.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "tests/engine/stage_rig.h"
#include "tests/support/test_support.h"

namespace strata::engine_internal {
namespace {

constexpr int64_t kElements = 5000;

class OptimizerStageTest : public StageTest {
 protected:
  void build(EngineOptions options) {
    if ((options.optimizer_tier == Tier::kNvme || options.param_tier == Tier::kNvme) && options.nvme_path.empty())
      options.nvme_path = dir_.str();
    options.adam.weight_decay = 0.1;
    STRATA_ASSERT_OK_AND_ASSIGN(rig_, StageRig::create(options, {one_tensor_group("a", kElements)}));
    STRATA_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::create({.threads = 1}));
    adam_.emplace(std::move(adam));
    if (options.optimizer_tier == Tier::kNvme) {
      STRATA_ASSERT_OK_AND_ASSIGN(nvme_state_, NvmeAdamState::create(*rig_->nvme, *rig_->arena, {shard()},
                                                                     state_ring_options(rig_->options, rig_->plan)));
    }
    shards_ = std::make_unique<ShardStore>(ShardStoreContext{&rig_->options, rig_->device.get(), rig_->update.get(), rig_->arena.get(),
                                                             rig_->nvme.get(), &rig_->tracer, &rig_->layouts});
    board_ = std::make_unique<GradientBoard>(1);
    versions_ = std::make_unique<VersionBoard>(std::vector<bool>{true});
    OptimizerStageContext context{&rig_->options, &rig_->plan, rig_->device.get(), rig_->update.get(), &rig_->tracer, &rig_->layouts,
                                  rig_->arena.get(), &*adam_, nvme_state_.get(), shards_.get(), board_.get(), versions_.get()};
    OptimizerStageHooks hooks;
    hooks.job_done = [this] {
      std::lock_guard<std::mutex> lock(mutex_);
      ++jobs_done_;
      cv_.notify_all();
    };
    hooks.failed = [this](Status status) {
      std::lock_guard<std::mutex> lock(mutex_);
      failure_ = std::move(status);
      cv_.notify_all();
    };
    STRATA_ASSERT_OK_AND_ASSIGN(stage_, OptimizerStage::create(context, std::move(hooks)));
    initial_ = ramp(shard(), 0.001f);
    STRATA_ASSERT_OK(shards_->allocate_group(0));
    for (int c = 0; c < shards_->copies(0); ++c) STRATA_ASSERT_OK(shards_->store_values(0, c, 0, initial_));
    STRATA_ASSERT_OK(stage_->initialize_group(0));
    STRATA_ASSERT_OK(stage_->write_state(0, StateKind::kMaster, 0, initial_));
    STRATA_ASSERT_OK(stage_->start());
  }
  void TearDown() override { release(); }
  // Everything build() made, users before what they use.
  void release() {
    if (stage_) stage_->stop();
    stage_.reset();
    versions_.reset();
    board_.reset();
    shards_.reset();
    nvme_state_.reset();
    adam_.reset();
    rig_.reset();
  }

  size_t shard() const { return rig_->layouts[0].shard_numel; }

  // Step `step`'s gradient, in host memory or (spilled) stored on NVMe, placed and published.
  void land_gradient(int64_t step, const std::vector<float>& values) {
    const int parity = rig_->options.overlap == OverlapMode::kDelayed ? static_cast<int>(step % 2) : 0;
    if (nvme_state_) {
      STRATA_ASSERT_OK(nvme_state_->store_gradient(0, static_cast<unsigned>(parity), values.data(), values.size() * sizeof(float)));
      board_->place(0, parity, {nullptr, DType::kFloat32, false, static_cast<unsigned>(parity)});
    } else {
      gradients_[static_cast<size_t>(parity)] = values;
      board_->place(0, parity, {gradients_[static_cast<size_t>(parity)].data(), DType::kFloat32, false, 0});
    }
    board_->publish(0, step);
  }
  // Step 0's update from `gradient`, landed; returns when the job is done or failed.
  Status update_with(const std::vector<float>& gradient) {
    land_gradient(0, gradient);
    stage_->submit(job(0));
    return wait_jobs(1);
  }
  OptimizerJob job(int64_t step) const {
    OptimizerJob j;
    j.step_index = step;
    kernels::AdamHyperparams hyper = rig_->options.adam;
    j.decay_plan = plan_adam_step(hyper, step + 1, GradientStats{}, {}).value();
    hyper.weight_decay = 0.0;
    j.no_decay_plan = plan_adam_step(hyper, step + 1, GradientStats{}, {}).value();
    j.order = {0};
    return j;
  }
  // Waits until `jobs` jobs are done or the stage failed; returns the failure.
  Status wait_jobs(int jobs) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, std::chrono::seconds(30), [&] { return jobs_done_ >= jobs || !failure_.ok(); }))
      return DeadlineExceededError("the optimizer stage neither finished nor failed");
    return failure_;
  }
  std::vector<float> state(StateKind kind) {
    std::vector<float> out(shard());
    EXPECT_TRUE(stage_->read_state(0, kind, 0, out).ok());
    return out;
  }
  std::vector<float> params(int copy) {
    std::vector<float> out(shard());
    EXPECT_TRUE(shards_->load_values(0, copy, 0, out).ok());
    return out;
  }
  // CPU Adam by hand over the group's decay runs, from the initial values and zero moments.
  std::vector<float> reference_master(const std::vector<float>& gradient, int64_t step) {
    std::vector<float> master = initial_, m(shard(), 0.0f), v(shard(), 0.0f);
    const OptimizerJob j = job(step);
    for (const DecayRun& run : decay_runs(rig_->layouts[0], 0)) {
      kernels::AdamBuffers b;
      b.grad = gradient.data() + run.begin;
      b.grad_type = DType::kFloat32;
      b.master = master.data() + run.begin;
      b.exp_avg = m.data() + run.begin;
      b.exp_avg_sq = v.data() + run.begin;
      b.count = run.end - run.begin;
      EXPECT_TRUE(adam_->step(b, run.decay ? j.decay_plan : j.no_decay_plan).ok());
    }
    return master;
  }

  std::optional<CpuAdam> adam_;
  std::unique_ptr<NvmeAdamState> nvme_state_;
  std::unique_ptr<ShardStore> shards_;
  std::unique_ptr<GradientBoard> board_;
  std::unique_ptr<VersionBoard> versions_;
  std::unique_ptr<OptimizerStage> stage_;
  std::vector<float> initial_;
  std::vector<float> gradients_[2];
  std::mutex mutex_;
  std::condition_variable cv_;
  int jobs_done_ = 0;
  Status failure_;
};

TEST_F(OptimizerStageTest, AnExactUpdateIsCpuAdamOnTheLandedGradientAndPublishesTheNextVersion) {
  build(fp32_options());
  const std::vector<float> gradient = ramp(shard(), -0.01f);
  STRATA_ASSERT_OK(update_with(gradient));
  EXPECT_EQ(versions_->version(0), 1);
  const std::vector<float> expected = reference_master(gradient, 0);
  EXPECT_EQ(state(StateKind::kMaster), expected);
  EXPECT_EQ(params(0), expected) << "fp32 parameters are the masters";
  EXPECT_NE(state(StateKind::kExpAvg), std::vector<float>(shard(), 0.0f));
}

TEST_F(OptimizerStageTest, ADelayedUpdateWritesTheOtherCopyAndKeepsTheStaleOne) {
  EngineOptions o = fp32_options();
  o.overlap = OverlapMode::kDelayed;
  build(o);
  const std::vector<float> gradient = ramp(shard(), 0.02f);
  STRATA_ASSERT_OK(update_with(gradient));
  EXPECT_EQ(versions_->version(0), 1);
  EXPECT_EQ(params(1), reference_master(gradient, 0)) << "version 1 lives in copy 1";
  EXPECT_EQ(params(0), initial_) << "version 0 is still there for the step computing with it";
}

TEST_F(OptimizerStageTest, NvmeStateStreamedInChunksGivesTheSameUpdateAsHostState) {
  EngineOptions o = fp32_options();
  o.optimizer_tier = Tier::kNvme;
  o.nvme_checksum = false;       // chunks on 4 KiB, not on the 1 MiB checksum block
  o.sub_group_elements = 1024;   // five chunks for the group
  build(o);
  ASSERT_LT(rig_->plan.state_piece_elements, shard()) << "the group must span several chunks";
  const std::vector<float> gradient = ramp(shard(), 0.003f);
  STRATA_ASSERT_OK(update_with(gradient));
  EXPECT_EQ(versions_->version(0), 1);
  const std::vector<float> expected = reference_master(gradient, 0);
  EXPECT_EQ(state(StateKind::kMaster), expected);
  EXPECT_EQ(params(0), expected);
}

TEST_F(OptimizerStageTest, ASkippedJobMovesTheVersionAndLeavesTheStateAlone) {
  build(fp32_options());
  OptimizerJob skipped = job(0);
  skipped.skip = true;
  stage_->submit(skipped);
  STRATA_ASSERT_OK(wait_jobs(1));
  EXPECT_EQ(versions_->version(0), 1);
  EXPECT_EQ(state(StateKind::kMaster), initial_);
}

TEST_F(OptimizerStageTest, AGradientThatHasNotLandedStopsTheStageWithAnError) {
  build(fp32_options());
  stage_->submit(job(0));
  const Status status = wait_jobs(1);
  EXPECT_EQ(status.code(), StatusCode::kInternal) << status.to_string();
  EXPECT_NE(status.message().find("has not landed"), std::string::npos) << status.to_string();
  EXPECT_EQ(versions_->version(0), 0);
}

TEST_F(OptimizerStageTest, AFailedNvmeWriteOfTheStateStopsTheStageWithTheError) {
  // A first run counts the writes of the set-up and the gradient's spill; in the second the
  // first write after those (the update's) fails.
  auto counter = std::make_shared<IoFaultInjector>(std::vector<IoFaultRule>{{{IoOp::kWrite, "swap", ~uint64_t{0}}, IoFaultAction::kFail, EIO}});
  EngineOptions o = fp32_options();
  o.optimizer_tier = Tier::kNvme;
  o.nvme_path = (dir_.path() / "count").string();
  o.io_faults = counter;
  build(o);
  land_gradient(0, ramp(shard(), 0.01f));
  const uint64_t writes_before_update = counter->matched(0);
  release();
  auto faults = std::make_shared<IoFaultInjector>(
      std::vector<IoFaultRule>{{{IoOp::kWrite, "swap", writes_before_update + 1}, IoFaultAction::kFail, EIO}});
  o.nvme_path = (dir_.path() / "fail").string();
  o.io_faults = faults;
  build(o);
  const Status status = update_with(ramp(shard(), 0.01f));
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.to_string().find("optimizer step 0"), std::string::npos) << status.to_string();
  EXPECT_EQ(faults->injected().size(), 1u);
  std::lock_guard<std::mutex> lock(mutex_);
  EXPECT_EQ(jobs_done_, 0) << "a job whose state was not written back is not done";
}

OptimizerJob one_group_update(int64_t step, int g) {
  OptimizerJob j;
  j.step_index = step;
  j.order = {g};
  return j;
}

std::vector<int> groups_in(const std::deque<OptimizerJob>& queue) {
  std::vector<int> out;
  for (const OptimizerJob& j : queue) out.push_back(j.order.size() == 1 ? j.order.front() : -1);
  return out;
}

TEST(UpdateQueuePosition, PutsAOneGroupUpdateAheadOfLaterGroupsOfItsStepThatHaveNotStarted) {
  // Landed in backward order: 3 is running, 2 and 1 wait; 0 lands last and goes first of those waiting.
  std::deque<OptimizerJob> queue = {one_group_update(7, 3), one_group_update(7, 2), one_group_update(7, 1)};
  const OptimizerJob first = one_group_update(7, 0);
  const size_t at = update_queue_position(queue, /*taken=*/1, first);
  queue.insert(queue.begin() + static_cast<std::ptrdiff_t>(at), first);
  EXPECT_EQ(groups_in(queue), (std::vector<int>{3, 0, 2, 1}));
}

TEST(UpdateQueuePosition, KeepsTheOrderOfRunningJobsOtherStepsAndWholeStepJobs) {
  const std::deque<OptimizerJob> running = {one_group_update(7, 3)};
  EXPECT_EQ(update_queue_position(running, 1, one_group_update(7, 0)), 1u);  // never ahead of a running job
  const std::deque<OptimizerJob> older_step = {one_group_update(6, 5)};
  EXPECT_EQ(update_queue_position(older_step, 0, one_group_update(7, 0)), 1u);
  OptimizerJob whole = one_group_update(7, 0);
  whole.order = {0, 1, 2};
  const std::deque<OptimizerJob> waiting = {one_group_update(7, 4)};
  EXPECT_EQ(update_queue_position(waiting, 0, whole), 1u);  // a whole step's job queues at the end
  std::deque<OptimizerJob> behind_whole = {whole};
  EXPECT_EQ(update_queue_position(behind_whole, 0, one_group_update(7, 0)), 1u);
}

}  // namespace
}  // namespace strata::engine_internal
