// The plan: pure sizing. Host memory with NVMe-resident state does not grow with the
// number of layers; budgets are honoured by automatic choices and explicit settings that
// do not fit fail with the settings that would.
#include "engine/engine_plan.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/support/test_support.h"

namespace strata::engine_internal {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// `layers` square linear layers of `width` (weight and bias), as strata-bench step builds.
std::vector<GroupLayout> linear_layers(int layers, int64_t width, int world = 1) {
  std::vector<GroupLayout> layouts;
  for (int i = 0; i < layers; ++i) {
    GroupSpec spec;
    spec.name = "layer" + std::to_string(i);
    spec.tensors.push_back({"weight", {width, width}, TensorInit::normal(0.02f), true});
    spec.tensors.push_back({"bias", {width}, TensorInit::zeros(), false});
    auto layout = layout_group(spec, i, world);
    EXPECT_TRUE(layout.ok()) << layout.status().to_string();
    layouts.push_back(std::move(layout).value());
  }
  return layouts;
}

EngineOptions nvme_options() {
  EngineOptions options;
  options.param_tier = Tier::kNvme;
  options.optimizer_tier = Tier::kNvme;
  options.nvme_path = "/nonexistent-plan-only";
  return options;
}

StatusOr<EnginePlan> plan_for(const EngineOptions& options, const std::vector<GroupLayout>& layouts, size_t device_budget) {
  PlanInputs inputs;
  inputs.options = &options;
  inputs.layouts = layouts;
  inputs.device_budget_bytes = device_budget;
  return make_engine_plan(inputs);
}

TEST(EnginePlanTest, HostBytesWithNvmeStateDoNotGrowWithTheNumberOfLayers) {
  for (size_t budget : {size_t{0}, 256 * kMiB}) {
    EngineOptions options = nvme_options();
    options.pinned_budget_bytes = budget;
    options.gradient_accumulation_steps = 2;
    STRATA_ASSERT_OK_AND_ASSIGN(EnginePlan few, plan_for(options, linear_layers(4, 1024), 1024 * kMiB));
    STRATA_ASSERT_OK_AND_ASSIGN(EnginePlan many, plan_for(options, linear_layers(64, 1024), 1024 * kMiB));
    EXPECT_EQ(few.pinned_bytes + few.host_bytes, many.pinned_bytes + many.host_bytes) << few.text << "\n" << many.text;
    EXPECT_GT(many.nvme_bytes, 10 * few.nvme_bytes) << "the model itself lives on NVMe";
    EXPECT_TRUE(many.gradients_spilled);
  }
}

TEST(EnginePlanTest, HostStateGrowsWithTheModelAndSaysSo) {
  EngineOptions options;  // parameters and optimizer state in pinned memory
  STRATA_ASSERT_OK_AND_ASSIGN(EnginePlan few, plan_for(options, linear_layers(4, 512), 1024 * kMiB));
  STRATA_ASSERT_OK_AND_ASSIGN(EnginePlan many, plan_for(options, linear_layers(16, 512), 1024 * kMiB));
  EXPECT_GT(many.pinned_bytes, 3 * few.pinned_bytes);
  EXPECT_FALSE(many.gradients_spilled);
  EXPECT_NE(many.text.find("master weights + exp_avg + exp_avg_sq"), std::string::npos) << many.text;
}

TEST(EnginePlanTest, ThePinnedBudgetSizesTheOptimizerStateChunks) {
  const auto layouts = linear_layers(8, 2048);
  size_t previous_piece = 0;
  for (size_t budget : {96 * kMiB, 192 * kMiB, 512 * kMiB}) {
    EngineOptions options = nvme_options();
    options.pinned_budget_bytes = budget;
    STRATA_ASSERT_OK_AND_ASSIGN(EnginePlan plan, plan_for(options, layouts, 1024 * kMiB));
    EXPECT_LE(plan.pinned_bytes + plan.host_bytes, budget) << plan.text;
    STRATA_EXPECT_OK(check_plan_against_machine(plan, options));
    EXPECT_GT(plan.state_piece_elements, 0u) << plan.text;
    EXPECT_GE(plan.state_piece_elements, previous_piece) << "a larger budget never gives smaller chunks";
    EXPECT_LE(plan.state_piece_elements, plan.max_shard_elements + (size_t{1} << 19)) << "no chunk larger than a group";
    previous_piece = plan.state_piece_elements;
  }
}

TEST(EnginePlanTest, SubGroupSizeCapsTheChunk) {
  EngineOptions options = nvme_options();
  options.sub_group_elements = size_t{1} << 20;
  STRATA_ASSERT_OK_AND_ASSIGN(EnginePlan plan, plan_for(options, linear_layers(4, 4096), 4096 * kMiB));
  EXPECT_EQ(plan.state_piece_elements, size_t{1} << 20) << plan.text;
  EXPECT_NE(plan.text.find("sub_group_size"), std::string::npos) << plan.text;
}

TEST(EnginePlanTest, APinnedBudgetTooSmallFailsNamingTheBudgetThatWouldFit) {
  EngineOptions options;  // state in pinned memory: 12 bytes per parameter at least
  options.pinned_budget_bytes = 8 * kMiB;
  STRATA_ASSERT_OK_AND_ASSIGN(EnginePlan plan, plan_for(options, linear_layers(8, 1024), 1024 * kMiB));
  const Status status = check_plan_against_machine(plan, options);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kOutOfMemory);
  EXPECT_NE(status.message().find("the pinned budget of 8.0 MiB cannot hold"), std::string::npos) << status.to_string();
  EXPECT_NE(status.message().find("a pinned budget of at least"), std::string::npos) << status.to_string();
  EXPECT_NE(status.message().find("optimizer state on nvme"), std::string::npos) << status.to_string();
}

TEST(EnginePlanTest, TheHostArenaIsThePlanWithItsSlackAndTheBudgetBoundsTheArena) {
  EXPECT_EQ(host_arena_bytes(0), 0u);
  EXPECT_EQ(host_arena_bytes(3200), 3200u + 100u + 4 * kMiB);
  for (const size_t budget : {size_t{0}, 4 * kMiB, 4 * kMiB + 1, 4 * kMiB + 33, 5 * kMiB + 7, 2048 * kMiB + 12345}) {
    const size_t within = plan_host_bytes_within(budget);
    if (within > 0) {
      EXPECT_LE(host_arena_bytes(within), budget) << budget;
    }
    EXPECT_GT(host_arena_bytes(within + 1), budget) << budget;
  }
}

TEST(EnginePlanTest, APlanThatFitsTheBudgetOnlyWithoutTheArenasSlackIsRefused) {
  EngineOptions options;  // parameters and optimizer state in pinned memory
  STRATA_ASSERT_OK_AND_ASSIGN(const EnginePlan unbounded, plan_for(options, linear_layers(4, 512), 1024 * kMiB));
  const size_t host = unbounded.pinned_bytes + unbounded.host_bytes;
  options.pinned_budget_bytes = host;  // the plan's bytes, not the arena's
  STRATA_ASSERT_OK_AND_ASSIGN(const EnginePlan tight, plan_for(options, linear_layers(4, 512), 1024 * kMiB));
  const Status status = check_plan_against_machine(tight, options);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("the host arena's slack"), std::string::npos) << status.to_string();
  options.pinned_budget_bytes = host_arena_bytes(host);
  STRATA_ASSERT_OK_AND_ASSIGN(const EnginePlan enough, plan_for(options, linear_layers(4, 512), 1024 * kMiB));
  STRATA_EXPECT_OK(check_plan_budgets(enough, options));
}

// The case strata-bench step --layers 8 --width 4096 --batch 4 --device-budget-mib 512
// hit: the default depth 2 did not fit where depth 1 does.
TEST(EnginePlanTest, AutomaticPrefetchDepthIsTheDeepestThatFitsTheDeviceBudget) {
  const auto layouts = linear_layers(8, 4096);
  EngineOptions options;
  options.param_tier = Tier::kPinned;
  options.optimizer_tier = Tier::kPinned;
  // Per gather slot: a bf16 4096 x 4096 layer (32 MiB); three fp32 gradient slots of
  // 64 MiB and one bf16 transfer cast of 32 MiB. Room for two gather slots.
  options.activation_bytes = 200 * kMiB;
  const size_t budget = 200 * kMiB + 3 * 64 * kMiB + 32 * kMiB + 2 * 32 * kMiB + 4 * kMiB;
  STRATA_ASSERT_OK_AND_ASSIGN(EnginePlan automatic, plan_for(options, layouts, budget));
  EXPECT_TRUE(automatic.prefetch_depth_chosen);
  EXPECT_EQ(automatic.prefetch_depth, 1) << automatic.text;
  EXPECT_LE(automatic.device_bytes, budget);
  STRATA_EXPECT_OK(check_plan_against_machine(automatic, options));
  EXPECT_NE(automatic.text.find("automatic"), std::string::npos) << automatic.text;

  options.prefetch_depth = 2;
  STRATA_ASSERT_OK_AND_ASSIGN(EnginePlan explicit_depth, plan_for(options, layouts, budget));
  EXPECT_EQ(explicit_depth.prefetch_depth, 2);
  const Status status = check_plan_against_machine(explicit_depth, options);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("or prefetch depth 1"), std::string::npos) << status.to_string();

  // A generous budget gets the deepest automatic depth.
  options.prefetch_depth = EngineOptions::kAutoDepth;
  STRATA_ASSERT_OK_AND_ASSIGN(EnginePlan roomy, plan_for(options, layouts, 4096 * kMiB));
  EXPECT_EQ(roomy.prefetch_depth, kMaxAutomaticPrefetchDepth);
}

// A vocabulary-sized group (a tied embedding) takes one gradient slot of its size; the
// other slots are sized for the largest of the rest, and one transfer cast serves them all.
TEST(EnginePlanTest, OnlyOneGradientSlotIsSizedForTheLargestGroup) {
  std::vector<GroupLayout> layouts = linear_layers(6, 1024);
  GroupSpec embedding;
  embedding.name = "wte";
  embedding.tensors.push_back({"weight", {8192, 1024}, TensorInit::normal(0.02f), true});
  auto layout = layout_group(embedding, 6, 1);
  STRATA_ASSERT_OK(layout.status());
  layouts.push_back(std::move(layout).value());
  EngineOptions options;
  STRATA_ASSERT_OK_AND_ASSIGN(EnginePlan plan, plan_for(options, layouts, 4096 * kMiB));
  ASSERT_EQ(plan.gradient_slot_elements.size(), static_cast<size_t>(plan.gradient_slots));
  EXPECT_EQ(plan.gradient_slot_elements.front(), layouts.back().padded_numel);
  for (size_t i = 1; i < plan.gradient_slot_elements.size(); ++i)
    EXPECT_EQ(plan.gradient_slot_elements[i], layouts.front().padded_numel) << plan.text;
  EXPECT_NE(plan.text.find("gradient transfer cast (one, shared by the slots)"), std::string::npos) << plan.text;
}

// A recorded schedule used to cost a third full-size gradient slot even for a model that
// holds none between uses (the Llama family's tied head): 1.14 GiB for Llama-3.2-1B's plan.
TEST(EnginePlanTest, DeclaredHeldGradientsSetTheGradientSlotsBeyondTheTwo) {
  const std::vector<GroupLayout> layouts = linear_layers(6, 1024);
  EngineOptions options;
  STRATA_ASSERT_OK_AND_ASSIGN(EnginePlan recorded, plan_for(options, layouts, 4096 * kMiB));
  EXPECT_EQ(recorded.gradient_slots, 3);
  for (int held : {0, 1, 4}) {
    PlanInputs inputs;
    inputs.options = &options;
    inputs.layouts = layouts;
    inputs.device_budget_bytes = 4096 * kMiB;
    inputs.held_gradients = held;
    STRATA_ASSERT_OK_AND_ASSIGN(EnginePlan plan, make_engine_plan(inputs));
    EXPECT_EQ(plan.gradient_slots, 2 + held);
    EXPECT_EQ(plan.gradient_slot_elements.size(), static_cast<size_t>(2 + held));
  }
}

// Two gradient buffers beyond the held ones, until they do not fit the device budget: then
// one, said in the plan's text (after every shallower prefetch, with the automatic depth);
// without a declared schedule (three buffers) never fewer.
TEST(EnginePlanTest, WhenTwoGradientBuffersDoNotFitTheBudgetThePlanTakesOne) {
  const std::vector<GroupLayout> layouts = linear_layers(6, 1024);  // 4 MiB of fp32 gradient per group
  EngineOptions options;
  options.prefetch_depth = 1;  // fixed: with the automatic depth a shallower prefetch is tried first
  PlanInputs inputs;
  inputs.options = &options;
  inputs.layouts = layouts;
  inputs.held_gradients = 0;
  inputs.device_budget_bytes = 4096 * kMiB;
  STRATA_ASSERT_OK_AND_ASSIGN(const EnginePlan roomy, make_engine_plan(inputs));
  EXPECT_EQ(roomy.gradient_slots, 2);
  EXPECT_FALSE(roomy.single_gradient_buffer);
  // Just under the two-buffer plan: one buffer (4 MiB less) fits.
  inputs.device_budget_bytes = roomy.device_bytes - 1;
  STRATA_ASSERT_OK_AND_ASSIGN(const EnginePlan tight, make_engine_plan(inputs));
  EXPECT_EQ(tight.gradient_slots, 1);
  EXPECT_TRUE(tight.single_gradient_buffer);
  EXPECT_LE(tight.device_bytes, tight.device_budget_bytes) << tight.text;
  EXPECT_NE(tight.text.find("gradient buffer (fp32: 1 x 4.0 MiB)"), std::string::npos) << tight.text;
  EXPECT_NE(tight.text.find("one gradient buffer (two do not fit"), std::string::npos) << tight.text;
  // Held gradients stay on top of the one.
  inputs.held_gradients = 2;
  STRATA_ASSERT_OK_AND_ASSIGN(const EnginePlan held_roomy, make_engine_plan(PlanInputs{inputs.options, inputs.layouts, {}, 2, 4096 * kMiB}));
  inputs.device_budget_bytes = held_roomy.device_bytes - 1;
  STRATA_ASSERT_OK_AND_ASSIGN(const EnginePlan held_tight, make_engine_plan(inputs));
  EXPECT_EQ(held_tight.gradient_slots, 3);
  // A model that declared nothing keeps its three, and fails the check instead.
  inputs.held_gradients = -1;
  STRATA_ASSERT_OK_AND_ASSIGN(const EnginePlan recorded, make_engine_plan(inputs));
  EXPECT_EQ(recorded.gradient_slots, 3);
  EXPECT_FALSE(recorded.single_gradient_buffer);
}

TEST(EnginePlanTest, TheAutomaticDepthAlsoFitsNvmeReadStagingIntoThePinnedBudget) {
  const auto layouts = linear_layers(8, 2048);  // 8 MiB bf16 shards
  EngineOptions options = nvme_options();
  options.pinned_budget_bytes = 96 * kMiB;
  STRATA_ASSERT_OK_AND_ASSIGN(EnginePlan plan, plan_for(options, layouts, 4096 * kMiB));
  EXPECT_LE(plan.pinned_bytes + plan.host_bytes, options.pinned_budget_bytes) << plan.text;
  EXPECT_GE(plan.prefetch_depth, 1) << plan.text;
}

}  // namespace
}  // namespace strata::engine_internal
