// strata-train's config (examples/run_config/run_config.h): the trainer's keys beside the
// engine's, parsed, overridden, checked and written with the engine's rules and messages.
#include "examples/run_config/run_config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/support/test_support.h"

namespace strata {
namespace {

::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected to find\n  " << part << "\nin\n  " << text;
}

TEST(RunConfigTest, DefaultsFromEmptyObject) {
  STRATA_ASSERT_OK_AND_ASSIGN(const RunConfig run, parse_run_config_json("{}", "empty.json"));
  EXPECT_EQ(run.engine.source, "empty.json");
  EXPECT_TRUE(run.engine.given.empty());
  EXPECT_TRUE(run.model.activation_checkpointing);
  EXPECT_FALSE(run.model.checkpoints_in_pinned_memory);
  EXPECT_EQ(run.data.kind, DataKind::kSynthetic);
  EXPECT_EQ(run.steps, 0);
}

TEST(RunConfigTest, ReadsTheTrainersKeysBesideTheEngines) {
  STRATA_ASSERT_OK_AND_ASSIGN(const RunConfig run, parse_run_config_json(R"({"train_micro_batch_size_per_gpu": 2, "strata": {
      "steps": 7, "seed": 3, "model": {"preset": "tiny", "n_layer": 4, "checkpoints_in_pinned_memory": true},
      "data": {"kind": "tokens", "path": "/data/train.bin", "eval_fraction": 0.25, "seq_len": 64}}})", "r.json"));
  EXPECT_EQ(run.steps, 7);
  EXPECT_EQ(run.engine.strata.seed, 3);
  EXPECT_EQ(run.engine.train_micro_batch_size_per_gpu, 2);
  EXPECT_EQ(run.model.preset, "tiny");
  EXPECT_EQ(run.model.n_layer, 4);
  EXPECT_TRUE(run.model.checkpoints_in_pinned_memory);
  EXPECT_EQ(run.data.kind, DataKind::kTokens);
  EXPECT_EQ(run.data.path, "/data/train.bin");
  EXPECT_DOUBLE_EQ(run.data.eval_fraction, 0.25);
  EXPECT_EQ(run.data.seq_len, 64);
  EXPECT_EQ(run.engine.given.at("strata.steps"), "r.json");  // the trainer's keys are recorded as given too
  EXPECT_EQ(run.engine.given.at("strata.model.n_layer"), "r.json");
}

TEST(RunConfigTest, IllTypedValuesNameTheKeyAsTheEnginesDo) {
  struct Case {
    const char* text;
    const char* expected;
  };
  const Case cases[] = {
      {R"({"strata": {"data": {"eval_fraction": 1.0}}})", "strata.data.eval_fraction: expected a number in [0, 1), got 1.0 in "},
      {R"({"strata": {"data": {"kind": "images"}}})", R"(strata.data.kind: expected one of "synthetic", "text", "tokens", got "images" in )"},
      {R"({"strata": {"model": {"n_layer": -2}}})", "strata.model.n_layer: expected a non-negative integer, got -2 in "},
      {R"({"strata": {"steps": "many"}})", R"(strata.steps: expected a non-negative integer, got "many" in )"},
  };
  for (const Case& c : cases) {
    const StatusOr<RunConfig> run = parse_run_config_json(c.text, "bad.json");
    ASSERT_FALSE(run.ok()) << c.text;
    EXPECT_EQ(run.status().message(), std::string(c.expected) + "bad.json") << c.text;
  }
}

TEST(RunConfigTest, UnknownKeysAreStillRejectedWithASuggestion) {
  const StatusOr<RunConfig> run = parse_run_config_json(R"({"strata": {"model": {"n_layers": 2}, "stepz": 3}})", "u.json");
  ASSERT_FALSE(run.ok());
  EXPECT_TRUE(Contains(run.status().message(), R"(unknown key "strata.model.n_layers" in u.json (did you mean "strata.model.n_layer"?))"));
  EXPECT_TRUE(Contains(run.status().message(), R"(unknown key "strata.stepz" in u.json (did you mean "strata.steps"?))"));
  RunConfig scratch;
  const Status override = apply_run_override(scratch, "strata.data.kinds", "text");
  EXPECT_EQ(override.message(), R"(unknown key "strata.data.kinds" on the command line (did you mean "strata.data.kind"?))");
}

TEST(RunConfigTest, ModelAndDataChecksJoinTheEnginesInOneStatus) {
  STRATA_ASSERT_OK_AND_ASSIGN(RunConfig run, parse_run_config_json(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}, "strata": {
      "model": {"n_head": 5, "n_embd": 64, "n_ctx": 32}, "data": {"kind": "text", "seq_len": 64}}})", "m.json"));
  const Status status = finalize_run_config(run, 1);
  ASSERT_FALSE(status.ok());
  EXPECT_TRUE(Contains(status.message(), "4 problems in m.json:"));
  EXPECT_TRUE(Contains(status.message(), "fp16.enabled and bf16.enabled are both true"));
  EXPECT_TRUE(Contains(status.message(), "strata.model.n_embd (64) is not a multiple of strata.model.n_head (5)"));
  EXPECT_TRUE(Contains(status.message(), "strata.data.seq_len (64) is longer than strata.model.n_ctx (32)"));
  EXPECT_TRUE(Contains(status.message(), "strata.data.kind is \"text\" but strata.data.path is not set"));
}

TEST(RunConfigTest, FlagsMapToTheTrainersKeysToo) {
  EXPECT_EQ(run_config_key_for_flag("--steps"), "strata.steps");
  EXPECT_EQ(run_config_key_for_flag("--seed"), "strata.seed");
  EXPECT_EQ(run_config_key_for_flag("--micro-batch"), "train_micro_batch_size_per_gpu");
  EXPECT_EQ(run_config_key_for_flag("--model"), std::nullopt);  // a section, not a key
  RunConfig run;
  STRATA_ASSERT_OK(apply_run_override(run, "strata.steps", "12"));
  STRATA_ASSERT_OK(apply_run_override(run, "strata.model.n_layer", "3"));
  STRATA_ASSERT_OK(apply_run_override(run, "strata.device_budget_mib", "64"));
  EXPECT_EQ(run.steps, 12);
  EXPECT_EQ(run.model.n_layer, 3);
  EXPECT_EQ(run.engine.strata.device_budget_mib, 64);
  EXPECT_EQ(run.engine.given.at("strata.steps"), "command line");
}

TEST(RunConfigTest, ToJsonRoundTripsTheTrainersKeys) {
  RunConfig run;
  STRATA_ASSERT_OK(apply_run_override(run, "strata.metrics", "/tmp/m.jsonl"));
  STRATA_ASSERT_OK(apply_run_override(run, "strata.model.n_layer", "12"));
  STRATA_ASSERT_OK(apply_run_override(run, "strata.data.kind", "tokens"));
  STRATA_ASSERT_OK(apply_run_override(run, "strata.data.path", "/data/train.bin"));
  STRATA_ASSERT_OK(apply_run_override(run, "strata.data.eval_fraction", "0.1"));
  STRATA_ASSERT_OK(apply_run_override(run, "strata.steps", "9"));
  STRATA_ASSERT_OK(finalize_run_config(run, 2));
  const std::string text = run_config_to_json(run);
  const nlohmann::json doc = nlohmann::json::parse(text);
  EXPECT_EQ(doc["strata"]["data"]["kind"], "tokens");
  EXPECT_EQ(doc["strata"]["model"]["n_layer"], 12);
  EXPECT_EQ(doc["strata"]["steps"], 9);
  EXPECT_EQ(doc["strata"]["world_size"], 2);

  STRATA_ASSERT_OK_AND_ASSIGN(RunConfig reloaded, parse_run_config_json(text, "saved.json"));
  STRATA_ASSERT_OK(finalize_run_config(reloaded, 2));
  EXPECT_EQ(run_config_to_json(reloaded), text);
  EXPECT_EQ(reloaded.data.path, "/data/train.bin");
  EXPECT_DOUBLE_EQ(reloaded.data.eval_fraction, 0.1);
  EXPECT_EQ(reloaded.steps, 9);
}

TEST(RunConfigTest, ShippedExamplesLoadAndFinalize) {
  const std::filesystem::path examples = strata::testing::source_dir() / "examples" / "configs";
  ASSERT_TRUE(std::filesystem::is_directory(examples)) << examples;
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(examples)) {
    if (entry.path().extension() != ".json") continue;
    ++count;
    ::testing::internal::CaptureStderr();
    StatusOr<RunConfig> config = load_run_config(entry.path().string());
    ASSERT_TRUE(config.ok()) << config.status().to_string();
    STRATA_EXPECT_OK(finalize_run_config(*config, kConfiguredWorldSize));
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "") << entry.path() << " should load without warnings";
  }
  EXPECT_GE(count, 1);

  STRATA_ASSERT_OK_AND_ASSIGN(RunConfig run, load_run_config((examples / "offload_nvme.json").string()));
  STRATA_ASSERT_OK(finalize_run_config(run, kConfiguredWorldSize));
  const StrataConfig& nvme = run.engine;
  EXPECT_EQ(nvme.zero.offload_param.device, Tier::kNvme);
  EXPECT_EQ(nvme.zero.offload_optimizer.device, Tier::kNvme);
  EXPECT_EQ(nvme.strata.nvme_path, "/local_nvme");
  EXPECT_EQ(nvme.strata.param_dtype, DType::kBFloat16);
  EXPECT_EQ(nvme.train_batch_size, 32);
}

TEST(RunConfigTest, DocsNameEveryTrainerKey) {
  const std::filesystem::path docs = strata::testing::source_dir() / "docs" / "config.md";
  std::ifstream in(docs);
  ASSERT_TRUE(in.good()) << docs;
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  int trainer_keys = 0;
  for (const ConfigKeyInfo& key : describe_run_config_keys()) {
    if (key.path != "strata.steps" && key.path.rfind("strata.model.", 0) != 0 && key.path.rfind("strata.data.", 0) != 0) continue;
    ++trainer_keys;
    EXPECT_EQ(key.kind, ConfigKeyKind::kImplemented) << key.path;
    EXPECT_TRUE(Contains(text, "| `" + key.path + "` |")) << key.path;
  }
  EXPECT_EQ(trainer_keys, 13);
}

}  // namespace
}  // namespace strata
