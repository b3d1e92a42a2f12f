// Fidelity of the Llama family against Hugging Face transformers (issue 11, item 6), through
// the strata-train program: tiny random Llama, Mistral and Qwen2 models made by transformers
// (tests/examples/hf_reference.py make-tiny, under STRATA_REFERENCE_PYTHON) are trained by
// strata-train --model DIR on exactly the reference's batch, written as a fine-tuning token
// file; then
//   - the first loss matches transformers' fp32 loss,
//   - K steps of AdamW match torch.optim.AdamW's losses, at world sizes 1 and 2, with and
//     without gradient accumulation,
//   - the export after K steps loads strictly in transformers and gives the logits of the
//     reference's weights after the same K steps, and a bf16 checkpoint exports as bf16.
// Tolerances are the (1e-5 relative for losses); what they actually are is printed
// ("measured ...") and recorded in the test's XML properties.
// Skips with the reason when STRATA_REFERENCE_PYTHON is unset or cannot import transformers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/core/dtype.h"
#include "examples/hf/safetensors.h"
#include "examples/data/token_data.h"
#include "tests/examples/hf_reference_runner.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;
using testing::TrainRun;

// The bound on every loss, relative to the reference's.
constexpr double kLossTolerance = 1e-5;
// Logits of the export against the reference's weights after the same AdamW steps, as
// hf_reference.py logits measures them (max |a - b| / max |b|). Measured up to 5.3e-5: Adam
// divides each gradient by its own magnitude, so elements whose gradient is rounding noise
// (a k_proj bias: softmax hardly depends on it) move by up to lr in either direction.
constexpr double kLogitsTolerance = 1e-4;
// Global batch rows: make-tiny's three kinds of row (masked prompt, two packed documents,
// padding) and a fourth so that world size 2 splits it.
constexpr int kBatchRows = 4;
constexpr int kAdamWSteps = 3;

struct FidelityVariant {
  std::string name;
  std::vector<std::string> args;  // make-tiny options besides the shared ones below
};

// The cases: Llama tied with llama3 rope scaling; Llama untied with attention and
// MLP biases (and linear rope scaling); Mistral untied from a bf16 checkpoint; Qwen2 (q/k/v
// biases) tied. All have GQA (4 query heads, 2 KV heads).
const std::vector<FidelityVariant>& fidelity_variants() {
  static const std::vector<FidelityVariant> variants = {
      {"llama-tied-llama3", {"--family", "llama", "--tied", "--rope-scaling", "llama3"}},
      {"llama-untied-linear-biases", {"--family", "llama", "--untied", "--rope-scaling", "linear", "--llama-biases", "attention-mlp"}},
      {"mistral-untied-bf16", {"--family", "mistral", "--untied", "--save-dtype", "bf16"}},
      {"qwen2-tied", {"--family", "qwen2", "--tied"}},
  };
  return variants;
}

// Strata decays the block matrices only, never the embeddings or an untied lm_head, while
// the reference's --decay-on matrices decays every 2-D tensor: no weight decay, so both
// optimizers are the same AdamW (the decay itself is checked against torch in
// tests/optim/adam_torch_reference_test).
const std::vector<std::string>& shared_make_tiny_args() {
  static const std::vector<std::string> args = {"--batch-size", std::to_string(kBatchRows), "--steps", std::to_string(kAdamWSteps),
                                                "--lr", "3e-3", "--beta1", "0.9", "--beta2", "0.95", "--eps", "1e-8",
                                                "--weight-decay", "0", "--seed", "7"};
  return args;
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

std::string exact(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.17g", value);
  return text;
}

double relative_error(double value, double reference) { return std::abs(value - reference) / std::abs(reference); }

// make-tiny's batch as a fine-tuning token file the trainer reads back as exactly that batch.
// A row of T input_ids is a row of T tokens (seq_len T - 1): the trainer's inputs are its
// first T - 1 tokens and transformers' last position predicts nothing (its target is -100),
// so both score the same T - 1 predictions. Token t is a target where labels[t] is not
// -100 (labels shift inside transformers: position t - 1 predicts labels[t]), except token 0,
// which nothing predicts; it starts a document where position_ids restarts at 0, which gives
// the trainer's positions (0 at a start, else the previous + 1) equal to position_ids.
// Returns the seq_len, or -1 after a failure.
int64_t write_batch_as_token_file(const nlohmann::json& batch, const fs::path& path) {
  const auto& rows = batch["input_ids"];
  const int64_t row_length = static_cast<int64_t>(rows[0].size());
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;
  int problems = 0;
  for (size_t row = 0; row < rows.size(); ++row) {
    problems += static_cast<int64_t>(rows[row].size()) != row_length ? 1 : 0;
    EXPECT_EQ(static_cast<int64_t>(rows[row].size()), row_length) << "row " << row;
    int32_t expected_position = 0;
    for (int64_t t = 0; t < row_length; ++t) {
      const int32_t position = batch["position_ids"][row][t].get<int32_t>();
      const bool target = t > 0 && batch["labels"][row][t].get<int>() != -100;
      const bool starts_document = position == 0;
      // A document's first token has nothing before it in its document to be predicted
      // from; make-tiny masks it, so the file can say both things exactly.
      EXPECT_FALSE(target && starts_document) << "row " << row << " token " << t << " is a target and a document start";
      // Anything but a restart at 0 or a step of one the trainer's positions cannot say.
      EXPECT_TRUE(starts_document || position == expected_position) << "row " << row << " token " << t << ": position " << position;
      problems += (target && starts_document) || !(starts_document || position == expected_position) ? 1 : 0;
      expected_position = position + 1;
      tokens.push_back(batch["input_ids"][row][t].get<int32_t>());
      flags.push_back(static_cast<uint8_t>((target ? data::kTokenIsTarget : 0) | (starts_document ? data::kTokenStartsDocument : 0)));
    }
  }
  const Status written = data::write_fine_tuning_file(path.string(), tokens, flags,
                                                     {.format = data::TokenFileFormat::kGpt2, .row_length = static_cast<uint64_t>(row_length)});
  EXPECT_TRUE(written.ok()) << written.to_string();
  return written.ok() && problems == 0 ? row_length - 1 : -1;
}

// How the kBatchRows rows of a step are split: over ranks, then into accumulated micro-batches.
struct BatchLayout {
  int world_size = 1;
  int grad_accum = 1;
};
constexpr BatchLayout kOneMicroBatch{};

// Makes every variant once for the whole suite, side by side, and its token file.
class LlamaFidelityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (testing::reference_python().empty()) return;
    dir_ = std::make_unique<TempDir>();
    std::vector<testing::StartedRun> started;
    for (const FidelityVariant& variant : fidelity_variants()) {
      std::vector<std::string> args = {(testing::source_dir() / "tests/examples/hf_reference.py").string(), "make-tiny"};
      args.insert(args.end(), variant.args.begin(), variant.args.end());
      args.insert(args.end(), shared_make_tiny_args().begin(), shared_make_tiny_args().end());
      args.insert(args.end(), {"--out", made(variant.name).string()});
      started.push_back(testing::start_program(*dir_, testing::reference_python(), args));
    }
    for (size_t i = 0; i < started.size(); ++i) made_[fidelity_variants()[i].name] = testing::finish_run(started[i]);
  }
  static void TearDownTestSuite() { dir_.reset(); }

  // Where make-tiny wrote the variant (check made_ first: ASSERT_MADE).
  static fs::path made(const std::string& name) { return dir_->path() / name; }
  static nlohmann::json expected(const std::string& name) { return read_json(made(name) / "expected.json"); }

  // The variant's batch as a token file (written on first use), and its seq_len.
  static fs::path token_file(const std::string& name) { return dir_->path() / (name + ".bin"); }
  static int64_t seq_len(const std::string& name) {
    auto [it, inserted] = seq_lens_.try_emplace(name, -1);
    if (inserted) it->second = write_batch_as_token_file(read_json(made(name) / "batch.json"), token_file(name));
    return it->second;
  }

  // strata-train on the variant's batch with the reference's AdamW settings, fp32 all
  // through, no clipping, constant learning rate (no scheduler), one thread each.
  static std::vector<std::string> strata_train_args(const std::string& name, const BatchLayout& layout, int steps, double lr,
                                                    std::vector<std::string> more) {
    const nlohmann::json adamw = expected(name)["adamw"];
    const auto& betas = adamw["betas"];
    std::vector<std::string> args = {
        "--model", made(name).string(), "--data", "tokens:" + token_file(name).string(), "--seq-len", std::to_string(seq_len(name)),
        "--world-size", std::to_string(layout.world_size), "--micro-batch", std::to_string(kBatchRows / (layout.world_size * layout.grad_accum)),
        "--grad-accum", std::to_string(layout.grad_accum),
        "--steps", std::to_string(steps), "--lr", exact(lr), "--clip", "0", "--seed", "1", "--eval-sequences", "0",
        "--set", "optimizer.params.betas=" + exact(betas[0].get<double>()) + "," + exact(betas[1].get<double>()),
        "--set", "optimizer.params.eps=" + exact(adamw["eps"].get<double>()),
        "--set", "optimizer.params.weight_decay=" + exact(adamw["weight_decay"].get<double>()),
        "--set", "strata.param_dtype=fp32", "--set", "strata.grad_wire_dtype=fp32",
        "--set", "strata.compute_threads=1", "--set", "strata.optimizer_threads=1"};
    args.insert(args.end(), more.begin(), more.end());
    return args;
  }
  static TrainRun strata_train(const std::string& name, const BatchLayout& layout, int steps, double lr, std::vector<std::string> more = {}) {
    testing::StartedRun started = testing::start_program(*dir_, (testing::binary_dir() / "bin" / "strata-train").string(),
                                                         strata_train_args(name, layout, steps, lr, std::move(more)));
    return testing::finish_run(started);
  }

  static std::unique_ptr<TempDir> dir_;
  static std::map<std::string, TrainRun> made_;
  static std::map<std::string, int64_t> seq_lens_;
};

std::unique_ptr<TempDir> LlamaFidelityTest::dir_;
std::map<std::string, TrainRun> LlamaFidelityTest::made_;
std::map<std::string, int64_t> LlamaFidelityTest::seq_lens_;

#define ASSERT_MADE(name)                                  \
  STRATA_SKIP_WITHOUT_REFERENCE_PYTHON();                  \
  STRATA_SKIP_IF_REFERENCE_UNAVAILABLE(made_.at(name));    \
  ASSERT_RAN(made_.at(name));                              \
  ASSERT_GT(seq_len(name), 0)

// The summary's losses, checked to be there.
std::vector<double> summary_losses(const TrainRun& run, size_t count) {
  std::vector<double> losses;
  EXPECT_TRUE(run.summary.is_object() && run.summary.contains("losses")) << run.out;
  if (!run.summary.is_object() || !run.summary.contains("losses")) return losses;
  losses = run.summary["losses"].get<std::vector<double>>();
  EXPECT_EQ(losses.size(), count) << run.out;
  return losses;
}

TEST_F(LlamaFidelityTest, FirstLossMatchesTransformersFp32Loss) {
  for (const FidelityVariant& variant : fidelity_variants()) {
    SCOPED_TRACE(variant.name);
    ASSERT_MADE(variant.name);
    const TrainRun run = strata_train(variant.name, kOneMicroBatch, /*steps=*/1, /*lr=*/0.0);
    ASSERT_RAN(run);
    const std::vector<double> losses = summary_losses(run, 1);
    ASSERT_EQ(losses.size(), 1u);
    const nlohmann::json reference = expected(variant.name);
    const double error32 = relative_error(losses[0], reference["loss_fp32"].get<double>());
    const double error64 = relative_error(losses[0], reference["loss_fp64"].get<double>());
    std::printf("measured %s: first loss %.12g, relative error %.2e against transformers fp32, %.2e against fp64\n",
                variant.name.c_str(), losses[0], error32, error64);
    RecordProperty(variant.name + "_first_loss_rel_error_fp32", exact(error32));
    EXPECT_LT(error32, kLossTolerance) << losses[0] << " against " << reference["loss_fp32"];
    EXPECT_LT(error64, kLossTolerance) << losses[0] << " against " << reference["loss_fp64"];
  }
}

// K + 1 steps: losses[k] is the loss after k updates, as expected.json's losses_fp32[k]
// (the last step's update is not compared). The batch's rows hold different numbers of
// targets, so ranks and accumulated micro-batches must weigh their losses by targets to give
// the whole batch's mean.
TEST_F(LlamaFidelityTest, AdamWLossesMatchTorchAdamWAcrossRanksAndAccumulation) {
  for (const FidelityVariant& variant : fidelity_variants()) {
    SCOPED_TRACE(variant.name);
    ASSERT_MADE(variant.name);
    const nlohmann::json adamw = expected(variant.name)["adamw"];
    const auto reference = adamw["losses_fp32"].get<std::vector<double>>();
    ASSERT_EQ(reference.size(), static_cast<size_t>(kAdamWSteps + 1));
    std::vector<std::vector<double>> by_layout;
    for (const BatchLayout layout : {BatchLayout{1, 1}, BatchLayout{2, 1}, BatchLayout{1, 2}, BatchLayout{2, 2}}) {
      const std::string where = "world size " + std::to_string(layout.world_size) + ", grad accum " + std::to_string(layout.grad_accum);
      SCOPED_TRACE(where);
      const TrainRun run = strata_train(variant.name, layout, kAdamWSteps + 1, adamw["lr"].get<double>());
      ASSERT_RAN(run);
      const std::vector<double> losses = summary_losses(run, reference.size());
      ASSERT_EQ(losses.size(), reference.size());
      double worst = 0.0;
      for (size_t k = 0; k < reference.size(); ++k) {
        worst = std::max(worst, relative_error(losses[k], reference[k]));
        EXPECT_LT(relative_error(losses[k], reference[k]), kLossTolerance) << "after " << k << " updates: " << losses[k] << " against " << reference[k];
      }
      std::printf("measured %s, %s: %d AdamW steps, worst loss relative error %.2e against torch fp32\n",
                  variant.name.c_str(), where.c_str(), kAdamWSteps, worst);
      RecordProperty(variant.name + "_adamw_worst_rel_error_world_" + std::to_string(layout.world_size) + "_accum_" +
                         std::to_string(layout.grad_accum), exact(worst));
      by_layout.push_back(losses);
    }
    // Splitting the batch changes only the order of the sums: the same losses to ~1e-8.
    for (size_t layout = 1; layout < by_layout.size(); ++layout)
      for (size_t k = 0; k < reference.size(); ++k)
        EXPECT_LT(relative_error(by_layout[layout][k], by_layout[0][k]), 1e-6) << "layout " << layout << ", after " << k << " updates";
  }
}

TEST_F(LlamaFidelityTest, ExportAfterAdamWLoadsStrictlyAndGivesTheReferenceLogits) {
  std::vector<std::string> check_load = {"check-load"};
  for (const FidelityVariant& variant : fidelity_variants()) {
    SCOPED_TRACE(variant.name);
    ASSERT_MADE(variant.name);
    const fs::path exported = dir_->path() / ("export-" + variant.name);
    const TrainRun run = strata_train(variant.name, kOneMicroBatch, kAdamWSteps, expected(variant.name)["adamw"]["lr"].get<double>(),
                                      {"--export", exported.string(), "--export-dtype", "fp32"});
    ASSERT_RAN(run);
    check_load.push_back(exported.string());
  }
  const TrainRun loaded = testing::run_hf_reference(*dir_, check_load);  // one process: importing torch takes seconds
  EXPECT_EQ(loaded.exit_code, 0) << loaded.err << loaded.out;

  // Tokens across the vocabulary (0 and 299 included), longer than the batch's rows.
  const std::string tokens = "0,1,299,5,17,42,250,3,3,8,100,200,150,7,9,11,13,2,4,6,280,290,1,0,33,66,99,12,24,48";
  std::vector<testing::StartedRun> started;
  for (const FidelityVariant& variant : fidelity_variants()) {
    const std::vector<std::string> args = {
        (testing::source_dir() / "tests/examples/hf_reference.py").string(), "logits", "--model", (dir_->path() / ("export-" + variant.name)).string(),
        "--tokens", tokens, "--compare-with", (made(variant.name) / "reference/after_adamw").string(),
        "--report", (dir_->path() / ("logits-" + variant.name + ".json")).string()};
    started.push_back(testing::start_program(*dir_, testing::reference_python(), args));
  }
  for (size_t i = 0; i < started.size(); ++i) {
    const std::string& name = fidelity_variants()[i].name;
    SCOPED_TRACE(name);
    const TrainRun run = testing::finish_run(started[i]);
    ASSERT_RAN(run);
    const nlohmann::json report = read_json(dir_->path() / ("logits-" + name + ".json"));
    ASSERT_TRUE(report.is_object()) << run.out;
    const double difference = report["max_rel_diff"].get<double>();
    std::printf("measured %s: logits of the export after %d steps against transformers' after_adamw: max rel diff %.2e "
                "(max abs %.2e)\n", name.c_str(), kAdamWSteps, difference, report["max_abs_diff"].get<double>());
    RecordProperty(name + "_export_logits_max_rel_diff", exact(difference));
    EXPECT_LT(difference, kLogitsTolerance);
    EXPECT_TRUE(report["same_argmax"].get<bool>());
  }
}

// Every tensor of a safetensors file, by name, as fp32 (with its dtype).
struct ReadTensor {
  hf::SafetensorsDType dtype;
  std::vector<float> values;
};
std::map<std::string, ReadTensor> read_all_tensors(const fs::path& path) {
  std::map<std::string, ReadTensor> tensors;
  auto reader = hf::SafetensorsReader::open(path.string());
  EXPECT_TRUE(reader.ok()) << reader.status().to_string();
  if (!reader.ok()) return tensors;
  for (const hf::SafetensorsTensor& tensor : reader->tensors()) {
    ReadTensor& read = tensors[tensor.name];
    read.dtype = tensor.dtype;
    read.values.resize(tensor.numel);
    const Status status = reader->read_fp32(tensor, 0, read.values);
    EXPECT_TRUE(status.ok()) << status.to_string();
  }
  return tensors;
}

// The export's dtype defaults to the checkpoint's: a bf16 model trained in fp32 comes out in
// bf16, each value its fp32 weight rounded to nearest even, and loads in transformers.
TEST_F(LlamaFidelityTest, Bf16CheckpointExportsAsItsFp32WeightsRoundedToBf16) {
  const std::string name = "mistral-untied-bf16";
  ASSERT_MADE(name);
  const double lr = expected(name)["adamw"]["lr"].get<double>();
  const fs::path as_bf16 = dir_->path() / "export-auto-bf16", as_fp32 = dir_->path() / "export-fp32-of-bf16";
  const TrainRun bf16_run = strata_train(name, kOneMicroBatch, kAdamWSteps, lr, {"--export", as_bf16.string()});
  ASSERT_RAN(bf16_run);
  const TrainRun fp32_run = strata_train(name, kOneMicroBatch, kAdamWSteps, lr, {"--export", as_fp32.string(), "--export-dtype", "fp32"});
  ASSERT_RAN(fp32_run);
  EXPECT_EQ(bf16_run.summary["param_checksum"], fp32_run.summary["param_checksum"]);  // the same training

  EXPECT_EQ(read_json(as_bf16 / "config.json")["torch_dtype"], "bfloat16");
  const auto bf16 = read_all_tensors(as_bf16 / "model.safetensors");
  const auto fp32 = read_all_tensors(as_fp32 / "model.safetensors");
  ASSERT_EQ(bf16.size(), fp32.size());
  ASSERT_FALSE(bf16.empty());
  for (const auto& [tensor, read] : bf16) {
    SCOPED_TRACE(tensor);
    ASSERT_TRUE(fp32.contains(tensor));
    EXPECT_EQ(read.dtype, hf::SafetensorsDType::kBF16);
    const std::vector<float>& full = fp32.at(tensor).values;
    ASSERT_EQ(read.values.size(), full.size());
    size_t mismatches = 0;
    for (size_t i = 0; i < full.size(); ++i) mismatches += read.values[i] != bf16_bits_to_float(float_to_bf16_bits(full[i])) ? 1 : 0;
    EXPECT_EQ(mismatches, 0u);
  }
  const TrainRun loaded = testing::run_hf_reference(*dir_, {"check-load", as_bf16.string()});
  EXPECT_EQ(loaded.exit_code, 0) << loaded.err << loaded.out;
}

// --eval-only is the perplexity evaluation outside tools compare with: the mean next-token
// loss over windows i = tokens [i*T, i*T + T] of a plain token file. transformers, given
// each window as a row (its T + 1 tokens, every one a label), scores the same T
// predictions per window; 3 windows over 1 and 2 ranks (the second rank's last pass is
// masked padding).
TEST_F(LlamaFidelityTest, EvalOnlyIsTransformersLossOverStridedWindows) {
  const std::string name = "llama-tied-llama3";
  ASSERT_MADE(name);
  constexpr int64_t kWindows = 3, kSeqLen = 16;
  std::vector<int32_t> tokens(kWindows * kSeqLen + 1);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919 + 13) % 300);  // vocabulary 300
  const fs::path file = dir_->path() / "windows.bin";
  STRATA_ASSERT_OK(data::write_token_file(file.string(), tokens));
  nlohmann::json batch = {{"attention", "causal"}};
  for (int64_t w = 0; w < kWindows; ++w) {
    std::vector<int32_t> row(tokens.begin() + w * kSeqLen, tokens.begin() + w * kSeqLen + kSeqLen + 1), positions(row.size()), targets(row);
    for (size_t t = 0; t < row.size(); ++t) positions[t] = static_cast<int32_t>(t);
    std::rotate(targets.begin(), targets.begin() + 1, targets.end());
    targets.back() = -100;
    batch["input_ids"].push_back(row);
    batch["labels"].push_back(row);
    batch["targets"].push_back(targets);
    batch["position_ids"].push_back(positions);
  }
  const fs::path batch_path = dir_->path() / "windows.json";
  std::ofstream(batch_path) << batch.dump();
  const TrainRun reference = testing::run_hf_reference(*dir_, {"loss", "--model", made(name).string(), "--batch", batch_path.string()});
  ASSERT_EQ(reference.exit_code, 0) << reference.err;
  const double transformers_loss = nlohmann::json::parse(reference.out.substr(reference.out.find('{')))["loss_fp32"].get<double>();
  for (int world : {1, 2}) {
    SCOPED_TRACE("world size " + std::to_string(world));
    testing::StartedRun started = testing::start_program(
        *dir_, (testing::binary_dir() / "bin" / "strata-train").string(),
        {"--model", made(name).string(), "--data", "tokens:" + file.string(), "--seq-len", std::to_string(kSeqLen), "--eval-only",
         "--eval-sequences", std::to_string(kWindows), "--world-size", std::to_string(world), "--set", "strata.param_dtype=fp32"});
    const TrainRun run = testing::finish_run(started);
    ASSERT_RAN(run);
    EXPECT_EQ(run.summary["losses"].size(), 0u);
    const double eval_loss = run.summary["eval_loss"].get<double>();
    std::printf("measured --eval-only vs transformers at world size %d: %.3g relative\n", world, relative_error(eval_loss, transformers_loss));
    EXPECT_LT(relative_error(eval_loss, transformers_loss), kLossTolerance) << eval_loss << " vs " << transformers_loss;
  }
  // Past the file's end: a clear error before anything runs.
  testing::StartedRun started = testing::start_program(
      *dir_, (testing::binary_dir() / "bin" / "strata-train").string(),
      {"--model", made(name).string(), "--data", "tokens:" + file.string(), "--seq-len", std::to_string(kSeqLen), "--eval-only",
       "--eval-sequences", "4"});
  const TrainRun too_many = testing::finish_run(started);
  EXPECT_NE(too_many.exit_code, 0);
  EXPECT_NE(too_many.err.find("4 windows of 16 tokens need 65 tokens"), std::string::npos) << too_many.err;
}

}  // namespace
}  // namespace strata
