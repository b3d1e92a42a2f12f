// engine_options_from_config: every config key the engine acts on lands in its
// EngineOptions field; keys left unset leave the engine's automatic choice.
#include "engine/engine_config.h"

#include <gtest/gtest.h>

#include <string>

#include "engine/core/config.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// A parsed, finalized config, or a test failure.
StrataConfig finalized(const std::string& text, int world_size = 1) {
  StatusOr<StrataConfig> config = parse_config_json(text, "engine_config_test.json");
  EXPECT_TRUE(config.ok()) << config.status().to_string();
  if (!config.ok()) return StrataConfig{};
  const Status status = finalize(*config, world_size);
  EXPECT_TRUE(status.ok()) << status.to_string();
  return *std::move(config);
}

// Every engine key set to a value unlike its default.
constexpr const char* kEveryEngineKey = R"({
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 3,
  "steps_per_print": 7,
  "wall_clock_breakdown": true,
  "gradient_clipping": 0.5,
  "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 300,
           "hysteresis": 4, "min_loss_scale": 0.25},
  "optimizer": {"type": "Adam", "params": {"lr": 0.002, "betas": [0.8, 0.95], "eps": 1e-6,
                                           "weight_decay": 0.1, "adam_w_mode": false}},
  "zero_optimization": {
    "offload_param": {"device": "nvme", "buffer_count": 6},
    "offload_optimizer": {"device": "cpu", "buffer_count": 5},
    "stage3_prefetch_bucket_size": 12345,
    "stage3_max_live_parameters": 67890,
    "stage3_param_persistence_threshold": 111,
    "reduce_bucket_size": 4096,
    "sub_group_size": 1000000
  },
  "aio": {"block_size": 262144, "queue_depth": 16},
  "strata": {
    "world_size": 2, "seed": 99, "pinned_budget_mib": 1536, "optimizer_threads": 3,
    "optimizer_overlap": "delayed", "grad_wire_dtype": "fp32", "prefetch_depth": 3,
    "nvme_path": "/scratch/nvme", "nvme_checksum": false, "io_engine": "psync",
    "metrics": "m.jsonl", "trace": "t.json"
  }
})";

TEST(EngineConfigTest, EveryEngineKeyLandsInItsField) {
  const StrataConfig config = finalized(kEveryEngineKey, 2);
  STRATA_ASSERT_OK_AND_ASSIGN(EngineOptions o, engine_options_from_config(config, 1));
  EXPECT_EQ(o.rank, 1);
  EXPECT_EQ(o.world_size, 2);
  EXPECT_EQ(o.seed, 99u);
  EXPECT_EQ(o.gradient_accumulation_steps, 3);
  EXPECT_EQ(o.steps_per_print, 7);
  EXPECT_TRUE(o.wall_clock_breakdown);
  EXPECT_FLOAT_EQ(o.gradient_clipping, 0.5f);
  // Precision: fp16 with dynamic loss scaling; grad_wire_dtype as given.
  EXPECT_EQ(o.param_dtype, DType::kFloat16);
  EXPECT_EQ(o.grad_wire_dtype, DType::kFloat32);
  EXPECT_EQ(o.grad_transfer_dtype, DType::kBFloat16);
  EXPECT_TRUE(o.fp16_loss_scaling);
  EXPECT_TRUE(o.loss_scaler.dynamic);
  EXPECT_FLOAT_EQ(o.loss_scaler.initial_scale, 4096.0f);
  EXPECT_EQ(o.loss_scaler.growth_interval, 300);
  EXPECT_EQ(o.loss_scaler.hysteresis, 4);
  EXPECT_FLOAT_EQ(o.loss_scaler.min_scale, 0.25f);
  // Adam with adam_w_mode false: L2 decay.
  EXPECT_DOUBLE_EQ(o.adam.lr, 0.002);
  EXPECT_DOUBLE_EQ(o.adam.beta1, 0.8);
  EXPECT_DOUBLE_EQ(o.adam.beta2, 0.95);
  EXPECT_DOUBLE_EQ(o.adam.eps, 1e-6);
  EXPECT_DOUBLE_EQ(o.adam.weight_decay, 0.1);
  EXPECT_EQ(o.adam.decay, kernels::AdamWeightDecay::kL2);
  EXPECT_EQ(o.optimizer_threads, 3);
  EXPECT_EQ(o.overlap, OverlapMode::kDelayed);
  // Placement, budgets and pipeline depths.
  EXPECT_EQ(o.param_tier, Tier::kNvme);
  EXPECT_EQ(o.optimizer_tier, Tier::kPinned);
  EXPECT_TRUE(o.pin_memory);
  EXPECT_EQ(o.nvme_path, "/scratch/nvme");
  EXPECT_EQ(o.param_buffer_count, 6);
  EXPECT_EQ(o.optimizer_buffer_count, 5);
  EXPECT_EQ(o.prefetch_bucket_elements, 12345u);
  EXPECT_EQ(o.max_live_elements, 67890u);
  EXPECT_EQ(o.persistence_threshold, 111u);
  EXPECT_EQ(o.reduce_bucket_elements, 4096u);
  EXPECT_EQ(o.sub_group_elements, 1000000u);
  EXPECT_EQ(o.prefetch_depth, 3);
  EXPECT_EQ(o.pinned_budget_bytes, 1536 * kMiB);
  // NVMe I/O and files.
  EXPECT_EQ(o.nvme_block_bytes, 262144u);
  EXPECT_EQ(o.nvme_queue_depth, 16);
  EXPECT_FALSE(o.nvme_checksum);
  EXPECT_EQ(o.io_engine, IoEngineKind::kPsync);
  EXPECT_EQ(o.metrics_path, "m.jsonl");
  EXPECT_EQ(o.trace_path, "t.json");
  EXPECT_EQ(o.activation_bytes, 0u);  // the model's, not the config's
}

TEST(EngineConfigTest, UnsetKeysLeaveTheEnginesAutomaticChoices) {
  const StrataConfig config = finalized("{}");
  STRATA_ASSERT_OK_AND_ASSIGN(EngineOptions o, engine_options_from_config(config, 0));
  EXPECT_EQ(o.prefetch_depth, EngineOptions::kAutoDepth);
  EXPECT_EQ(o.sub_group_elements, 0u);
  EXPECT_EQ(o.reduce_bucket_elements, 0u);
  EXPECT_EQ(o.optimizer_buffer_count, 0);
  EXPECT_EQ(o.param_buffer_count, 0);
  EXPECT_EQ(o.pinned_budget_bytes, 0u);
  EXPECT_EQ(o.steps_per_print, 10);  // DeepSpeed's default
  EXPECT_FALSE(o.wall_clock_breakdown);
  EXPECT_EQ(o.param_tier, Tier::kDevice);
  EXPECT_EQ(o.optimizer_tier, Tier::kDevice);
  EXPECT_EQ(o.io_engine, IoEngineKind::kAuto);
  EXPECT_EQ(o.overlap, OverlapMode::kExact);
  // fp32 training keeps fp32 gradients end to end.
  EXPECT_EQ(o.param_dtype, DType::kFloat32);
  EXPECT_EQ(o.grad_wire_dtype, DType::kFloat32);
  EXPECT_EQ(o.grad_transfer_dtype, DType::kFloat32);
  EXPECT_FALSE(o.fp16_loss_scaling);
}

TEST(EngineConfigTest, ExplicitPrefetchDepthZeroIsNotAutomatic) {
  const StrataConfig config = finalized(R"({"strata": {"prefetch_depth": 0}})");
  STRATA_ASSERT_OK_AND_ASSIGN(EngineOptions o, engine_options_from_config(config, 0));
  EXPECT_EQ(o.prefetch_depth, 0);
}

TEST(EngineConfigTest, TrainGptPinnedBudgetFlagReachesTheEngine) {
  // train_gpt maps its flags with config_key_for_flag and applies them as overrides.
  const std::optional<std::string> key = config_key_for_flag("--pinned-budget-mib");
  ASSERT_EQ(key, "strata.pinned_budget_mib");
  StrataConfig config;
  STRATA_ASSERT_OK(apply_override(config, *key, "2048"));
  STRATA_ASSERT_OK(finalize(config, kConfiguredWorldSize));
  STRATA_ASSERT_OK_AND_ASSIGN(EngineOptions o, engine_options_from_config(config, 0));
  EXPECT_EQ(o.pinned_budget_bytes, 2048 * kMiB);
}

TEST(EngineConfigTest, PageableHostMemoryWhenPinMemoryIsFalse) {
  const StrataConfig config = finalized(R"({"zero_optimization": {
      "offload_param": {"device": "cpu", "pin_memory": false}, "offload_optimizer": {"device": "cpu"}}})");
  STRATA_ASSERT_OK_AND_ASSIGN(EngineOptions o, engine_options_from_config(config, 0));
  EXPECT_FALSE(o.pin_memory);
  EXPECT_EQ(o.param_tier, Tier::kHost);
  EXPECT_EQ(o.optimizer_tier, Tier::kHost);
}

TEST(EngineConfigTest, Bf16TrainingSendsBf16Gradients) {
  const StrataConfig config = finalized(R"({"bf16": {"enabled": true}})");
  STRATA_ASSERT_OK_AND_ASSIGN(EngineOptions o, engine_options_from_config(config, 0));
  EXPECT_EQ(o.param_dtype, DType::kBFloat16);
  EXPECT_EQ(o.grad_wire_dtype, DType::kBFloat16);
  EXPECT_EQ(o.grad_transfer_dtype, DType::kBFloat16);
  EXPECT_FALSE(o.fp16_loss_scaling);
}

TEST(EngineConfigTest, RejectsAnUnfinalizedConfigAndARankOutsideTheWorld) {
  StrataConfig raw;
  const StatusOr<EngineOptions> unfinalized = engine_options_from_config(raw, 0);
  ASSERT_FALSE(unfinalized.ok());
  EXPECT_EQ(unfinalized.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(unfinalized.status().message().find("finalize"), std::string::npos);

  const StrataConfig config = finalized("{}", 2);
  EXPECT_TRUE(engine_options_from_config(config, 1).ok());
  const StatusOr<EngineOptions> outside = engine_options_from_config(config, 2);
  ASSERT_FALSE(outside.ok());
  EXPECT_NE(outside.status().message().find("rank 2 is outside world size 2"), std::string::npos);
  EXPECT_FALSE(engine_options_from_config(config, -1).ok());
}

}  // namespace
}  // namespace strata
