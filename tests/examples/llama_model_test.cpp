// The Llama-family model on the engine: its loss and every gradient against a float64
// PyTorch implementation (tests/examples/llama_reference.py) for GQA, Qwen2 biases, Llama
// biases, tied and untied heads, llama3 and linear rope scaling, positions restarting
// inside a sequence and masked targets; vocabulary chunks; checkpointing; world sizes;
// config.json parsing; presets.
#include "examples/llama/llama_model.h"

#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>

#include <nlohmann/json.hpp>

#include "engine/counter_rng.h"
#include "engine/local_cluster.h"
#include "examples/hf/safetensors.h"
#include "tests/support/test_support.h"

namespace strata::llama {
namespace {

using hf::SafetensorsDType;
using hf::SafetensorsTensorSpec;
using hf::SafetensorsWriter;

namespace fs = std::filesystem;
using hf::SafetensorsDType;
using hf::SafetensorsTensorSpec;
using hf::SafetensorsWriter;

using testing::contains;

// A config.json for a tiny model with no size a multiple of a vector width: 2 layers,
// hidden 24, 4 heads of 6 sharing 2 key/value heads, MLP 40, vocabulary 37.
nlohmann::json tiny_config_json(const std::string& model_type) {
  nlohmann::json j = {{"model_type", model_type}, {"hidden_size", 24},       {"intermediate_size", 40}, {"num_hidden_layers", 2},
                      {"num_attention_heads", 4},  {"num_key_value_heads", 2}, {"vocab_size", 37},        {"max_position_embeddings", 64},
                      {"rms_norm_eps", 1e-5},      {"rope_theta", 10000.0},    {"hidden_act", "silu"},    {"tie_word_embeddings", false}};
  return j;
}

struct Case {
  std::string name;
  nlohmann::json config;
};

std::vector<Case> reference_cases() {
  std::vector<Case> cases;
  nlohmann::json gqa = tiny_config_json("llama");  // Llama 3.2 style: tied, llama3 scaling
  gqa["tie_word_embeddings"] = true;
  gqa["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 16}};
  cases.push_back({"llama_gqa_tied_llama3", gqa});
  nlohmann::json qwen = tiny_config_json("qwen2");  // q/k/v biases, untied, linear scaling
  qwen["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  qwen["rope_theta"] = 1000000.0;
  cases.push_back({"qwen2_bias_untied_linear", qwen});
  nlohmann::json biased = tiny_config_json("llama");  // every bias, plain MHA, tied
  biased["num_key_value_heads"] = 4;
  biased["attention_bias"] = true;
  biased["mlp_bias"] = true;
  biased["tie_word_embeddings"] = true;
  cases.push_back({"llama_all_biases_mha", biased});
  return cases;
}

EngineOptions fp32_engine_options() {
  EngineOptions options;
  options.param_dtype = DType::kFloat32;
  options.grad_wire_dtype = DType::kFloat32;
  options.grad_transfer_dtype = DType::kFloat32;
  options.param_tier = Tier::kPinned;
  options.optimizer_tier = Tier::kPinned;
  options.seed = 4242;
  options.optimizer_threads = 1;
  return options;
}

struct Batch {
  std::vector<int32_t> inputs, targets, positions;
};

// Deterministic tokens; a few targets -1; positions restart at 0 at token 5 of every
// sequence (two packed documents).
Batch make_batch(int64_t vocab, int64_t sequences, int64_t seq_len, uint64_t seed) {
  Batch batch;
  const size_t n = static_cast<size_t>(sequences * seq_len);
  for (size_t i = 0; i < n; ++i) {
    batch.inputs.push_back(static_cast<int32_t>(counter_uniform(seed, 1, i) * float(vocab)) % int32_t(vocab));
    batch.targets.push_back(static_cast<int32_t>(counter_uniform(seed, 2, i) * float(vocab)) % int32_t(vocab));
    const int64_t t = static_cast<int64_t>(i) % seq_len;
    batch.positions.push_back(static_cast<int32_t>(t < 5 ? t : t - 5));
  }
  batch.targets[3] = -1;
  batch.targets[n - 1] = -1;
  return batch;
}

// 37 rows of 24 floats in chunks of 10 rows: 10, 10, 10, 7. Head blocks of 7 rows.
LlamaModelOptions tiny_options(const LlamaConfig& config, ActivationCheckpointing mode) {
  LlamaModelOptions options;
  options.config = config;
  options.batch = 3;
  options.seq_len = 11;
  options.checkpointing = mode;
  options.vocab_chunk_bytes = 10 * 24 * 4;
  options.head_chunk_rows = 7;
  options.capture_gradients = true;
  return options;
}

struct SingleRank {
  std::unique_ptr<LocalCluster> cluster;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<LlamaModel> model;

  Status init(const LlamaModelOptions& model_options, const EngineOptions& engine_options) {
    LocalClusterOptions cluster_options;
    cluster_options.world_size = 1;
    cluster_options.device_budget_bytes = size_t{256} << 20;
    cluster_options.compute_threads = 2;
    STRATA_ASSIGN_OR_RETURN(cluster, LocalCluster::create(cluster_options));
    EngineOptions options = engine_options;
    STRATA_ASSIGN_OR_RETURN(LlamaActivationPlan plan, plan_llama_activations(model_options, DeviceKind::kCpu));
    options.activation_bytes = plan.device_bytes;
    STRATA_ASSIGN_OR_RETURN(engine, Engine::create(options, cluster->device(0), cluster->gather_communicator(0), cluster->reduce_communicator(0)));
    STRATA_ASSIGN_OR_RETURN(model, LlamaModel::create(*engine, model_options));
    STRATA_RETURN_IF_ERROR(engine->start());
    return model->allocate();
  }
  // Every group's full fp32 master weights.
  StatusOr<std::map<int, std::vector<float>>> masters() {
    std::map<int, std::vector<float>> out;
    for (int g = 0; g < engine->group_count(); ++g) {
      std::vector<float> shard(engine->layout(g).shard_numel);
      STRATA_RETURN_IF_ERROR(engine->read_state_shard(g, Engine::StateKind::kMaster, shard));
      shard.resize(engine->layout(g).numel);
      out[g] = std::move(shard);
    }
    return out;
  }
  // One micro-batch's gradients (captured) and loss, no update.
  StatusOr<MicroBatchLosses> gradients(const Batch& batch, int64_t sequences, bool with_positions = true) {
    STRATA_RETURN_IF_ERROR(engine->begin_step(0.0));
    int64_t tokens = 0;
    for (int32_t t : batch.targets) tokens += t != -1;
    const TokenBatch train{batch.inputs.data(), batch.targets.data(), sequences, with_positions ? batch.positions.data() : nullptr};
    STRATA_ASSIGN_OR_RETURN(MicroBatchLosses losses, model->run_micro_batch(&train, nullptr, 1.0f / float(tokens)));
    STRATA_ASSIGN_OR_RETURN(StepReport report, engine->step(losses.train_loss_sum / double(losses.train_tokens)));
    (void)report;
    STRATA_RETURN_IF_ERROR(engine->finish());
    return losses;
  }
};

// Full Hugging Face tensors from per-group values (the inverse of the chunking).
std::map<std::string, std::vector<float>> to_hf(Engine& engine, const LlamaModelOptions& options, const VocabChunks& chunks,
                                                const std::map<int, std::vector<float>>& groups) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& [name, shape] : llama_hf_tensors(options.config)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    out[name].assign(static_cast<size_t>(n), std::nanf(""));
  }
  for (const auto& [g, values] : groups) {
    const GroupLayout& layout = engine.layout(g);
    for (const TensorLayout& t : layout.tensors) {
      const HfTensorSlice slice = llama_tensor_source(options.config, chunks, layout.name, t.name);
      std::vector<float>& dst = out.at(slice.hf_name);
      const size_t row = dst.size() / static_cast<size_t>(slice.hf_shape[0]);
      const size_t mapped = static_cast<size_t>(slice.rows) * row;  // a chunk's padding rows are not Hugging Face's
      std::copy(values.begin() + static_cast<std::ptrdiff_t>(t.offset), values.begin() + static_cast<std::ptrdiff_t>(t.offset + mapped),
                dst.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(slice.row_offset) * row));
    }
  }
  return out;
}

Status write_tensors(const std::string& path, const LlamaConfig& config, const std::map<std::string, std::vector<float>>& tensors,
                     std::map<std::string, std::string> metadata = {}) {
  std::vector<SafetensorsTensorSpec> specs;
  for (const auto& [name, shape] : llama_hf_tensors(config)) specs.push_back({name, SafetensorsDType::kF32, shape});
  STRATA_ASSIGN_OR_RETURN(SafetensorsWriter writer, SafetensorsWriter::create(path, specs, std::move(metadata)));
  for (const auto& spec : specs) STRATA_RETURN_IF_ERROR(writer.append_fp32(spec.name, tensors.at(spec.name)));
  return writer.finish();
}

Status write_batch(const std::string& path, const Batch& batch, int64_t sequences, int64_t seq_len) {
  STRATA_ASSIGN_OR_RETURN(SafetensorsWriter writer,
                          SafetensorsWriter::create(path, {{"inputs", SafetensorsDType::kI32, {sequences, seq_len}},
                                                           {"targets", SafetensorsDType::kI32, {sequences, seq_len}},
                                                           {"positions", SafetensorsDType::kI32, {sequences, seq_len}}}));
  STRATA_RETURN_IF_ERROR(writer.append_bytes("inputs", std::as_bytes(std::span<const int32_t>(batch.inputs))));
  STRATA_RETURN_IF_ERROR(writer.append_bytes("targets", std::as_bytes(std::span<const int32_t>(batch.targets))));
  STRATA_RETURN_IF_ERROR(writer.append_bytes("positions", std::as_bytes(std::span<const int32_t>(batch.positions))));
  return writer.finish();
}

TEST(LlamaModelTest, LossAndEveryGradientMatchAFloat64PyTorchLlama) {
  if (!fs::exists("/usr/bin/python3")) GTEST_SKIP() << "/usr/bin/python3 is not installed";
  testing::TempDir dir;
  const std::vector<Case> cases = reference_cases();
  std::string case_dirs;
  std::vector<LlamaConfig> configs;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path case_dir = dir.path() / c.name;
    fs::create_directories(case_dir);
    case_dirs.append(" ").append(case_dir.string());
    const std::string config_path = (case_dir / "config.json").string();
    std::ofstream(config_path) << c.config.dump(1);
    STRATA_ASSERT_OK_AND_ASSIGN(LlamaConfig config, read_llama_config(case_dir.string()));
    configs.push_back(config);
    const LlamaModelOptions options = tiny_options(config, ActivationCheckpointing::kDevice);
    SingleRank rank;
    STRATA_ASSERT_OK(rank.init(options, fp32_engine_options()));
    const VocabChunks chunks = rank.model->activation_plan().chunks;
    ASSERT_EQ(chunks.count, 4);
    STRATA_ASSERT_OK_AND_ASSIGN(auto masters, rank.masters());
    STRATA_ASSERT_OK(write_tensors((case_dir / "model.safetensors").string(), config, to_hf(*rank.engine, options, chunks, masters)));

    const Batch batch = make_batch(config.vocab_size, 3, 11, 17);
    STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses losses, rank.gradients(batch, 3));
    ASSERT_EQ(losses.train_tokens, 3 * 11 - 2);
    const double loss = losses.train_loss_sum / double(losses.train_tokens);
    EXPECT_NEAR(loss, std::log(double(config.vocab_size)), 0.1);  // N(0, 0.02) weights predict nearly uniformly
    STRATA_ASSERT_OK(write_batch((case_dir / "batch.safetensors").string(), batch, 3, 11));
    char loss_text[64];
    std::snprintf(loss_text, sizeof(loss_text), "%.17g", loss);
    const auto& captured = rank.model->captured_gradients();
    ASSERT_EQ(captured.size(), size_t(rank.engine->group_count()));
    STRATA_ASSERT_OK(
        write_tensors((case_dir / "grads.safetensors").string(), config, to_hf(*rank.engine, options, chunks, captured), {{"loss", loss_text}}));
  }

  const std::string log_path = (dir.path() / "reference.log").string();
  const std::string command = "/usr/bin/python3 " + (testing::source_dir() / "tests/examples/llama_reference.py").string() + case_dirs + " > " +
                              log_path + " 2>&1";
  const int status = std::system(command.c_str());
  std::ifstream log_file(log_path);
  const std::string log((std::istreambuf_iterator<char>(log_file)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(WIFEXITED(status)) << command;
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "PyTorch is not available to /usr/bin/python3: " << log;
  ASSERT_EQ(WEXITSTATUS(status), 0) << command << "\n" << log;
  std::cout << "llama_reference.py:\n" << log;
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].name);
    std::ifstream report_file(dir.path() / cases[i].name / "report.json");
    const nlohmann::json report = nlohmann::json::parse(report_file);
    EXPECT_LT(report["loss_relative_error"].get<double>(), 1e-5) << report.dump(1);
    EXPECT_TRUE(report["missing"].empty()) << report.dump(1);
    ASSERT_EQ(report["gradients"].size(), llama_hf_tensors(configs[i]).size());
    for (const auto& [name, error] : report["gradients"].items()) EXPECT_LT(error.get<double>(), 1e-5) << name;
  }
}

// Runs one micro-batch and returns (loss sum, captured gradients).
std::pair<double, std::map<int, std::vector<float>>> run_once(const LlamaModelOptions& options, const Batch& batch, int64_t sequences,
                                                              bool with_positions = true) {
  SingleRank rank;
  Status status = rank.init(options, fp32_engine_options());
  EXPECT_TRUE(status.ok()) << status.to_string();
  if (!status.ok()) return {};
  auto losses = rank.gradients(batch, sequences, with_positions);
  EXPECT_TRUE(losses.ok()) << losses.status().to_string();
  if (!losses.ok()) return {};
  return {losses->train_loss_sum, rank.model->captured_gradients()};
}

LlamaConfig tiny_config(const std::string& model_type, bool tied) {
  nlohmann::json j = tiny_config_json(model_type);
  j["tie_word_embeddings"] = tied;
  auto config = parse_llama_config(j.dump(), "test config");
  EXPECT_TRUE(config.ok()) << config.status().to_string();
  return *config;
}

TEST(LlamaModelTest, CheckpointingModesGiveBitIdenticalGradients) {
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    LlamaConfig config = tiny_config("qwen2", tied);
    config.num_hidden_layers = 4;  // pinned: saves 3 inputs and restores 2 of them ahead
    const Batch batch = make_batch(config.vocab_size, 3, 11, 5);
    const auto [loss_off, off] = run_once(tiny_options(config, ActivationCheckpointing::kOff), batch, 3);
    ASSERT_FALSE(off.empty());
    for (ActivationCheckpointing mode : {ActivationCheckpointing::kDevice, ActivationCheckpointing::kPinnedHost}) {
      SCOPED_TRACE(std::string(lm::activation_checkpointing_name(mode)));
      const auto [loss_on, on] = run_once(tiny_options(config, mode), batch, 3);
      ASSERT_FALSE(on.empty());
      EXPECT_EQ(loss_off, loss_on);
      for (const auto& [g, values] : off) {
        ASSERT_EQ(on.at(g).size(), values.size());
        EXPECT_EQ(std::memcmp(on.at(g).data(), values.data(), values.size() * 4), 0) << "group " << g;
      }
    }
  }
}

// Writes full Hugging Face tensors into every group's master weights (world size 1).
Status load_hf(SingleRank& rank, const LlamaModelOptions& options, const std::map<std::string, std::vector<float>>& tensors) {
  const VocabChunks chunks = rank.model->activation_plan().chunks;
  for (int g = 0; g < rank.engine->group_count(); ++g) {
    const GroupLayout& layout = rank.engine->layout(g);
    std::vector<float> shard(layout.shard_numel, 0.0f);
    for (const TensorLayout& t : layout.tensors) {
      const HfTensorSlice slice = llama_tensor_source(options.config, chunks, layout.name, t.name);
      const std::vector<float>& src = tensors.at(slice.hf_name);
      const size_t row = src.size() / static_cast<size_t>(slice.hf_shape[0]);
      std::copy_n(src.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(slice.row_offset) * row), static_cast<size_t>(slice.rows) * row,
                  shard.begin() + static_cast<std::ptrdiff_t>(t.offset));
    }
    STRATA_RETURN_IF_ERROR(rank.engine->write_state_shard(g, Engine::StateKind::kMaster, shard));
  }
  return rank.engine->refresh_parameters();
}

TEST(LlamaModelTest, OneVocabularyChunkAndManyAgreeToFp32Rounding) {
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const LlamaConfig config = tiny_config("llama", tied);
    const Batch batch = make_batch(config.vocab_size, 3, 11, 8);
    LlamaModelOptions many = tiny_options(config, ActivationCheckpointing::kDevice);
    LlamaModelOptions one = many;
    one.vocab_chunk_bytes = kDefaultVocabChunkBytes;
    one.head_chunk_rows = 0;
    SingleRank chunked, whole;
    STRATA_ASSERT_OK(chunked.init(many, fp32_engine_options()));
    STRATA_ASSERT_OK(whole.init(one, fp32_engine_options()));
    STRATA_ASSERT_OK_AND_ASSIGN(auto masters, chunked.masters());
    STRATA_ASSERT_OK(load_hf(whole, one, to_hf(*chunked.engine, many, chunked.model->activation_plan().chunks, masters)));
    STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses a, chunked.gradients(batch, 3));
    STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses b, whole.gradients(batch, 3));
    EXPECT_NEAR(a.train_loss_sum, b.train_loss_sum, 1e-6 * std::abs(b.train_loss_sum));
    const auto grads_many = to_hf(*chunked.engine, many, chunked.model->activation_plan().chunks, chunked.model->captured_gradients());
    const auto grads_one = to_hf(*whole.engine, one, whole.model->activation_plan().chunks, whole.model->captured_gradients());
    for (const auto& [name, want] : grads_one) {
      const std::vector<float>& got = grads_many.at(name);
      double diff = 0.0, norm = 0.0;
      for (size_t i = 0; i < want.size(); ++i) {
        diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
        norm += double(want[i]) * want[i];
      }
      EXPECT_LT(std::sqrt(diff / norm), 1e-6) << name;
    }
  }
}

TEST(LlamaModelTest, NullPositionsMeanZeroToSeqLenInEverySequence) {
  const LlamaConfig config = tiny_config("llama", false);
  Batch batch = make_batch(config.vocab_size, 3, 11, 9);
  const LlamaModelOptions options = tiny_options(config, ActivationCheckpointing::kDevice);
  const auto [loss_null, grads_null] = run_once(options, batch, 3, /*with_positions=*/false);
  for (size_t i = 0; i < batch.positions.size(); ++i) batch.positions[i] = static_cast<int32_t>(i % 11);
  const auto [loss_explicit, grads_explicit] = run_once(options, batch, 3);
  ASSERT_FALSE(grads_null.empty());
  EXPECT_EQ(loss_null, loss_explicit);
  for (const auto& [g, values] : grads_null)
    EXPECT_EQ(std::memcmp(grads_explicit.at(g).data(), values.data(), values.size() * 4), 0) << "group " << g;
  // And restarting positions change the loss (rotary positions are used).
  const Batch packed = make_batch(config.vocab_size, 3, 11, 9);
  const auto [loss_packed, grads_packed] = run_once(options, packed, 3);
  EXPECT_NE(loss_packed, loss_null);
}

TEST(LlamaModelTest, TwoRanksGiveTheGradientsOfOne) {
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const LlamaConfig config = tiny_config("llama", tied);
    const Batch batch = make_batch(config.vocab_size, 2, 11, 21);
    LlamaModelOptions one_rank = tiny_options(config, ActivationCheckpointing::kDevice);
    one_rank.batch = 2;
    const auto [loss_one, grads_one] = run_once(one_rank, batch, 2);
    ASSERT_FALSE(grads_one.empty());

    LocalClusterOptions cluster_options;
    cluster_options.world_size = 2;
    cluster_options.compute_threads = 1;
    cluster_options.device_budget_bytes = size_t{128} << 20;
    STRATA_ASSERT_OK_AND_ASSIGN(auto cluster, LocalCluster::create(cluster_options));
    std::mutex mutex;
    std::map<int, std::vector<double>> summed;
    double loss_sum = 0.0;
    int64_t tokens = 0;
    for (int32_t t : batch.targets) tokens += t != -1;
    STRATA_ASSERT_OK(cluster->run([&](int rank) -> Status {
      LlamaModelOptions options = tiny_options(config, ActivationCheckpointing::kDevice);
      options.batch = 1;
      EngineOptions engine_options = fp32_engine_options();
      engine_options.rank = rank;
      engine_options.world_size = 2;
      STRATA_ASSIGN_OR_RETURN(LlamaActivationPlan plan, plan_llama_activations(options, DeviceKind::kCpu));
      engine_options.activation_bytes = plan.device_bytes;
      STRATA_ASSIGN_OR_RETURN(auto engine, Engine::create(engine_options, cluster->device(rank), cluster->gather_communicator(rank),
                                                          cluster->reduce_communicator(rank)));
      STRATA_ASSIGN_OR_RETURN(auto model, LlamaModel::create(*engine, options));
      STRATA_RETURN_IF_ERROR(engine->start());
      STRATA_RETURN_IF_ERROR(model->allocate());
      STRATA_RETURN_IF_ERROR(engine->begin_step(0.0));
      const size_t offset = static_cast<size_t>(rank) * 11;
      const TokenBatch mine{batch.inputs.data() + offset, batch.targets.data() + offset, 1, batch.positions.data() + offset};
      STRATA_ASSIGN_OR_RETURN(MicroBatchLosses losses, model->run_micro_batch(&mine, nullptr, 1.0f / float(tokens)));
      STRATA_RETURN_IF_ERROR(engine->step(0.0).status());
      STRATA_RETURN_IF_ERROR(engine->finish());
      std::lock_guard<std::mutex> lock(mutex);
      loss_sum += losses.train_loss_sum;
      for (const auto& [g, values] : model->captured_gradients()) {
        auto& total = summed[g];
        total.resize(values.size(), 0.0);
        for (size_t i = 0; i < values.size(); ++i) total[i] += values[i];
      }
      return {};
    }));
    EXPECT_NEAR(loss_sum, loss_one, 1e-6 * loss_one);
    for (const auto& [g, values] : grads_one) {
      double diff = 0.0, norm = 0.0;
      for (size_t i = 0; i < values.size(); ++i) {
        diff += (summed.at(g)[i] - values[i]) * (summed.at(g)[i] - values[i]);
        norm += double(values[i]) * values[i];
      }
      EXPECT_LT(std::sqrt(diff / norm), 1e-6) << "group " << g;
    }
  }
}

// Three steps on one batch (the tied model's schedule is recorded on the first, the
// untied one's declared), then an evaluation-only pass that sees the updated weights.
TEST(LlamaModelTest, TrainingStepsLowerTheLossAndEvaluationSeesTheUpdates) {
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const LlamaConfig config = tiny_config("mistral", tied);
    LlamaModelOptions options = tiny_options(config, ActivationCheckpointing::kDevice);
    options.capture_gradients = false;
    options.eval_batch = 2;
    SingleRank rank;
    STRATA_ASSERT_OK(rank.init(options, fp32_engine_options()));
    const Batch batch = make_batch(config.vocab_size, 3, 11, 30);
    int64_t tokens = 0;
    for (int32_t t : batch.targets) tokens += t != -1;
    const TokenBatch train{batch.inputs.data(), batch.targets.data(), 3, batch.positions.data()};
    std::vector<double> losses;
    for (int step = 0; step < 3; ++step) {
      STRATA_ASSERT_OK(rank.engine->begin_step(1e-2));
      STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses l, rank.model->run_micro_batch(&train, nullptr, 1.0f / float(tokens)));
      EXPECT_EQ(l.train_tokens, tokens);
      losses.push_back(l.train_loss_sum / double(l.train_tokens));
      STRATA_ASSERT_OK(rank.engine->step(losses.back()).status());
    }
    STRATA_ASSERT_OK(rank.engine->finish());
    EXPECT_LT(losses[1], losses[0]);
    EXPECT_LT(losses[2], losses[1]);
    // The first two sequences, evaluated after the third update.
    STRATA_ASSERT_OK(rank.engine->begin_forward(llama_forward_order(config, rank.model->activation_plan().chunks)));
    const TokenBatch eval{batch.inputs.data(), batch.targets.data(), 2, batch.positions.data()};
    STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses e, rank.model->run_micro_batch(nullptr, &eval, 0.0f));
    STRATA_ASSERT_OK(rank.engine->end_forward());
    STRATA_ASSERT_OK(rank.engine->finish());
    EXPECT_EQ(e.train_tokens, 0);
    EXPECT_EQ(e.eval_tokens, 2 * 11 - 1);  // targets[3] is -1
    EXPECT_LT(e.eval_loss_sum / double(e.eval_tokens), losses[2]);
  }
}

// Evaluation and training in one call: the training pass is the one without evaluation,
// bit for bit, and the evaluation loss is an evaluation-only pass's on the same weights.
TEST(LlamaModelTest, EvaluationInTheSameCallChangesNoGradientAndMatchesAnEvaluationPass) {
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    LlamaModelOptions options = tiny_options(tiny_config("llama", tied), ActivationCheckpointing::kDevice);
    options.eval_batch = 5;
    const Batch batch = make_batch(options.config.vocab_size, 3, 11, 9);
    const Batch eval = make_batch(options.config.vocab_size, 5, 11, 10);
    SingleRank plain, with_eval, eval_only;
    STRATA_ASSERT_OK(plain.init(options, fp32_engine_options()));
    STRATA_ASSERT_OK(with_eval.init(options, fp32_engine_options()));
    STRATA_ASSERT_OK(eval_only.init(options, fp32_engine_options()));
    STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses a, plain.gradients(batch, 3));
    STRATA_ASSERT_OK(with_eval.engine->begin_step(0.0));
    const TokenBatch train{batch.inputs.data(), batch.targets.data(), 3, batch.positions.data()};
    const TokenBatch eval_batch{eval.inputs.data(), eval.targets.data(), 5, eval.positions.data()};
    STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses b, with_eval.model->run_micro_batch(&train, &eval_batch, 1.0f / float(a.train_tokens)));
    STRATA_ASSERT_OK(with_eval.engine->step(0.0).status());
    STRATA_ASSERT_OK(with_eval.engine->finish());
    EXPECT_EQ(a.train_loss_sum, b.train_loss_sum);
    EXPECT_EQ(b.eval_tokens, 5 * 11 - 2);
    for (const auto& [g, values] : plain.model->captured_gradients())
      EXPECT_EQ(std::memcmp(with_eval.model->captured_gradients().at(g).data(), values.data(), values.size() * 4), 0) << "group " << g;
    STRATA_ASSERT_OK(eval_only.engine->begin_forward(llama_forward_order(options.config, eval_only.model->activation_plan().chunks)));
    STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses c, eval_only.model->run_micro_batch(nullptr, &eval_batch, 0.0f));
    STRATA_ASSERT_OK(eval_only.engine->end_forward());
    STRATA_ASSERT_OK(eval_only.engine->finish());
    EXPECT_EQ(c.eval_loss_sum, b.eval_loss_sum);
    EXPECT_EQ(c.train_tokens, 0);
  }
}

// bf16 parameters are widened exactly into fp32 scratch: with weights that bf16 holds
// exactly, the gradients are those of fp32 parameters, bit for bit.
TEST(LlamaModelTest, BF16ParametersOnTheCpuDeviceGiveTheGradientsOfTheirFp32Values) {
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const LlamaConfig config = tiny_config("qwen2", tied);
    const LlamaModelOptions fp32_options = tiny_options(config, ActivationCheckpointing::kDevice);
    LlamaModelOptions bf16_options = fp32_options;
    bf16_options.param_dtype = DType::kBFloat16;
    EngineOptions bf16_engine = fp32_engine_options();
    bf16_engine.param_dtype = DType::kBFloat16;
    SingleRank wide, narrow;
    STRATA_ASSERT_OK(wide.init(fp32_options, fp32_engine_options()));
    STRATA_ASSERT_OK(narrow.init(bf16_options, bf16_engine));
    EXPECT_EQ(narrow.model->compute_dtype(), DType::kFloat32);
    STRATA_ASSERT_OK_AND_ASSIGN(auto masters, wide.masters());
    for (auto& [g, values] : masters) {
      std::vector<float> shard(wide.engine->layout(g).shard_numel, 0.0f);
      for (size_t i = 0; i < values.size(); ++i) shard[i] = bf16_bits_to_float(float_to_bf16_bits(values[i]));
      STRATA_ASSERT_OK(wide.engine->write_state_shard(g, Engine::StateKind::kMaster, shard));
      STRATA_ASSERT_OK(narrow.engine->write_state_shard(g, Engine::StateKind::kMaster, shard));
    }
    STRATA_ASSERT_OK(wide.engine->refresh_parameters());
    STRATA_ASSERT_OK(narrow.engine->refresh_parameters());
    const Batch batch = make_batch(config.vocab_size, 3, 11, 3);
    STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses a, wide.gradients(batch, 3));
    STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses b, narrow.gradients(batch, 3));
    EXPECT_EQ(a.train_loss_sum, b.train_loss_sum);
    for (const auto& [g, values] : wide.model->captured_gradients())
      EXPECT_EQ(std::memcmp(narrow.model->captured_gradients().at(g).data(), values.data(), values.size() * 4), 0) << "group " << g;
  }
}

TEST(LlamaModelTest, BadTokensTargetsAndPositionsAreRefusedByPlace) {
  const LlamaConfig config = tiny_config("llama", true);
  SingleRank rank;
  STRATA_ASSERT_OK(rank.init(tiny_options(config, ActivationCheckpointing::kDevice), fp32_engine_options()));
  STRATA_ASSERT_OK(rank.engine->begin_step(0.0));
  Batch batch = make_batch(config.vocab_size, 3, 11, 3);
  batch.targets[13] = 37;
  const TokenBatch bad_target{batch.inputs.data(), batch.targets.data(), 3, nullptr};
  auto refused = rank.model->run_micro_batch(&bad_target, nullptr, 1.0f);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(contains(refused.status().message(), "target 37 at sequence 1, position 2")) << refused.status().message();
  batch.targets[13] = 1;
  batch.positions[4] = -3;
  const TokenBatch bad_position{batch.inputs.data(), batch.targets.data(), 3, batch.positions.data()};
  refused = rank.model->run_micro_batch(&bad_position, nullptr, 1.0f);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(contains(refused.status().message(), "position id -3")) << refused.status().message();
}

TEST(LlamaModelTest, TheActivationPlanIsWhatTheDeviceIsCharged) {
  for (ActivationCheckpointing mode : {ActivationCheckpointing::kOff, ActivationCheckpointing::kDevice, ActivationCheckpointing::kPinnedHost}) {
    LlamaModelOptions options = tiny_options(tiny_config("qwen2", false), mode);
    options.capture_gradients = false;
    LocalClusterOptions cluster_options;
    cluster_options.device_budget_bytes = size_t{64} << 20;
    STRATA_ASSERT_OK_AND_ASSIGN(auto cluster, LocalCluster::create(cluster_options));
    STRATA_ASSERT_OK_AND_ASSIGN(LlamaActivationPlan plan, plan_llama_activations(options, DeviceKind::kCpu));
    EngineOptions engine_options = fp32_engine_options();
    engine_options.activation_bytes = plan.device_bytes;
    STRATA_ASSERT_OK_AND_ASSIGN(auto engine, Engine::create(engine_options, cluster->device(0), cluster->gather_communicator(0),
                                                            cluster->reduce_communicator(0)));
    STRATA_ASSERT_OK_AND_ASSIGN(auto model, LlamaModel::create(*engine, options));
    STRATA_ASSERT_OK(engine->start());
    const size_t before = cluster->device(0).memory_stats().reserved_bytes;
    STRATA_ASSERT_OK(model->allocate());
    EXPECT_EQ(cluster->device(0).memory_stats().reserved_bytes - before, plan.device_bytes);
    // Pinned: block 0's input of 3 x 11 x 24 fp32 (the last block's stays on the device).
    EXPECT_EQ(plan.pinned_bytes, mode == ActivationCheckpointing::kPinnedHost ? size_t{4096} : size_t{0});
  }
}

TEST(LlamaModelTest, NoGroupOfTheOneBillionModelIsVocabularySized) {
  STRATA_ASSERT_OK_AND_ASSIGN(LlamaConfig config, llama_preset("llama-1b"));
  const VocabChunks chunks = vocab_chunks(config, kDefaultVocabChunkBytes);
  EXPECT_EQ(chunks.rows_per_chunk, 8192);
  EXPECT_EQ(chunks.count, 16);  // 15 x 8192 rows + 5376
  const auto specs = llama_group_specs(config, chunks);
  ASSERT_EQ(specs.size(), size_t(16 + 16 + 1));  // tied: no lm_head groups
  size_t largest_embedding = 0;
  int64_t embedding_rows = 0;
  for (const auto& spec : specs) {
    STRATA_ASSERT_OK_AND_ASSIGN(GroupLayout layout, layout_group(spec, 0, 1));
    if (spec.name.rfind("model.embed_tokens.", 0) == 0) {
      largest_embedding = std::max(largest_embedding, layout.numel * 4);
      embedding_rows += spec.tensors[0].shape[0];
      const HfTensorSlice slice = llama_tensor_source(config, chunks, spec.name, "weight");
      EXPECT_EQ(slice.hf_name, "model.embed_tokens.weight");
      EXPECT_EQ(slice.rows, spec.tensors[0].shape[0]);
    }
  }
  EXPECT_LE(largest_embedding, kDefaultVocabChunkBytes);
  EXPECT_EQ(embedding_rows, 128256);
  const HfTensorSlice last = llama_tensor_source(config, chunks, "model.embed_tokens.15", "weight");
  EXPECT_EQ(last.row_offset, 15 * 8192);
  EXPECT_EQ(last.rows, 128256 - 15 * 8192);
  const HfTensorSlice q = llama_tensor_source(config, chunks, "model.layers.3", "self_attn.q_proj.weight");
  EXPECT_EQ(q.hf_name, "model.layers.3.self_attn.q_proj.weight");
  EXPECT_EQ(q.hf_shape, (std::vector<int64_t>{2048, 2048}));
  EXPECT_EQ(q.row_offset, 0);
  // A smaller bound gives more, smaller chunks.
  EXPECT_EQ(vocab_chunks(config, size_t{16} << 20).count, 63);
  // The activations hold one chunk (and its gradient), never the vocabulary: a 1024-token
  // micro-batch of bf16 parameters on the CPU device.
  LlamaModelOptions options;
  options.config = config;
  options.seq_len = 1024;
  options.param_dtype = DType::kBFloat16;
  STRATA_ASSERT_OK_AND_ASSIGN(LlamaActivationPlan plan, plan_llama_activations(options, DeviceKind::kCpu));
  std::cout << plan.text();
  int chunk_sized = 0;
  for (const auto& [what, bytes] : plan.lines) {
    if (what.rfind("one matrix slot", 0) == 0 || what.rfind("an embedding chunk", 0) == 0) {
      EXPECT_LT(bytes, size_t{65} << 20) << what;  // (8192 + 1) rows x 2048 fp32
      ++chunk_sized;
    }
  }
  EXPECT_EQ(chunk_sized, 2) << plan.text();
  EXPECT_EQ(plan.head_rows, 1024);  // 32 MiB of fp32 logits over an 8192-row chunk
}

TEST(LlamaModelTest, PresetsHaveTheRealModelsShapesAndParameterCounts) {
  const std::pair<const char*, int64_t> known[] = {{"llama-1b", 1'235'814'400}, {"llama-3b", 3'212'749'824}, {"llama-8b", 8'030'261'248}};
  for (const auto& [name, count] : known) {
    STRATA_ASSERT_OK_AND_ASSIGN(LlamaConfig config, llama_preset(name));
    EXPECT_EQ(llama_parameter_count(config), count) << name;
    int64_t from_groups = 0;
    for (const auto& spec : llama_group_specs(config, vocab_chunks(config, kDefaultVocabChunkBytes)))
      for (const auto& t : spec.tensors) {
        int64_t n = 1;
        for (int64_t d : t.shape) n *= d;
        from_groups += n;
      }
    EXPECT_EQ(from_groups, count) << name;
  }
  for (const std::string& name : llama_preset_names()) {
    STRATA_ASSERT_OK_AND_ASSIGN(LlamaConfig config, llama_preset(name));
    STRATA_EXPECT_OK(validate_llama_config(config));
  }
  STRATA_ASSERT_OK_AND_ASSIGN(LlamaConfig one, llama_preset("llama-1b"));
  EXPECT_TRUE(one.tie_word_embeddings);
  EXPECT_EQ(one.rope_scaling.kind, kernels::RopeScaling::Kind::kLlama3);
  EXPECT_EQ(one.rope_scaling.factor, 32.0);
  EXPECT_EQ(one.rope_theta, 500000.0);
  EXPECT_EQ(describe_llama_config(one),
            "llama: 16 layers, hidden 2048, 32 heads (8 kv) x 64, MLP 8192, vocabulary 128256, tied, rope 500000 llama3 x32 (1235.81M parameters)");
  STRATA_ASSERT_OK_AND_ASSIGN(LlamaConfig eight, llama_preset("llama-8b"));
  EXPECT_FALSE(eight.tie_word_embeddings);
  auto missing = llama_preset("llama-70b");
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(contains(missing.status().message(), "llama-8b")) << missing.status().message();
}

// Llama-3.2-1B's config.json as transformers writes it.
constexpr const char* kLlama32Config = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 128000,
  "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
                   "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0",
  "use_cache": true, "vocab_size": 128256})";

TEST(LlamaConfigTest, ParsesLlama32MistralAndQwen2ConfigFiles) {
  STRATA_ASSERT_OK_AND_ASSIGN(LlamaConfig parsed, parse_llama_config(kLlama32Config, "config.json"));
  STRATA_ASSERT_OK_AND_ASSIGN(LlamaConfig preset, llama_preset("llama-1b"));
  EXPECT_EQ(describe_llama_config(parsed), describe_llama_config(preset));
  EXPECT_EQ(parsed.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(parsed.rms_norm_eps, 1e-5);

  nlohmann::json mistral = tiny_config_json("mistral");
  mistral["sliding_window"] = 8;
  mistral["head_dim"] = nullptr;  // Mistral's files may write null: hidden / heads
  STRATA_ASSERT_OK_AND_ASSIGN(LlamaConfig m, parse_llama_config(mistral.dump(), "mistral.json"));
  EXPECT_EQ(m.family, LlamaFamily::kMistral);
  EXPECT_EQ(m.head_dim, 6);
  EXPECT_EQ(m.sliding_window, 8);
  EXPECT_TRUE(contains(describe_llama_config(m), "sliding window 8")) << describe_llama_config(m);
  STRATA_EXPECT_OK(check_sequence_length(m, 8));
  const Status too_long = check_sequence_length(m, 11);
  ASSERT_FALSE(too_long.ok());
  EXPECT_TRUE(contains(too_long.message(), "seq_len (11)") && contains(too_long.message(), "sliding_window (8)")) << too_long.message();
  LlamaModelOptions options = tiny_options(m, ActivationCheckpointing::kDevice);
  auto plan = plan_llama_activations(options, DeviceKind::kCpu);
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(contains(plan.status().message(), "sliding_window (8)")) << plan.status().message();

  nlohmann::json qwen = tiny_config_json("");
  qwen.erase("model_type");
  qwen["architectures"] = {"Qwen2ForCausalLM"};
  qwen["use_sliding_window"] = false;
  qwen["sliding_window"] = 4;  // ignored unless use_sliding_window
  STRATA_ASSERT_OK_AND_ASSIGN(LlamaConfig q, parse_llama_config(qwen.dump(), "qwen.json"));
  EXPECT_EQ(q.family, LlamaFamily::kQwen2);
  EXPECT_TRUE(q.qkv_bias);
  EXPECT_FALSE(q.o_proj_bias);
  EXPECT_EQ(q.sliding_window, 0);
  EXPECT_EQ(q.rms_norm_eps, 1e-5);
}

TEST(LlamaConfigTest, BadKeysAreRefusedByName) {
  struct BadCase {
    std::function<void(nlohmann::json&)> edit;
    std::string expected;
  };
  const std::vector<BadCase> cases = {
      {[](nlohmann::json& j) { j.erase("hidden_size"); }, "\"hidden_size\" is missing"},
      {[](nlohmann::json& j) { j["num_attention_heads"] = "4"; }, "\"num_attention_heads\" is a string, expected an integer"},
      {[](nlohmann::json& j) { j["vocab_size"] = 37.5; }, "\"vocab_size\" is 37.5, expected an integer"},
      {[](nlohmann::json& j) { j["rms_norm_eps"] = "small"; }, "\"rms_norm_eps\" is a string, expected a number"},
      {[](nlohmann::json& j) { j["tie_word_embeddings"] = 1; }, "\"tie_word_embeddings\" is an integer, expected true or false"},
      {[](nlohmann::json& j) { j["model_type"] = "gpt2"; }, "\"model_type\" is \"gpt2\""},
      {[](nlohmann::json& j) { j["hidden_act"] = "gelu"; }, "\"hidden_act\" is \"gelu\""},
      {[](nlohmann::json& j) { j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; }, "rope_type \"yarn\""},
      {[](nlohmann::json& j) { j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}}; }, "\"low_freq_factor\" is missing"},
      {[](nlohmann::json& j) { j["rope_scaling"] = {{"rope_type", "linear"}}; }, "\"factor\" is missing"},
      {[](nlohmann::json& j) { j["num_key_value_heads"] = 3; }, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"},
      {[](nlohmann::json& j) { j["head_dim"] = 5; }, "head_dim (5) must be even"},
      {[](nlohmann::json& j) { j["intermediate_size"] = 0; }, "intermediate_size must be positive, got 0"},
  };
  for (const BadCase& c : cases) {
    nlohmann::json j = tiny_config_json("llama");
    c.edit(j);
    auto parsed = parse_llama_config(j.dump(), "/models/x/config.json");
    ASSERT_FALSE(parsed.ok()) << c.expected;
    EXPECT_TRUE(contains(parsed.status().to_string(), c.expected)) << parsed.status().to_string();
    EXPECT_TRUE(contains(parsed.status().to_string(), "/models/x/config.json")) << parsed.status().to_string();
  }
  auto not_json = parse_llama_config("{\"hidden_size\": ", "broken.json");
  ASSERT_FALSE(not_json.ok());
  EXPECT_TRUE(contains(not_json.status().message(), "broken.json: not valid JSON"));
  auto no_family = parse_llama_config(R"({"hidden_size": 8})", "nofamily.json");
  ASSERT_FALSE(no_family.ok());
  EXPECT_TRUE(contains(no_family.status().message(), "cannot tell the model family")) << no_family.status().message();
}

}  // namespace
}  // namespace strata::llama
