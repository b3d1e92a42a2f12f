// Frozen parameter groups (GroupSpec::trainable = false, PEFT base weights): gathered like
// any group, never updated, with no gradients and no optimizer state, across parameter
// and optimizer tiers, overlap modes, micro-batches, world sizes and checkpoints.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "engine/checkpoint.h"
#include "engine/engine.h"
#include "engine/local_cluster.h"
#include "examples/models/linear_stack.h"
#include "kernels/blas_context.h"
#include "kernels/cast.h"
#include "kernels/transformer_ops.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

constexpr int kFeatures = 24;
constexpr int kWidth = 64;
constexpr int kGlobalRows = 8;
constexpr int kEmbed = 0, kBase = 1, kHead = 2;

// embed (trainable) -> base (frozen: a square layer with bias and GELU) -> head
// (trainable, with bias) -> cross-entropy. The gradient flows through the frozen layer to
// the embedding, as it flows through a LoRA model's base weights. `base_trainable` makes
// the base an ordinary group without weight decay that the model gives zero gradients:
// Adam leaves it unchanged, and the other groups must train exactly as with it frozen.
std::vector<GroupSpec> frozen_stack_groups(bool base_trainable) {
  GroupSpec embed{"embed", {{"weight", {kFeatures, kWidth}, TensorInit::normal(0.3f)}}};
  GroupSpec base{"base",
                 {{"weight", {kWidth, kWidth}, TensorInit::normal(0.2f), !base_trainable},
                  {"bias", {kWidth}, TensorInit::normal(0.1f), !base_trainable}}};
  base.trainable = base_trainable;
  GroupSpec head{"head", {{"weight", {kWidth, kFeatures}, TensorInit::normal(0.2f)}, {"bias", {kFeatures}, TensorInit::zeros(), false}}};
  return {embed, base, head};
}

models::LinearStackConfig data_config() {
  models::LinearStackConfig config;
  config.features = kFeatures;
  config.global_rows = kGlobalRows;
  return config;
}

// The frozen group's full initial values in the parameter dtype, as fp32 bit patterns:
// what every gather of it must return.
std::vector<uint32_t> expected_base_values(int world, uint64_t seed, DType dtype) {
  auto layout = layout_group(frozen_stack_groups(false)[kBase], kBase, world);
  std::vector<uint32_t> bits(layout->padded_numel);
  std::vector<float> shard(layout->shard_numel);
  for (int r = 0; r < world; ++r) {
    init_shard(*layout, r, seed, shard.data());
    for (size_t i = 0; i < shard.size(); ++i) {
      char rounded[4];
      store_from_float(rounded, dtype, 0, shard[i]);
      bits[layout->shard_begin(r) + i] = std::bit_cast<uint32_t>(load_as_float(rounded, dtype, 0));
    }
  }
  return bits;
}

class FrozenStack {
 public:
  FrozenStack(Engine& engine, int rank, int world, bool base_trainable)
      : engine_(engine), rank_(rank), rows_(kGlobalRows / world), base_trainable_(base_trainable) {}

  Status register_groups() {
    for (const GroupSpec& spec : frozen_stack_groups(base_trainable_)) STRATA_RETURN_IF_ERROR(engine_.register_group(spec).status());
    return engine_.declare_schedule({kEmbed, kBase, kHead, kHead, kBase, kEmbed});
  }

  Status allocate() {
    Device& device = engine_.device();
    STRATA_ASSIGN_OR_RETURN(kernels::BlasContext blas, kernels::BlasContext::create(device, kernels::BlasOptions{}));
    blas_ = std::make_unique<kernels::BlasContext>(std::move(blas));
    const size_t r = static_cast<size_t>(rows_);
    STRATA_ASSIGN_OR_RETURN(x_, device.allocate(r * kFeatures * 4, "x"));
    STRATA_ASSIGN_OR_RETURN(labels_, device.allocate(r * 4, "labels"));
    STRATA_ASSIGN_OR_RETURN(h0_, device.allocate(r * kWidth * 4, "h0"));
    STRATA_ASSIGN_OR_RETURN(pre_, device.allocate(r * kWidth * 4, "pre"));
    STRATA_ASSIGN_OR_RETURN(h1_, device.allocate(r * kWidth * 4, "h1"));
    STRATA_ASSIGN_OR_RETURN(dh1_, device.allocate(r * kWidth * 4, "dh1"));
    STRATA_ASSIGN_OR_RETURN(dh0_, device.allocate(r * kWidth * 4, "dh0"));
    STRATA_ASSIGN_OR_RETURN(logits_, device.allocate(r * kFeatures * 4, "logits"));
    STRATA_ASSIGN_OR_RETURN(losses_, device.allocate(r * 4, "losses"));
    STRATA_ASSIGN_OR_RETURN(mean_loss_, device.allocate(4, "mean loss"));
    for (int g = 0; g < 3; ++g) {
      STRATA_ASSIGN_OR_RETURN(DeviceBuffer scratch, device.allocate(engine_.layout(g).padded_numel * 4, "fp32 parameters"));
      fp32_.push_back(std::move(scratch));
    }
    return {};
  }

  // One step; every gather of the base group is compared with `expected` (its bits).
  Status train_step(int64_t step, int micro_batches, const std::vector<uint32_t>& expected, int* mismatches) {
    STRATA_RETURN_IF_ERROR(engine_.begin_step(1e-2));
    for (int micro = 0; micro < micro_batches; ++micro) {
      if (micro > 0) STRATA_RETURN_IF_ERROR(engine_.begin_micro_batch());
      STRATA_RETURN_IF_ERROR(forward_backward(step, micro, micro_batches, expected, mismatches));
    }
    STRATA_RETURN_IF_ERROR(engine_.compute_stream().synchronize());
    return engine_.step(0.0).status();
  }

 private:
  // The gathered group as fp32 (16-bit parameters are widened into a scratch copy).
  StatusOr<GroupView> as_fp32(StatusOr<GroupView> gathered) {
    STRATA_ASSIGN_OR_RETURN(GroupView view, std::move(gathered));
    if (view.dtype == DType::kFloat32) return view;
    const GroupLayout& layout = engine_.layout(view.group);
    DeviceBuffer& scratch = fp32_[static_cast<size_t>(view.group)];
    STRATA_RETURN_IF_ERROR(kernels::cast(engine_.compute_stream(), view.flat, view.dtype, scratch.data(), DType::kFloat32, layout.padded_numel));
    GroupView widened = view;
    widened.dtype = DType::kFloat32;
    widened.flat = scratch.data();
    for (size_t t = 0; t < layout.tensors.size(); ++t) widened.tensors[t] = scratch.as<float>() + layout.tensors[t].offset;
    return widened;
  }

  Status check_base(const GroupView& view, const std::vector<uint32_t>& expected, int* mismatches) {
    std::vector<char> host(expected.size() * dtype_size(view.dtype));
    STRATA_RETURN_IF_ERROR(engine_.device().copy_async(host.data(), view.flat, host.size(), CopyKind::kDeviceToHost, engine_.compute_stream()));
    STRATA_RETURN_IF_ERROR(engine_.compute_stream().synchronize());
    for (size_t i = 0; i < expected.size(); ++i)
      if (std::bit_cast<uint32_t>(load_as_float(host.data(), view.dtype, i)) != expected[i]) ++*mismatches;
    return {};
  }

  Status forward_backward(int64_t step, int micro, int micro_batches, const std::vector<uint32_t>& expected, int* mismatches) {
    Stream& stream = engine_.compute_stream();
    const size_t r = static_cast<size_t>(rows_);
    host_x_.resize(r * kFeatures);
    host_labels_.resize(r);
    models::make_batch(data_config(), step, micro, rank_ * rows_, rows_, host_x_.data(), host_labels_.data());
    STRATA_RETURN_IF_ERROR(engine_.device().copy_async(x_.data(), host_x_.data(), r * kFeatures * 4, CopyKind::kHostToDevice, stream));
    STRATA_RETURN_IF_ERROR(engine_.device().copy_async(labels_.data(), host_labels_.data(), r * 4, CopyKind::kHostToDevice, stream));
    const kernels::MatmulShape embed_shape{r, kFeatures, kWidth, kernels::WeightLayout::kInOut};
    const kernels::MatmulShape base_shape{r, kWidth, kWidth, kernels::WeightLayout::kInOut};
    const kernels::MatmulShape head_shape{r, kWidth, kFeatures, kernels::WeightLayout::kInOut};
    const DType f32 = DType::kFloat32;
    auto bias_of = [&](const GroupView& view) { return view.tensors[1]; };

    STRATA_ASSIGN_OR_RETURN(GroupView embed, as_fp32(engine_.gather(kEmbed)));
    STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, *blas_, embed_shape, f32, x_.data(), embed.flat, nullptr, h0_.data()));
    STRATA_RETURN_IF_ERROR(engine_.release(kEmbed));
    STRATA_ASSIGN_OR_RETURN(GroupView base, engine_.gather(kBase));
    STRATA_RETURN_IF_ERROR(check_base(base, expected, mismatches));
    STRATA_ASSIGN_OR_RETURN(base, as_fp32(base));
    STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, *blas_, base_shape, f32, h0_.data(), base.flat, bias_of(base), pre_.data()));
    STRATA_RETURN_IF_ERROR(kernels::gelu_forward(stream, f32, pre_.data(), h1_.data(), r * kWidth));
    STRATA_RETURN_IF_ERROR(engine_.release(kBase));
    STRATA_ASSIGN_OR_RETURN(GroupView head, as_fp32(engine_.gather(kHead)));
    STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, *blas_, head_shape, f32, h1_.data(), head.flat, bias_of(head), logits_.data()));
    STRATA_RETURN_IF_ERROR(engine_.release(kHead));
    const float grad_scale = 1.0f / static_cast<float>(kGlobalRows * micro_batches);
    STRATA_RETURN_IF_ERROR(kernels::cross_entropy_fused(stream, {r, kFeatures, -1}, f32, logits_.data(), labels_.as<int32_t>(), grad_scale,
                                                        losses_.as<float>(), mean_loss_.as<float>(), logits_.data()));

    const kernels::GradOptions add_params{kernels::GradWrite::kOverwrite, kernels::GradWrite::kAccumulate};
    STRATA_ASSIGN_OR_RETURN(head, as_fp32(engine_.gather(kHead)));
    STRATA_ASSIGN_OR_RETURN(GroupView d_head, engine_.gradient_buffer(kHead));
    STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, *blas_, head_shape, f32, logits_.data(), h1_.data(), head.flat, dh1_.data(),
                                                    static_cast<float*>(d_head.tensors[0]), static_cast<float*>(d_head.tensors[1]), add_params));
    STRATA_RETURN_IF_ERROR(engine_.release(kHead));
    STRATA_RETURN_IF_ERROR(engine_.grads_ready(kHead));
    STRATA_ASSIGN_OR_RETURN(base, as_fp32(engine_.gather(kBase)));
    // The zero-gradient twin asks for its (zeroed) buffer and writes nothing into it.
    if (base_trainable_) STRATA_RETURN_IF_ERROR(engine_.gradient_buffer(kBase).status());
    STRATA_RETURN_IF_ERROR(kernels::gelu_backward(stream, f32, dh1_.data(), pre_.data(), dh1_.data(), r * kWidth, kernels::GradWrite::kOverwrite));
    STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, *blas_, base_shape, f32, dh1_.data(), h0_.data(), base.flat, dh0_.data(), nullptr,
                                                    nullptr, add_params));
    STRATA_RETURN_IF_ERROR(engine_.release(kBase));
    if (base_trainable_) STRATA_RETURN_IF_ERROR(engine_.grads_ready(kBase));
    STRATA_ASSIGN_OR_RETURN(embed, as_fp32(engine_.gather(kEmbed)));
    STRATA_ASSIGN_OR_RETURN(GroupView d_embed, engine_.gradient_buffer(kEmbed));
    STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, *blas_, embed_shape, f32, dh0_.data(), x_.data(), embed.flat, nullptr,
                                                    static_cast<float*>(d_embed.tensors[0]), nullptr, add_params));
    STRATA_RETURN_IF_ERROR(engine_.release(kEmbed));
    return engine_.grads_ready(kEmbed);
  }

  Engine& engine_;
  int rank_;
  int rows_;
  bool base_trainable_;
  std::unique_ptr<kernels::BlasContext> blas_;
  DeviceBuffer x_, labels_, h0_, pre_, h1_, dh1_, dh0_, logits_, losses_, mean_loss_;
  std::vector<DeviceBuffer> fp32_;  // per group: its fp32 copy when parameters are 16-bit
  std::vector<float> host_x_;
  std::vector<int32_t> host_labels_;
};

EngineOptions fp32_options() {
  EngineOptions options;
  options.param_dtype = DType::kFloat32;
  options.grad_wire_dtype = DType::kFloat32;
  options.grad_transfer_dtype = DType::kFloat32;
  options.adam.lr = 1e-2;
  options.adam.weight_decay = 0.01;
  options.adam.eps = 1e-6;
  options.gradient_clipping = 1.0f;
  options.seed = 99;
  options.optimizer_threads = 1;
  return options;
}

struct FrozenRun {
  std::vector<std::vector<float>> masters;  // per group, the unpadded flat fp32 master (base: its parameters)
  int base_mismatches = 0;                  // gathered base elements unequal to its initial values
  EnginePlan plan;                          // rank 0's
};

struct FrozenSpec {
  EngineOptions options = fp32_options();
  int world = 1;
  int micro_batches = 1;
  int steps = 4;
  bool base_trainable = false;
  // Checkpoints: save after this many steps (0 = none) into `saver`; or start from `resume`.
  int save_after = 0;
  CheckpointSaver* saver = nullptr;
  const CheckpointReader* resume = nullptr;
  int first_step = 0;
};

// The frozen group written by the caller, as a front end loads base weights: declared
// loaded (no draw at start), then its initial values written as its master.
Status load_base_like_a_front_end(Engine& engine, int rank, uint64_t seed) {
  const GroupLayout& layout = engine.layout(kBase);
  std::vector<float> values(layout.shard_numel);
  init_shard(layout, rank, seed, values.data());
  return engine.write_state_shard(kBase, Engine::StateKind::kMaster, values);
}

Status train_rank(const FrozenSpec& spec, LocalCluster& cluster, int rank, std::mutex& mutex, FrozenRun& run) {
  EngineOptions options = spec.options;
  options.rank = rank;
  options.world_size = spec.world;
  options.gradient_accumulation_steps = spec.micro_batches;
  STRATA_ASSIGN_OR_RETURN(auto engine, Engine::create(options, cluster.device(rank), cluster.gather_communicator(rank),
                                                      cluster.reduce_communicator(rank)));
  FrozenStack model(*engine, rank, spec.world, spec.base_trainable);
  STRATA_RETURN_IF_ERROR(model.register_groups());
  if (spec.resume != nullptr) STRATA_RETURN_IF_ERROR(engine->declare_loaded(kBase));
  STRATA_RETURN_IF_ERROR(engine->start());
  STRATA_RETURN_IF_ERROR(model.allocate());
  if (spec.resume != nullptr) {
    STRATA_RETURN_IF_ERROR(load_engine_state(*engine, rank, *spec.resume));
    STRATA_RETURN_IF_ERROR(load_base_like_a_front_end(*engine, rank, options.seed));
  }
  const std::vector<uint32_t> expected = expected_base_values(spec.world, options.seed, options.param_dtype);
  int mismatches = 0;
  for (int step = spec.first_step; step < spec.steps; ++step) {
    STRATA_RETURN_IF_ERROR(model.train_step(step, spec.micro_batches, expected, &mismatches));
    if (step + 1 == spec.save_after) {
      STRATA_ASSIGN_OR_RETURN(RankSnapshot snapshot, snapshot_engine_state(*engine, rank));
      STRATA_RETURN_IF_ERROR(spec.saver->submit(step + 1, std::move(snapshot)));
      if (rank == 0) STRATA_RETURN_IF_ERROR(spec.saver->submit_trainer_state(step + 1, "{}"));
    }
  }
  STRATA_RETURN_IF_ERROR(engine->finish());
  std::vector<float> shard;
  std::lock_guard<std::mutex> lock(mutex);
  run.base_mismatches += mismatches;
  if (rank == 0) run.plan = engine->plan();
  for (int g = 0; g < engine->group_count(); ++g) {
    const GroupLayout& layout = engine->layout(g);
    shard.resize(layout.shard_numel);
    STRATA_RETURN_IF_ERROR(engine->read_state_shard(g, Engine::StateKind::kMaster, shard));
    for (size_t i = 0; i < layout.shard_numel && layout.shard_begin(rank) + i < layout.numel; ++i)
      run.masters[static_cast<size_t>(g)][layout.shard_begin(rank) + i] = shard[i];
  }
  return {};
}

StatusOr<FrozenRun> train(const FrozenSpec& spec) {
  LocalClusterOptions cluster_options;
  cluster_options.world_size = spec.world;
  cluster_options.device_budget_bytes = size_t{256} << 20;
  cluster_options.compute_threads = 1;
  cluster_options.collective_timeout = std::chrono::seconds(60);
  STRATA_ASSIGN_OR_RETURN(auto cluster, LocalCluster::create(cluster_options));
  FrozenRun run;
  for (const GroupSpec& group : frozen_stack_groups(false)) run.masters.emplace_back(layout_group(group, 0, 1)->numel);
  std::mutex mutex;
  STRATA_RETURN_IF_ERROR(cluster->run([&](int rank) { return train_rank(spec, *cluster, rank, mutex, run); }));
  return run;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

std::vector<float> initial_values(int group, uint64_t seed) {
  auto layout = layout_group(frozen_stack_groups(false)[static_cast<size_t>(group)], group, 1);
  std::vector<float> values(layout->shard_numel);
  init_shard(*layout, 0, seed, values.data());
  values.resize(layout->numel);
  return values;
}

// ---------------------------------------------------------------------------------------

struct ModeCase {
  OverlapMode overlap;
  int micro_batches;
  float clipping;
};

class FrozenGroupModes : public ::testing::TestWithParam<ModeCase> {};

TEST_P(FrozenGroupModes, KeepsItsInitialValuesAndTrainsTheOthersAsAZeroGradientGroupWould) {
  FrozenSpec spec;
  spec.options.overlap = GetParam().overlap;
  spec.options.gradient_clipping = GetParam().clipping;
  spec.micro_batches = GetParam().micro_batches;
  STRATA_ASSERT_OK_AND_ASSIGN(FrozenRun frozen, train(spec));
  spec.base_trainable = true;
  STRATA_ASSERT_OK_AND_ASSIGN(FrozenRun twin, train(spec));

  EXPECT_EQ(frozen.base_mismatches, 0) << "a gather of the frozen group differed from its initial values";
  EXPECT_TRUE(same_bits(frozen.masters[kBase], initial_values(kBase, spec.options.seed)));
  EXPECT_TRUE(same_bits(twin.masters[kBase], initial_values(kBase, spec.options.seed))) << "the twin's zero gradients moved its base";
  for (int g : {kEmbed, kHead}) {
    EXPECT_FALSE(same_bits(frozen.masters[static_cast<size_t>(g)], initial_values(g, spec.options.seed))) << "group " << g << " did not train";
    EXPECT_TRUE(same_bits(frozen.masters[static_cast<size_t>(g)], twin.masters[static_cast<size_t>(g)]))
        << "group " << g << " trained differently beside a frozen group than beside a zero-gradient one";
  }
}

INSTANTIATE_TEST_SUITE_P(Overlap, FrozenGroupModes,
                         ::testing::Values(ModeCase{OverlapMode::kExact, 1, 0.0f}, ModeCase{OverlapMode::kExact, 2, 1.0f},
                                           ModeCase{OverlapMode::kDelayed, 1, 1.0f}, ModeCase{OverlapMode::kDelayed, 2, 0.0f}));

struct TierCase {
  Tier param_tier;
  Tier optimizer_tier;
  OverlapMode overlap;
  size_t persistence_threshold;
};

class FrozenGroupTiers : public ::testing::TestWithParam<TierCase> {};

TEST_P(FrozenGroupTiers, TrainTheSameBitsAsPinnedTiers) {
  testing::TempDir dir;
  FrozenSpec spec;
  spec.options.overlap = GetParam().overlap;
  // bf16 parameters; fp32 gradient transfers, as device-resident optimizer state takes them.
  spec.options.param_dtype = DType::kBFloat16;
  STRATA_ASSERT_OK_AND_ASSIGN(FrozenRun pinned, train(spec));
  spec.options.pin_memory = GetParam().param_tier != Tier::kHost;
  spec.options.param_tier = GetParam().param_tier;
  spec.options.optimizer_tier = GetParam().optimizer_tier;
  spec.options.persistence_threshold = GetParam().persistence_threshold;
  spec.options.nvme_path = dir.str();
  STRATA_ASSERT_OK_AND_ASSIGN(FrozenRun other, train(spec));
  EXPECT_EQ(pinned.base_mismatches, 0);
  EXPECT_EQ(other.base_mismatches, 0);
  for (size_t g = 0; g < pinned.masters.size(); ++g)
    EXPECT_TRUE(same_bits(pinned.masters[g], other.masters[g])) << "group " << g << " differs from the pinned-tier run";
}

INSTANTIATE_TEST_SUITE_P(Tiers, FrozenGroupTiers,
                         ::testing::Values(TierCase{Tier::kNvme, Tier::kPinned, OverlapMode::kExact, 0},
                                           TierCase{Tier::kPinned, Tier::kNvme, OverlapMode::kExact, 0},
                                           TierCase{Tier::kPinned, Tier::kDevice, OverlapMode::kExact, 0},
                                           TierCase{Tier::kDevice, Tier::kPinned, OverlapMode::kExact, 0},
                                           TierCase{Tier::kNvme, Tier::kNvme, OverlapMode::kDelayed, 0},
                                           TierCase{Tier::kHost, Tier::kDevice, OverlapMode::kDelayed, 0},
                                           TierCase{Tier::kNvme, Tier::kNvme, OverlapMode::kExact, size_t{1} << 20}));

TEST(FrozenGroupTest, TrainsTheSameWeightsOnTwoRanksAsOnOne) {
  FrozenSpec spec;
  spec.micro_batches = 2;
  STRATA_ASSERT_OK_AND_ASSIGN(FrozenRun one, train(spec));
  spec.world = 2;
  STRATA_ASSERT_OK_AND_ASSIGN(FrozenRun two, train(spec));
  EXPECT_EQ(two.base_mismatches, 0);
  EXPECT_TRUE(same_bits(two.masters[kBase], one.masters[kBase]));
  // Two ranks sum the batch's gradients in another order: equal to fp32 rounding.
  for (int g : {kEmbed, kHead}) EXPECT_LT(relative_error(two.masters[static_cast<size_t>(g)], one.masters[static_cast<size_t>(g)]), 1e-5);
}

// The engine alone, started, for the API checks.
struct StartedEngine {
  std::unique_ptr<LocalCluster> cluster;
  std::unique_ptr<Engine> engine;
};

StatusOr<StartedEngine> start_engine(EngineOptions options) {
  StartedEngine started;
  LocalClusterOptions cluster_options;
  cluster_options.device_budget_bytes = size_t{256} << 20;
  cluster_options.compute_threads = 1;
  STRATA_ASSIGN_OR_RETURN(started.cluster, LocalCluster::create(cluster_options));
  STRATA_ASSIGN_OR_RETURN(started.engine, Engine::create(options, started.cluster->device(0), started.cluster->gather_communicator(0),
                                                         started.cluster->reduce_communicator(0)));
  for (const GroupSpec& spec : frozen_stack_groups(false)) STRATA_RETURN_IF_ERROR(started.engine->register_group(spec).status());
  STRATA_RETURN_IF_ERROR(started.engine->start());
  return started;
}

void expect_frozen_error(const Status& status, const std::string& call) {
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition) << call << ": " << status.to_string();
  EXPECT_NE(status.message().find("'base'"), std::string::npos) << call << ": " << status.message();
  EXPECT_NE(status.message().find("frozen"), std::string::npos) << call << ": " << status.message();
}

TEST(FrozenGroupTest, RefusesGradientsAndOptimizerStateWithAnErrorNamingTheGroup) {
  EngineOptions options = fp32_options();
  options.overlap = OverlapMode::kDelayed;
  STRATA_ASSERT_OK_AND_ASSIGN(StartedEngine started, start_engine(options));
  Engine& engine = *started.engine;
  const size_t shard = engine.layout(kBase).shard_numel;
  std::vector<float> values(shard, 0.5f);
  STRATA_ASSERT_OK(engine.begin_step());
  STRATA_ASSERT_OK(engine.gather(kBase).status());
  expect_frozen_error(engine.gradient_buffer(kBase).status(), "gradient_buffer");
  STRATA_ASSERT_OK(engine.release(kBase));
  expect_frozen_error(engine.grads_ready(kBase), "grads_ready");
  for (int g : {kEmbed, kHead}) {
    STRATA_ASSERT_OK(engine.gather(g).status());
    STRATA_ASSERT_OK(engine.gradient_buffer(g).status());
    STRATA_ASSERT_OK(engine.release(g));
    STRATA_ASSERT_OK(engine.grads_ready(g));
  }
  STRATA_ASSERT_OK(engine.step(0.0).status());
  ASSERT_TRUE(engine.has_stale_parameters());
  for (Engine::StateKind kind : {Engine::StateKind::kExpAvg, Engine::StateKind::kExpAvgSq, Engine::StateKind::kStaleParams}) {
    expect_frozen_error(engine.read_state_shard(kBase, kind, values), "read_state_shard");
    expect_frozen_error(engine.write_state_shard(kBase, kind, values), "write_state_shard");
  }
  STRATA_ASSERT_OK(engine.finish());
}

TEST(FrozenGroupTest, ItsMasterIsItsParameterCopyInTheParameterDtype) {
  EngineOptions options = fp32_options();
  options.param_dtype = DType::kBFloat16;
  options.overlap = OverlapMode::kDelayed;
  STRATA_ASSERT_OK_AND_ASSIGN(StartedEngine started, start_engine(options));
  Engine& engine = *started.engine;
  const GroupLayout& layout = engine.layout(kBase);
  std::vector<float> read(layout.shard_numel);
  STRATA_ASSERT_OK(engine.read_state_shard(kBase, Engine::StateKind::kMaster, read));
  std::vector<uint32_t> expected = expected_base_values(1, options.seed, options.param_dtype);
  for (size_t i = 0; i < read.size(); ++i) ASSERT_EQ(std::bit_cast<uint32_t>(read[i]), expected[i]) << "element " << i;

  // A write is rounded to bf16 as refresh_parameters() rounds a master, and gathered.
  std::vector<float> written(layout.shard_numel);
  for (size_t i = 0; i < written.size(); ++i) written[i] = 1.0f + static_cast<float>(i) * 1e-4f;
  STRATA_ASSERT_OK(engine.write_state_shard(kBase, Engine::StateKind::kMaster, written));
  STRATA_ASSERT_OK(engine.begin_forward());
  STRATA_ASSERT_OK_AND_ASSIGN(GroupView view, engine.gather(kBase));
  std::vector<uint16_t> gathered(layout.shard_numel);
  STRATA_ASSERT_OK(engine.device().copy_async(gathered.data(), view.flat, gathered.size() * 2, CopyKind::kDeviceToHost, engine.compute_stream()));
  STRATA_ASSERT_OK(engine.compute_stream().synchronize());
  STRATA_ASSERT_OK(engine.release(kBase));
  STRATA_ASSERT_OK(engine.end_forward());
  STRATA_ASSERT_OK(engine.read_state_shard(kBase, Engine::StateKind::kMaster, read));
  for (size_t i = 0; i < written.size(); ++i) {
    uint16_t rounded = 0;
    store_from_float(&rounded, DType::kBFloat16, 0, written[i]);
    ASSERT_EQ(gathered[i], rounded) << "element " << i;
    ASSERT_EQ(read[i], load_as_float(&rounded, DType::kBFloat16, 0)) << "element " << i;
  }
  STRATA_ASSERT_OK(engine.finish());
}

const PlanLine* find_line(const EnginePlan& plan, const std::string& prefix, Tier tier) {
  for (const PlanLine& line : plan.lines)
    if (line.tier == tier && line.what.rfind(prefix, 0) == 0) return &line;
  return nullptr;
}

// Inference on the engine: every group frozen, so no gradient slot, landing buffer or
// optimizer state exists, and steps (with their gathers) still run.
TEST(FrozenGroupTest, AModelWithEveryGroupFrozenStepsWithoutGradients) {
  testing::TempDir dir;
  for (Tier optimizer_tier : {Tier::kPinned, Tier::kNvme, Tier::kDevice}) {
    SCOPED_TRACE(tier_name(optimizer_tier));
    LocalClusterOptions cluster_options;
    cluster_options.device_budget_bytes = size_t{256} << 20;
    cluster_options.compute_threads = 1;
    STRATA_ASSERT_OK_AND_ASSIGN(auto cluster, LocalCluster::create(cluster_options));
    EngineOptions options = fp32_options();
    options.optimizer_tier = optimizer_tier;
    options.param_tier = Tier::kNvme;
    options.overlap = OverlapMode::kDelayed;
    options.nvme_path = dir.str() + "/" + std::string(tier_name(optimizer_tier));
    STRATA_ASSERT_OK_AND_ASSIGN(auto engine, Engine::create(options, cluster->device(0), cluster->gather_communicator(0),
                                                            cluster->reduce_communicator(0)));
    for (GroupSpec spec : frozen_stack_groups(false)) {
      spec.trainable = false;
      STRATA_ASSERT_OK(engine->register_group(spec).status());
    }
    STRATA_ASSERT_OK(engine->start());
    EXPECT_EQ(engine->plan().gradient_slots, 0) << engine->plan().text;
    EXPECT_EQ(engine->plan().max_trainable_shard_elements, 0u);
    EXPECT_EQ(find_line(engine->plan(), "master weights", Tier::kPinned), nullptr) << engine->plan().text;
    EXPECT_EQ(find_line(engine->plan(), "master weights", Tier::kNvme), nullptr) << engine->plan().text;
    for (int step = 0; step < 3; ++step) {
      STRATA_ASSERT_OK(engine->begin_step());
      for (int g = 0; g < engine->group_count(); ++g) {
        STRATA_ASSERT_OK(engine->gather(g).status());
        STRATA_ASSERT_OK(engine->release(g));
      }
      STRATA_ASSERT_OK_AND_ASSIGN(StepReport report, engine->step(0.0));
      EXPECT_EQ(report.grad_norm, 0.0);
    }
    STRATA_ASSERT_OK(engine->finish());
    std::vector<float> values(engine->layout(kBase).shard_numel);
    STRATA_ASSERT_OK(engine->read_state_shard(kBase, Engine::StateKind::kMaster, values));
    values.resize(engine->layout(kBase).numel);
    EXPECT_TRUE(same_bits(values, initial_values(kBase, options.seed)));
  }
}

TEST(FrozenGroupTest, ThePlanCountsOptimizerStateAndGradientsOfTrainableGroupsOnly) {
  for (OverlapMode overlap : {OverlapMode::kExact, OverlapMode::kDelayed}) {
    SCOPED_TRACE(overlap_mode_name(overlap));
    EngineOptions options = fp32_options();
    options.overlap = overlap;
    STRATA_ASSERT_OK_AND_ASSIGN(StartedEngine started, start_engine(options));
    const Engine& engine = *started.engine;
    const EnginePlan& plan = engine.plan();
    const size_t trainable_shard = engine.layout(kEmbed).shard_numel + engine.layout(kHead).shard_numel;
    const size_t frozen_shard = engine.layout(kBase).shard_numel;
    ASSERT_GT(frozen_shard, engine.layout(kHead).shard_numel) << "the frozen group should be the largest";
    const size_t copies = overlap == OverlapMode::kDelayed ? 2 : 1;
    const PlanLine* state = find_line(plan, "master weights + exp_avg + exp_avg_sq", Tier::kPinned);
    ASSERT_NE(state, nullptr) << plan.text;
    EXPECT_EQ(state->bytes, 12 * trainable_shard) << plan.text;
    const PlanLine* landing = find_line(plan, "gradient landing shards", Tier::kPinned);
    ASSERT_NE(landing, nullptr) << plan.text;
    EXPECT_EQ(landing->bytes, copies * 4 * trainable_shard) << plan.text;
    const PlanLine* params = find_line(plan, "parameter shards", Tier::kPinned);
    ASSERT_NE(params, nullptr) << plan.text;
    EXPECT_EQ(params->bytes, 4 * (copies * trainable_shard + frozen_shard)) << "one copy of the frozen group\n" << plan.text;
    EXPECT_EQ(plan.max_trainable_shard_elements, engine.layout(kHead).shard_numel);
    ASSERT_FALSE(plan.gradient_slot_elements.empty());
    EXPECT_EQ(plan.gradient_slot_elements.front(), engine.layout(kHead).padded_numel) << "gradient slots sized by the trainable groups";
    const size_t numel = engine.layout(kEmbed).numel + engine.layout(kBase).numel + engine.layout(kHead).numel;
    EXPECT_EQ(plan.state_bytes, numel * 4 + (engine.layout(kEmbed).numel + engine.layout(kHead).numel) * 16);
    EXPECT_NE(plan.text.find("1 frozen group(s)"), std::string::npos) << plan.text;
    STRATA_ASSERT_OK(started.engine->finish());
  }
}

TEST(FrozenGroupTest, ACheckpointHoldsTheTrainableGroupsAndResumesBitIdentically) {
  testing::TempDir dir;
  const std::string save_dir = (dir.path() / "ckpt").string();
  FrozenSpec straight;
  straight.world = 2;
  straight.options.overlap = OverlapMode::kDelayed;
  straight.options.optimizer_tier = Tier::kNvme;
  straight.options.nvme_path = dir.str() + "/nvme";
  straight.steps = 5;
  straight.save_after = 3;
  CheckpointSaverOptions saver_options;
  saver_options.directory = save_dir;
  saver_options.world_size = 2;
  STRATA_ASSERT_OK_AND_ASSIGN(auto saver, CheckpointSaver::create(saver_options));
  straight.saver = saver.get();
  STRATA_ASSERT_OK_AND_ASSIGN(FrozenRun reference, train(straight));
  STRATA_ASSERT_OK(saver->finish());

  STRATA_ASSERT_OK_AND_ASSIGN(CheckpointRef latest, latest_complete(save_dir));
  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open(latest.path));
  ASSERT_EQ(reader->groups().size(), 3u);
  EXPECT_TRUE(reader->groups()[kBase].frozen);
  EXPECT_FALSE(reader->groups()[kEmbed].frozen);
  std::ifstream manifest(latest.path + "/manifest.json");
  std::stringstream text;
  text << manifest.rdbuf();
  EXPECT_NE(text.str().find("\"frozen\": true"), std::string::npos);
  // The rank files hold the trainable groups' four segments each (delayed mode: stale parameters too).
  const size_t trainable_bytes = (reader->groups()[kEmbed].shard_numel + reader->groups()[kHead].shard_numel) * 4 * 4;
  EXPECT_EQ(std::filesystem::file_size(latest.path + "/rank-0-of-2.bin"), trainable_bytes);
  std::vector<float> shard(reader->groups()[kBase].shard_numel);
  expect_frozen_error(reader->load_shard(kBase, Engine::StateKind::kMaster, 0, 2, shard), "load_shard");

  FrozenSpec resumed = straight;
  resumed.save_after = 0;
  resumed.saver = nullptr;
  resumed.resume = reader.get();
  resumed.first_step = 3;
  resumed.options.nvme_path = dir.str() + "/nvme-resumed";
  STRATA_ASSERT_OK_AND_ASSIGN(FrozenRun result, train(resumed));
  EXPECT_EQ(result.base_mismatches, 0);
  for (size_t g = 0; g < reference.masters.size(); ++g)
    EXPECT_TRUE(same_bits(result.masters[g], reference.masters[g])) << "group " << g << " differs after resuming";

  // An engine whose base is trainable does not load a checkpoint where it is frozen.
  FrozenSpec mismatched = resumed;
  mismatched.base_trainable = true;
  const StatusOr<FrozenRun> refused = train(mismatched);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("'base'"), std::string::npos) << refused.status().message();
  EXPECT_NE(refused.status().message().find("frozen in the checkpoint but trainable in the model"), std::string::npos)
      << refused.status().message();
}

}  // namespace
}  // namespace strata
