// The engine against a plain dense trainer, across world sizes, micro-batches, tiers and
// budgets, on the CPU device.
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <map>
#include <mutex>

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
  size_t max_high_water = 0;
  std::vector<TraceInterval> rank0_trace;
};

struct RunSpec {
  LinearStackConfig model;
  int world = 1;
  int micro_batches = 1;
  int steps = 10;
  size_t budget_bytes = size_t{256} << 20;
  bool declare_schedule = true;
  double learning_rate = 1e-2;
};

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
    for (int s = 0; s < spec.steps; ++s) {
      STRATA_ASSIGN_OR_RETURN(StepReport report, model->train_step(s, spec.micro_batches, spec.learning_rate));
      if (rank == 0) {
        run.losses.push_back(report.loss);
        run.reports.push_back(report);
      }
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
      run.rank0_trace = engine->tracer().intervals();
    }
    return {};
  });
  return run;
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

struct PlacementCase {
  Tier params;
  Tier optimizer;
};

std::string placement_name(const PlacementCase& p) {
  return std::string(tier_name(p.params)) + "_" + std::string(tier_name(p.optimizer));
}

TEST(EngineTest, WhereStateLivesDoesNotChangeABit) {
  testing::TempDir dir;
  for (int world : {1, 4}) {
    std::map<std::string, EngineRun> runs;
    for (PlacementCase placement : {PlacementCase{Tier::kPinned, Tier::kPinned}, PlacementCase{Tier::kPinned, Tier::kNvme},
                                    PlacementCase{Tier::kDevice, Tier::kPinned}, PlacementCase{Tier::kNvme, Tier::kPinned},
                                    PlacementCase{Tier::kNvme, Tier::kNvme}, PlacementCase{Tier::kHost, Tier::kHost}}) {
      RunSpec spec;
      spec.model = small_model();
      spec.world = world;
      spec.steps = 10;
      EngineOptions options;  // bf16 parameters and transfers, the defaults
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
            << name << " vs " << runs.begin()->first << " group " << g << " world " << world;
    }
  }
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

TEST(EngineTest, TheNextGroupIsFetchedBeforeComputeOfThisOneEnds) {
  RunSpec spec;
  spec.model = small_model();
  // Compute slices of a millisecond or more: the property is about overlap, not about
  // thread wake-up latency on a busy 2-core machine.
  spec.model.layers = 5;
  spec.model.width = 256;
  spec.model.global_rows = 256;
  spec.steps = 4;
  EngineOptions options;
  options.param_tier = Tier::kNvme;
  testing::TempDir dir;
  options.nvme_path = dir.str();
  options.prefetch_depth = 2;
  EngineRun run = run_engine(options, spec);
  STRATA_ASSERT_OK(run.status);
  // After the warm-up step, each compute slice of group g (forward) must be preceded by
  // the start of the next forward group's fetch (its NVMe read) before it ends.
  std::vector<TraceInterval> compute, fetch;
  for (const auto& iv : run.rank0_trace) {
    if (iv.stage == Stage::kCompute) compute.push_back(iv);
    if (iv.stage == Stage::kNvmeRead && iv.label.find("update") == std::string::npos) fetch.push_back(iv);
  }
  std::sort(compute.begin(), compute.end(), [](auto& a, auto& b) { return a.begin < b.begin; });
  std::sort(fetch.begin(), fetch.end(), [](auto& a, auto& b) { return a.begin < b.begin; });
  const size_t uses_per_step = models::linear_stack_schedule(spec.model).size();
  ASSERT_EQ(compute.size(), uses_per_step * spec.steps);
  // Every use of a non-persistent group is a fetch; the prefetcher may also have fetched
  // the first groups of a step that never came.
  ASSERT_GE(fetch.size(), compute.size());
  int checked = 0;
  for (size_t u = uses_per_step; u + 1 < compute.size(); ++u) {
    // Within a step (the first fetch of a step waits, in exact mode, for the update of
    // the previous step's last group): fetch[u + 1] is the fetch for use u + 1.
    if ((u + 1) % uses_per_step == 0) continue;
    EXPECT_LT(fetch[u + 1].begin, compute[u].end) << "use " << u % uses_per_step << " of step " << u / uses_per_step << [&] {
      std::string text;
      const auto origin = compute[u - u % uses_per_step].begin;
      auto us = [&](TraceClock::time_point t) { return std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(t - origin).count()); };
      for (size_t v = u - u % uses_per_step; v < u - u % uses_per_step + uses_per_step && v + 1 < fetch.size(); ++v)
        text += "\n use " + std::to_string(v % uses_per_step) + " compute [" + us(compute[v].begin) + ", " + us(compute[v].end) + "] fetch [" + us(fetch[v].begin) + ", " + us(fetch[v].end) + "] " + compute[v].label + "/" + fetch[v].label;
      return text;
    }();
    ++checked;
  }
  EXPECT_GT(checked, 10);
}

TEST(EngineTest, MisuseGetsClearErrors) {
  LocalClusterOptions cluster_options;
  auto cluster = LocalCluster::create(cluster_options);
  STRATA_ASSERT_OK(cluster.status());
  EngineOptions options;
  STRATA_ASSERT_OK_AND_ASSIGN(auto engine, Engine::create(options, (*cluster)->device(0), (*cluster)->gather_communicator(0),
                                                          (*cluster)->reduce_communicator(0)));
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
  STRATA_ASSERT_OK(engine->gradient_buffer(0).status());
  STRATA_ASSERT_OK(engine->grads_ready(0));
  STRATA_ASSERT_OK(engine->step(0.0).status());
  STRATA_ASSERT_OK(engine->finish());
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
