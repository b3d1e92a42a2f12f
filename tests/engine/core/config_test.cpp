#include "engine/core/config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/core/log.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

// Substring checks that print both strings on failure (gmock is not a dependency).
::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected to find\n  " << part << "\nin\n  " << text;
}
::testing::AssertionResult Lacks(const std::string& text, const std::string& part) {
  if (text.find(part) == std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "did not expect to find\n  " << part << "\nin\n  " << text;
}

class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_level_ = log_level();
    set_log_level(LogLevel::kInfo);  // the warnings under test are at kWarn
  }
  void TearDown() override { set_log_level(saved_level_); }

  // Writes `text` to a file in this test's directory and returns its path.
  std::string write_file(const std::string& name, const std::string& text) {
    const std::string path = (dir_.path() / name).string();
    std::ofstream(path) << text;
    return path;
  }

  // Loads `text` from a file; the status message of a failure.
  std::string load_error(const std::string& text, std::string* path_out = nullptr) {
    const std::string path = write_file("cfg.json", text);
    if (path_out != nullptr) *path_out = path;
    StatusOr<StrataConfig> config = load_config_file(path);
    EXPECT_FALSE(config.ok()) << "loaded but should not have: " << text;
    return config.ok() ? std::string() : config.status().message();
  }

  strata::testing::TempDir dir_;
  LogLevel saved_level_ = LogLevel::kInfo;
};

// DeepSpeed's ZeRO-Infinity example (parameters and optimizer state on NVMe), as its
// docs and the Hugging Face integration docs show it, with the keys Strata ignores.
constexpr const char* kDeepSpeedNvmeExample = R"({
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "optimizer": {
    "type": "AdamW",
    "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}
  },
  "scheduler": {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500}
  },
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "buffer_count": 4,
      "fast_init": false
    },
    "offload_param": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "buffer_count": 5,
      "buffer_size": 1e8,
      "max_in_cpu": 1e9
    },
    "overlap_comm": true,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": 1e6,
    "stage3_prefetch_bucket_size": 0.94e6,
    "stage3_param_persistence_threshold": 1e4,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  },
  "aio": {
    "block_size": 1048576,
    "queue_depth": 8,
    "thread_count": 1,
    "single_submit": false,
    "overlap_events": true
  },
  "gradient_accumulation_steps": 2,
  "gradient_clipping": 1.0,
  "steps_per_print": 2000,
  "train_batch_size": 32,
  "train_micro_batch_size_per_gpu": 4,
  "wall_clock_breakdown": false
})";

TEST_F(ConfigTest, DefaultsFromEmptyObject) {
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig config, parse_config_json("{}", "empty.json"));
  EXPECT_EQ(config.source, "empty.json");
  EXPECT_TRUE(config.given.empty());
  EXPECT_EQ(config.zero.stage, 3);
  EXPECT_EQ(config.zero.offload_param.device, Tier::kDevice);
  EXPECT_EQ(config.zero.offload_optimizer.device, Tier::kDevice);
  EXPECT_TRUE(config.zero.offload_param.pin_memory);
  // Left to the engine: it picks what fits the budgets.
  EXPECT_FALSE(config.strata.prefetch_depth.has_value());
  EXPECT_FALSE(config.zero.sub_group_size.has_value());
  EXPECT_FALSE(config.zero.reduce_bucket_size.has_value());
  EXPECT_FALSE(config.zero.offload_param.buffer_count.has_value());
  EXPECT_FALSE(config.zero.offload_optimizer.buffer_count.has_value());
  EXPECT_EQ(config.steps_per_print, 10);
  EXPECT_FALSE(config.wall_clock_breakdown);
  EXPECT_EQ(config.aio.block_size, 1048576);
  EXPECT_EQ(config.aio.queue_depth, 8);
  EXPECT_EQ(config.optimizer.type, OptimizerType::kAdam);
  EXPECT_TRUE(decoupled_weight_decay(config.optimizer));
  EXPECT_EQ(config.scheduler.type, SchedulerType::kNone);
  EXPECT_FALSE(config.strata.device.has_value());
  EXPECT_EQ(config.strata.optimizer_overlap, OverlapMode::kExact);
  EXPECT_EQ(config.strata.grad_wire_dtype, DType::kBFloat16);
  EXPECT_FALSE(config.train_batch_size.has_value());

  STRATA_ASSERT_OK(finalize(config, 1));
  EXPECT_EQ(config.train_batch_size, 1);
  EXPECT_EQ(config.train_micro_batch_size_per_gpu, 1);
  EXPECT_EQ(config.gradient_accumulation_steps, 1);
  EXPECT_EQ(config.strata.param_dtype, DType::kFloat32);
}

TEST_F(ConfigTest, LoadsDeepSpeedZero3NvmeExample) {
  const std::string path = write_file("ds_zero3_nvme.json", kDeepSpeedNvmeExample);
  ::testing::internal::CaptureStderr();
  StatusOr<StrataConfig> loaded = load_config_file(path);
  const std::string log = ::testing::internal::GetCapturedStderr();
  STRATA_ASSERT_OK(loaded);
  StrataConfig config = *std::move(loaded);

  EXPECT_TRUE(config.fp16.enabled);
  EXPECT_EQ(config.fp16.loss_scale, 0.0);
  EXPECT_EQ(config.fp16.initial_scale_power, 16);
  EXPECT_EQ(config.optimizer.type, OptimizerType::kAdamW);
  EXPECT_DOUBLE_EQ(config.optimizer.lr, 3e-5);
  EXPECT_DOUBLE_EQ(config.optimizer.betas[0], 0.8);
  EXPECT_DOUBLE_EQ(config.optimizer.betas[1], 0.999);
  EXPECT_DOUBLE_EQ(config.optimizer.weight_decay, 3e-7);
  EXPECT_EQ(config.scheduler.type, SchedulerType::kWarmupLR);
  EXPECT_EQ(config.scheduler.warmup_num_steps, 500);
  EXPECT_EQ(config.zero.offload_param.device, Tier::kNvme);
  EXPECT_EQ(config.zero.offload_optimizer.device, Tier::kNvme);
  EXPECT_EQ(config.strata.nvme_path, "/local_nvme");
  EXPECT_EQ(config.zero.offload_param.buffer_count, 5);
  EXPECT_EQ(config.zero.offload_optimizer.buffer_count, 4);
  EXPECT_EQ(config.zero.reduce_bucket_size, 1000000);
  EXPECT_EQ(config.zero.sub_group_size, 1000000000);
  EXPECT_EQ(config.zero.prefetch_bucket_size, 940000);
  EXPECT_EQ(config.zero.param_persistence_threshold, 10000);
  EXPECT_EQ(config.zero.max_live_parameters, 1000000000);
  EXPECT_EQ(config.aio.block_size, 1048576);
  EXPECT_EQ(config.aio.queue_depth, 8);
  EXPECT_DOUBLE_EQ(config.gradient_clipping, 1.0);
  EXPECT_EQ(config.steps_per_print, 2000);

  // One warning line per ignored key, naming it.
  const std::vector<std::string> ignored = {
      "zero_optimization.offload_optimizer.fast_init", "zero_optimization.offload_param.max_in_cpu",
      "zero_optimization.offload_param.buffer_size", "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
      "zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
      "aio.thread_count", "aio.single_submit", "aio.overlap_events"};
  for (const std::string& key : ignored) {
    EXPECT_TRUE(Contains(log, path + ": " + key + " is a DeepSpeed setting Strata does not act on")) << key;
  }
  size_t warning_lines = 0;
  for (size_t at = log.find("[strata W"); at != std::string::npos; at = log.find("[strata W", at + 1)) ++warning_lines;
  EXPECT_EQ(warning_lines, ignored.size()) << log;

  // 32 = 4 micro * 2 accumulation * 4 ranks.
  STRATA_ASSERT_OK(finalize(config, 4));
  EXPECT_EQ(config.strata.world_size, 4);
  EXPECT_EQ(config.strata.param_dtype, DType::kFloat16);
  EXPECT_DOUBLE_EQ(*config.scheduler.warmup_max_lr, 3e-5);
  // With 2 ranks the same file is inconsistent, and the error names all four numbers.
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig again, load_config_file(path));
  const Status mismatch = finalize(again, 2);
  ASSERT_FALSE(mismatch.ok());
  EXPECT_TRUE(Contains(mismatch.message(), "train_batch_size (32) must equal train_micro_batch_size_per_gpu (4) * "
                                            "gradient_accumulation_steps (2) * world_size (2) = 16 in " + path));
}

TEST_F(ConfigTest, CleanConfigLogsNoWarning) {
  ::testing::internal::CaptureStderr();
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig config,
                              parse_config_json(R"({"train_batch_size": 8, "bf16": {"enabled": true}})", "clean.json"));
  STRATA_ASSERT_OK(finalize(config, 2));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

TEST_F(ConfigTest, IgnoredSectionsAreNotInspected) {
  ::testing::internal::CaptureStderr();
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig config, parse_config_json(R"({
      "tensorboard": {"enabled": true, "anything": {"goes": [1, 2]}},
      "activation_checkpointing": {"partition_activations": false, "cpu_checkpointing": true},
      "zero_allow_untested_optimizer": true,
      "comms_logger": {"enabled": false}})", "ignored.json"));
  const std::string log = ::testing::internal::GetCapturedStderr();
  for (const char* key : {"tensorboard", "activation_checkpointing", "zero_allow_untested_optimizer", "comms_logger"}) {
    EXPECT_TRUE(Contains(log, std::string("ignored.json: ") + key + " is a DeepSpeed setting")) << key;
  }
  EXPECT_TRUE(Contains(log, "use strata.model.activation_checkpointing"));
  EXPECT_TRUE(Lacks(log, ("anything")));
}

TEST_F(ConfigTest, UnknownKeyNamesKeyFileAndSuggestion) {
  std::string path;
  std::string message = load_error(R"({"train_batch_sise": 32})", &path);
  EXPECT_EQ(message, "unknown key \"train_batch_sise\" in " + path + " (did you mean \"train_batch_size\"?)");

  message = load_error(R"({"zero_optimization": {"offload_param": {"devise": "cpu"}}})", &path);
  EXPECT_EQ(message, "unknown key \"zero_optimization.offload_param.devise\" in " + path +
                         " (did you mean \"zero_optimization.offload_param.device\"?)");

  // A known name at the wrong level points at where it belongs.
  message = load_error(R"({"stage": 3})", &path);
  EXPECT_TRUE(Contains(message, "unknown key \"stage\" in " + path));
  EXPECT_TRUE(Contains(message, "did you mean \"zero_optimization.stage\"?"));

  // Nothing close: no suggestion.
  message = load_error(R"({"strata": {"frobnicate": 1}})", &path);
  EXPECT_EQ(message, "unknown key \"strata.frobnicate\" in " + path);

  message = load_error(R"({"zero_optimization.stage": 3})", &path);
  EXPECT_TRUE(Contains(message, "keys are nested objects, not dotted names"));
}

TEST_F(ConfigTest, IllTypedAndOutOfRangeValues) {
  struct Case {
    const char* text;
    const char* expected;
  };
  const Case cases[] = {
      {R"({"zero_optimization": {"offload_param": {"device": "gpu"}}})",
       R"(zero_optimization.offload_param.device: expected one of "none", "cpu", "nvme", got "gpu" in )"},
      {R"({"train_batch_size": "32"})", R"(train_batch_size: expected a positive integer, got "32" in )"},
      {R"({"train_batch_size": 0})", "train_batch_size: expected a positive integer, got 0 in "},
      {R"({"zero_optimization": {"offload_param": {"buffer_count": 2.5}}})",
       "zero_optimization.offload_param.buffer_count: expected an integer in [1, 2147483647], got 2.5 in "},
      {R"({"aio": {"block_size": 1000}})", "aio.block_size: expected an integer >= 4096 that is a multiple of 4096, got 1000 in "},
      {R"({"aio": {"queue_depth": 0}})", "aio.queue_depth: expected an integer in [1, 32768], got 0 in "},
      {R"({"zero_optimization": {"stage": 4}})", "zero_optimization.stage: expected an integer in [0, 3], got 4 in "},
      {R"({"strata": {"device_thread_nice": 20}})", "strata.device_thread_nice: expected an integer in [0, 19], got 20 in "},
      {R"({"fp16": {"min_loss_scale": 0}})", "fp16.min_loss_scale: expected a number > 0, got 0 in "},
      {R"({"bf16": {"enabled": 1}})", "bf16.enabled: expected true or false, got 1 in "},
      {R"({"gradient_clipping": -1})", "gradient_clipping: expected a number >= 0, got -1 in "},
      {R"({"optimizer": {"params": {"betas": [0.9]}}})", "optimizer.params.betas: expected a list of two numbers in [0, 1), got [0.9] in "},
      {R"({"optimizer": {"params": {"betas": [0.9, 1.5]}}})", "optimizer.params.betas: expected a list of two numbers in [0, 1), got [0.9,1.5] in "},
      {R"({"optimizer": {"type": "Lamb"}})",
       R"(optimizer.type: expected one of "Adam", "AdamW" (any case), got "Lamb" (a DeepSpeed choice Strata does not implement) in )"},
      {R"({"scheduler": {"type": "OneCycle"}})", R"(scheduler.type: expected one of "WarmupLR", "WarmupDecayLR", "WarmupCosineLR" (any case), got "OneCycle" (a DeepSpeed choice Strata does not implement) in )"},
      {R"({"optimizer": {"params": {"amsgrad": true}}})",
       "optimizer.params.amsgrad: expected false (Strata's Adam does not implement AMSGrad), got true in "},
      {R"({"zero_optimization": true})", "zero_optimization: expected an object, got true in "},
      {R"({"strata": {"optimizer_overlap": "lazy"}})", R"(strata.optimizer_overlap: expected one of "exact", "delayed", got "lazy" in )"},
      {R"({"strata": {"grad_wire_dtype": "fp16"}})", R"(strata.grad_wire_dtype: expected one of "bf16", "fp32", got "fp16" in )"},
      {R"({"strata": {"device": "tpu"}})", R"(strata.device: expected one of "cpu", "cuda" or "auto", got "tpu" in )"},
      {R"({"strata": {"io_engine": "aio"}})", R"(strata.io_engine: expected one of "auto", "io_uring", "psync", got "aio" in )"},
      {R"({"strata": {"matmul_precision": "fp16"}})", R"(strata.matmul_precision: expected one of "fp32", "tf32", "bf16", got "fp16" in )"},
      {R"({"strata": {"nvme_path": 7}})", "strata.nvme_path: expected a string, got 7 in "},
      {R"({"strata": {"world_size": 0}})", "strata.world_size: expected an integer in [1, 1048576], got 0 in "},
      {R"({"strata": {"checkpoint": {"on_save_failure": "retry"}}})",
       R"(strata.checkpoint.on_save_failure: expected one of "stop", "continue", got "retry" in )"},
      {R"({"strata": {"max_nonfinite_steps": -1}})", "strata.max_nonfinite_steps: expected a non-negative integer, got -1 in "},
  };
  for (const Case& c : cases) {
    std::string path;
    const std::string message = load_error(c.text, &path);
    EXPECT_EQ(message, std::string(c.expected) + path) << c.text;
  }
}

TEST_F(ConfigTest, AllProblemsReportedTogether) {
  std::string path;
  const std::string message =
      load_error(R"({"train_batch_sise": 1, "aio": {"queue_depth": -1}, "fp16": {"enabled": "yes"}})", &path);
  EXPECT_TRUE(Contains(message, "3 problems in " + path + ":"));
  EXPECT_TRUE(Contains(message, "\n  - unknown key \"train_batch_sise\""));
  EXPECT_TRUE(Contains(message, "\n  - aio.queue_depth: expected"));
  EXPECT_TRUE(Contains(message, "\n  - fp16.enabled: expected true or false, got \"yes\""));
}

TEST_F(ConfigTest, MalformedJsonGivesFileLineAndColumn) {
  std::string path;
  // The position is that of the last character read: the end of the unexpected "10".
  std::string message = load_error("{\n  \"train_batch_size\": 8,\n  \"steps_per_print\" 10\n}\n", &path);
  EXPECT_TRUE(Contains(message, "malformed JSON in " + path + " at line 3, column 22: "));
  EXPECT_TRUE(Contains(message, "syntax error"));

  message = load_error("{\"a\": [1, 2}", &path);
  EXPECT_TRUE(Contains(message, "malformed JSON in " + path + " at line 1, column 12"));

  message = load_error("", &path);
  EXPECT_TRUE(Contains(message, "malformed JSON in " + path + " at line 1"));

  message = load_error("[1, 2]", &path);
  EXPECT_EQ(message, "the config in " + path + " must be a JSON object, got [1,2]");
}

// 100k levels used to overflow the stack (a segfault) while the error quoting the value
// was built: nlohmann's dump() recurses once per level.
TEST_F(ConfigTest, DeeplyNestedJsonIsRefusedWithAClearErrorInsteadOfOverflowingTheStack) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  for (const std::string& text : {R"({"train_batch_size": )" + deep + "}", R"({"not_a_key": )" + deep + "}", deep}) {
    std::string path;
    const std::string message = load_error(text, &path);
    EXPECT_EQ(message, "the JSON in " + path +
                           " nests objects and arrays more than 64 levels deep; a config never needs that many (is it the intended file?)");
  }
  // 64 levels (the object and 63 arrays) are still read, and judged by the key's type.
  const std::string message = load_error(R"({"train_batch_size": )" + std::string(63, '[') + std::string(63, ']') + "}");
  EXPECT_TRUE(Contains(message, "train_batch_size: expected a positive integer, got an array")) << message;
}

// A count the engine holds in an int is range-checked as one: 2^32 + 1 used to pass the
// int64 check and reach the trainer as static_cast<int>(4294967297) == 1.
TEST_F(ConfigTest, IntCountsAboveIntMaxAreRefusedNamingKeyValueAndRange) {
  for (const char* key : {"gradient_accumulation_steps", "steps_per_print", "fp16.loss_scale_window", "fp16.hysteresis",
                          "zero_optimization.offload_param.buffer_count", "zero_optimization.offload_optimizer.buffer_count"}) {
    StrataConfig config;
    const Status status = apply_override(config, key, "4294967297");
    ASSERT_FALSE(status.ok()) << key;
    EXPECT_TRUE(Contains(status.message(), std::string(key) + ": expected an integer in [")) << status.message();
    EXPECT_TRUE(Contains(status.message(), ", 2147483647], got 4294967297 on the command line")) << status.message();
  }
  StrataConfig config;
  EXPECT_TRUE(apply_override(config, "gradient_accumulation_steps", "2147483647").ok());
}

TEST_F(ConfigTest, DuplicateKeysAreErrors) {
  std::string path;
  const std::string message = load_error(R"({"zero_optimization": {"stage": 3, "stage": 2}})", &path);
  EXPECT_EQ(message, "duplicate key \"zero_optimization.stage\" in " + path);
}

TEST_F(ConfigTest, CommentsAreAllowedAsInDeepSpeedsHjsonLoader) {
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig config, parse_config_json(R"({
      // micro batch per rank
      "train_micro_batch_size_per_gpu": 4, /* two per step */ "gradient_accumulation_steps": 2})", "c.json"));
  EXPECT_EQ(config.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(config.gradient_accumulation_steps, 2);
}

TEST_F(ConfigTest, MissingFileNamesThePath) {
  const std::string path = (dir_.path() / "absent.json").string();
  StatusOr<StrataConfig> config = load_config_file(path);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(config.status().message(), "open(" + path + "): No such file or directory"));
}

TEST_F(ConfigTest, AliasesAgreeOrConflict) {
  // strata.persistence_threshold is DeepSpeed's stage3_param_persistence_threshold.
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig config,
                              parse_config_json(R"({"strata": {"persistence_threshold": 4096}})", "a.json"));
  EXPECT_EQ(config.zero.param_persistence_threshold, 4096);
  EXPECT_TRUE(config.was_given("zero_optimization.stage3_param_persistence_threshold"));
  STRATA_ASSERT_OK(parse_config_json(
      R"({"strata": {"persistence_threshold": 1e4}, "zero_optimization": {"stage3_param_persistence_threshold": 10000}})", "a.json"));

  std::string path;
  std::string message = load_error(
      R"({"strata": {"persistence_threshold": 100}, "zero_optimization": {"stage3_param_persistence_threshold": 200}})", &path);
  EXPECT_TRUE(Contains(message, "\"strata.persistence_threshold\" (100)"));
  EXPECT_TRUE(Contains(message, "\"zero_optimization.stage3_param_persistence_threshold\" (200)"));
  EXPECT_TRUE(Contains(message, "disagree in " + path));

  // One nvme_path for the NVMe tier: DeepSpeed's two keys must agree.
  message = load_error(R"({"zero_optimization": {"offload_param": {"nvme_path": "/a"}, "offload_optimizer": {"nvme_path": "/b"}}})",
                       &path);
  EXPECT_TRUE(Contains(message, "\"zero_optimization.offload_optimizer.nvme_path\" (\"/b\")"));
  EXPECT_TRUE(Contains(message, "both set strata.nvme_path and disagree"));

  // DeepSpeed's older section name "bfloat16".
  STRATA_ASSERT_OK_AND_ASSIGN(config, parse_config_json(R"({"bfloat16": {"enabled": true}})", "a.json"));
  EXPECT_TRUE(config.bf16.enabled);

  // Deprecated cpu_offload booleans map to the offload placements.
  STRATA_ASSERT_OK_AND_ASSIGN(config, parse_config_json(R"({"zero_optimization": {"cpu_offload": true, "cpu_offload_param": false}})", "a.json"));
  EXPECT_EQ(config.zero.offload_optimizer.device, Tier::kPinned);
  EXPECT_EQ(config.zero.offload_param.device, Tier::kDevice);
  message = load_error(R"({"zero_optimization": {"cpu_offload": true, "offload_optimizer": {"device": "nvme"}}})", &path);
  EXPECT_TRUE(Contains(message, "both set zero_optimization.offload_optimizer.device and disagree"));
}

TEST_F(ConfigTest, PlacementAndEnumSpellings) {
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig config, parse_config_json(R"({
      "optimizer": {"type": "adamw"},
      "scheduler": {"type": "warmupcosinelr", "params": {"total_num_steps": 10}},
      "zero_optimization": {"offload_param": {"device": "device"}, "offload_optimizer": {"device": "none"}},
      "strata": {"device": "gpu", "param_dtype": "bfloat16"}})", "s.json"));
  EXPECT_EQ(config.optimizer.type, OptimizerType::kAdamW);
  EXPECT_EQ(config.scheduler.type, SchedulerType::kWarmupCosineLR);
  EXPECT_EQ(config.zero.offload_param.device, Tier::kDevice);
  EXPECT_EQ(config.zero.offload_optimizer.device, Tier::kDevice);
  EXPECT_EQ(config.strata.device, DeviceKind::kCuda);
  EXPECT_EQ(config.strata.param_dtype, DType::kBFloat16);
  EXPECT_EQ(resolve_device(config), DeviceKind::kCuda);

  STRATA_ASSERT_OK_AND_ASSIGN(config, parse_config_json(R"({"strata": {"device": "cpu"}})", "s.json"));
  EXPECT_EQ(resolve_device(config), DeviceKind::kCpu);

  // One enum per concept, spelled the same in the config, on command lines and in code.
  EXPECT_EQ(placement_name(Tier::kPinned), "cpu");
  EXPECT_EQ(placement_name(Tier::kHost), "cpu");
  EXPECT_EQ(placement_name(Tier::kDevice), "device");
  EXPECT_EQ(placement_name(Tier::kNvme), "nvme");
  EXPECT_EQ(tier_name(Tier::kPinned), "pinned");
  EXPECT_EQ(tier_name(Tier::kHost), "host");
  STRATA_ASSERT_OK_AND_ASSIGN(Tier tier, parse_placement("none"));
  EXPECT_EQ(tier, Tier::kDevice);
  STRATA_ASSERT_OK_AND_ASSIGN(tier, parse_placement("cpu"));
  EXPECT_EQ(tier, Tier::kPinned);
  STRATA_ASSERT_OK_AND_ASSIGN(tier, parse_placement("cpu", /*pin_memory=*/false));
  EXPECT_EQ(tier, Tier::kHost);
  EXPECT_FALSE(parse_placement("disk").ok());
  for (OverlapMode mode : {OverlapMode::kExact, OverlapMode::kDelayed}) {
    STRATA_ASSERT_OK_AND_ASSIGN(OverlapMode parsed, parse_overlap_mode(overlap_mode_name(mode)));
    EXPECT_EQ(parsed, mode);
    STRATA_ASSERT_OK(apply_override(config, "strata.optimizer_overlap", overlap_mode_name(mode)));
    EXPECT_EQ(config.strata.optimizer_overlap, mode);
  }
  EXPECT_FALSE(parse_overlap_mode("eventually").ok());
  for (IoEngineKind kind : {IoEngineKind::kAuto, IoEngineKind::kIoUring, IoEngineKind::kPsync}) {
    STRATA_ASSERT_OK_AND_ASSIGN(IoEngineKind parsed, parse_io_engine_kind(io_engine_kind_name(kind)));
    EXPECT_EQ(parsed, kind);
    STRATA_ASSERT_OK(apply_override(config, "strata.io_engine", io_engine_kind_name(kind)));
    EXPECT_EQ(config.strata.io_engine, kind);
  }
  EXPECT_EQ(config.strata.matmul_precision, MatmulPrecision::kFp32);  // the default: exact fp32 GEMMs
  for (MatmulPrecision precision : {MatmulPrecision::kTf32, MatmulPrecision::kBf16, MatmulPrecision::kFp32}) {
    STRATA_ASSERT_OK(apply_override(config, "strata.matmul_precision", matmul_precision_name(precision)));
    EXPECT_EQ(config.strata.matmul_precision, precision);
  }
  EXPECT_EQ(io_engine_kind_name(IoEngineKind::kIoUring), "io_uring");
  EXPECT_EQ(overlap_mode_name(OverlapMode::kDelayed), "delayed");
  EXPECT_EQ(config.strata.on_save_failure, SaveFailurePolicy::kStop);
  for (SaveFailurePolicy policy : {SaveFailurePolicy::kContinue, SaveFailurePolicy::kStop}) {
    STRATA_ASSERT_OK(apply_override(config, "strata.checkpoint.on_save_failure", save_failure_policy_name(policy)));
    EXPECT_EQ(config.strata.on_save_failure, policy);
  }
  EXPECT_EQ(config.strata.max_nonfinite_steps, 0);
  STRATA_ASSERT_OK(apply_override(config, "strata.max_nonfinite_steps", "5"));
  EXPECT_EQ(config.strata.max_nonfinite_steps, 5);
}

TEST_F(ConfigTest, PinMemoryFalseMakesEveryHostPlacementPageable) {
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig config, parse_config_json(R"({"zero_optimization": {
      "offload_param": {"device": "cpu", "pin_memory": true},
      "offload_optimizer": {"device": "cpu", "pin_memory": false}}})", "p.json"));
  EXPECT_EQ(config.zero.offload_param.device, Tier::kPinned);  // before finalize: what "cpu" reads as
  ::testing::internal::CaptureStderr();
  STRATA_ASSERT_OK(finalize(config, 1));
  const std::string log = ::testing::internal::GetCapturedStderr();
  // The engine has one host arena: pageable for both, and a warning naming both keys.
  EXPECT_EQ(config.zero.offload_param.device, Tier::kHost);
  EXPECT_EQ(config.zero.offload_optimizer.device, Tier::kHost);
  EXPECT_TRUE(Contains(log, "zero_optimization.offload_param.pin_memory is true and "
                            "zero_optimization.offload_optimizer.pin_memory is false")) << log;
  // to_json writes the placement word back, and finalizing the reloaded file agrees.
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig reloaded, parse_config_json(to_json(config), "again.json"));
  ::testing::internal::CaptureStderr();
  STRATA_ASSERT_OK(finalize(reloaded, 1));
  (void)::testing::internal::GetCapturedStderr();
  EXPECT_EQ(reloaded.zero.offload_param.device, Tier::kHost);
  EXPECT_EQ(to_json(reloaded), to_json(config));
  // Pinning again turns them back into pinned memory (finalize is idempotent either way).
  STRATA_ASSERT_OK(apply_override(config, "zero_optimization.offload_optimizer.pin_memory", "true"));
  STRATA_ASSERT_OK(finalize(config, 1));
  EXPECT_EQ(config.zero.offload_param.device, Tier::kPinned);
  EXPECT_EQ(config.zero.offload_optimizer.device, Tier::kPinned);
}

TEST_F(ConfigTest, PrefetchDepthIsAutomaticUntilSet) {
  StrataConfig config;
  EXPECT_FALSE(config.strata.prefetch_depth.has_value());
  EXPECT_TRUE(Contains(to_json(config), "\"prefetch_depth\": \"auto\""));
  STRATA_ASSERT_OK(apply_override(config, "strata.prefetch_depth", "0"));
  EXPECT_EQ(config.strata.prefetch_depth, 0);  // explicit 0 (no prefetch) is not "auto"
  STRATA_ASSERT_OK(apply_override(config, "strata.prefetch_depth", "auto"));
  EXPECT_FALSE(config.strata.prefetch_depth.has_value());
  STRATA_ASSERT_OK_AND_ASSIGN(config, parse_config_json(R"({"strata": {"prefetch_depth": 3}})", "d.json"));
  EXPECT_EQ(config.strata.prefetch_depth, 3);
  EXPECT_FALSE(apply_override(config, "strata.prefetch_depth", "-1").ok());
}

TEST_F(ConfigTest, KeysWithoutAMeaningHereAreWarnedOrRejected) {
  // offload_param.buffer_size: staging is sized by the largest shard; one warning.
  ::testing::internal::CaptureStderr();
  StatusOr<StrataConfig> loaded = parse_config_json(R"({"zero_optimization": {"offload_param": {"buffer_size": 1e8}}})", "b.json");
  const std::string log = ::testing::internal::GetCapturedStderr();
  STRATA_ASSERT_OK(loaded);
  EXPECT_TRUE(Contains(log, "b.json: zero_optimization.offload_param.buffer_size is a DeepSpeed setting Strata does not act on"));
  EXPECT_FALSE(apply_override(*loaded, "zero_optimization.offload_param.buffer_size", "100").ok());
  // bias_correction: the engine's Adam always corrects; false is an error at load.
  std::string path;
  std::string message = load_error(R"({"optimizer": {"params": {"bias_correction": false}}})", &path);
  EXPECT_TRUE(Contains(message, "optimizer.params.bias_correction: expected true")) << message;
  STRATA_ASSERT_OK(parse_config_json(R"({"optimizer": {"params": {"bias_correction": true}}})", "t.json"));
  // The optimizer-state ring needs a chunk to read, one to step and one to write.
  message = load_error(R"({"zero_optimization": {"offload_optimizer": {"buffer_count": 2}}})", &path);
  EXPECT_TRUE(Contains(message, "zero_optimization.offload_optimizer.buffer_count: expected an integer in [3, 2147483647], got 2")) << message;
}

TEST_F(ConfigTest, AdamWModeFollowsDeepSpeed) {
  OptimizerConfig optimizer;
  optimizer.type = OptimizerType::kAdam;
  optimizer.adam_w_mode = false;
  EXPECT_FALSE(decoupled_weight_decay(optimizer));  // classic Adam with L2
  optimizer.adam_w_mode = true;
  EXPECT_TRUE(decoupled_weight_decay(optimizer));
  optimizer.type = OptimizerType::kAdamW;
  optimizer.adam_w_mode = false;
  EXPECT_TRUE(decoupled_weight_decay(optimizer));  // AdamW is always decoupled

  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig config,
                              parse_config_json(R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})", "w.json"));
  ::testing::internal::CaptureStderr();
  STRATA_ASSERT_OK(finalize(config, 1));
  EXPECT_TRUE(Contains(::testing::internal::GetCapturedStderr(), "weight decay stays decoupled"));
}

struct BatchCase {
  std::optional<int64_t> total, micro, accumulation;
  int world;
  // Expected resolution; all zero when an error is expected.
  int64_t want_total, want_micro, want_accumulation;
};

class BatchResolutionTest : public ConfigTest, public ::testing::WithParamInterface<BatchCase> {};

TEST_P(BatchResolutionTest, FollowsDeepSpeedsRule) {
  const BatchCase& c = GetParam();
  StrataConfig config;
  config.train_batch_size = c.total;
  config.train_micro_batch_size_per_gpu = c.micro;
  config.gradient_accumulation_steps = c.accumulation;
  const Status status = finalize(config, c.world);
  if (c.want_total == 0) {
    ASSERT_FALSE(status.ok());
    EXPECT_TRUE(Contains(status.message(), "train_batch_size (" + std::to_string(*c.total) + ")"));
    EXPECT_TRUE(Contains(status.message(), "world_size (" + std::to_string(c.world) + ")"));
    EXPECT_TRUE(Contains(status.message(), "train_micro_batch_size_per_gpu"));
    EXPECT_TRUE(Contains(status.message(), "gradient_accumulation_steps"));
    return;
  }
  STRATA_ASSERT_OK(status);
  EXPECT_EQ(config.train_batch_size, c.want_total);
  EXPECT_EQ(config.train_micro_batch_size_per_gpu, c.want_micro);
  EXPECT_EQ(config.gradient_accumulation_steps, c.want_accumulation);
  EXPECT_EQ(*config.train_batch_size, *config.train_micro_batch_size_per_gpu * *config.gradient_accumulation_steps * c.world);
  // Finalizing again changes nothing.
  STRATA_ASSERT_OK(finalize(config, c.world));
  EXPECT_EQ(config.train_batch_size, c.want_total);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, BatchResolutionTest,
    ::testing::Values(BatchCase{32, 4, 2, 4, 32, 4, 2},                    // all three, consistent
                      BatchCase{32, 4, std::nullopt, 4, 32, 4, 2},         // accumulation derived
                      BatchCase{32, std::nullopt, 2, 4, 32, 4, 2},         // micro derived
                      BatchCase{std::nullopt, 4, 2, 4, 32, 4, 2},          // total derived
                      BatchCase{32, std::nullopt, std::nullopt, 4, 32, 8, 1},  // total only: accumulation 1
                      BatchCase{std::nullopt, 3, std::nullopt, 2, 6, 3, 1},    // micro only
                      BatchCase{std::nullopt, std::nullopt, 5, 2, 10, 1, 5},   // accumulation only: micro 1
                      BatchCase{std::nullopt, std::nullopt, std::nullopt, 3, 3, 1, 1},
                      BatchCase{30, 4, 2, 4, 0, 0, 0},                     // disagree
                      BatchCase{10, 3, std::nullopt, 1, 0, 0, 0},          // 10 is not a multiple of 3
                      BatchCase{12, std::nullopt, 5, 1, 0, 0, 0},          // 12 is not a multiple of 5
                      BatchCase{10, std::nullopt, std::nullopt, 4, 0, 0, 0}));  // 10 ranks-wise indivisible

TEST_F(ConfigTest, WorldSizeFromConfigOrRun) {
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig config, parse_config_json(R"({"strata": {"world_size": 2}, "train_batch_size": 8})", "w.json"));
  StrataConfig configured = config;
  STRATA_ASSERT_OK(finalize(configured, kConfiguredWorldSize));
  EXPECT_EQ(configured.strata.world_size, 2);
  EXPECT_EQ(configured.train_micro_batch_size_per_gpu, 4);

  const Status status = finalize(config, 4);
  ASSERT_FALSE(status.ok());
  EXPECT_TRUE(Contains(status.message(), "strata.world_size is 2 in w.json but the run has 4 ranks"));

  StrataConfig unset;
  STRATA_ASSERT_OK(finalize(unset, 8));
  EXPECT_EQ(unset.strata.world_size, 8);
}

TEST_F(ConfigTest, NvmePlacementNeedsNvmePath) {
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig config,
                              parse_config_json(R"({"zero_optimization": {"offload_param": {"device": "nvme"}}})", "n.json"));
  Status status = finalize(config, 1);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.message(),
            "zero_optimization.offload_param.device is \"nvme\" but zero_optimization.offload_param.nvme_path is not set "
            "(nor strata.nvme_path or --nvme-path) in n.json");

  STRATA_ASSERT_OK(apply_override(config, "strata.nvme_path", dir_.str()));
  STRATA_ASSERT_OK(finalize(config, 1));
  EXPECT_EQ(config.strata.nvme_path, dir_.str());
}

TEST_F(ConfigTest, PrecisionChecks) {
  std::string path;
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig both, parse_config_json(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", "p.json"));
  Status status = finalize(both, 1);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.message(), "fp16.enabled and bf16.enabled are both true in p.json; enable one of them");

  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig conflict,
                              parse_config_json(R"({"bf16": {"enabled": true}, "strata": {"param_dtype": "fp32"}})", "p.json"));
  status = finalize(conflict, 1);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.message(), "strata.param_dtype is \"fp32\" but bf16.enabled is true in p.json");

  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig from_dtype, parse_config_json(R"({"strata": {"param_dtype": "fp16"}})", "p.json"));
  STRATA_ASSERT_OK(finalize(from_dtype, 1));
  EXPECT_TRUE(from_dtype.fp16.enabled);
  EXPECT_FALSE(from_dtype.bf16.enabled);

  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig from_bf16, parse_config_json(R"({"bf16": {"enabled": true}})", "p.json"));
  STRATA_ASSERT_OK(finalize(from_bf16, 1));
  EXPECT_EQ(from_bf16.strata.param_dtype, DType::kBFloat16);
}

TEST_F(ConfigTest, SchedulerParametersBelongToTheirType) {
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig warmup, parse_config_json(R"({
      "optimizer": {"type": "Adam", "params": {"lr": 0.02}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})", "s.json"));
  STRATA_ASSERT_OK(finalize(warmup, 1));
  EXPECT_DOUBLE_EQ(*warmup.scheduler.warmup_max_lr, 0.02);  // DeepSpeed: the optimizer's lr
  EXPECT_DOUBLE_EQ(*warmup.scheduler.warmup_min_lr, 0.0);
  EXPECT_EQ(warmup.scheduler.warmup_type, WarmupType::kLog);
  EXPECT_FALSE(warmup.scheduler.total_num_steps.has_value());

  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig decay, parse_config_json(R"({"scheduler": {"type": "WarmupDecayLR"}})", "s.json"));
  Status status = finalize(decay, 1);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.message(), "scheduler.params.total_num_steps is required for WarmupDecayLR in s.json");

  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig cosine, parse_config_json(R"({
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_max_lr": 0.1}}})", "s.json"));
  status = finalize(cosine, 1);
  ASSERT_FALSE(status.ok());
  EXPECT_TRUE(Contains(status.message(), "scheduler.params.warmup_max_lr does not apply to WarmupCosineLR (its parameters: "
                                          "total_num_steps, warmup_min_ratio, warmup_num_steps, cos_min_ratio, warmup_type)"));

  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig no_type, parse_config_json(R"({"scheduler": {"params": {"warmup_num_steps": 5}}})", "s.json"));
  status = finalize(no_type, 1);
  ASSERT_FALSE(status.ok());
  EXPECT_TRUE(Contains(status.message(), "scheduler.params.warmup_num_steps is set but scheduler.type is not"));

  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig good_cosine, parse_config_json(R"({
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_type": "linear"}}})", "s.json"));
  STRATA_ASSERT_OK(finalize(good_cosine, 1));
  EXPECT_DOUBLE_EQ(*good_cosine.scheduler.cos_min_ratio, 0.0001);
  EXPECT_DOUBLE_EQ(*good_cosine.scheduler.warmup_min_ratio, 0.0);
  EXPECT_EQ(good_cosine.scheduler.warmup_type, WarmupType::kLinear);
}

TEST_F(ConfigTest, StageBelowThreeRunsAsThreeWithAWarning) {
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig config, parse_config_json(R"({"zero_optimization": {"stage": 2}})", "z.json"));
  EXPECT_EQ(config.zero.stage, 2);
  ::testing::internal::CaptureStderr();
  STRATA_ASSERT_OK(finalize(config, 1));
  EXPECT_TRUE(Contains(::testing::internal::GetCapturedStderr(), "z.json: zero_optimization.stage is 2; Strata implements stage 3 only"));
  EXPECT_EQ(config.zero.stage, 3);
}

TEST_F(ConfigTest, HuggingFaceAutoMeansNotGiven) {
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig config, parse_config_json(R"({
      "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto",
      "fp16": {"enabled": "auto"}, "gradient_clipping": "auto",
      "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}})", "hf.json"));
  EXPECT_FALSE(config.train_batch_size.has_value());
  EXPECT_FALSE(config.fp16.enabled);
  EXPECT_FALSE(config.zero.reduce_bucket_size.has_value());  // "auto": the engine reduces a group at a time
  STRATA_ASSERT_OK(finalize(config, 2));
  EXPECT_EQ(config.train_batch_size, 4);
  // "auto" is not a value for Strata's own keys.
  EXPECT_TRUE(Contains(load_error(R"({"strata": {"world_size": "auto"}})"), "strata.world_size: expected an integer"));
}

TEST_F(ConfigTest, TrainerKeysAreUnknownToTheEngine) {
  // strata.model.*, strata.data.* and strata.steps belong to strata-train
  // (examples/run_config); the engine's parser alone names them as unknown keys.
  EXPECT_TRUE(Contains(load_error(R"({"strata": {"steps": 5}})"), "unknown key \"strata.steps\""));
  EXPECT_TRUE(Contains(load_error(R"({"strata": {"model": {"n_layer": 2}}})"), "unknown key \"strata.model\""));
  EXPECT_EQ(config_key_for_flag("--steps"), std::nullopt);
}

TEST_F(ConfigTest, OverridesGoThroughTheSameValidation) {
  StrataConfig config;
  STRATA_ASSERT_OK(apply_override(config, "strata.device_budget_mib", "4096"));
  STRATA_ASSERT_OK(apply_override(config, "zero_optimization.offload_param.device", "nvme"));
  STRATA_ASSERT_OK(apply_override(config, "zero_optimization.offload_optimizer.device", "cpu"));
  STRATA_ASSERT_OK(apply_override(config, "zero_optimization.offload_optimizer.pin_memory", "false"));
  STRATA_ASSERT_OK(apply_override(config, "zero_optimization.offload_param.nvme_path", "/mnt/nvme"));  // an alias
  STRATA_ASSERT_OK(apply_override(config, "optimizer.params.betas", "0.8,0.95"));
  STRATA_ASSERT_OK(apply_override(config, "zero_optimization.stage3_max_live_parameters", "1e9"));
  STRATA_ASSERT_OK(apply_override(config, "strata.device", "auto"));
  STRATA_ASSERT_OK(apply_override(config, "strata.seed", "7"));
  STRATA_ASSERT_OK(apply_override(config, "optimizer.type", "adamw"));
  EXPECT_EQ(config.strata.device_budget_mib, 4096);
  EXPECT_EQ(config.zero.offload_param.device, Tier::kNvme);
  EXPECT_EQ(config.zero.offload_optimizer.device, Tier::kPinned);
  EXPECT_FALSE(config.zero.offload_optimizer.pin_memory);
  EXPECT_EQ(config.strata.nvme_path, "/mnt/nvme");
  EXPECT_DOUBLE_EQ(config.optimizer.betas[0], 0.8);
  EXPECT_DOUBLE_EQ(config.optimizer.betas[1], 0.95);
  EXPECT_EQ(config.zero.max_live_parameters, 1000000000);
  EXPECT_FALSE(config.strata.device.has_value());
  EXPECT_EQ(config.strata.seed, 7);
  EXPECT_EQ(config.optimizer.type, OptimizerType::kAdamW);
  EXPECT_EQ(config.given.at("strata.nvme_path"), "command line");

  // Errors read as the file's do, naming the key and what was expected.
  Status status = apply_override(config, "zero_optimization.offload_param.device", "gpu");
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.message(),
            R"(zero_optimization.offload_param.device: expected one of "none", "cpu", "nvme", got "gpu" on the command line)");
  EXPECT_EQ(config.zero.offload_param.device, Tier::kNvme);  // unchanged
  status = apply_override(config, "strata.device_budget_mib", "lots");
  EXPECT_EQ(status.message(), R"(strata.device_budget_mib: expected a non-negative integer, got "lots" on the command line)");
  status = apply_override(config, "strata.device_budjet_mib", "1");
  EXPECT_EQ(status.message(), R"(unknown key "strata.device_budjet_mib" on the command line (did you mean "strata.device_budget_mib"?))");
  status = apply_override(config, "zero_optimization.overlap_comm", "true");
  EXPECT_TRUE(Contains(status.message(), "is a DeepSpeed setting Strata does not act on"));
  status = apply_override(config, "zero_optimization", "3");
  EXPECT_TRUE(Contains(status.message(), "is a section, not a key"));

  // A restricted key at its one accepted value is a no-op; any other value is an error.
  STRATA_EXPECT_OK(apply_override(config, "optimizer.params.amsgrad", "false"));
  EXPECT_TRUE(Contains(apply_override(config, "optimizer.params.amsgrad", "true").message(), "can only be false"));

  // Bytes that are not UTF-8 (a path can hold any) neither throw nor get lost in messages.
  STRATA_ASSERT_OK(apply_override(config, "strata.trace", "/tmp/\xff.json"));
  EXPECT_TRUE(Contains(to_json(config), "\"trace\": \"/tmp/\xef\xbf\xbd.json\""));
  EXPECT_TRUE(Contains(apply_override(config, "strata.io_engine", "\xff").message(), "strata.io_engine: expected one of"));

  // A deprecated boolean alias.
  STRATA_ASSERT_OK(apply_override(config, "zero_optimization.cpu_offload_param", "true"));
  EXPECT_EQ(config.zero.offload_param.device, Tier::kPinned);

  // A file's value replaced from the command line, then checked by finalize.
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig from_file, parse_config_json(R"({"train_micro_batch_size_per_gpu": 4})", "o.json"));
  STRATA_ASSERT_OK(apply_override(from_file, "train_micro_batch_size_per_gpu", "2"));
  STRATA_ASSERT_OK(apply_override(from_file, "train_batch_size", "6"));
  STRATA_ASSERT_OK(apply_override(from_file, "strata.world_size", "2"));
  status = finalize(from_file, kConfiguredWorldSize);
  ASSERT_FALSE(status.ok());
  EXPECT_TRUE(Contains(status.message(), "train_batch_size (6) is not a multiple of train_micro_batch_size_per_gpu (2) * world_size (2) = 4, so "
                                          "gradient_accumulation_steps cannot be derived"));
  EXPECT_TRUE(Contains(status.message(), "in o.json (with command-line overrides)"));
}

TEST_F(ConfigTest, TrainerFlagsMapToKeys) {
  EXPECT_EQ(config_key_for_flag("--device-budget-mib"), "strata.device_budget_mib");
  EXPECT_EQ(config_key_for_flag("--offload-param"), "zero_optimization.offload_param.device");
  EXPECT_EQ(config_key_for_flag("--offload-optimizer"), "zero_optimization.offload_optimizer.device");
  EXPECT_EQ(config_key_for_flag("--nvme-path"), "strata.nvme_path");
  EXPECT_EQ(config_key_for_flag("--world-size"), "strata.world_size");
  EXPECT_EQ(config_key_for_flag("--metrics"), "strata.metrics");
  EXPECT_EQ(config_key_for_flag("--trace"), "strata.trace");
  EXPECT_EQ(config_key_for_flag("--seed"), "strata.seed");
  EXPECT_EQ(config_key_for_flag("--persistence-threshold"), "strata.persistence_threshold");
  EXPECT_EQ(config_key_for_flag("--micro-batch"), "train_micro_batch_size_per_gpu");
  EXPECT_EQ(config_key_for_flag("--config"), std::nullopt);
  EXPECT_EQ(config_key_for_flag("--model"), std::nullopt);  // a section, not a key
  // Every mapped flag names a key apply_override accepts.
  for (const char* flag : {"--device", "--world-size", "--device-budget-mib", "--pinned-budget-mib", "--offload-param",
                           "--offload-optimizer", "--nvme-path", "--metrics", "--trace", "--seed", "--io-engine",
                           "--micro-batch", "--grad-accum", "--batch-size", "--lr", "--zero-stage", "--clip", "--aio-block-size",
                           "--aio-queue-depth", "--bf16", "--fp16", "--compute-threads", "--optimizer-threads",
                           "--optimizer-overlap", "--prefetch-depth", "--nvme-checksum"}) {
    const std::optional<std::string> key = config_key_for_flag(flag);
    ASSERT_TRUE(key.has_value()) << flag;
    StrataConfig config;
    const Status status = apply_override(config, *key, "");
    EXPECT_TRUE(Lacks(status.message(), ("unknown key"))) << flag;
  }
}

TEST_F(ConfigTest, ToJsonRoundTrips) {
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig config, parse_config_json(kDeepSpeedNvmeExample, "rt.json"));
  STRATA_ASSERT_OK(apply_override(config, "strata.metrics", "/tmp/m.jsonl"));
  STRATA_ASSERT_OK(finalize(config, 4));
  const std::string text = to_json(config);

  // The file's own vocabulary: DeepSpeed keys at DeepSpeed's paths, Strata's under "strata".
  const nlohmann::json doc = nlohmann::json::parse(text);
  EXPECT_EQ(doc["train_batch_size"], 32);
  EXPECT_EQ(doc["zero_optimization"]["offload_param"]["device"], "nvme");
  EXPECT_EQ(doc["zero_optimization"]["offload_optimizer"]["device"], "nvme");
  EXPECT_EQ(doc["zero_optimization"]["stage3_param_persistence_threshold"], 10000);
  EXPECT_EQ(doc["optimizer"]["type"], "AdamW");
  EXPECT_EQ(doc["optimizer"]["params"]["betas"], nlohmann::json::array({0.8, 0.999}));
  EXPECT_EQ(doc["scheduler"]["params"]["warmup_max_lr"], 3e-5);
  EXPECT_EQ(doc["strata"]["nvme_path"], "/local_nvme");
  EXPECT_EQ(doc["strata"]["world_size"], 4);
  EXPECT_EQ(doc["strata"]["param_dtype"], "fp16");
  EXPECT_EQ(doc["strata"]["device"], "auto");
  EXPECT_FALSE(doc["zero_optimization"].contains("overlap_comm"));  // ignored keys are not kept

  ::testing::internal::CaptureStderr();
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig reloaded, parse_config_json(text, "saved.json"));
  STRATA_ASSERT_OK(finalize(reloaded, 4));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");  // a saved config has nothing to warn about
  EXPECT_EQ(to_json(reloaded), text);
  EXPECT_DOUBLE_EQ(reloaded.optimizer.eps, 1e-8);

  // Defaults round-trip too.
  StrataConfig defaults;
  STRATA_ASSERT_OK(finalize(defaults, 1));
  STRATA_ASSERT_OK_AND_ASSIGN(StrataConfig defaults_again, parse_config_json(to_json(defaults), "defaults.json"));
  STRATA_ASSERT_OK(finalize(defaults_again, 1));
  EXPECT_EQ(to_json(defaults_again), to_json(defaults));
}

TEST_F(ConfigTest, DocsNameEveryKey) {
  const std::filesystem::path docs = strata::testing::source_dir() / "docs" / "config.md";
  std::ifstream in(docs);
  ASSERT_TRUE(in.good()) << docs;
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::vector<ConfigKeyInfo> keys = describe_config_keys();
  EXPECT_GT(keys.size(), 150u);
  // The page's section for each kind of key; an implemented key's rows lie outside both.
  auto section = [&text](const std::string& heading) {
    const size_t begin = text.find(heading);
    EXPECT_NE(begin, std::string::npos) << heading;
    if (begin == std::string::npos) return std::string();
    const size_t end = text.find("\n## ", begin + heading.size());
    return text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
  };
  const std::string ignored = section("## DeepSpeed keys Strata knows and does not act on");
  const std::string restricted = section("## DeepSpeed keys Strata accepts at one value only");
  std::string implemented = text;
  for (const std::string* part : {&ignored, &restricted}) {
    if (const size_t at = implemented.find(*part); !part->empty() && at != std::string::npos) implemented.erase(at, part->size());
  }
  for (const ConfigKeyInfo& key : keys) {
    const std::string row = "| `" + key.path + "` |";
    const bool in_ignored = Contains(ignored, row);
    const bool in_restricted = Contains(restricted, row);
    const bool in_implemented = Contains(implemented, row);
    switch (key.kind) {
      case ConfigKeyKind::kIgnored:
        EXPECT_TRUE(in_ignored && !in_restricted && !in_implemented) << key.path << " must have a row among the ignored keys only";
        break;
      case ConfigKeyKind::kRestricted:
        EXPECT_TRUE(in_restricted && !in_ignored && !in_implemented) << key.path << " must have a row among the restricted keys only";
        break;
      case ConfigKeyKind::kImplemented:
      case ConfigKeyKind::kAlias:
        EXPECT_TRUE(in_implemented && !in_ignored && !in_restricted) << key.path << " must have a row among the implemented keys only";
        break;
    }
  }
}

}  // namespace
}  // namespace strata
