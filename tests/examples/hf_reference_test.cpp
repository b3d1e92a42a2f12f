// The transformers reference the Llama-family fidelity tests compare against
// (tests/examples/hf_reference.py, under STRATA_REFERENCE_PYTHON): tiny random Llama, Mistral
// and Qwen2 models made by transformers load back strictly, their expected numbers are
// consistent with their batch and their saved weights, and the strict load, logits and
// weight checks fail when they should.
// Skips with the reason when STRATA_REFERENCE_PYTHON is unset or cannot import transformers.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "examples/hf/safetensors.h"
#include "tests/examples/hf_reference_runner.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;
using testing::TrainRun;
using hf::SafetensorsDType;
using hf::SafetensorsWriter;

struct TinyVariant {
  std::string name;
  std::vector<std::string> args;  // make-tiny options besides --seed and --out
};

// Between them: the three families, tied and untied, llama3 and linear rope scaling, Qwen2's
// q/k/v biases and Llama's attention and MLP biases, both attention modes, a bf16 checkpoint.
const std::vector<TinyVariant>& tiny_variants() {
  static const std::vector<TinyVariant> variants = {
      {"llama-tied-llama3", {"--family", "llama", "--tied", "--rope-scaling", "llama3"}},
      {"llama-untied-linear-biases", {"--family", "llama", "--untied", "--rope-scaling", "linear", "--llama-biases", "attention-mlp"}},
      {"mistral-untied-bf16", {"--family", "mistral", "--untied", "--save-dtype", "bf16"}},
      {"qwen2-tied-document", {"--family", "qwen2", "--tied", "--attention", "document"}},
  };
  return variants;
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

// Makes every variant once for the whole suite, the runs side by side.
class HfReferenceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (testing::reference_python().empty()) return;
    dir_ = std::make_unique<TempDir>();
    std::vector<testing::StartedRun> started;
    for (const TinyVariant& variant : tiny_variants()) {
      std::vector<std::string> args = {(testing::source_dir() / "tests/examples/hf_reference.py").string(), "make-tiny"};
      args.insert(args.end(), variant.args.begin(), variant.args.end());
      args.insert(args.end(), {"--seed", "7", "--out", (dir_->path() / variant.name).string()});
      started.push_back(testing::start_program(*dir_, testing::reference_python(), args));
    }
    for (size_t i = 0; i < started.size(); ++i) made_[tiny_variants()[i].name] = testing::finish_run(started[i]);
  }
  static void TearDownTestSuite() { dir_.reset(); }

  // Where make-tiny wrote the variant (check made_ first: ASSERT_MADE).
  static fs::path made(const std::string& name) { return dir_->path() / name; }

  static std::unique_ptr<TempDir> dir_;
  static std::map<std::string, TrainRun> made_;
};

std::unique_ptr<TempDir> HfReferenceTest::dir_;
std::map<std::string, TrainRun> HfReferenceTest::made_;

#define ASSERT_MADE(name)                                    \
  STRATA_SKIP_WITHOUT_REFERENCE_PYTHON();                    \
  STRATA_SKIP_IF_REFERENCE_UNAVAILABLE(made_.at(name));      \
  ASSERT_RAN(made_.at(name))

TEST_F(HfReferenceTest, EveryTinyModelLoadsBackWithNoMissingOrUnexpectedKeys) {
  std::vector<std::string> args = {"check-load"};
  for (const TinyVariant& variant : tiny_variants()) {
    SCOPED_TRACE(variant.name);
    ASSERT_MADE(variant.name);
    for (const char* file : {"config.json", "model.safetensors", "tokenizer.json", "batch.json", "expected.json",
                             "reference/gradients_fp64.safetensors", "reference/after_adamw/model.safetensors"}) {
      EXPECT_TRUE(fs::exists(made(variant.name) / file)) << file;
    }
    args.push_back(made(variant.name).string());
    args.push_back((made(variant.name) / "reference/after_adamw").string());
  }
  const TrainRun check = testing::run_hf_reference(*dir_, args);  // one process: importing torch takes seconds
  EXPECT_EQ(check.exit_code, 0) << check.err << check.out;
}

TEST_F(HfReferenceTest, ExpectedLossesAgreeWithTheBatchAndWithEachOther) {
  for (const TinyVariant& variant : tiny_variants()) {
    SCOPED_TRACE(variant.name);
    ASSERT_MADE(variant.name);
    const nlohmann::json batch = read_json(made(variant.name) / "batch.json");
    const nlohmann::json expected = read_json(made(variant.name) / "expected.json");
    ASSERT_FALSE(batch.is_discarded());
    ASSERT_FALSE(expected.is_discarded());
    // targets are labels shifted by one, and the loss averages over the unmasked ones.
    int64_t unmasked = 0;
    for (size_t row = 0; row < batch["labels"].size(); ++row) {
      const auto& labels = batch["labels"][row];
      const auto& targets = batch["targets"][row];
      ASSERT_EQ(labels.size(), targets.size());
      for (size_t t = 0; t + 1 < labels.size(); ++t) EXPECT_EQ(targets[t], labels[t + 1]) << row << "," << t;
      EXPECT_EQ(targets.back().get<int>(), -100);
      for (const auto& target : targets) unmasked += target.get<int>() != -100 ? 1 : 0;
    }
    EXPECT_EQ(expected["loss_tokens"].get<int64_t>(), unmasked);
    const double loss32 = expected["loss_fp32"].get<double>();
    const double loss64 = expected["loss_fp64"].get<double>();
    EXPECT_LT(std::abs(loss32 - loss64) / loss64, 1e-5);
    EXPECT_NEAR(loss64, std::log(300.0), 1.0);  // near uniform over the 300-token vocabulary
    // steps + 1 losses starting at the initial loss, falling on the one batch they train on.
    for (const char* key : {"losses_fp32", "losses_fp64"}) {
      const auto& losses = expected["adamw"][key];
      ASSERT_EQ(losses.size(), expected["adamw"]["steps"].get<size_t>() + 1) << key;
      EXPECT_NEAR(losses[0].get<double>(), loss64, 1e-5 * loss64) << key;
      for (size_t k = 1; k < losses.size(); ++k) EXPECT_LT(losses[k].get<double>(), losses[k - 1].get<double>()) << key << k;
    }
  }
}

TEST_F(HfReferenceTest, LogitsComparisonPassesForTheSameWeightsAndFailsForTrainedOnes) {
  const std::string name = tiny_variants().front().name;
  ASSERT_MADE(name);
  const std::string model = made(name).string();
  const TrainRun same = testing::run_hf_reference(*dir_, {"logits", "--model", model, "--tokens", "1,0,299,5,42",
                                                          "--compare-with", model, "--tolerance", "0"});
  EXPECT_EQ(same.exit_code, 0) << same.err << same.out;
  EXPECT_TRUE(testing::contains(same.out, "\"max_abs_diff\": 0.0")) << same.out;
  const TrainRun trained = testing::run_hf_reference(*dir_, {"logits", "--model", model, "--tokens", "1,0,299,5,42", "--compare-with",
                                                             model + "/reference/after_adamw", "--tolerance", "1e-5"});
  EXPECT_EQ(trained.exit_code, 1) << trained.err << trained.out;
  EXPECT_TRUE(testing::contains(trained.err, "logits differ")) << trained.err;
}

TEST_F(HfReferenceTest, TheLossOfTheSavedBf16CheckpointIsTheExpectedOne) {
  const std::string name = "mistral-untied-bf16";
  ASSERT_MADE(name);
  const TrainRun run = testing::run_hf_reference(*dir_, {"loss", "--model", made(name).string(), "--batch", (made(name) / "batch.json").string()});
  ASSERT_RAN(run);
  const nlohmann::json report = nlohmann::json::parse(run.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(report.is_discarded()) << run.out;
  const nlohmann::json expected = read_json(made(name) / "expected.json");
  // The reference was computed from the rounded values the checkpoint holds, so exactly.
  EXPECT_EQ(report["loss_fp32"].get<double>(), expected["loss_fp32"].get<double>());
  EXPECT_EQ(report["loss_fp64"].get<double>(), expected["loss_fp64"].get<double>());
}

TEST_F(HfReferenceTest, WeightComparisonPassesForTheSameWeightsAndFailsForTrainedOnes) {
  const std::string name = tiny_variants().front().name;
  ASSERT_MADE(name);
  const std::string trained = (made(name) / "reference/after_adamw").string();
  const TrainRun same = testing::run_hf_reference(*dir_, {"compare-weights", "--model", trained, "--reference", trained, "--tolerance", "0"});
  EXPECT_EQ(same.exit_code, 0) << same.err << same.out;
  const TrainRun changed = testing::run_hf_reference(*dir_, {"compare-weights", "--model", trained, "--reference", made(name).string(),
                                                             "--tolerance", "1e-5"});
  EXPECT_EQ(changed.exit_code, 1) << changed.err << changed.out;
  EXPECT_TRUE(testing::contains(changed.err, "weights differ")) << changed.err;
}

// A checkpoint with one tensor of the model and one it does not have.
void write_broken_checkpoint(const fs::path& dir) {
  fs::create_directories(dir);
  const nlohmann::json config = {{"model_type", "llama"}, {"architectures", {"LlamaForCausalLM"}}, {"vocab_size", 300},
                                 {"hidden_size", 64}, {"intermediate_size", 96}, {"num_hidden_layers", 2},
                                 {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"max_position_embeddings", 128},
                                 {"tie_word_embeddings", true}, {"torch_dtype", "float32"}};
  std::ofstream(dir / "config.json") << config.dump(1);
  STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsWriter writer,
                              SafetensorsWriter::create((dir / "model.safetensors").string(),
                                                        {{"model.embed_tokens.weight", SafetensorsDType::kF32, {300, 64}},
                                                         {"model.not_in_llama.weight", SafetensorsDType::kF32, {3}}},
                                                        {{"format", "pt"}}));
  const std::vector<float> embedding(300 * 64, 0.5f), extra(3, 1.0f);
  STRATA_ASSERT_OK(writer.append_fp32("model.embed_tokens.weight", embedding));
  STRATA_ASSERT_OK(writer.append_fp32("model.not_in_llama.weight", extra));
  STRATA_ASSERT_OK(writer.finish());
}

TEST(HfReferenceCheckLoadTest, FailsNamingMissingAndUnexpectedTensors) {
  STRATA_SKIP_WITHOUT_REFERENCE_PYTHON();
  TempDir dir;
  write_broken_checkpoint(dir.path() / "broken");
  const TrainRun run = testing::run_hf_reference(dir, {"check-load", (dir.path() / "broken").string()});
  STRATA_SKIP_IF_REFERENCE_UNAVAILABLE(run);
  EXPECT_EQ(run.exit_code, 1) << run.err << run.out;
  EXPECT_TRUE(testing::contains(run.err, "missing_keys")) << run.err;
  EXPECT_TRUE(testing::contains(run.err, "model.layers.1.mlp.down_proj.weight")) << run.err;
  EXPECT_TRUE(testing::contains(run.err, "unexpected_keys: ['model.not_in_llama.weight']")) << run.err;
}

}  // namespace
}  // namespace strata
