// The engine against a plain dense trainer, across world sizes, micro-batches, tiers and
// budgets, on the CPU device.
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <bit>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>
#include <atomic>

#include "engine/local_cluster.h"
#include "examples/models/linear_stack.h"
#include "tests/engine/dense_reference.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

using models::LinearStackConfig;

struct EngineRun {
  Status status;
  std::vector<std::vector<float>> masters;  // per group, the full flattened group (numel)
  std::vector<double> losses;               // rank 0's reported loss per step
  std::vector<StepReport> reports;          // rank 0's
  size_t state_bytes = 0;
  EnginePlan plan;                          // rank 0's
  size_t max_high_water = 0;
  std::vector<TraceInterval> rank0_trace;
  int forward_passes = 0;                   // forward-only passes run, all ranks
  int forward_mismatches = 0;               // gathered elements unequal to the masters
};

struct RunSpec {
  LinearStackConfig model;
  int world = 1;
  int micro_batches = 1;
  int steps = 10;
  size_t budget_bytes = size_t{256} << 20;
  bool declare_schedule = true;
  double learning_rate = 1e-2;
  bool forward_pass_after_each_step = false;  // then finish() follows a forward-only pass
};

// How a forward-only pass tells the engine its gathers.
enum class ForwardOrder { kOnDemand, kDeclared, kDeclaredThenDeviating };

// A forward-only pass that gathers every group (last to first, then the last again) and
// counts the elements of this rank's shard that differ from its masters (in the parameter
// dtype): the pass must see the weights after every step taken.
Status forward_pass_sees_the_masters(Engine& engine, int rank, DType param_dtype, ForwardOrder how, int* mismatches) {
  std::vector<std::vector<float>> masters;
  for (int g = 0; g < engine.group_count(); ++g) {
    masters.emplace_back(engine.layout(g).shard_numel);
    STRATA_RETURN_IF_ERROR(engine.read_state_shard(g, Engine::StateKind::kMaster, masters.back()));
  }
  std::vector<int> order;
  for (int g = engine.group_count() - 1; g >= 0; --g) order.push_back(g);
  order.push_back(engine.group_count() - 1);
  std::vector<int> declared;
  if (how != ForwardOrder::kOnDemand) declared = order;
  if (how == ForwardOrder::kDeclaredThenDeviating) std::swap(declared[1], declared[2]);
  STRATA_RETURN_IF_ERROR(engine.begin_forward(declared));
  std::vector<char> gathered;
  for (int g : order) {
    const GroupLayout& layout = engine.layout(g);
    STRATA_ASSIGN_OR_RETURN(GroupView view, engine.gather(g));
    gathered.resize(layout.numel * dtype_size(param_dtype));
    STRATA_RETURN_IF_ERROR(engine.device().copy_async(gathered.data(), view.flat, gathered.size(), CopyKind::kDeviceToHost,
                                                      engine.compute_stream()));
    STRATA_RETURN_IF_ERROR(engine.compute_stream().synchronize());
    STRATA_RETURN_IF_ERROR(engine.release(g));
    const size_t begin = layout.shard_begin(rank);
    for (size_t i = 0; i < layout.shard_numel && begin + i < layout.numel; ++i) {
      char rounded[4];
      store_from_float(rounded, param_dtype, 0, masters[static_cast<size_t>(g)][i]);
      const float expected = load_as_float(rounded, param_dtype, 0);
      const float got = load_as_float(gathered.data(), param_dtype, begin + i);
      if (std::bit_cast<uint32_t>(got) != std::bit_cast<uint32_t>(expected)) ++*mismatches;
    }
  }
  return engine.end_forward();
}

EngineOptions fp32_options() {
  EngineOptions options;
  options.param_dtype = DType::kFloat32;
  options.grad_wire_dtype = DType::kFloat32;
  options.grad_transfer_dtype = DType::kFloat32;
  options.param_tier = Tier::kPinned;
  options.optimizer_tier = Tier::kPinned;
  options.adam.lr = 1e-2;
  options.adam.weight_decay = 0.01;
  // Adam's update g / (|g| + eps) turns fp32 rounding differences in gradients far below
  // eps into visible differences (two correct fp32 trainers sum in different orders); an
  // eps of 1e-6 keeps those gradients from deciding the comparison.
  options.adam.eps = 1e-6;
  options.gradient_clipping = 1.0f;
  options.seed = 99;
  options.optimizer_threads = 1;
  return options;
}

EngineRun run_engine(const EngineOptions& base, const RunSpec& spec) {
  EngineRun run;
  LocalClusterOptions cluster_options;
  cluster_options.world_size = spec.world;
  cluster_options.device_budget_bytes = spec.budget_bytes;
  cluster_options.compute_threads = 1;
  cluster_options.collective_timeout = std::chrono::seconds(60);
  auto cluster = LocalCluster::create(cluster_options);
  if (!cluster.ok()) {
    run.status = cluster.status();
    return run;
  }
  const auto specs = models::linear_stack_groups(spec.model);
  for (size_t g = 0; g < specs.size(); ++g) run.masters.emplace_back(layout_group(specs[g], int(g), 1)->numel);
  std::mutex mutex;
  run.status = (*cluster)->run([&](int rank) -> Status {
    EngineOptions options = base;
    options.rank = rank;
    options.world_size = spec.world;
    options.gradient_accumulation_steps = spec.micro_batches;
    options.activation_bytes = models::linear_stack_activation_bytes(spec.model, spec.model.global_rows / spec.world, options.param_dtype);
    STRATA_ASSIGN_OR_RETURN(auto engine, Engine::create(options, (*cluster)->device(rank), (*cluster)->gather_communicator(rank),
                                                        (*cluster)->reduce_communicator(rank)));
    STRATA_ASSIGN_OR_RETURN(auto model, models::LinearStackModel::create(*engine, spec.model, rank, spec.world, spec.declare_schedule));
    STRATA_RETURN_IF_ERROR(engine->start());
    STRATA_RETURN_IF_ERROR(model->allocate());
    int forward_passes = 0, forward_mismatches = 0;
    for (int s = 0; s < spec.steps; ++s) {
      STRATA_ASSIGN_OR_RETURN(StepReport report, model->train_step(s, spec.micro_batches, spec.learning_rate));
      if (rank == 0) {
        run.losses.push_back(report.loss);
        run.reports.push_back(report);
      }
      if (spec.forward_pass_after_each_step) {
        const ForwardOrder how = static_cast<ForwardOrder>(s % 3);
        STRATA_RETURN_IF_ERROR(forward_pass_sees_the_masters(*engine, rank, options.param_dtype, how, &forward_mismatches));
        ++forward_passes;
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex);
      run.forward_passes += forward_passes;
      run.forward_mismatches += forward_mismatches;
    }
    STRATA_RETURN_IF_ERROR(engine->finish());
    std::vector<float> shard;
    for (int g = 0; g < engine->group_count(); ++g) {
      const GroupLayout& layout = engine->layout(g);
      shard.resize(layout.shard_numel);
      STRATA_RETURN_IF_ERROR(engine->read_state_shard(g, Engine::StateKind::kMaster, shard));
      const size_t begin = layout.shard_begin(rank);
      std::lock_guard<std::mutex> lock(mutex);
      for (size_t i = 0; i < layout.shard_numel && begin + i < layout.numel; ++i) run.masters[size_t(g)][begin + i] = shard[i];
    }
    std::lock_guard<std::mutex> lock(mutex);
    run.max_high_water = std::max(run.max_high_water, (*cluster)->device(rank).memory_stats().high_water_bytes);
    if (rank == 0) {
      run.state_bytes = engine->plan().state_bytes;
      run.plan = engine->plan();
      run.rank0_trace = engine->tracer().intervals();
    }
    return {};
  });
  return run;
}

// One rank with a 64 MiB device budget.
StatusOr<std::unique_ptr<LocalCluster>> one_rank_cluster() {
  LocalClusterOptions options;
  options.world_size = 1;
  options.device_budget_bytes = size_t{64} << 20;
  return LocalCluster::create(options);
}

LinearStackConfig small_model() {
  LinearStackConfig model;
  model.features = 24;
  model.width = 40;
  model.layers = 3;
  model.global_rows = 8;
  return model;
}

// --------------------------------------------------------------------------------------

struct DenseCase {
  int world;
  int micro_batches;
};

class EngineMatchesDense : public ::testing::TestWithParam<DenseCase> {};

TEST_P(EngineMatchesDense, After10StepsInFp32) {
  RunSpec spec;
  spec.model = small_model();
  spec.world = GetParam().world;
  spec.micro_batches = GetParam().micro_batches;
  const EngineOptions options = fp32_options();
  EngineRun run = run_engine(options, spec);
  STRATA_ASSERT_OK(run.status);
  testing::DenseLinearStack dense(spec.model, options.seed, options.adam, options.gradient_clipping);
  std::vector<double> dense_losses;
  for (int s = 0; s < spec.steps; ++s) dense_losses.push_back(dense.step(s, spec.micro_batches, spec.learning_rate));
  for (size_t g = 0; g < run.masters.size(); ++g) {
    const double error = testing::relative_error(run.masters[g].data(), dense.params(int(g)).data(), run.masters[g].size());
    EXPECT_LT(error, 1e-5) << "group " << g << " world " << spec.world << " micro-batches " << spec.micro_batches;
  }
  // The losses agree step by step (rank 0 reports its own rows for world > 1, so only
  // the world-1 losses are the full-batch loss).
  if (spec.world == 1) {
    for (int s = 0; s < spec.steps; ++s) EXPECT_NEAR(run.losses[s], dense_losses[s], 1e-4 * std::abs(dense_losses[s]));
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsAndAccumulation, EngineMatchesDense,
                         ::testing::Values(DenseCase{1, 1}, DenseCase{2, 1}, DenseCase{4, 1}, DenseCase{1, 2}, DenseCase{2, 2},
                                           DenseCase{4, 3}),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.world) + "_micro" + std::to_string(info.param.micro_batches);
                         });

// --------------------------------------------------------------------------------------

// Small groups under the persistence threshold stay gathered on the device (fetched once
// per step); the result must not change.
// A checkpoint load declares the groups it writes: start() draws and writes no initial
// values for them (the counter says how many it did initialize), zeroes their moments, and
// the loaded values are what the first gather sees; other groups are initialized as ever.
TEST(EngineTest, GroupsDeclaredLoadedAreNotInitializedAndTakeTheLoadedValues) {
  testing::TempDir dir;
  for (Tier tier : {Tier::kPinned, Tier::kNvme}) {
    SCOPED_TRACE(std::string(tier_name(tier)));
    STRATA_ASSERT_OK_AND_ASSIGN(auto cluster, one_rank_cluster());
    const auto specs = models::linear_stack_groups(small_model());
    auto start = [&](bool declare, std::unique_ptr<Engine>& engine) -> Status {
      EngineOptions options = fp32_options();
      options.param_tier = tier;
      options.optimizer_tier = tier;
      options.nvme_path = (dir.path() / ("nvme-" + std::string(tier_name(tier)) + (declare ? "-loaded" : "-drawn"))).string();
      STRATA_ASSIGN_OR_RETURN(engine, Engine::create(options, cluster->device(0), cluster->gather_communicator(0), cluster->reduce_communicator(0)));
      for (const GroupSpec& spec : specs) STRATA_RETURN_IF_ERROR(engine->register_group(spec).status());
      if (declare)
        for (int g = 0; g + 1 < int(specs.size()); ++g) STRATA_RETURN_IF_ERROR(engine->declare_loaded(g));
      EXPECT_FALSE(engine->declare_loaded(int(specs.size())).ok());
      STRATA_RETURN_IF_ERROR(engine->start());
      EXPECT_FALSE(engine->declare_loaded(0).ok());  // after start()
      return {};
    };
    std::unique_ptr<Engine> drawn, loaded;
    STRATA_ASSERT_OK(start(false, drawn));
    STRATA_ASSERT_OK(start(true, loaded));
    const int groups = int(specs.size());
    EXPECT_EQ(drawn->initialized_group_count(), groups);
    EXPECT_EQ(loaded->initialized_group_count(), 1);
    // The load: values unlike the initial ones into every declared group.
    for (int g = 0; g < groups; ++g) {
      std::vector<float> shard(loaded->layout(g).shard_numel);
      if (g + 1 < groups) {
        for (size_t i = 0; i < shard.size(); ++i) shard[i] = i < loaded->layout(g).numel ? 0.5f + 0.001f * float(i % 97) : 0.0f;
        STRATA_ASSERT_OK(loaded->write_state_shard(g, Engine::StateKind::kMaster, shard));
      }
      for (Engine::StateKind kind : {Engine::StateKind::kExpAvg, Engine::StateKind::kExpAvgSq}) {
        STRATA_ASSERT_OK(loaded->read_state_shard(g, kind, shard));
        for (float v : shard) ASSERT_EQ(v, 0.0f) << "group " << g;
      }
    }
    STRATA_ASSERT_OK(loaded->refresh_parameters());
    // The group nobody loads has the initial values a plain start gives it.
    std::vector<float> a(drawn->layout(groups - 1).shard_numel), b(a.size());
    STRATA_ASSERT_OK(drawn->read_state_shard(groups - 1, Engine::StateKind::kMaster, a));
    STRATA_ASSERT_OK(loaded->read_state_shard(groups - 1, Engine::StateKind::kMaster, b));
    EXPECT_EQ(a, b);
    int mismatches = 0;
    STRATA_ASSERT_OK(forward_pass_sees_the_masters(*loaded, 0, DType::kFloat32, ForwardOrder::kOnDemand, &mismatches));
    EXPECT_EQ(mismatches, 0);
    STRATA_ASSERT_OK(drawn->finish());
    STRATA_ASSERT_OK(loaded->finish());
  }
}

// A shard written and read in ranges holds what whole-shard calls move, in every tier
// (an NVMe range is a ranged transfer on checksum blocks); refresh_parameters(), which
// streams a shard in chunks, makes the forward pass see the masters; a range off the
// alignment rule is refused, naming the rule.
TEST(EngineTest, StateRangesMoveWhatWholeShardsMove) {
  testing::TempDir dir;
  LinearStackConfig model = small_model();
  model.width = 1200;  // a hidden layer of 1.44 M elements: over one range alignment
  model.layers = 1;
  for (Tier tier : {Tier::kPinned, Tier::kNvme}) {
    SCOPED_TRACE(std::string(tier_name(tier)));
    STRATA_ASSERT_OK_AND_ASSIGN(auto cluster, one_rank_cluster());
    EngineOptions options = fp32_options();
    options.param_tier = tier;
    options.optimizer_tier = tier;
    options.nvme_path = (dir.path() / ("nvme-" + std::string(tier_name(tier)))).string();
    STRATA_ASSERT_OK_AND_ASSIGN(auto engine, Engine::create(options, cluster->device(0), cluster->gather_communicator(0), cluster->reduce_communicator(0)));
    for (const GroupSpec& spec : models::linear_stack_groups(model)) STRATA_ASSERT_OK(engine->register_group(spec).status());
    STRATA_ASSERT_OK(engine->start());
    int g = 0;
    while (g < engine->group_count() && engine->layout(g).shard_numel <= kStateRangeAlignment) ++g;
    ASSERT_LT(g, engine->group_count());
    const size_t n = engine->layout(g).shard_numel, cut = kStateRangeAlignment;
    std::vector<float> values(n), back(n);
    for (size_t i = 0; i < n; ++i) values[i] = i < engine->layout(g).numel ? 0.25f + 0.001f * float(i % 89) : 0.0f;
    const std::span<const float> all(values);
    for (Engine::StateKind kind : {Engine::StateKind::kMaster, Engine::StateKind::kExpAvg}) {
      STRATA_ASSERT_OK(engine->write_state_range(g, kind, cut, all.subspan(cut)));
      STRATA_ASSERT_OK(engine->write_state_range(g, kind, 0, all.first(cut)));
      STRATA_ASSERT_OK(engine->read_state_shard(g, kind, back));
      EXPECT_EQ(back, values);
      std::vector<float> tail(n - cut);
      STRATA_ASSERT_OK(engine->read_state_range(g, kind, cut, tail));
      EXPECT_TRUE(std::equal(tail.begin(), tail.end(), values.begin() + std::ptrdiff_t(cut)));
    }
    STRATA_ASSERT_OK(engine->refresh_parameters());
    int mismatches = 0;
    STRATA_ASSERT_OK(forward_pass_sees_the_masters(*engine, 0, DType::kFloat32, ForwardOrder::kOnDemand, &mismatches));
    EXPECT_EQ(mismatches, 0);
    std::vector<float> odd(cut - 1);
    const Status off = engine->read_state_range(g, Engine::StateKind::kMaster, 1, odd);
    EXPECT_EQ(off.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(off.to_string().find("must start on a multiple of"), std::string::npos) << off.to_string();
    EXPECT_EQ(engine->read_state_range(g, Engine::StateKind::kMaster, 0, odd).code(), StatusCode::kInvalidArgument);  // ends mid-range
    EXPECT_EQ(engine->write_state_range(g, Engine::StateKind::kMaster, cut, all).code(), StatusCode::kInvalidArgument);  // past the end
    STRATA_ASSERT_OK(engine->finish());
  }
}

TEST(EngineTest, PersistentGroupsTrainTheSame) {
  RunSpec spec;
  spec.model = small_model();
  spec.world = 2;
  spec.micro_batches = 2;
  EngineOptions options = fp32_options();
  options.persistence_threshold = 4096;  // every group of this model pads to 4096 elements at world 2
  EngineRun persistent = run_engine(options, spec);
  STRATA_ASSERT_OK(persistent.status);
  options.persistence_threshold = 0;
  EngineRun streamed = run_engine(options, spec);
  STRATA_ASSERT_OK(streamed.status);
  for (size_t g = 0; g < persistent.masters.size(); ++g)
    EXPECT_EQ(std::memcmp(persistent.masters[g].data(), streamed.masters[g].data(), persistent.masters[g].size() * 4), 0) << "group " << g;
  // Fewer fetches: a persistent group is gathered once per step, not once per use.
  size_t persistent_gathers = 0, streamed_gathers = 0;
  for (const auto& iv : persistent.rank0_trace) persistent_gathers += iv.stage == Stage::kAllGather;
  for (const auto& iv : streamed.rank0_trace) streamed_gathers += iv.stage == Stage::kAllGather;
  EXPECT_LT(persistent_gathers, streamed_gathers);
}

TEST(EngineTest, RecordedScheduleGivesTheSameWeightsAsADeclaredOne) {
  RunSpec spec;
  spec.model = small_model();
  spec.world = 2;
  spec.steps = 4;
  EngineOptions options = fp32_options();
  EngineRun declared = run_engine(options, spec);
  STRATA_ASSERT_OK(declared.status);
  spec.declare_schedule = false;
  EngineRun recorded = run_engine(options, spec);
  STRATA_ASSERT_OK(recorded.status);
  for (size_t g = 0; g < declared.masters.size(); ++g)
    EXPECT_EQ(std::memcmp(declared.masters[g].data(), recorded.masters[g].data(), declared.masters[g].size() * 4), 0) << "group " << g;
}

// A device budget that holds one gradient buffer but not two: the backward waits for each
// group's gradients to leave before writing the next's, and the weights are the same bits.
TEST(EngineTest, OneGradientBufferUnderATightBudgetTrainsTheSameBitsAsTwo) {
  for (int world : {1, 2}) {
    RunSpec spec;
    spec.model = small_model();
    spec.world = world;
    spec.steps = 4;
    spec.micro_batches = 2;
    EngineOptions options = fp32_options();
    options.prefetch_depth = 1;
    EngineRun two = run_engine(options, spec);
    STRATA_ASSERT_OK(two.status);
    ASSERT_FALSE(two.plan.single_gradient_buffer);
    spec.budget_bytes = two.plan.device_bytes - 1;
    EngineRun one = run_engine(options, spec);
    STRATA_ASSERT_OK(one.status);
    ASSERT_TRUE(one.plan.single_gradient_buffer) << one.plan.text;
    EXPECT_EQ(one.plan.gradient_slots, two.plan.gradient_slots - 1);
    EXPECT_LE(one.max_high_water, spec.budget_bytes);
    for (size_t g = 0; g < two.masters.size(); ++g)
      EXPECT_EQ(std::memcmp(two.masters[g].data(), one.masters[g].data(), two.masters[g].size() * 4), 0) << "group " << g << " world " << world;
  }
}

struct PlacementCase {
  Tier params;
  Tier optimizer;
};

std::string placement_name(const PlacementCase& p) {
  return std::string(tier_name(p.params)) + "_" + std::string(tier_name(p.optimizer));
}

// Optimizer state on the device is stepped by the device's Adam kernel from the fp32
// gradient it keeps there, so it joins the comparison when gradients reach the host in
// fp32 too; with bf16 transfers (the default) the host tiers are compared.
struct TransferCase {
  DType transfer;
  std::vector<PlacementCase> placements;
};

TEST(EngineTest, WhereStateLivesDoesNotChangeABit) {
  testing::TempDir dir;
  const std::vector<PlacementCase> host_tiers = {{Tier::kPinned, Tier::kPinned}, {Tier::kPinned, Tier::kNvme},
                                                 {Tier::kDevice, Tier::kPinned}, {Tier::kNvme, Tier::kPinned},
                                                 {Tier::kNvme, Tier::kNvme},     {Tier::kHost, Tier::kHost}};
  std::vector<PlacementCase> all_tiers = host_tiers;
  for (PlacementCase extra : {PlacementCase{Tier::kDevice, Tier::kDevice}, PlacementCase{Tier::kPinned, Tier::kDevice},
                              PlacementCase{Tier::kNvme, Tier::kDevice}})
    all_tiers.push_back(extra);
  for (const TransferCase& transfer : {TransferCase{DType::kBFloat16, host_tiers}, TransferCase{DType::kFloat32, all_tiers}}) {
    for (int world : {1, 4}) {
      std::map<std::string, EngineRun> runs;
      for (PlacementCase placement : transfer.placements) {
        RunSpec spec;
        spec.model = small_model();
        spec.world = world;
        spec.steps = 10;
        EngineOptions options;  // bf16 parameters
        options.grad_transfer_dtype = transfer.transfer;
        options.param_tier = placement.params;
        options.optimizer_tier = placement.optimizer;
        options.pin_memory = placement.params != Tier::kHost;
        options.nvme_path = (dir.path() / ("nvme-" + placement_name(placement) + "-" + std::to_string(world))).string();
        options.adam.lr = 1e-2;
        options.adam.weight_decay = 0.01;
        options.gradient_clipping = 1.0f;
        options.optimizer_threads = 1;
        runs[placement_name(placement)] = run_engine(options, spec);
        ASSERT_TRUE(runs[placement_name(placement)].status.ok())
            << placement_name(placement) << " world " << world << ": " << runs[placement_name(placement)].status.to_string();
      }
      const EngineRun& reference = runs.begin()->second;
      for (const auto& [name, run] : runs) {
        for (size_t g = 0; g < run.masters.size(); ++g)
          EXPECT_EQ(std::memcmp(run.masters[g].data(), reference.masters[g].data(), run.masters[g].size() * 4), 0)
              << name << " vs " << runs.begin()->first << " group " << g << " world " << world << " transfer "
              << dtype_name(transfer.transfer);
      }
    }
  }
}

// NVMe-resident state streams through a ring of chunks smaller than a group
// (sub_group_size) with the gradients spilled beside it: bit-identical to the state in
// pinned memory in every overlap mode, with gradient accumulation, for parameters on
// every tier the new values are written to piece by piece.
TEST(EngineTest, OptimizerStateStreamedInChunksGivesTheBitsOfStateInMemory) {
  testing::TempDir dir;
  struct Mode {
    const char* name;
    OverlapMode overlap;
    float clipping;
    int micro_batches;
    int world;
  };
  const Mode modes[] = {{"exact, clipped", OverlapMode::kExact, 1.0f, 2, 2},
                        {"exact, update as gradients land", OverlapMode::kExact, 0.0f, 1, 1},
                        {"delayed", OverlapMode::kDelayed, 0.0f, 2, 1}};
  for (const Mode& mode : modes) {
    for (Tier params : {Tier::kPinned, Tier::kNvme, Tier::kDevice}) {
      RunSpec spec;
      spec.model = small_model();
      spec.model.width = 128;  // 16,512 elements a layer: several 4,096-element chunks
      spec.world = mode.world;
      spec.micro_batches = mode.micro_batches;
      spec.steps = 5;
      EngineOptions options;  // bf16 parameters and gradient transfers
      options.param_tier = params;
      options.overlap = mode.overlap;
      options.gradient_clipping = mode.clipping;
      options.adam.lr = 1e-2;
      options.adam.weight_decay = 0.01;
      options.optimizer_threads = 1;
      options.nvme_path = (dir.path() / ("nvme-" + std::to_string(&mode - modes) + std::string(tier_name(params)))).string();
      options.optimizer_tier = Tier::kPinned;
      const EngineRun in_memory = run_engine(options, spec);
      ASSERT_TRUE(in_memory.status.ok()) << mode.name << ": " << in_memory.status.to_string();
      options.optimizer_tier = Tier::kNvme;
      options.nvme_checksum = false;  // chunks may then be as small as the 4 KiB alignment allows
      options.sub_group_elements = 4096;
      const EngineRun streamed = run_engine(options, spec);
      ASSERT_TRUE(streamed.status.ok()) << mode.name << ": " << streamed.status.to_string();
      EXPECT_TRUE(streamed.plan.gradients_spilled);
      EXPECT_EQ(streamed.plan.state_piece_elements, 4096u) << streamed.plan.text;
      EXPECT_GT(streamed.plan.max_shard_elements, 2 * streamed.plan.state_piece_elements) << "groups must span several chunks";
      EXPECT_EQ(streamed.losses, in_memory.losses) << mode.name << ", parameters on " << tier_name(params);
      for (size_t g = 0; g < streamed.masters.size(); ++g)
        EXPECT_EQ(std::memcmp(streamed.masters[g].data(), in_memory.masters[g].data(), streamed.masters[g].size() * 4), 0)
            << mode.name << ", parameters on " << tier_name(params) << ", group " << g;
    }
  }
}

// reduce_bucket_size: the reduce-scatter in pieces gives the bits of the whole-group one.
TEST(EngineTest, ReduceScatterInBucketsGivesTheSameBits) {
  for (int world : {2, 4}) {
    RunSpec spec;
    spec.model = small_model();
    spec.model.width = 128;
    spec.world = world;
    spec.micro_batches = 2;
    spec.steps = 4;
    EngineOptions options = fp32_options();
    const EngineRun whole = run_engine(options, spec);
    STRATA_ASSERT_OK(whole.status);
    options.reduce_bucket_elements = 1000;  // not a divisor of any shard
    const EngineRun bucketed = run_engine(options, spec);
    STRATA_ASSERT_OK(bucketed.status);
    EXPECT_EQ(bucketed.plan.reduce_bucket_elements, 1000u) << bucketed.plan.text;
    EXPECT_NE(bucketed.plan.text.find("reduce-scatter buckets"), std::string::npos) << bucketed.plan.text;
    EXPECT_EQ(whole.losses, bucketed.losses) << "world " << world;
    for (size_t g = 0; g < whole.masters.size(); ++g)
      EXPECT_EQ(std::memcmp(whole.masters[g].data(), bucketed.masters[g].data(), whole.masters[g].size() * 4), 0) << "group " << g;
  }
}

// steps_per_print / wall_clock_breakdown: rank 0 logs a progress line every N steps, with
// every stage's busy seconds when asked.
TEST(EngineTest, ProgressLinesComeEveryStepsPerPrintWithTheBreakdown) {
  RunSpec spec;
  spec.model = small_model();
  spec.steps = 6;
  EngineOptions options = fp32_options();
  options.steps_per_print = 3;
  options.wall_clock_breakdown = true;
  const char* level = std::getenv("STRATA_LOG_LEVEL");
  if (level != nullptr && std::string(level) == "error") GTEST_SKIP() << "info lines are off (STRATA_LOG_LEVEL=error)";
  ::testing::internal::CaptureStderr();
  const EngineRun run = run_engine(options, spec);
  const std::string log = ::testing::internal::GetCapturedStderr();
  STRATA_ASSERT_OK(run.status);
  size_t lines = 0;
  for (size_t at = log.find("step "); at != std::string::npos; at = log.find("step ", at + 1))
    if (log.compare(at, 7, "step 3:") == 0 || log.compare(at, 7, "step 6:") == 0) ++lines;
  EXPECT_EQ(lines, 2u) << log;
  EXPECT_EQ(log.find("step 2:"), std::string::npos) << log;
  EXPECT_NE(log.find("busy s: compute"), std::string::npos) << log;
  EXPECT_NE(log.find("landing"), std::string::npos) << log;
}

TEST(EngineTest, DelayedOverlapTrainsAndDiffersFromExact) {
  RunSpec spec;
  spec.model = small_model();
  spec.world = 2;
  spec.steps = 12;
  EngineOptions options = fp32_options();
  options.overlap = OverlapMode::kDelayed;
  EngineRun delayed = run_engine(options, spec);
  STRATA_ASSERT_OK(delayed.status);
  EXPECT_LT(delayed.losses.back(), delayed.losses.front());
}

// Delayed overlap with the optimizer state on the device: step s's device Adam reads the
// group's device gradient accumulator while step s+1 runs its forward and backward, whose
// first micro-batch overwrites that accumulator. The CPU device's streams are real queues
// on their own threads, so without the ordering the update reads the next step's partial
// sums; with it, the run gives the bits of the same run with the state in pinned memory
// (two host gradient copies by step parity, no sharing). Large groups make each update
// slow next to the model's compute, so an unordered write lands inside it.
TEST(EngineTest, DelayedDeviceUpdateReadsItsStepsGradientsBeforeTheNextStepWritesThem) {
  RunSpec spec;
  spec.model.features = 64;
  spec.model.width = 1024;
  spec.model.layers = 4;
  spec.model.global_rows = 4;
  spec.world = 2;
  spec.micro_batches = 3;
  spec.steps = 6;
  EngineOptions options = fp32_options();
  options.overlap = OverlapMode::kDelayed;
  options.gradient_clipping = 0.0f;
  std::map<Tier, EngineRun> runs;
  for (Tier tier : {Tier::kPinned, Tier::kDevice}) {
    options.optimizer_tier = tier;
    runs[tier] = run_engine(options, spec);
    ASSERT_TRUE(runs[tier].status.ok()) << tier_name(tier) << ": " << runs[tier].status.to_string();
  }
  for (size_t g = 0; g < runs[Tier::kPinned].masters.size(); ++g)
    EXPECT_EQ(std::memcmp(runs[Tier::kDevice].masters[g].data(), runs[Tier::kPinned].masters[g].data(),
                          runs[Tier::kPinned].masters[g].size() * 4),
              0)
        << "group " << g << ": the device update of a step read gradients of the next";
}

// Forward-only passes between steps and after the last one (an evaluation) see the
// weights of every step taken, change no bit of training, and leave finish() nothing to
// wait for that never comes.
TEST(EngineTest, ForwardOnlyPassesSeeTheLatestWeightsAndChangeNothing) {
  testing::TempDir dir;
  struct Case {
    std::string name;
    Tier params;
    OverlapMode overlap;
    int world;
    size_t persistence_threshold;
  };
  const std::vector<Case> cases = {
      {"pinned-exact-1", Tier::kPinned, OverlapMode::kExact, 1, 0},
      {"device-exact-1", Tier::kDevice, OverlapMode::kExact, 1, 0},
      {"nvme-exact-2", Tier::kNvme, OverlapMode::kExact, 2, 0},
      {"pinned-delayed-2", Tier::kPinned, OverlapMode::kDelayed, 2, 0},
      {"device-delayed-1", Tier::kDevice, OverlapMode::kDelayed, 1, 0},
      {"persistent-exact-2", Tier::kPinned, OverlapMode::kExact, 2, 100000},
  };
  for (const Case& c : cases) {
    RunSpec spec;
    spec.model = small_model();
    spec.world = c.world;
    spec.micro_batches = 2;
    spec.steps = 5;
    EngineOptions options;  // bf16 parameters
    options.param_tier = c.params;
    options.optimizer_tier = Tier::kPinned;
    options.overlap = c.overlap;
    options.persistence_threshold = c.persistence_threshold;
    options.nvme_path = (dir.path() / ("nvme-" + c.name)).string();
    options.optimizer_threads = 1;
    EngineRun plain = run_engine(options, spec);
    ASSERT_TRUE(plain.status.ok()) << c.name << ": " << plain.status.to_string();
    spec.forward_pass_after_each_step = true;
    EngineRun with_passes = run_engine(options, spec);
    ASSERT_TRUE(with_passes.status.ok()) << c.name << ": " << with_passes.status.to_string();
    EXPECT_EQ(with_passes.forward_passes, spec.steps * c.world) << c.name;
    EXPECT_EQ(with_passes.forward_mismatches, 0) << c.name;
    for (size_t g = 0; g < plain.masters.size(); ++g)
      EXPECT_EQ(std::memcmp(plain.masters[g].data(), with_passes.masters[g].data(), plain.masters[g].size() * 4), 0)
          << c.name << " group " << g;
    EXPECT_EQ(plain.losses, with_passes.losses) << c.name;
  }
}

TEST(EngineTest, ABudgetOfAnEighthOfTheStateIsNeverExceeded) {
  RunSpec spec;
  spec.model = small_model();
  spec.model.width = 128;
  spec.model.layers = 24;
  spec.world = 2;
  spec.steps = 4;
  EngineOptions options;  // bf16
  options.param_tier = Tier::kPinned;
  options.optimizer_tier = Tier::kPinned;
  options.prefetch_depth = 1;
  // Measure the state first with a generous budget, then train at one eighth of it.
  EngineRun probe = run_engine(options, spec);
  STRATA_ASSERT_OK(probe.status);
  spec.budget_bytes = probe.state_bytes / 8;
  EngineRun run = run_engine(options, spec);
  ASSERT_TRUE(run.status.ok()) << "budget " << spec.budget_bytes << ": " << run.status.to_string();
  EXPECT_LE(run.max_high_water, spec.budget_bytes);
  EXPECT_GT(run.max_high_water, 0u);
  for (const auto& report : run.reports) EXPECT_LE(report.device_high_water_bytes, report.device_budget_bytes);
}

TEST(EngineTest, ABudgetBelowTheWorkingSetFailsAtStartNamingTheFix) {
  RunSpec spec;
  spec.model = small_model();
  spec.model.width = 256;
  spec.budget_bytes = 256 << 10;
  EngineOptions options;
  EngineRun run = run_engine(options, spec);
  ASSERT_FALSE(run.status.ok());
  const std::string text = run.status.to_string();
  EXPECT_EQ(run.status.code(), StatusCode::kOutOfMemory) << text;
  EXPECT_NE(text.find("device budget of 256.0 KiB cannot hold the plan"), std::string::npos) << text;
  EXPECT_NE(text.find("gather buffers"), std::string::npos) << text;
  EXPECT_NE(text.find("settings that would fit: a device budget of at least"), std::string::npos) << text;
}

TEST(EngineTest, NvmePathWithoutRoomFailsAtStartAndLeavesItsFilesAlone) {
  testing::TempDir dir;
  const auto mount_point = dir.path() / "small";
  std::filesystem::create_directories(mount_point);
  if (std::system(("mount -t tmpfs -o size=1m tmpfs " + mount_point.string() + " 2>/dev/null").c_str()) != 0)
    GTEST_SKIP() << "cannot mount a small tmpfs here (needs root)";
  const auto sentinel = mount_point / "earlier-data.bin";
  { std::ofstream(sentinel) << "keep me"; }
  RunSpec spec;
  spec.model = small_model();
  spec.model.width = 512;  // optimizer state of several MiB
  spec.steps = 1;
  EngineOptions options;
  options.optimizer_tier = Tier::kNvme;
  options.nvme_path = mount_point.string();
  EngineRun run = run_engine(options, spec);
  std::string contents;
  { std::ifstream in(sentinel); std::getline(in, contents); }
  (void)std::system(("umount " + mount_point.string()).c_str());
  ASSERT_FALSE(run.status.ok());
  const std::string text = run.status.to_string();
  EXPECT_EQ(run.status.code(), StatusCode::kResourceExhausted) << text;
  EXPECT_NE(text.find("nvme_path " + mount_point.string() + " has"), std::string::npos) << text;
  EXPECT_NE(text.find("free but rank 0 needs"), std::string::npos) << text;
  EXPECT_EQ(contents, "keep me");
}

// An engine of kGroups groups with NVMe-resident parameters and prefetch depth 2, and a
// compute that cannot end before a given group's n-th NVMe read is in the trace.
class FetchAheadRig {
 public:
  static constexpr int kGroups = 6;

  Status init(const std::vector<int>& schedule) {
    LocalClusterOptions cluster_options;
    cluster_options.compute_threads = 1;
    STRATA_ASSIGN_OR_RETURN(cluster_, LocalCluster::create(cluster_options));
    EngineOptions options;
    options.param_tier = Tier::kNvme;
    options.nvme_path = dir_.str();
    options.prefetch_depth = 2;
    STRATA_ASSIGN_OR_RETURN(engine_, Engine::create(options, cluster_->device(0), cluster_->gather_communicator(0),
                                                    cluster_->reduce_communicator(0)));
    for (int g = 0; g < kGroups; ++g) {
      std::string name = "g";
      name += std::to_string(g);
      STRATA_RETURN_IF_ERROR(engine_->register_group({name, {{"w", {64, 64}}}}).status());
    }
    if (!schedule.empty()) STRATA_RETURN_IF_ERROR(engine_->declare_schedule(schedule));
    return engine_->start();
  }

  Engine& engine() { return *engine_; }
  int reads_of(int group) const {
    int count = 0;
    for (const auto& iv : engine_->tracer().intervals()) count += iv.stage == Stage::kNvmeRead && iv.group == group ? 1 : 0;
    return count;
  }
  // Enqueues a compute that waits until `group` has been read `reads` times (a deadline
  // only bounds a failure), then waits for that compute as a model waiting for its kernel
  // would: nothing but a fetch planned ahead can bring that read in.
  Status compute_until_read(int group, int reads) {
    STRATA_RETURN_IF_ERROR(engine_->compute_stream().enqueue_host([this, group, reads]() -> Status {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (reads_of(group) < reads) {
        if (std::chrono::steady_clock::now() > deadline)
          return DeadlineExceededError("compute of a group would have ended before the next group was fetched");
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      waits_satisfied_.fetch_add(1);
      return Status();
    }));
    return engine_->compute_stream().synchronize();
  }
  int waits_satisfied() const { return waits_satisfied_.load(); }

 private:
  testing::TempDir dir_;
  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<Engine> engine_;
  std::atomic<int> waits_satisfied_{0};
};

// Compute of group g does not end until group g + 1's NVMe read has completed: if the
// engine did not fetch ahead, the compute would wait in vain and the test fails. So the
// property "the fetch of g + 1 starts before compute of g ends" is checked without
// depending on how the threads of a busy machine happen to be scheduled.
TEST(EngineTest, TheNextGroupIsFetchedBeforeComputeOfThisOneEnds) {
  constexpr int kGroups = FetchAheadRig::kGroups;
  constexpr int kSteps = 3;
  std::vector<int> schedule;
  for (int g = 0; g < kGroups; ++g) schedule.push_back(g);
  for (int g = kGroups - 1; g >= 0; --g) schedule.push_back(g);
  FetchAheadRig rig;
  STRATA_ASSERT_OK(rig.init(schedule));
  Engine* engine = &rig.engine();
  for (int step = 0; step < kSteps; ++step) {
    STRATA_ASSERT_OK(engine->begin_step());
    for (int g = 0; g < kGroups; ++g) {
      STRATA_ASSERT_OK(engine->gather(g).status());
      // Group g+1 is read twice a step (forward and backward): this step's forward read
      // is number 2 * step + 1.
      if (step > 0 && g + 1 < kGroups) STRATA_ASSERT_OK(rig.compute_until_read(g + 1, 2 * step + 1));
      STRATA_ASSERT_OK(engine->release(g));
    }
    for (int g = kGroups - 1; g >= 0; --g) {
      STRATA_ASSERT_OK(engine->gather(g).status());
      STRATA_ASSERT_OK(engine->gradient_buffer(g).status());
      STRATA_ASSERT_OK(engine->release(g));
      STRATA_ASSERT_OK(engine->grads_ready(g));
    }
    STRATA_ASSERT_OK(engine->step(0.0).status());
  }
  STRATA_ASSERT_OK(engine->finish());
  EXPECT_EQ(rig.waits_satisfied(), (kSteps - 1) * (kGroups - 1));
  // And the trace says so: every such compute slice ends after the next group's read began.
  // (A use's compute resumed after a wait for its gradient buffer is a second, labelled slice.)
  std::vector<TraceInterval> compute, reads;
  for (const auto& iv : engine->tracer().intervals()) {
    if (iv.stage == Stage::kCompute && iv.label.find("after a wait") == std::string::npos) compute.push_back(iv);
    if (iv.stage == Stage::kNvmeRead) reads.push_back(iv);
  }
  ASSERT_EQ(compute.size(), size_t{kSteps * kGroups * 2});
  for (int step = 1; step < kSteps; ++step) {
    for (int g = 0; g + 1 < kGroups; ++g) {
      const TraceInterval& c = compute[static_cast<size_t>(step * kGroups * 2 + g)];
      ASSERT_EQ(c.group, g);
      int seen = 0;
      const TraceInterval* read = nullptr;
      for (const auto& r : reads)
        if (r.group == g + 1 && ++seen == 2 * step + 1) read = &r;
      ASSERT_NE(read, nullptr);
      EXPECT_LT(read->begin, c.end) << "step " << step << " group " << g;
    }
  }
}

// A forward-only pass with a declared order prefetches along it, checked as above
// (without the order, the first wait runs out).
TEST(EngineTest, AForwardPassWithAnOrderFetchesAhead) {
  constexpr int kGroups = FetchAheadRig::kGroups;
  FetchAheadRig rig;
  STRATA_ASSERT_OK(rig.init({}));
  Engine* engine = &rig.engine();
  std::vector<int> order;
  for (int g = kGroups - 1; g >= 0; --g) order.push_back(g);
  EXPECT_EQ(engine->begin_forward(std::vector<int>{0, kGroups}).code(), StatusCode::kInvalidArgument);
  STRATA_ASSERT_OK(engine->begin_forward(order));
  for (size_t i = 0; i < order.size(); ++i) {
    STRATA_ASSERT_OK(engine->gather(order[i]).status());
    if (i + 1 < order.size()) STRATA_ASSERT_OK(rig.compute_until_read(order[i + 1], 1));
    STRATA_ASSERT_OK(engine->release(order[i]));
  }
  STRATA_ASSERT_OK(engine->end_forward());
  STRATA_ASSERT_OK(engine->finish());
  EXPECT_EQ(rig.waits_satisfied(), kGroups - 1);
}

TEST(EngineTest, WritesMetricsLinesAndAChromeTrace) {
  testing::TempDir dir;
  RunSpec spec;
  spec.model = small_model();
  spec.world = 2;
  spec.steps = 3;
  EngineOptions options;
  options.param_tier = Tier::kNvme;
  options.optimizer_tier = Tier::kNvme;
  options.nvme_path = (dir.path() / "nvme").string();
  options.metrics_path = (dir.path() / "metrics.jsonl").string();
  options.trace_path = (dir.path() / "trace.json").string();
  EngineRun run = run_engine(options, spec);
  STRATA_ASSERT_OK(run.status);
  std::ifstream metrics(options.metrics_path);
  std::string line;
  int lines = 0;
  while (std::getline(metrics, line)) {
    const auto record = nlohmann::json::parse(line);
    ++lines;
    EXPECT_EQ(record["step"].get<int>(), lines);
    EXPECT_GT(record["step_seconds"].get<double>(), 0.0);
    for (const char* stage : {"compute", "nvme_read", "nvme_write", "h2d", "allgather", "reduce_scatter", "d2h", "optimizer"})
      EXPECT_TRUE(record["busy_seconds"].contains(stage)) << stage;
    EXPECT_GT(record["busy_seconds"]["nvme_read"].get<double>(), 0.0);
    EXPECT_GT(record["busy_seconds"]["allgather"].get<double>(), 0.0);
    EXPECT_GT(record["busy_seconds"]["reduce_scatter"].get<double>(), 0.0);
    EXPECT_LE(record["device_high_water_bytes"].get<size_t>(), record["device_budget_bytes"].get<size_t>());
    EXPECT_GT(record["nvme_bytes_read"].get<uint64_t>(), 0u);
    EXPECT_GT(record["nvme_bytes_written"].get<uint64_t>(), 0u);
    EXPECT_GT(record["pinned_bytes"].get<size_t>(), 0u);
  }
  EXPECT_EQ(lines, spec.steps);
  std::ifstream trace_file(options.trace_path);
  const auto trace = nlohmann::json::parse(trace_file);
  std::map<std::string, int> slices_per_track;
  for (const auto& event : trace["traceEvents"])
    if (event["ph"] == "X") ++slices_per_track[event["cat"].get<std::string>()];
  for (const char* stage : {"compute", "nvme_read", "nvme_write", "h2d", "allgather", "reduce_scatter", "d2h", "optimizer"})
    EXPECT_GT(slices_per_track[stage], 0) << stage;
}

// A device that hands out the streams of another one wrapped, counting the host
// functions enqueued on each: what a CUDA stream would run on a runtime thread while it
// waits. Buffers and events are the inner device's; the wrapped streams report the inner
// device, so the communicators built for it accept them.
class HostCallCountingStream final : public Stream {
 public:
  HostCallCountingStream(std::unique_ptr<Stream> inner, std::atomic<int>& host_calls) : inner_(std::move(inner)), host_calls_(host_calls) {}
  Stream& inner() { return *inner_; }
  Device& device() override { return inner_->device(); }
  const std::string& name() const override { return inner_->name(); }
  Status record(Event& event) override { return inner_->record(event); }
  Status wait(Event& event) override { return inner_->wait(event); }
  Status synchronize() override { return inner_->synchronize(); }
  Status launch(Kernel kernel) override { return inner_->launch(std::move(kernel)); }
  Status enqueue_host(std::function<Status()> fn) override {
    host_calls_.fetch_add(1);
    return inner_->enqueue_host(std::move(fn));
  }
  void* native_handle() override { return inner_->native_handle(); }

 private:
  std::unique_ptr<Stream> inner_;
  std::atomic<int>& host_calls_;
};

class HostCallCountingDevice final : public Device {
 public:
  explicit HostCallCountingDevice(Device& inner) : inner_(inner) {}
  // Host functions enqueued so far on the streams called `name`.
  int host_calls(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mutex_);
    int total = 0;
    for (const auto& [stream_name, count] : counts_)
      if (stream_name == name) total += count->load();
    return total;
  }

  DeviceKind kind() const override { return inner_.kind(); }
  int ordinal() const override { return inner_.ordinal(); }
  std::string description() const override { return inner_.description(); }
  MatmulPrecision matmul_precision() const override { return inner_.matmul_precision(); }
  StatusOr<DeviceBuffer> allocate(size_t bytes, std::string_view purpose) override { return inner_.allocate(bytes, purpose); }
  MemoryStats memory_stats() const override { return inner_.memory_stats(); }
  Status release_cached_memory() override { return inner_.release_cached_memory(); }
  StatusOr<std::unique_ptr<Stream>> create_stream(std::string name) override {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, inner_.create_stream(name));
    std::lock_guard<std::mutex> lock(mutex_);
    counts_.emplace_back(std::move(name), std::make_unique<std::atomic<int>>(0));
    return std::unique_ptr<Stream>(std::make_unique<HostCallCountingStream>(std::move(stream), *counts_.back().second));
  }
  StatusOr<std::unique_ptr<Event>> create_event() override { return inner_.create_event(); }
  StatusOr<std::unique_ptr<TimingEvent>> create_timing_event() override { return inner_.create_timing_event(); }
  Status copy_async(void* dst, const void* src, size_t bytes, CopyKind kind, Stream& stream) override {
    return inner_.copy_async(dst, src, bytes, kind, unwrap(stream));
  }
  Status memset_async(void* dst, int value, size_t bytes, Stream& stream) override {
    return inner_.memset_async(dst, value, bytes, unwrap(stream));
  }
  Status synchronize() override { return inner_.synchronize(); }

 protected:
  // Never called: every buffer is the inner device's and goes back to it.
  void free_buffer(void* /*data*/, size_t /*bytes*/) noexcept override {}

 private:
  static Stream& unwrap(Stream& stream) {
    auto* counting = dynamic_cast<HostCallCountingStream*>(&stream);
    return counting != nullptr ? counting->inner() : stream;
  }
  Device& inner_;
  mutable std::mutex mutex_;
  std::vector<std::pair<std::string, std::unique_ptr<std::atomic<int>>>> counts_;  // guarded by mutex_
};

// Tracing a group's compute puts no host function on the compute stream (on CUDA each
// would hold the stream until a runtime thread had run it: ~200 a micro-batch for GPT-2
// XL), and every compute interval still reaches the trace, from timing events.
TEST(EngineTest, GatherAndReleaseEnqueueNoHostFunctionOnTheComputeStream) {
  constexpr int kGroups = 3;
  constexpr int kSteps = 2;
  LocalClusterOptions cluster_options;
  cluster_options.compute_threads = 1;
  STRATA_ASSERT_OK_AND_ASSIGN(auto cluster, LocalCluster::create(cluster_options));
  HostCallCountingDevice device(cluster->device(0));
  EngineOptions options;
  options.param_tier = Tier::kPinned;
  options.optimizer_tier = Tier::kPinned;
  STRATA_ASSERT_OK_AND_ASSIGN(auto engine,
                              Engine::create(options, device, cluster->gather_communicator(0), cluster->reduce_communicator(0)));
  for (int g = 0; g < kGroups; ++g) STRATA_ASSERT_OK(engine->register_group({"g" + std::to_string(g), {{"w", {16, 16}}}}).status());
  STRATA_ASSERT_OK(engine->start());
  int calls_in_gather_release = 0;
  auto counted = [&](const std::function<Status()>& call) {
    const int before = device.host_calls("compute");
    const Status status = call();
    calls_in_gather_release += device.host_calls("compute") - before;
    return status;
  };
  for (int step = 0; step < kSteps; ++step) {
    STRATA_ASSERT_OK(engine->begin_step());
    for (int g = 0; g < kGroups; ++g) {
      STRATA_ASSERT_OK(counted([&] { return engine->gather(g).status(); }));
      STRATA_ASSERT_OK(counted([&] { return engine->release(g); }));
    }
    for (int g = kGroups - 1; g >= 0; --g) {
      STRATA_ASSERT_OK(counted([&] { return engine->gather(g).status(); }));
      STRATA_ASSERT_OK(engine->gradient_buffer(g).status());
      STRATA_ASSERT_OK(counted([&] { return engine->release(g); }));
      STRATA_ASSERT_OK(engine->grads_ready(g));
    }
    STRATA_ASSERT_OK(engine->step(0.0).status());
  }
  STRATA_ASSERT_OK(engine->finish());
  EXPECT_EQ(calls_in_gather_release, 0);
  int compute_intervals = 0;
  for (const auto& iv : engine->tracer().intervals())
    compute_intervals += iv.stage == Stage::kCompute && iv.label.find("after a wait") == std::string::npos ? 1 : 0;
  EXPECT_EQ(compute_intervals, kSteps * kGroups * 2);
}

// One group trained by hand: a step gathers it, writes a fixed gradient and steps.
Status hand_step(Engine& engine, float gradient) {
  STRATA_RETURN_IF_ERROR(engine.begin_step());
  STRATA_RETURN_IF_ERROR(engine.gather(0).status());
  STRATA_RETURN_IF_ERROR(engine.release(0));
  STRATA_ASSIGN_OR_RETURN(GroupView grads, engine.gradient_buffer(0));
  const size_t numel = engine.layout(0).numel;
  std::vector<float> values(numel);
  for (size_t i = 0; i < numel; ++i) values[i] = gradient * static_cast<float>(i % 7 + 1);
  STRATA_RETURN_IF_ERROR(engine.device().copy_async(grads.flat, values.data(), numel * 4, CopyKind::kHostToDevice, engine.compute_stream()));
  STRATA_RETURN_IF_ERROR(engine.compute_stream().synchronize());
  STRATA_RETURN_IF_ERROR(engine.grads_ready(0));
  return engine.step(0.0).status();
}

// Delayed overlap: after each step the stale copy (what the next step computes with) is
// the master of one update before, rounded to the parameter dtype; exact mode has none,
// and writing one there is an error.
TEST(EngineTest, TheStaleCopyIsTheMasterOfOneUpdateBefore) {
  for (OverlapMode overlap : {OverlapMode::kDelayed, OverlapMode::kExact}) {
    LocalClusterOptions cluster_options;
    STRATA_ASSERT_OK_AND_ASSIGN(auto cluster, LocalCluster::create(cluster_options));
    EngineOptions options;  // bf16 parameters
    options.overlap = overlap;
    STRATA_ASSERT_OK_AND_ASSIGN(auto engine, Engine::create(options, cluster->device(0), cluster->gather_communicator(0),
                                                            cluster->reduce_communicator(0)));
    STRATA_ASSERT_OK(engine->register_group({"g", {{"w", {40, 33}}}}).status());
    STRATA_ASSERT_OK(engine->start());
    const size_t shard = engine->layout(0).shard_numel;
    std::vector<float> previous(shard), master(shard), stale(shard);
    EXPECT_FALSE(engine->has_stale_parameters());
    EXPECT_EQ(engine->read_state_shard(0, Engine::StateKind::kStaleParams, stale).code(), StatusCode::kFailedPrecondition);
    for (int step = 0; step < 3; ++step) {
      STRATA_ASSERT_OK(engine->read_state_shard(0, Engine::StateKind::kMaster, previous));
      STRATA_ASSERT_OK(hand_step(*engine, 0.01f * static_cast<float>(step + 1)));
      EXPECT_EQ(engine->has_stale_parameters(), overlap == OverlapMode::kDelayed);
      if (overlap == OverlapMode::kExact) continue;
      STRATA_ASSERT_OK(engine->read_state_shard(0, Engine::StateKind::kStaleParams, stale));
      STRATA_ASSERT_OK(engine->read_state_shard(0, Engine::StateKind::kMaster, master));
      size_t mismatches = 0, unchanged = 0;
      for (size_t i = 0; i < shard; ++i) {
        char rounded[2];
        store_from_float(rounded, DType::kBFloat16, 0, previous[i]);
        mismatches += std::bit_cast<uint32_t>(stale[i]) != std::bit_cast<uint32_t>(load_as_float(rounded, DType::kBFloat16, 0));
        unchanged += master[i] == previous[i];
      }
      EXPECT_EQ(mismatches, 0u) << "after step " << step + 1;
      EXPECT_LT(unchanged, shard / 2) << "the update changed too little to tell the copies apart";
    }
    const Status write = engine->write_state_shard(0, Engine::StateKind::kStaleParams, stale);
    if (overlap == OverlapMode::kExact) {
      EXPECT_EQ(write.code(), StatusCode::kFailedPrecondition);
      EXPECT_NE(write.message().find("exact overlap mode"), std::string::npos) << write.to_string();
    } else {
      STRATA_EXPECT_OK(write);
    }
    STRATA_ASSERT_OK(engine->finish());
  }
}

// One rank's engine on the CPU device; the cluster outlives the engine (members go in
// reverse order).
struct OneRank {
  std::unique_ptr<LocalCluster> cluster;
  std::unique_ptr<Engine> engine;
};
StatusOr<OneRank> one_rank_engine(const EngineOptions& options) {
  OneRank rank;
  STRATA_ASSIGN_OR_RETURN(rank.cluster, LocalCluster::create(LocalClusterOptions{}));
  STRATA_ASSIGN_OR_RETURN(rank.engine, Engine::create(options, rank.cluster->device(0), rank.cluster->gather_communicator(0),
                                                      rank.cluster->reduce_communicator(0)));
  return rank;
}

TEST(EngineTest, MisuseGetsClearErrors) {
  STRATA_ASSERT_OK_AND_ASSIGN(OneRank rank, one_rank_engine(EngineOptions{}));
  Engine* engine = rank.engine.get();
  EXPECT_EQ(engine->begin_step().code(), StatusCode::kFailedPrecondition);
  auto bad = engine->register_group({"empty", {}});
  EXPECT_FALSE(bad.ok());
  STRATA_ASSERT_OK(engine->register_group({"g", {{"w", {8, 8}}}}).status());
  STRATA_ASSERT_OK(engine->start());
  STRATA_ASSERT_OK(engine->begin_step());
  EXPECT_NE(engine->grads_ready(0).message().find("without gradient_buffer(0)"), std::string::npos);
  EXPECT_EQ(engine->release(0).code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(engine->gather(5).ok());
  auto view = engine->gather(0);
  STRATA_ASSERT_OK(view.status());
  EXPECT_NE(engine->gather(0).status().message().find("release() it first"), std::string::npos);
  STRATA_ASSERT_OK(engine->release(0));
  EXPECT_NE(engine->finish().message().find("inside a step"), std::string::npos);
  EXPECT_NE(engine->begin_forward().message().find("inside a step"), std::string::npos);
  STRATA_ASSERT_OK(engine->gradient_buffer(0).status());
  STRATA_ASSERT_OK(engine->grads_ready(0));
  STRATA_ASSERT_OK(engine->step(0.0).status());
  // A forward-only pass takes no gradients and is not a step.
  EXPECT_NE(engine->end_forward().message().find("without begin_forward()"), std::string::npos);
  STRATA_ASSERT_OK(engine->begin_forward());
  STRATA_ASSERT_OK(engine->gather(0).status());
  EXPECT_NE(engine->gradient_buffer(0).status().message().find("forward-only"), std::string::npos);
  EXPECT_NE(engine->end_forward().message().find("still gathered"), std::string::npos);
  STRATA_ASSERT_OK(engine->release(0));
  EXPECT_NE(engine->step(0.0).status().message().find("forward-only"), std::string::npos);
  EXPECT_NE(engine->begin_step().message().find("forward-only"), std::string::npos);
  EXPECT_NE(engine->finish().message().find("end_forward()"), std::string::npos);
  STRATA_ASSERT_OK(engine->end_forward());
  // Loss scaling is off: there is no scaler state to restore.
  EXPECT_FALSE(engine->loss_scaler_state().has_value());
  EXPECT_EQ(engine->restore_loss_scaler_state({1024.0f, 0, 2, 0}).code(), StatusCode::kFailedPrecondition);
  STRATA_ASSERT_OK(engine->finish());
}

TEST(EngineTest, AskingForMoreGradientBuffersThanPlannedWhileHoldingThemAllIsAnErrorNotAHang) {
  STRATA_ASSERT_OK_AND_ASSIGN(OneRank rank, one_rank_engine(EngineOptions{}));
  Engine* engine = rank.engine.get();
  constexpr int kGroups = 6;
  for (int g = 0; g < kGroups; ++g) STRATA_ASSERT_OK(engine->register_group({"g" + std::to_string(g), {{"w", {8, 8}}}}).status());
  STRATA_ASSERT_OK(engine->declare_held_gradients(0));
  STRATA_ASSERT_OK(engine->start());
  const int slots = engine->plan().gradient_slots;
  ASSERT_LT(slots, kGroups);
  STRATA_ASSERT_OK(engine->begin_step());
  for (int g = 0; g < slots; ++g) STRATA_ASSERT_OK(engine->gradient_buffer(g).status());
  // Every slot is held by a group whose grads_ready has not come: no wait could end.
  const Status held = engine->gradient_buffer(slots).status();
  EXPECT_EQ(held.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(held.message().find("declare_held_gradients"), std::string::npos) << held.to_string();
  EXPECT_NE(held.message().find("g0"), std::string::npos) << held.to_string();
  // Handing one over frees its slot for the next group.
  STRATA_ASSERT_OK(engine->grads_ready(0));
  STRATA_ASSERT_OK(engine->gradient_buffer(slots).status());
}

TEST(EngineTest, GatheringWhileHoldingEveryGatherSlotIsAnErrorNotAHang) {
  EngineOptions options;
  options.prefetch_depth = 1;  // two gather slots
  STRATA_ASSERT_OK_AND_ASSIGN(OneRank rank, one_rank_engine(options));
  Engine* engine = rank.engine.get();
  for (int g = 0; g < 4; ++g) STRATA_ASSERT_OK(engine->register_group({"g" + std::to_string(g), {{"w", {8, 8}}}}).status());
  STRATA_ASSERT_OK(engine->start());
  ASSERT_EQ(engine->plan().gather_slots, 2);
  STRATA_ASSERT_OK(engine->begin_step());
  STRATA_ASSERT_OK(engine->gather(0).status());
  STRATA_ASSERT_OK(engine->gather(1).status());
  const Status full = engine->gather(2).status();
  EXPECT_EQ(full.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(full.message().find("g0, g1"), std::string::npos) << full.to_string();
  STRATA_ASSERT_OK(engine->release(0));
  STRATA_ASSERT_OK(engine->gather(2).status());
}

TEST(EngineOptionsTest, NvmeWithoutAPathIsAnError) {
  LocalClusterOptions cluster_options;
  auto cluster = LocalCluster::create(cluster_options);
  STRATA_ASSERT_OK(cluster.status());
  EngineOptions options;
  options.optimizer_tier = Tier::kNvme;
  auto engine = Engine::create(options, (*cluster)->device(0), (*cluster)->gather_communicator(0), (*cluster)->reduce_communicator(0));
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("nvme_path"), std::string::npos);
}

}  // namespace
}  // namespace strata
