// The parameter fetcher on its own (one rank, the CPU device, parameters in pinned memory
// or on NVMe). The test plays the use planner and the model: it plans fetches, takes and
// releases them, and publishes versions on the VersionBoard as the optimizer would. The
// ring is filled in order (slot i mod slots, phase i div slots) with each group's values;
// a slot held by a reader is never refilled until released; NVMe reads run ahead of the
// fills by at most the prefetch depth, each group read once; a fetch waits for the
// version its use needs.
#include "engine/param_fetcher.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include "engine/core/self_communicator.h"
#include "tests/engine/stage_rig.h"
#include "tests/support/test_support.h"

namespace strata::engine_internal {
namespace {

constexpr int kGroups = 6;
constexpr int64_t kElements = 1024;
constexpr auto kSettle = std::chrono::milliseconds(300);

class ParamFetcherTest : public StageTest {
 protected:
  void build(EngineOptions options) {
    std::vector<GroupSpec> specs;
    for (int g = 0; g < kGroups; ++g) specs.push_back(one_tensor_group("g" + std::to_string(g), kElements));
    STRATA_ASSERT_OK_AND_ASSIGN(rig_, StageRig::create(options, specs));
    shard_ = rig_->layouts[0].shard_numel;  // every group's: the values fill it, padding included
    comm_ = std::make_unique<SelfCommunicator>(*rig_->device);
    shards_ = std::make_unique<ShardStore>(ShardStoreContext{&rig_->options, rig_->device.get(), rig_->update.get(), rig_->arena.get(),
                                                             rig_->nvme.get(), &rig_->tracer, &rig_->layouts});
    for (int g = 0; g < kGroups; ++g) {
      STRATA_ASSERT_OK(shards_->allocate_group(g));
      for (int c = 0; c < shards_->copies(g); ++c) STRATA_ASSERT_OK(shards_->store_values(g, c, 0, values(g, 0)));
    }
    versions_ = std::make_unique<VersionBoard>(std::vector<bool>(kGroups, true));
    ParamFetcherContext context{&rig_->options,  &rig_->plan,  rig_->device.get(), rig_->h2d.get(),      rig_->gather.get(),
                                rig_->compute.get(), comm_.get(), &rig_->tracer,     rig_->stream_trace.get(), &rig_->layouts,
                                rig_->nvme.get(),  rig_->arena.get(), versions_.get(), shards_.get()};
    ParamFetcherHooks hooks;
    hooks.failed = [this](Status status) { failure_ = std::move(status); };
    hooks.describe_engine = [] { return std::string("test"); };
    STRATA_ASSERT_OK_AND_ASSIGN(fetcher_, ParamFetcher::create(context, std::move(hooks)));
    STRATA_ASSERT_OK(fetcher_->allocate());
    STRATA_ASSERT_OK(fetcher_->start());
    slots_ = rig_->plan.gather_slots;
    ASSERT_GE(slots_, 2);
  }
  void TearDown() override {
    if (versions_) versions_->stop();
    if (fetcher_) fetcher_->stop();
    fetcher_.reset();
    if (rig_) (void)rig_->device->synchronize();
  }

  // Group g's shard at version v: distinct per group and version.
  std::vector<float> values(int g, int64_t v) const { return ramp(shard_, static_cast<float>(g + 1) + 100.0f * static_cast<float>(v)); }

  // Takes `request`, checks the gathered group holds `expected`, and returns its position.
  PipelineState take_and_check(uint64_t request, const std::vector<float>& expected) {
    PipelineState position;
    auto taken = fetcher_->take(request, &position);
    EXPECT_TRUE(taken.ok()) << taken.status().to_string();
    if (!taken.ok()) return position;
    EXPECT_TRUE(rig_->compute->synchronize().ok());
    const float* data = static_cast<const float*>(*taken);
    EXPECT_EQ(std::vector<float>(data, data + shard_), expected);
    return position;
  }

  std::unique_ptr<SelfCommunicator> comm_;
  std::unique_ptr<ShardStore> shards_;
  std::unique_ptr<VersionBoard> versions_;
  std::unique_ptr<ParamFetcher> fetcher_;
  Status failure_;
  int slots_ = 0;
  size_t shard_ = 0;
};

TEST_F(ParamFetcherTest, TheRingIsFilledInOrderWithEachGroupsParameters) {
  build(fp32_options());
  std::vector<uint64_t> requests;
  for (int i = 0; i < 2 * slots_; ++i) requests.push_back(fetcher_->plan_fetch(i % kGroups, 0, 0));
  for (int i = 0; i < 2 * slots_; ++i) {
    const PipelineState position = take_and_check(requests[static_cast<size_t>(i)], values(i % kGroups, 0));
    EXPECT_EQ(position.index, i % slots_) << "use " << i;
    EXPECT_EQ(position.phase, static_cast<uint64_t>(i / slots_)) << "use " << i;
    STRATA_ASSERT_OK(fetcher_->release(i % kGroups, position));
  }
  STRATA_ASSERT_OK(fetcher_->wait_idle());
  EXPECT_TRUE(failure_.ok()) << failure_.to_string();
}

TEST_F(ParamFetcherTest, ASlotHeldByAReaderIsNotRefilledUntilReleased) {
  build(fp32_options());
  std::vector<uint64_t> requests;
  for (int i = 0; i <= slots_; ++i) requests.push_back(fetcher_->plan_fetch(i, 0, 0));
  PipelineState held;
  STRATA_ASSERT_OK_AND_ASSIGN(void* held_data, fetcher_->take(requests[0], &held));
  ASSERT_EQ(held.index, 0);
  for (int i = 1; i < slots_; ++i) STRATA_ASSERT_OK(fetcher_->release(i, take_and_check(requests[static_cast<size_t>(i)], values(i, 0))));
  // Request `slots_` goes to slot 0 again: its fill waits for the reader of slot 0.
  auto next = std::async(std::launch::async, [&] {
    PipelineState position;
    return fetcher_->take(requests.back(), &position);
  });
  EXPECT_EQ(next.wait_for(kSettle), std::future_status::timeout) << "slot 0 was refilled under its reader";
  STRATA_ASSERT_OK(rig_->compute->synchronize());
  const float* slot0 = static_cast<const float*>(held_data);
  EXPECT_EQ(std::vector<float>(slot0, slot0 + shard_), values(0, 0)) << "the reader's data is intact";
  STRATA_ASSERT_OK(fetcher_->release(0, held));
  auto taken = next.get();
  STRATA_ASSERT_OK(taken.status());
  STRATA_ASSERT_OK(rig_->compute->synchronize());
  const float* data = static_cast<const float*>(*taken);
  EXPECT_EQ(std::vector<float>(data, data + shard_), values(slots_, 0));
}

TEST_F(ParamFetcherTest, AFetchWaitsForTheVersionItsUseNeeds) {
  build(fp32_options());
  const uint64_t request = fetcher_->plan_fetch(2, 1, 1);
  auto next = std::async(std::launch::async, [&] {
    PipelineState position;
    return fetcher_->take(request, &position);
  });
  EXPECT_EQ(next.wait_for(kSettle), std::future_status::timeout) << "fetched before version 1 was published";
  // The optimizer's part: the new values in place, then the version.
  STRATA_ASSERT_OK(shards_->store_values(2, 0, 0, values(2, 1)));
  versions_->publish(2, 1);
  auto taken = next.get();
  STRATA_ASSERT_OK(taken.status());
  STRATA_ASSERT_OK(rig_->compute->synchronize());
  const float* data = static_cast<const float*>(*taken);
  EXPECT_EQ(std::vector<float>(data, data + shard_), values(2, 1));
}

TEST_F(ParamFetcherTest, NvmeReadsRunAheadOfTheFillsByAtMostThePrefetchDepth) {
  auto counter = std::make_shared<IoFaultInjector>(std::vector<IoFaultRule>{{{IoOp::kRead, "swap", ~uint64_t{0}}, IoFaultAction::kFail, EIO}});
  EngineOptions o = fp32_options();
  o.param_tier = Tier::kNvme;
  o.nvme_path = dir_.str();
  o.io_faults = counter;
  o.prefetch_depth = 2;
  build(o);
  const int depth = rig_->plan.prefetch_depth;
  const uint64_t reads_before = counter->matched(0);
  std::vector<uint64_t> requests;
  for (int i = 0; i < 2 * kGroups; ++i) requests.push_back(fetcher_->plan_fetch(i % kGroups, 0, 0));
  // Nobody takes or releases: every slot fills once, and reads go at most `depth` beyond.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (counter->matched(0) - reads_before < static_cast<uint64_t>(slots_) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::this_thread::sleep_for(kSettle);
  const uint64_t ahead = counter->matched(0) - reads_before;
  EXPECT_GE(ahead, static_cast<uint64_t>(slots_)) << "every slot's first fill is read";
  EXPECT_LE(ahead, static_cast<uint64_t>(slots_ + depth)) << "reads ran further ahead than the prefetch depth";
  for (int i = 0; i < 2 * kGroups; ++i)
    STRATA_ASSERT_OK(fetcher_->release(i % kGroups, take_and_check(requests[static_cast<size_t>(i)], values(i % kGroups, 0))));
  EXPECT_EQ(counter->matched(0) - reads_before, static_cast<uint64_t>(2 * kGroups)) << "one read per fetch";
}

}  // namespace
}  // namespace strata::engine_internal
