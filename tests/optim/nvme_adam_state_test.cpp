// Adam state on NVMe: the read-ahead / step / write-back pipeline gives the in-memory
// CPU Adam's bits exactly, whatever the slot count, the piece size (groups split by a
// small pinned budget), the group order, the moment dtype and the I/O engine; a skipped
// step does no I/O; a corrupted block surfaces as the step's error.
#include "optim/nvme_adam_state.h"

#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <chrono>
#include <numeric>
#include <string>
#include <vector>

#include "tests/optim/adam_test_data.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

using testing::AdamShardData;

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * kKiB;

struct StoreSetup {
  std::unique_ptr<PinnedArena> arena;
  std::unique_ptr<NvmeStore> store;
};

// A store with 64 KiB checksum blocks, so that pieces (multiples of a block) stay small.
StatusOr<StoreSetup> make_setup(const std::string& path, IoEngineKind kind, bool checksums) {
  StoreSetup setup;
  STRATA_ASSIGN_OR_RETURN(setup.arena, PinnedArena::create({.bytes = 16 * kMiB}));
  NvmeStoreOptions options;
  options.nvme_path = path;
  options.checksums = checksums;
  options.checksum_block_bytes = 64 * kKiB;
  options.growth_bytes = 8 * kMiB;
  options.io.kind = kind;
  options.io.queue_depth = 16;
  STRATA_ASSIGN_OR_RETURN(setup.store, NvmeStore::open(options));
  return setup;
}

struct PipelineCase {
  const char* name;
  IoEngineKind io;
  bool checksums;
  DType moment;
  unsigned slots;
  size_t budget;         // pinned staging; small enough to split groups into pieces
  bool reverse_order;    // step groups in reverse (backward) order
};

class NvmeAdamStateTest : public ::testing::TestWithParam<PipelineCase> {};

// Three steps through NVMe equal three steps in memory, bit for bit.
TEST_P(NvmeAdamStateTest, StepsAreBitIdenticalToTheInMemoryPath) {
  const PipelineCase& c = GetParam();
  testing::TempDir dir;
  auto setup_or = make_setup(dir.str() + "/nvme", c.io, c.checksums);
  if (!setup_or.ok() && setup_or.status().code() == StatusCode::kUnavailable) GTEST_SKIP() << setup_or.status().message();
  STRATA_ASSERT_OK(setup_or);
  StoreSetup setup = std::move(setup_or).value();

  const std::vector<size_t> sizes{100003, 7, 70000, 4097};
  std::vector<AdamShardData> memory, nvme;
  for (size_t g = 0; g < sizes.size(); ++g) {
    memory.push_back(AdamShardData::random(sizes[g], DType::kBFloat16, c.moment, true, DType::kBFloat16, 100 + static_cast<uint32_t>(g)));
    nvme.push_back(memory.back());
  }
  STRATA_ASSERT_OK_AND_ASSIGN(
      auto state, NvmeAdamState::create(*setup.store, *setup.arena, sizes,
                                        {.key_prefix = "test", .moment_type = c.moment, .pinned_budget_bytes = c.budget, .slots = c.slots}));
  EXPECT_LT(state->piece_elements(), sizes[0]) << "the budget should split the largest group";
  for (size_t g = 0; g < sizes.size(); ++g) {
    const kernels::AdamBuffers b = nvme[g].buffers();
    STRATA_ASSERT_OK(state->store_group(g, b.master, b.exp_avg, b.exp_avg_sq));
  }
  std::vector<size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), 0);
  if (c.reverse_order) std::reverse(order.begin(), order.end());

  STRATA_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::create({.threads = 2, .chunk_elements = 4096}));
  for (int64_t step = 1; step <= 3; ++step) {
    const kernels::AdamHyperparams hyper{.lr = 1e-3 * static_cast<double>(step), .weight_decay = 0.01};
    STRATA_ASSERT_OK_AND_ASSIGN(AdamStepPlan plan, plan_adam_step(hyper, step, {}, {}));
    std::vector<AdamGroupIo> io;
    for (size_t g = 0; g < sizes.size(); ++g) {
      STRATA_ASSERT_OK(adam.step(memory[g].buffers(), plan));
      const kernels::AdamBuffers b = nvme[g].buffers();
      io.push_back({b.grad, b.grad_type, b.param, b.param_type});
    }
    STRATA_ASSERT_OK(state->step(adam, io, plan, order));
    // The parameter copies are written during the step, straight into the caller's buffers.
    for (size_t g = 0; g < sizes.size(); ++g) ASSERT_EQ(nvme[g].param, memory[g].param) << "group " << g << " step " << step;
  }
  for (size_t g = 0; g < sizes.size(); ++g) {
    AdamShardData loaded = nvme[g];
    const kernels::AdamBuffers b = loaded.buffers();
    STRATA_ASSERT_OK(state->load_group(g, b.master, b.exp_avg, b.exp_avg_sq));
    EXPECT_EQ(loaded.master, memory[g].master) << "group " << g;
    EXPECT_EQ(loaded.exp_avg, memory[g].exp_avg) << "group " << g;
    EXPECT_EQ(loaded.exp_avg_sq, memory[g].exp_avg_sq) << "group " << g;
  }
  const NvmeAdamStateStats stats = state->stats();
  const size_t total = std::accumulate(sizes.begin(), sizes.end(), size_t{0});
  EXPECT_EQ(stats.steps, 3u);
  EXPECT_EQ(stats.bytes_read, 3 * total * state->state_bytes_per_element());
  EXPECT_EQ(stats.bytes_written, stats.bytes_read);
  EXPECT_GT(stats.pieces, 3 * sizes.size());
}

INSTANTIATE_TEST_SUITE_P(
    Pipelines, NvmeAdamStateTest,
    ::testing::Values(PipelineCase{"uring_fp32_3slots", IoEngineKind::kAuto, true, DType::kFloat32, 3, 3 * 900 * kKiB, false},
                      PipelineCase{"uring_bf16_4slots_reverse", IoEngineKind::kAuto, true, DType::kBFloat16, 4, 4 * 600 * kKiB, true},
                      PipelineCase{"psync_fp32_5slots_nochecksum", IoEngineKind::kPsync, false, DType::kFloat32, 5, 5 * 300 * kKiB, true},
                      PipelineCase{"psync_bf16_3slots", IoEngineKind::kPsync, true, DType::kBFloat16, 3, 3 * 400 * kKiB, false}),
    [](const auto& info) { return std::string(info.param.name); });

// The engine's form: gradients stored beside the state and read with each piece, new
// parameters staged in the slot and handed to a sink piece by piece, two plans per group
// (decayed and not), groups stepped twice in back-to-back passes whose write-backs stay
// in flight between them: the bits of the in-memory path, and transfers reported with
// their completion times.
TEST_P(NvmeAdamStateTest, StoredGradientsAndStagedParametersGiveTheBitsOfTheInMemoryPath) {
  const PipelineCase& c = GetParam();
  testing::TempDir dir;
  auto setup_or = make_setup(dir.str() + "/nvme", c.io, c.checksums);
  if (!setup_or.ok() && setup_or.status().code() == StatusCode::kUnavailable) GTEST_SKIP() << setup_or.status().message();
  STRATA_ASSERT_OK(setup_or);
  StoreSetup setup = std::move(setup_or).value();
  const std::vector<size_t> sizes{100003, 7, 70000};
  std::vector<AdamShardData> memory;
  for (size_t g = 0; g < sizes.size(); ++g)
    memory.push_back(AdamShardData::random(sizes[g], DType::kBFloat16, c.moment, true, DType::kBFloat16, 300 + static_cast<uint32_t>(g)));
  NvmeAdamStateOptions options{.key_prefix = "engine", .moment_type = c.moment, .pinned_budget_bytes = 2 * c.budget, .slots = c.slots};
  options.stored_gradient_type = DType::kBFloat16;
  options.staged_param_type = DType::kBFloat16;
  STRATA_ASSERT_OK_AND_ASSIGN(auto state, NvmeAdamState::create(*setup.store, *setup.arena, sizes, options));
  EXPECT_LT(state->piece_elements(), sizes[0]) << "the budget should split the largest group";
  std::vector<std::vector<uint8_t>> staged(sizes.size());
  for (size_t g = 0; g < sizes.size(); ++g) {
    const kernels::AdamBuffers b = memory[g].buffers();
    STRATA_ASSERT_OK(state->store_group(g, b.master, b.exp_avg, b.exp_avg_sq));
    STRATA_ASSERT_OK(state->store_gradient(g, 0, b.grad));
    staged[g].assign(sizes[g] * 2, 0);
  }
  STRATA_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::create({.threads = 2, .chunk_elements = 4096}));
  size_t transfers = 0;
  bool completion_in_order = true;
  for (int64_t step = 1; step <= 2; ++step) {
    const kernels::AdamHyperparams hyper{.lr = 1e-3, .weight_decay = 0.1};
    STRATA_ASSERT_OK_AND_ASSIGN(AdamStepPlan decay, plan_adam_step(hyper, step, {}, {}));
    STRATA_ASSERT_OK_AND_ASSIGN(AdamStepPlan no_decay, plan_adam_step({.lr = 1e-3, .weight_decay = 0.0}, step, {}, {}));
    std::vector<std::vector<AdamPlanRun>> runs;
    std::vector<NvmeAdamGroupStep> steps;
    for (size_t g = 0; g < sizes.size(); ++g) {
      const size_t half = sizes[g] / 2;
      runs.push_back({{0, half, &decay}, {half, sizes[g], &no_decay}});
      for (const AdamPlanRun& run : runs.back())
        STRATA_ASSERT_OK(adam.step(adam_buffers_slice(memory[g].buffers(), run.begin, run.end), *run.plan));
    }
    for (size_t g = 0; g < sizes.size(); ++g) {
      AdamGroupIo io;
      io.grad_type = DType::kBFloat16;  // stored: read with each piece
      io.param_type = DType::kBFloat16;  // staged: handed to the sink
      steps.push_back({g, io, runs[g]});
    }
    NvmeAdamStepSinks sinks;
    sinks.staged_params = [&](size_t g, size_t begin, size_t end, const void* param) {
      std::memcpy(staged[g].data() + begin * 2, param, (end - begin) * 2);
      return Status();
    };
    sinks.transfer_done = [&](size_t, bool, std::chrono::steady_clock::time_point begin, std::chrono::steady_clock::time_point end) {
      ++transfers;
      completion_in_order = completion_in_order && begin <= end;
    };
    STRATA_ASSERT_OK(state->step_groups(adam, steps, sinks));
    for (size_t g = 0; g < sizes.size(); ++g) ASSERT_EQ(staged[g], memory[g].param) << "group " << g << " step " << step;
  }
  // The second pass read what the first wrote back, and load_group waits for the last
  // write-backs left in flight.
  for (size_t g = 0; g < sizes.size(); ++g) {
    AdamShardData loaded = memory[g];
    const kernels::AdamBuffers b = loaded.buffers();
    STRATA_ASSERT_OK(state->load_group(g, b.master, b.exp_avg, b.exp_avg_sq));
    EXPECT_EQ(loaded.master, memory[g].master) << "group " << g;
    EXPECT_EQ(loaded.exp_avg, memory[g].exp_avg) << "group " << g;
    EXPECT_EQ(loaded.exp_avg_sq, memory[g].exp_avg_sq) << "group " << g;
  }
  EXPECT_GT(transfers, 2 * sizes.size());
  EXPECT_TRUE(completion_in_order) << "a transfer reported ending before it began";
}

TEST(NvmeAdamStateErrorsTest, SkippedStepDoesNoIoAndBadArgumentsAreNamed) {
  testing::TempDir dir;
  auto setup_or = make_setup(dir.str() + "/nvme", IoEngineKind::kAuto, true);
  if (!setup_or.ok() && setup_or.status().code() == StatusCode::kUnavailable) GTEST_SKIP() << setup_or.status().message();
  STRATA_ASSERT_OK(setup_or);
  StoreSetup setup = std::move(setup_or).value();

  auto tiny = NvmeAdamState::create(*setup.store, *setup.arena, {1000}, {.pinned_budget_bytes = 64 * kKiB});
  ASSERT_FALSE(tiny.ok());
  EXPECT_NE(tiny.status().message().find("budget"), std::string::npos) << tiny.status().message();
  auto two_slots = NvmeAdamState::create(*setup.store, *setup.arena, {1000}, {.slots = 2});
  ASSERT_FALSE(two_slots.ok());
  EXPECT_NE(two_slots.status().message().find("slots"), std::string::npos);
  auto fp16 = NvmeAdamState::create(*setup.store, *setup.arena, {1000}, {.moment_type = DType::kFloat16});
  EXPECT_FALSE(fp16.ok());

  STRATA_ASSERT_OK_AND_ASSIGN(auto state, NvmeAdamState::create(*setup.store, *setup.arena, {5000, 3000},
                                                                {.pinned_budget_bytes = 3 * 900 * kKiB}));
  AdamShardData a = AdamShardData::random(5000, DType::kFloat16, DType::kFloat32, true, DType::kFloat16, 1);
  AdamShardData b = AdamShardData::random(3000, DType::kFloat16, DType::kFloat32, true, DType::kFloat16, 2);
  STRATA_ASSERT_OK(state->store_group(0, a.master.data(), a.exp_avg.data(), a.exp_avg_sq.data()));
  STRATA_ASSERT_OK(state->store_group(1, b.master.data(), b.exp_avg.data(), b.exp_avg_sq.data()));
  STRATA_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::create({.threads = 2}));
  const std::vector<AdamGroupIo> io{{a.grad.data(), DType::kFloat16, a.param.data(), DType::kFloat16},
                                    {b.grad.data(), DType::kFloat16, b.param.data(), DType::kFloat16}};
  // fp16 overflow: the plan skips, and the state is neither read nor written.
  STRATA_ASSERT_OK_AND_ASSIGN(AdamStepPlan skip, plan_adam_step({}, 1, {.sum_of_squares = 0, .non_finite = true}, {.loss_scale = 65536.0f}));
  ASSERT_TRUE(skip.skip);
  const std::vector<uint8_t> param_before = a.param;
  STRATA_ASSERT_OK(state->step(adam, io, skip));
  EXPECT_EQ(state->stats().bytes_read, 0u);
  EXPECT_EQ(state->stats().bytes_written, 0u);
  EXPECT_EQ(a.param, param_before);

  STRATA_ASSERT_OK_AND_ASSIGN(AdamStepPlan plan, plan_adam_step({}, 1, {}, {}));
  EXPECT_FALSE(state->step(adam, std::span<const AdamGroupIo>(io.data(), 1), plan).ok()) << "one group's io for two groups";
  const std::vector<size_t> bad_order{0, 7};
  auto status = state->step(adam, io, plan, bad_order);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("group 7"), std::string::npos) << status.message();
  EXPECT_FALSE(state->store_group(2, a.master.data(), a.exp_avg.data(), a.exp_avg_sq.data()).ok());
}

// An array stored in ranges is the array stored whole, at an odd size with bf16 moments
// (ranges on the store's checksum blocks: 16 Ki fp32 or 32 Ki bf16 elements here); a range
// off the blocks or past the group's end is an error naming the group.
TEST(NvmeAdamStateErrorsTest, RangesOfAnArrayHoldWhatTheWholeArrayHolds) {
  testing::TempDir dir;
  auto setup_or = make_setup(dir.str() + "/nvme", IoEngineKind::kAuto, true);
  if (!setup_or.ok() && setup_or.status().code() == StatusCode::kUnavailable) GTEST_SKIP() << setup_or.status().message();
  STRATA_ASSERT_OK(setup_or);
  StoreSetup setup = std::move(setup_or).value();
  constexpr size_t kN = 70001, kCut = 32768;
  STRATA_ASSERT_OK_AND_ASSIGN(auto state, NvmeAdamState::create(*setup.store, *setup.arena, {kN}, {.moment_type = DType::kBFloat16}));
  AdamShardData a = AdamShardData::random(kN, DType::kBFloat16, DType::kBFloat16, false, DType::kBFloat16, 3);
  using Array = NvmeAdamState::Array;
  STRATA_ASSERT_OK(state->store_range(0, Array::kMaster, kCut, kN - kCut, a.master.data() + kCut));
  STRATA_ASSERT_OK(state->store_range(0, Array::kMaster, 0, kCut, a.master.data()));
  STRATA_ASSERT_OK(state->store_range(0, Array::kExpAvg, 0, kN, a.exp_avg.data()));
  STRATA_ASSERT_OK(state->store_range(0, Array::kExpAvgSq, kCut, kN - kCut, a.exp_avg_sq.data() + kCut * 2));
  STRATA_ASSERT_OK(state->store_range(0, Array::kExpAvgSq, 0, kCut, a.exp_avg_sq.data()));
  AdamShardData back = AdamShardData::random(kN, DType::kBFloat16, DType::kBFloat16, false, DType::kBFloat16, 4);
  STRATA_ASSERT_OK(state->load_group(0, back.master.data(), back.exp_avg.data(), back.exp_avg_sq.data()));
  EXPECT_EQ(back.master, a.master);
  EXPECT_EQ(back.exp_avg, a.exp_avg);
  EXPECT_EQ(back.exp_avg_sq, a.exp_avg_sq);
  std::vector<float> middle(kCut);
  STRATA_ASSERT_OK(state->load_range(0, Array::kMaster, 16384, kCut, middle.data()));
  EXPECT_TRUE(std::equal(middle.begin(), middle.end(), a.master.begin() + 16384));
  const Status off = state->load_range(0, Array::kMaster, 100, 200, middle.data());
  EXPECT_FALSE(off.ok());
  EXPECT_NE(off.to_string().find("group 0 master elements [100, 300)"), std::string::npos) << off.to_string();
  const Status past = state->store_range(0, Array::kExpAvg, kCut, kN, a.exp_avg.data());
  EXPECT_EQ(past.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(past.to_string().find("exp_avg"), std::string::npos) << past.to_string();
}

// A block corrupted on disk behind the store's back fails the step that reads it (the
// checksum catches it on the I/O thread), and the error names the group.
TEST(NvmeAdamStateErrorsTest, CorruptedStateFailsTheStepWithDataLoss) {
  testing::TempDir dir;
  auto setup_or = make_setup(dir.str() + "/nvme", IoEngineKind::kAuto, true);
  if (!setup_or.ok() && setup_or.status().code() == StatusCode::kUnavailable) GTEST_SKIP() << setup_or.status().message();
  STRATA_ASSERT_OK(setup_or);
  StoreSetup setup = std::move(setup_or).value();
  STRATA_ASSERT_OK_AND_ASSIGN(auto state, NvmeAdamState::create(*setup.store, *setup.arena, {40000, 40000},
                                                                {.key_prefix = "corrupt", .pinned_budget_bytes = 3 * 900 * kKiB}));
  std::vector<AdamShardData> groups{AdamShardData::random(40000, DType::kBFloat16, DType::kFloat32, false, DType::kBFloat16, 3),
                                    AdamShardData::random(40000, DType::kBFloat16, DType::kFloat32, false, DType::kBFloat16, 4)};
  for (size_t g = 0; g < 2; ++g) STRATA_ASSERT_OK(state->store_group(g, groups[g].master.data(), groups[g].exp_avg.data(), groups[g].exp_avg_sq.data()));
  STRATA_ASSERT_OK(setup.store->wait_all());

  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent extent, setup.store->find("corrupt/group1/exp_avg_sq"));
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtentInfo info, setup.store->info(extent));
  const int fd = ::open(setup.store->file_path().c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  const char garbage[16] = "not adam state!";
  ASSERT_EQ(::pwrite(fd, garbage, sizeof(garbage), static_cast<off_t>(info.file_offset + 100)), static_cast<ssize_t>(sizeof(garbage)));
  ::fsync(fd);
  ::close(fd);

  STRATA_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::create({.threads = 2}));
  const std::vector<AdamGroupIo> io{{groups[0].grad.data(), DType::kBFloat16, nullptr, DType::kBFloat16},
                                    {groups[1].grad.data(), DType::kBFloat16, nullptr, DType::kBFloat16}};
  STRATA_ASSERT_OK_AND_ASSIGN(AdamStepPlan plan, plan_adam_step({}, 1, {}, {}));
  const Status status = state->step(adam, io, plan);
  if (status.ok()) GTEST_SKIP() << "the corruption was not visible through the store (page cache under O_DIRECT fallback?)";
  EXPECT_EQ(status.code(), StatusCode::kDataLoss) << status.to_string();
  EXPECT_NE(status.to_string().find("group 1"), std::string::npos) << status.to_string();
}

}  // namespace
}  // namespace strata
