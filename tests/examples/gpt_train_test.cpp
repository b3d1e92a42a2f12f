// train_gpt end to end, through the binary (build/bin/train_gpt): the summary line,
// resuming (straight vs. saved and resumed; a 2-rank checkpoint resumed on 1 and 4
// ranks), optimizer state on cpu vs. nvme, export and fine-tuning from the export, and
// clear errors for bad input. Tiny models and few steps: each run takes well under a second.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "examples/hf/safetensors.h"
#include "examples/data/token_data.h"
#include "tests/examples/train_gpt_runner.h"
#include "tests/support/test_support.h"

namespace strata::gpt {
namespace {

using hf::SafetensorsDType;
using hf::SafetensorsReader;
using hf::SafetensorsTensor;
using hf::SafetensorsTensorSpec;
using hf::SafetensorsWriter;
using data::write_token_file;

namespace fs = std::filesystem;

using testing::contains;
using testing::read_file;
using testing::train_gpt;
using testing::TrainRun;
std::vector<std::string> tiny(std::vector<std::string> more) { return testing::tiny_train_gpt_args(std::move(more)); }

std::vector<double> losses_of(const TrainRun& run) { return run.summary["losses"].get<std::vector<double>>(); }

TEST(TrainGptTest, PrintsThePlanProgressAndOneJsonSummaryLast) {
  testing::TempDir dir;
  const fs::path metrics = dir.path() / "metrics.jsonl";
  const fs::path trace = dir.path() / "trace.json";
  TrainRun run = train_gpt(dir, tiny({"--steps", "4", "--micro-batch", "2", "--grad-accum", "2", "--metrics", metrics.string(), "--trace",
                                 trace.string()}));
  ASSERT_RAN(run);
  ASSERT_TRUE(run.summary.is_object()) << run.out;
  for (const char* key : {"final_loss", "eval_loss", "entropy_floor", "vocab_size", "steps", "resumed_from_step", "tokens_per_s",
                          "device_peak_bytes", "device_budget_bytes", "state_bytes", "nvme_bytes_read", "nvme_bytes_written",
                          "param_checksum", "param_norm"})
    EXPECT_TRUE(run.summary.contains(key)) << key;
  EXPECT_EQ(run.summary["steps"], 4);
  EXPECT_EQ(run.summary["resumed_from_step"], 0);
  EXPECT_EQ(run.summary["vocab_size"], 64);
  EXPECT_NEAR(run.summary["entropy_floor"].get<double>(), std::log(4.0), 1e-12);
  EXPECT_TRUE(run.summary["eval_loss"].is_number());
  EXPECT_LE(run.summary["device_peak_bytes"].get<size_t>(), run.summary["device_budget_bytes"].get<size_t>());
  EXPECT_EQ(run.summary["param_checksum"].get<std::string>().size(), 16u);
  EXPECT_TRUE(contains(run.out, "Strata plan")) << run.out;
  EXPECT_TRUE(contains(run.out, "step 4/4 | loss")) << run.out;
  EXPECT_TRUE(contains(run.out, "eval ")) << run.out;
  // The engine's metrics (one line per step; the evaluation after the last step is a
  // forward-only pass, not a step) and the trace.
  std::ifstream metrics_in(metrics);
  int lines = 0;
  for (std::string line; std::getline(metrics_in, line);) lines += !line.empty();
  EXPECT_EQ(lines, 4);
  EXPECT_TRUE(fs::exists(trace));
}

TEST(TrainGptTest, TheSummaryReportsModelTflopsFromTokensPerSecondAndTheModelsFlopsPerToken) {
  testing::TempDir dir;
  TrainRun run = train_gpt(dir, tiny({"--steps", "2"}));
  ASSERT_RAN(run);
  // The tiny settings: 2 layers, 32 wide (2 heads), vocabulary 64, 16 tokens a sequence.
  const int64_t L = 2, C = 32, V = 64, T = 16;
  const int64_t forward_per_token = L * 2 * (C * 3 * C + C * C + C * 4 * C + 4 * C * C)  // c_attn, c_proj, c_fc, mlp c_proj
                                    + L * 2 * (2 * T * C)                                 // scores and values, full causal square
                                    + 2 * C * V;                                          // the head (tied to wte)
  EXPECT_EQ(run.summary["model_flops_per_token"].get<int64_t>(), 3 * forward_per_token);
  const double tflops = run.summary["model_tflops"].get<double>();
  EXPECT_TRUE(std::isfinite(tflops) && tflops > 0) << run.out;
  EXPECT_NEAR(tflops, run.summary["tokens_per_s"].get<double>() * double(3 * forward_per_token) / 1e12, 1e-9 * tflops);
  EXPECT_TRUE(contains(run.out, "tok/s | model ")) << run.out;
  EXPECT_TRUE(contains(run.out, "FLOPS | ")) << run.out;
}

TEST(TrainGptTest, ResumingAfterFourStepsGivesTheStraightRunsLossesAndWeights) {
  testing::TempDir dir;
  const std::vector<std::string> common = {"--micro-batch", "2", "--grad-accum", "2"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> args = common;
    args.insert(args.end(), more.begin(), more.end());
    return tiny(args);
  };
  TrainRun straight = train_gpt(dir, with({"--steps", "8"}));
  ASSERT_RAN(straight);
  const std::string save = (dir.path() / "ckpt").string();
  TrainRun first = train_gpt(dir, with({"--steps", "4", "--save-dir", save}));
  ASSERT_RAN(first);
  EXPECT_TRUE(fs::exists(fs::path(save) / "step-4" / "manifest.json"));
  TrainRun second = train_gpt(dir, with({"--steps", "8", "--resume", save}));
  ASSERT_RAN(second);
  EXPECT_EQ(second.summary["resumed_from_step"], 4);
  EXPECT_EQ(second.summary["first_step"], 5);
  EXPECT_EQ(second.summary["param_checksum"], straight.summary["param_checksum"]);
  const auto all = losses_of(straight);
  const auto a = losses_of(first), b = losses_of(second);
  ASSERT_EQ(all.size(), 8u);
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(a[i], all[i]) << "step " << i + 1;
    EXPECT_EQ(b[i], all[4 + i]) << "step " << i + 5;
  }
  EXPECT_EQ(second.summary["final_loss"], straight.summary["final_loss"]);
  EXPECT_EQ(second.summary["eval_loss"], straight.summary["eval_loss"]);
  EXPECT_LT(all.back(), all.front());
}

std::vector<double> metric_of(const fs::path& metrics, const std::string& key);

// Resuming is exact in both overlap modes (delayed: the checkpoint carries the
// parameters one update behind the masters that the next step computes with), with the
// parameters and optimizer state in pinned memory or on NVMe, with gradient accumulation.
struct ResumeCase {
  const char* name;
  const char* overlap;
  const char* tier;  // --offload-param and --offload-optimizer
};

class TrainGptResumeTest : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(TrainGptResumeTest, AResumedRunEndsOnTheStraightRunsChecksum) {
  const ResumeCase& c = GetParam();
  testing::TempDir dir;
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> args = {"--micro-batch", "2", "--grad-accum", "2", "--set", std::string("strata.optimizer_overlap=") + c.overlap,
                                     "--offload-param", c.tier, "--offload-optimizer", c.tier,
                                     "--nvme-path", (dir.path() / "nvme").string()};
    args.insert(args.end(), more.begin(), more.end());
    return tiny(args);
  };
  TrainRun straight = train_gpt(dir, with({"--steps", "8"}));
  ASSERT_RAN(straight);
  const std::string save = (dir.path() / "ckpt").string();
  TrainRun first = train_gpt(dir, with({"--steps", "3", "--save-dir", save}));
  ASSERT_RAN(first);
  const fs::path metrics = dir.path() / "resumed.jsonl";
  TrainRun second = train_gpt(dir, with({"--steps", "8", "--resume", save, "--metrics", metrics.string()}));
  ASSERT_RAN(second);
  EXPECT_EQ(second.summary["resumed_from_step"], 3);
  EXPECT_EQ(metric_of(metrics, "step"), (std::vector<double>{4, 5, 6, 7, 8}));
  EXPECT_EQ(second.summary["param_checksum"], straight.summary["param_checksum"]);
  const auto all = losses_of(straight), b = losses_of(second);
  ASSERT_EQ(all.size(), 8u);
  ASSERT_EQ(b.size(), 5u);
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(b[i], all[3 + i]) << "step " << i + 4;
  const std::string manifest = read_file(fs::path(save) / "step-3" / "manifest.json");
  EXPECT_EQ(contains(manifest, "stale_parameters"), std::string(c.overlap) == "delayed") << manifest.substr(0, 400);
}

INSTANTIATE_TEST_SUITE_P(OverlapAndTiers, TrainGptResumeTest,
                         ::testing::Values(ResumeCase{"exact_cpu", "exact", "cpu"}, ResumeCase{"delayed_cpu", "delayed", "cpu"},
                                           ResumeCase{"exact_nvme", "exact", "nvme"}, ResumeCase{"delayed_nvme", "delayed", "nvme"}),
                         [](const auto& info) { return std::string(info.param.name); });

std::vector<double> metric_of(const fs::path& metrics, const std::string& key) {
  std::vector<double> values;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) values.push_back(nlohmann::json::parse(line)[key].get<double>());
  return values;
}

// fp16 training with a dynamic loss scale that grows every 2 clean steps: the scale a
// resumed run uses is the straight run's (the scale cancels exactly in the update, so
// the weights alone would not show a scale lost on resume).
TEST(TrainGptTest, ResumingRestoresTheLossScale) {
  testing::TempDir dir;
  auto fp16 = [&](std::vector<std::string> more) {
    std::vector<std::string> args = {"--set", "fp16.enabled=true", "--set", "fp16.loss_scale_window=2", "--set", "fp16.initial_scale_power=8"};
    args.insert(args.end(), more.begin(), more.end());
    return tiny(args);
  };
  const fs::path straight_metrics = dir.path() / "straight.jsonl", resumed_metrics = dir.path() / "resumed.jsonl";
  TrainRun straight = train_gpt(dir, fp16({"--steps", "7", "--metrics", straight_metrics.string()}));
  ASSERT_RAN(straight);
  const std::string save = (dir.path() / "ckpt").string();
  ASSERT_RAN(train_gpt(dir, fp16({"--steps", "3", "--save-dir", save})));
  TrainRun resumed = train_gpt(dir, fp16({"--steps", "7", "--resume", save, "--metrics", resumed_metrics.string()}));
  ASSERT_RAN(resumed);
  const auto all = metric_of(straight_metrics, "loss_scale");
  const auto tail = metric_of(resumed_metrics, "loss_scale");
  ASSERT_EQ(all.size(), 7u);
  ASSERT_EQ(tail.size(), 4u);
  EXPECT_GT(all.back(), all.front()) << "the scale never grew: the test shows nothing";
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(tail[i], all[3 + i]) << "step " << i + 4;
  // The resumed run's metrics continue the numbering.
  EXPECT_EQ(metric_of(resumed_metrics, "step"), (std::vector<double>{4, 5, 6, 7}));
  EXPECT_EQ(resumed.summary["param_checksum"], straight.summary["param_checksum"]);
}

double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(diff) / std::sqrt(norm);
}

TEST(TrainGptTest, ATwoRankCheckpointResumesOnOneAndFourRanks) {
  testing::TempDir dir;
  const std::string save = (dir.path() / "ckpt").string();
  const std::string export2 = (dir.path() / "export2").string();
  // The global batch stays 4 sequences per micro-batch: 2 x 2, 1 x 4, 4 x 1.
  TrainRun two = train_gpt(dir, tiny({"--steps", "8", "--world-size", "2", "--micro-batch", "2", "--save-dir", save, "--save-every", "4",
                                 "--export", export2}));
  ASSERT_RAN(two);
  const auto want = losses_of(two);
  STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsReader reference, SafetensorsReader::open(export2 + "/model.safetensors"));
  for (const auto& [ranks, micro] : std::vector<std::pair<std::string, std::string>>{{"1", "4"}, {"4", "1"}}) {
    SCOPED_TRACE(ranks + " rank(s)");
    const std::string exported = (dir.path() / ("export" + ranks)).string();
    // Resume step-4 (remove step-8 from a copy so the latest complete one is step 4).
    const fs::path copy = dir.path() / ("ckpt-copy" + ranks);
    fs::create_directories(copy);
    fs::copy(fs::path(save) / "step-4", copy / "step-4", fs::copy_options::recursive);
    TrainRun resumed = train_gpt(dir, tiny({"--steps", "8", "--world-size", ranks, "--micro-batch", micro, "--resume", copy.string(),
                                       "--export", exported}));
    ASSERT_RAN(resumed);
    EXPECT_EQ(resumed.summary["resumed_from_step"], 4);
    const auto got = losses_of(resumed);
    ASSERT_EQ(got.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(got[i], want[4 + i], 1e-5 * std::abs(want[4 + i])) << "step " << i + 5;
    STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsReader reader, SafetensorsReader::open(exported + "/model.safetensors"));
    ASSERT_EQ(reader.tensors().size(), reference.tensors().size());
    for (const auto& t : reference.tensors()) {
      const SafetensorsTensor* mine = reader.find(t.name);
      ASSERT_NE(mine, nullptr) << t.name;
      std::vector<float> a(t.numel), b(t.numel);
      STRATA_ASSERT_OK(reference.read_fp32(t, 0, a));
      STRATA_ASSERT_OK(reader.read_fp32(*mine, 0, b));
      if (t.name.ends_with("attn.c_attn.bias")) {
        // The key third of c_attn's bias has an exactly zero gradient (adding a constant
        // to every key leaves the softmax unchanged): what it gets is rounding noise, which
        // depends on the summation order and which Adam scales up to full-size updates.
        // Compare the query and value thirds.
        const size_t third = t.numel / 3;
        std::vector<float> qa(a.begin(), a.begin() + third), qb(b.begin(), b.begin() + third);
        std::vector<float> va(a.begin() + 2 * third, a.end()), vb(b.begin() + 2 * third, b.end());
        EXPECT_LT(relative_error(qb, qa), 1e-5) << t.name << " (query)";
        EXPECT_LT(relative_error(vb, va), 1e-5) << t.name << " (value)";
        continue;
      }
      EXPECT_LT(relative_error(b, a), 1e-5) << t.name;
    }
  }
}

TEST(TrainGptTest, OptimizerStateOnCpuAndOnNvmeGiveTheSameWeights) {
  testing::TempDir dir;
  TrainRun cpu = train_gpt(dir, tiny({"--steps", "4", "--offload-optimizer", "cpu", "--offload-param", "cpu"}));
  ASSERT_RAN(cpu);
  TrainRun nvme = train_gpt(dir, tiny({"--steps", "4", "--offload-optimizer", "nvme", "--offload-param", "cpu", "--nvme-path",
                                  (dir.path() / "nvme").string()}));
  ASSERT_RAN(nvme);
  EXPECT_EQ(cpu.summary["param_checksum"], nvme.summary["param_checksum"]);
  EXPECT_EQ(cpu.summary["losses"], nvme.summary["losses"]);
  EXPECT_EQ(cpu.summary["nvme_bytes_written"], 0);
  EXPECT_GT(nvme.summary["nvme_bytes_written"].get<uint64_t>(), 0u);
  EXPECT_GT(nvme.summary["nvme_bytes_read"].get<uint64_t>(), 0u);
}

TEST(TrainGptTest, ExportThenInitFromGivesBackTheSameWeights) {
  testing::TempDir dir;
  const std::string exported = (dir.path() / "export").string();
  TrainRun trained = train_gpt(dir, tiny({"--steps", "3", "--export", exported}));
  ASSERT_RAN(trained);
  EXPECT_TRUE(fs::exists(fs::path(exported) / "config.json"));
  // No steps: the checksum is the loaded weights'. The shape comes from the file and its config.json.
  TrainRun loaded = train_gpt(dir, {"--init-from", exported + "/model.safetensors", "--steps", "0", "--seq-len", "16"});
  ASSERT_RAN(loaded);
  EXPECT_EQ(loaded.summary["param_checksum"], trained.summary["param_checksum"]);
  // Fine-tuning continues from there: the first loss is the trained model's, not ln(vocab).
  TrainRun tuned = train_gpt(dir, tiny({"--init-from", exported + "/model.safetensors", "--steps", "2"}));
  ASSERT_RAN(tuned);
  EXPECT_LT(losses_of(tuned).front(), std::log(64.0) - 0.05);
}

// --model DIR reads a Hugging Face directory (config.json names the family); the export's
// dtype follows the weights it started from unless --export-dtype says otherwise.
TEST(TrainGptTest, AModelDirectoryLoadsAndItsExportKeepsOrChangesTheDtype) {
  testing::TempDir dir;
  const std::string fp32 = (dir.path() / "fp32").string();
  ASSERT_RAN(train_gpt(dir, tiny({"--steps", "1", "--export", fp32})));
  const std::string bf16 = (dir.path() / "bf16").string();
  TrainRun from_dir = train_gpt(dir, {"--model", fp32, "--steps", "0", "--seq-len", "16", "--export", bf16, "--export-dtype", "bf16"});
  ASSERT_RAN(from_dir);
  const std::string again = (dir.path() / "again").string();
  TrainRun from_bf16 = train_gpt(dir, {"--model", bf16, "--steps", "0", "--seq-len", "16", "--export", again});
  ASSERT_RAN(from_bf16);
  for (const auto& [path, dtype] : {std::pair{fp32, SafetensorsDType::kF32}, {bf16, SafetensorsDType::kBF16}, {again, SafetensorsDType::kBF16}}) {
    STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsReader reader, SafetensorsReader::open(path + "/model.safetensors"));
    for (const auto& tensor : reader.tensors()) EXPECT_EQ(tensor.dtype, dtype) << path << " " << tensor.name;
  }
  // bf16 -> fp32 masters -> bf16 is exact: the round trip through the directory keeps the weights.
  EXPECT_EQ(from_bf16.summary["param_checksum"], train_gpt(dir, {"--model", again, "--steps", "0", "--seq-len", "16"}).summary["param_checksum"]);
  TrainRun both = train_gpt(dir, {"--model", fp32, "--init-from", fp32 + "/model.safetensors", "--steps", "0"});
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.err.find("--model and --init-from both name weights to start from; give one"), std::string::npos) << both.err;
  TrainRun missing = train_gpt(dir, {"--model", dir.str(), "--steps", "0"});
  EXPECT_NE(missing.err.find("no config.json in it"), std::string::npos) << missing.err;
}

// Each of these used to train first: a wrapped count ran (--grad-accum 4294967297 ran with
// 1), a flag became a value (--save-dir --steps=8), an unwritable --trace or --export
// failed after the last step, a token past the vocabulary failed when a window hit it.
TEST(TrainGptTest, HostileFlagsOutputsAndTokensFailBeforeTheFirstStep) {
  testing::TempDir dir;
  const fs::path plain = dir.path() / "plain-file";
  std::ofstream(plain) << "x";
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  const fs::path tokens = dir.path() / "tokens.bin";
  std::vector<int32_t> ids(100);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % 64);
  ids[10] = 64;  // tiny() has a vocabulary of 64
  STRATA_ASSERT_OK(write_token_file(tokens.string(), ids));
  const Case cases[] = {
      {{"--grad-accum", "4294967297"}, "--grad-accum 4294967297: gradient_accumulation_steps: expected an integer in [1, 2147483647]"},
      {{"--keep-checkpoints", "4294967297"}, "--keep-checkpoints is out of range: got \"4294967297\", expected an integer in [0, 2147483647]"},
      {{"--save-dir", "--steps=8"}, "--save-dir needs a value, but the next argument is the flag \"--steps=8\""},
      {{"--trace", (plain / "t.json").string()}, "--trace (strata.trace) " + (plain / "t.json").string() + ": cannot create its directory"},
      {{"--metrics", (plain / "m.jsonl").string()}, "--metrics (strata.metrics) " + (plain / "m.jsonl").string() + ": cannot create its directory"},
      {{"--export", (plain / "x").string()}, "--export " + (plain / "x").string() + ": cannot be created: " + plain.string() + " is not a directory"},
      {{"--data", "tokens:" + tokens.string()}, tokens.string() + ": token 10 (byte offset 1044) is 64, at or above the vocabulary size 64"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = c.args;
    args.insert(args.end(), {"--steps", "2"});
    TrainRun run = train_gpt(dir, tiny(args));
    EXPECT_NE(run.exit_code, 0) << c.args[0];
    EXPECT_TRUE(contains(run.err, c.expected)) << run.err;
    EXPECT_FALSE(contains(run.out, "step 1/")) << c.args[0] << " trained:\n" << run.out;
  }
  EXPECT_FALSE(fs::exists(fs::current_path() / "--steps=8"));
}

TEST(TrainGptTest, BadInputGetsAClearError) {
  testing::TempDir dir;
  {
    const fs::path config = dir.path() / "bad.json";
    std::ofstream(config) << R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "offload_parm": {"device": "cpu"}}})";
    TrainRun run = train_gpt(dir, {"--config", config.string(), "--steps", "1"});
    EXPECT_EQ(run.exit_code, 2);
    EXPECT_TRUE(contains(run.err, "zero_optimization.offload_parm")) << run.err;
    EXPECT_TRUE(contains(run.err, "bad.json")) << run.err;
  }
  {
    TrainRun run = train_gpt(dir, {"--stpes", "1"});
    EXPECT_EQ(run.exit_code, 2);
    EXPECT_TRUE(contains(run.err, "--stpes")) << run.err;
  }
  {
    const fs::path tokens = dir.path() / "bad_header.bin";
    std::vector<int32_t> header(256, 0);
    header[0] = 12345;  // not llm.c's magic
    header[1] = 1;
    header[2] = 10;
    std::ofstream out(tokens, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
    out.write(std::string(20, '\0').data(), 20);
    out.close();
    TrainRun run = train_gpt(dir, {"--data", "tokens:" + tokens.string(), "--steps", "1", "--seq-len", "4"});
    EXPECT_NE(run.exit_code, 0);
    EXPECT_TRUE(contains(run.err, "bad_header.bin")) << run.err;
    EXPECT_TRUE(contains(run.err, "magic") || contains(run.err, "20240520")) << run.err;
  }
  {
    // A safetensors file with a tensor missing, then one with a wrong shape.
    const std::string exported = (dir.path() / "export").string();
    TrainRun trained = train_gpt(dir, tiny({"--steps", "1", "--export", exported}));
    ASSERT_RAN(trained);
    STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsReader reader, SafetensorsReader::open(exported + "/model.safetensors"));
    for (const std::string& defect : {std::string("missing"), std::string("shape")}) {
      std::vector<SafetensorsTensorSpec> specs;
      for (const auto& t : reader.tensors()) {
        if (defect == "missing" && t.name == "h.1.attn.c_proj.bias") continue;
        std::vector<int64_t> shape = t.shape;
        if (defect == "shape" && t.name == "h.0.mlp.c_fc.weight") shape[1] -= 1;
        specs.push_back({t.name, t.dtype, shape});
      }
      const fs::path bad_dir = dir.path() / defect;
      fs::create_directories(bad_dir);
      fs::copy_file(fs::path(exported) / "config.json", bad_dir / "config.json");
      const std::string path = (bad_dir / "model.safetensors").string();
      {
        STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsWriter writer, SafetensorsWriter::create(path, specs));
        for (const auto& s : specs) {
          size_t n = 1;
          for (int64_t d : s.shape) n *= static_cast<size_t>(d);
          STRATA_ASSERT_OK(writer.append_fp32(s.name, std::vector<float>(n, 0.5f)));
        }
        STRATA_ASSERT_OK(writer.finish());
      }
      TrainRun run = train_gpt(dir, {"--init-from", path, "--steps", "1", "--seq-len", "16"});
      EXPECT_NE(run.exit_code, 0) << defect;
      EXPECT_TRUE(contains(run.err, defect == "missing" ? "h.1.attn.c_proj.bias" : "h.0.mlp.c_fc.weight")) << run.err;
      EXPECT_TRUE(contains(run.err, "model.safetensors")) << run.err;
    }
  }
  {
    // Resuming from a directory without a complete checkpoint.
    TrainRun run = train_gpt(dir, tiny({"--steps", "2", "--resume", (dir.path() / "nothing").string()}));
    EXPECT_NE(run.exit_code, 0);
    EXPECT_TRUE(contains(run.err, "nothing")) << run.err;
  }
  {
    // A checkpoint of another model shape is refused by name.
    const std::string save = (dir.path() / "ckpt").string();
    ASSERT_RAN(train_gpt(dir, tiny({"--steps", "1", "--save-dir", save})));
    TrainRun run = train_gpt(dir, tiny({"--steps", "2", "--n-embd", "48", "--resume", save}));
    EXPECT_NE(run.exit_code, 0);
    EXPECT_TRUE(contains(run.err, "n_embd")) << run.err;
  }
}

}  // namespace
}  // namespace strata::gpt
