// The shard store on its own, in each parameter tier (device, pinned, host, NVMe): the
// values stored at allocation read back exactly, a write lands where it is asked,
// a version's source is in the tier's form, delayed mode keeps two copies by version
// parity (a frozen group one), and only the host tiers lend a copy to write in place.
#include "engine/shard_store.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/engine/stage_rig.h"
#include "tests/support/test_support.h"

namespace strata::engine_internal {
namespace {

struct TierCase {
  Tier tier;
  OverlapMode overlap;
};

std::string case_name(const ::testing::TestParamInfo<TierCase>& info) {
  return std::string(tier_name(info.param.tier)) + "_" + std::string(overlap_mode_name(info.param.overlap));
}

class ShardStoreTest : public StageTest, public ::testing::WithParamInterface<TierCase> {
 protected:
  void SetUp() override {
    EngineOptions o = fp32_options();
    o.param_tier = GetParam().tier;
    o.overlap = GetParam().overlap;
    if (o.param_tier == Tier::kNvme) o.nvme_path = dir_.str();
    STRATA_ASSERT_OK_AND_ASSIGN(rig_, StageRig::create(o, {one_tensor_group("a", 1000), one_tensor_group("frozen", 300, false)}));
    store_ = std::make_unique<ShardStore>(ShardStoreContext{&rig_->options, rig_->device.get(), rig_->update.get(), rig_->arena.get(),
                                                            rig_->nvme.get(), &rig_->tracer, &rig_->layouts});
  }
  void TearDown() override { store_.reset(); }

  // Allocates group g and stores `values` in every copy.
  Status allocate(int g, const std::vector<float>& values) {
    STRATA_RETURN_IF_ERROR(store_->allocate_group(g));
    for (int c = 0; c < store_->copies(g); ++c) STRATA_RETURN_IF_ERROR(store_->store_values(g, c, 0, values));
    return {};
  }
  std::vector<float> load(int g, int copy) {
    std::vector<float> out(rig_->layouts[static_cast<size_t>(g)].shard_numel, -1.0f);
    Status status = store_->load_values(g, copy, 0, out);
    EXPECT_TRUE(status.ok()) << status.to_string();
    return out;
  }

  std::unique_ptr<ShardStore> store_;
};

TEST_P(ShardStoreTest, ValuesStoredInEveryCopyReadBackExactly) {
  const std::vector<float> values = ramp(rig_->layouts[0].shard_numel, 0.25f);
  STRATA_ASSERT_OK(allocate(0, values));
  for (int c = 0; c < store_->copies(0); ++c) EXPECT_EQ(load(0, c), values) << "copy " << c;
}

TEST_P(ShardStoreTest, DelayedModeKeepsTwoCopiesByVersionParityAndAFrozenGroupOne) {
  const bool delayed = GetParam().overlap == OverlapMode::kDelayed;
  EXPECT_EQ(store_->copies(0), delayed ? 2 : 1);
  EXPECT_EQ(store_->copies(1), 1) << "a frozen group never changes";
  EXPECT_EQ(store_->copy_of(0, 3), delayed ? 1 : 0);
  EXPECT_EQ(store_->copy_of(0, 4), 0);
  EXPECT_EQ(store_->copy_of(1, 3), 0);
}

// NVMe writes cover whole checksum blocks (or run to the extent's end): a small shard
// is written whole there.
TEST_P(ShardStoreTest, AWriteChangesOnlyItsElementsOfItsCopy) {
  const size_t shard = rig_->layouts[0].shard_numel;
  std::vector<float> values = ramp(shard, 1.0f);
  STRATA_ASSERT_OK(allocate(0, values));
  const bool nvme = GetParam().tier == Tier::kNvme;
  const size_t begin = nvme ? 0 : 200;
  const size_t count = nvme ? shard : 100;
  const std::vector<float> update(count, -7.0f);
  const int copy = store_->copies(0) - 1;
  STRATA_ASSERT_OK(store_->write(0, copy, begin, count, update.data(), 0));
  std::vector<float> expected = values;
  std::fill(expected.begin() + static_cast<std::ptrdiff_t>(begin), expected.begin() + static_cast<std::ptrdiff_t>(begin + count), -7.0f);
  EXPECT_EQ(load(0, copy), expected);
  if (copy == 1) {
    EXPECT_EQ(load(0, 0), values) << "the other copy is untouched";
  }
}

TEST_P(ShardStoreTest, AVersionsSourceIsInTheTiersFormAndOnlyHostTiersLendACopy) {
  const std::vector<float> values = ramp(rig_->layouts[0].shard_numel, 0.5f);
  STRATA_ASSERT_OK(allocate(0, values));
  const Tier tier = GetParam().tier;
  const ParamSource where = store_->source(0, 1);
  EXPECT_EQ(where.tier, tier);
  EXPECT_EQ(where.host != nullptr, tier_is_host(tier));
  EXPECT_EQ(where.device != nullptr, tier == Tier::kDevice);
  EXPECT_EQ(store_->host_copy(0, 0) != nullptr, tier_is_host(tier));
  EXPECT_EQ(store_->device_copy(0, 0) != nullptr, tier == Tier::kDevice);
  if (tier_is_host(tier)) {
    EXPECT_EQ(where.host, store_->host_copy(0, store_->copy_of(0, 1)));
    EXPECT_EQ(std::memcmp(where.host, values.data(), values.size() * sizeof(float)), 0);
  }
}

// CPU Adam writes a version in place wherever the memory is the host's: a host tier's
// copy, or the device tier's on the CPU device (the rig's device); NVMe copies are staged.
TEST_P(ShardStoreTest, CpuAdamWritesInPlaceWhereverTheCopyIsHostMemory) {
  const std::vector<float> values = ramp(rig_->layouts[0].shard_numel, 0.5f);
  STRATA_ASSERT_OK(allocate(0, values));
  const Tier tier = GetParam().tier;
  ASSERT_EQ(rig_->device->kind(), DeviceKind::kCpu);
  const int copy = store_->copies(0) - 1;
  void* target = store_->host_writable_copy(0, copy);
  if (tier == Tier::kNvme) {
    EXPECT_EQ(target, nullptr);
    return;
  }
  EXPECT_EQ(target, tier == Tier::kDevice ? store_->device_copy(0, copy) : store_->host_copy(0, copy));
  ASSERT_NE(target, nullptr);
  static_cast<float*>(target)[3] = -2.0f;
  std::vector<float> expected = values;
  expected[3] = -2.0f;
  EXPECT_EQ(load(0, copy), expected);
}

TEST_P(ShardStoreTest, BfloatParametersReadBackAsTheRoundedValues) {
  rig_->options.param_dtype = DType::kBFloat16;
  store_ = std::make_unique<ShardStore>(ShardStoreContext{&rig_->options, rig_->device.get(), rig_->update.get(), rig_->arena.get(),
                                                          rig_->nvme.get(), &rig_->tracer, &rig_->layouts});
  const std::vector<float> values = ramp(rig_->layouts[0].shard_numel, 0.1f);
  STRATA_ASSERT_OK(allocate(0, values));
  const std::vector<float> back = load(0, 0);
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t bits = 0;
    store_from_float(&bits, DType::kBFloat16, 0, values[i]);
    ASSERT_EQ(back[i], load_as_float(&bits, DType::kBFloat16, 0)) << "element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(EachTier, ShardStoreTest,
                         ::testing::Values(TierCase{Tier::kDevice, OverlapMode::kExact}, TierCase{Tier::kPinned, OverlapMode::kExact},
                                           TierCase{Tier::kHost, OverlapMode::kExact}, TierCase{Tier::kNvme, OverlapMode::kExact},
                                           TierCase{Tier::kDevice, OverlapMode::kDelayed}, TierCase{Tier::kPinned, OverlapMode::kDelayed},
                                           TierCase{Tier::kNvme, OverlapMode::kDelayed}),
                         case_name);

}  // namespace
}  // namespace strata::engine_internal
