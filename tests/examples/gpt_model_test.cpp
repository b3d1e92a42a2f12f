// The GPT-2 model on the engine: its loss and every gradient against PyTorch
// (tests/examples/gpt2_reference.py), activation checkpointing modes, evaluation riding
// along a training forward, the activation plan against what the device is charged,
// presets, Hugging Face names, loading weights from safetensors files (good and bad), wte
// in vocabulary chunks against one chunk, and the vocabulary's padding rows.
#include "examples/gpt/gpt_model.h"

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
#include "examples/gpt/gpt_weights.h"
#include "examples/train/param_checksum.h"
#include "examples/hf/safetensors.h"
#include "tests/support/test_support.h"

namespace strata::gpt {
namespace {

using hf::SafetensorsDType;
using hf::SafetensorsReader;
using hf::SafetensorsTensorSpec;
using hf::SafetensorsWriter;

namespace fs = std::filesystem;

using testing::contains;

// Small, with no size a multiple of a vector width: 2 layers, 3 heads of 6, context 13,
// vocabulary 37, sequences of 11 tokens (shorter than the context).
GptConfig odd_config() { return GptConfig{2, 3, 18, 13, 37}; }

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
  std::vector<int32_t> inputs, targets;
};

// Deterministic tokens; a few targets are -1 (ignored), as a padded batch would have.
Batch make_batch(const GptConfig& config, int64_t sequences, int64_t seq_len, uint64_t seed, bool with_ignored) {
  Batch batch;
  const size_t n = static_cast<size_t>(sequences * seq_len);
  for (size_t i = 0; i < n; ++i) {
    batch.inputs.push_back(static_cast<int32_t>(counter_uniform(seed, 1, i) * float(config.vocab_size)) % int32_t(config.vocab_size));
    batch.targets.push_back(static_cast<int32_t>(counter_uniform(seed, 2, i) * float(config.vocab_size)) % int32_t(config.vocab_size));
  }
  if (with_ignored) {
    batch.targets[3] = -1;
    batch.targets[n - 1] = -1;
  }
  return batch;
}

// One rank, fp32: creates the engine and model, optionally runs `body` between start and finish.
struct SingleRank {
  std::unique_ptr<LocalCluster> cluster;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<GptModel> model;

  Status init(const GptModelOptions& model_options, const EngineOptions& engine_options, size_t budget = size_t{256} << 20) {
    LocalClusterOptions cluster_options;
    cluster_options.world_size = 1;
    cluster_options.device_budget_bytes = budget;
    cluster_options.compute_threads = 2;
    STRATA_ASSIGN_OR_RETURN(cluster, LocalCluster::create(cluster_options));
    EngineOptions options = engine_options;
    STRATA_ASSIGN_OR_RETURN(GptActivationPlan plan, plan_gpt_activations(model_options, DeviceKind::kCpu));
    options.activation_bytes = plan.device_bytes;
    STRATA_ASSIGN_OR_RETURN(engine, Engine::create(options, cluster->device(0), cluster->gather_communicator(0), cluster->reduce_communicator(0)));
    STRATA_ASSIGN_OR_RETURN(model, GptModel::create(*engine, model_options));
    STRATA_RETURN_IF_ERROR(engine->start());
    return model->allocate();
  }
  // Full group `g`'s master weights.
  Status master(int g, std::span<float> out) {
    std::vector<float> shard(engine->layout(g).shard_numel);
    STRATA_RETURN_IF_ERROR(engine->read_state_shard(g, Engine::StateKind::kMaster, shard));
    std::copy(shard.begin(), shard.begin() + static_cast<std::ptrdiff_t>(out.size()), out.begin());
    return {};
  }
  // One micro-batch's gradients (captured) and loss, no update.
  StatusOr<MicroBatchLosses> gradients(const Batch& batch, int64_t sequences, const Batch* eval = nullptr, int64_t eval_sequences = 0) {
    STRATA_RETURN_IF_ERROR(engine->begin_step(0.0));
    int64_t tokens = 0;
    for (int32_t t : batch.targets) tokens += t != -1;
    const TokenBatch train{batch.inputs.data(), batch.targets.data(), sequences};
    const TokenBatch eval_batch{eval ? eval->inputs.data() : nullptr, eval ? eval->targets.data() : nullptr, eval_sequences};
    STRATA_ASSIGN_OR_RETURN(MicroBatchLosses losses, model->run_micro_batch(&train, eval ? &eval_batch : nullptr, 1.0f / float(tokens)));
    STRATA_ASSIGN_OR_RETURN(StepReport report, engine->step(losses.train_loss_sum / double(losses.train_tokens)));
    (void)report;
    STRATA_RETURN_IF_ERROR(engine->finish());
    return losses;
  }
};

GptModelOptions odd_model_options(ActivationCheckpointing mode) {
  GptModelOptions options;
  options.config = odd_config();
  options.batch = 3;
  options.seq_len = 11;
  options.eval_batch = 5;  // evaluated in chunks of 3 and 2 sequences
  options.checkpointing = mode;
  options.head_chunk_rows = 7;  // the head runs in 5 chunks, the last one partial
  options.capture_gradients = true;
  return options;
}

Status write_batch(const std::string& path, const Batch& batch, int64_t sequences, int64_t seq_len) {
  STRATA_ASSIGN_OR_RETURN(SafetensorsWriter writer, SafetensorsWriter::create(path, {{"inputs", SafetensorsDType::kI32, {sequences, seq_len}},
                                                                                     {"targets", SafetensorsDType::kI32, {sequences, seq_len}}}));
  STRATA_RETURN_IF_ERROR(writer.append_bytes("inputs", std::as_bytes(std::span<const int32_t>(batch.inputs))));
  STRATA_RETURN_IF_ERROR(writer.append_bytes("targets", std::as_bytes(std::span<const int32_t>(batch.targets))));
  return writer.finish();
}

TEST(GptModelTest, LossAndEveryGradientMatchPyTorch) {
  if (!fs::exists("/usr/bin/python3")) GTEST_SKIP() << "/usr/bin/python3 is not installed";
  testing::TempDir dir;
  for (ActivationCheckpointing mode : {ActivationCheckpointing::kDevice, ActivationCheckpointing::kOff}) {
    SCOPED_TRACE(std::string(activation_checkpointing_name(mode)));
    const GptModelOptions model_options = odd_model_options(mode);
    SingleRank rank;
    STRATA_ASSERT_OK(rank.init(model_options, fp32_engine_options()));
    const std::string model_path = (dir.path() / "model.safetensors").string();
    STRATA_ASSERT_OK(write_gpt2_safetensors(model_path, model_options.config, [&](int g, std::span<float> out) { return rank.master(g, out); }));
    const Batch batch = make_batch(model_options.config, 3, 11, 17, /*with_ignored=*/true);
    STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses losses, rank.gradients(batch, 3));
    ASSERT_EQ(losses.train_tokens, 3 * 11 - 2);
    const double loss = losses.train_loss_sum / double(losses.train_tokens);
    const std::string batch_path = (dir.path() / "batch.safetensors").string();
    STRATA_ASSERT_OK(write_batch(batch_path, batch, 3, 11));
    const std::string grads_path = (dir.path() / "grads.safetensors").string();
    ExportOptions grads_options;
    char loss_text[64];
    std::snprintf(loss_text, sizeof(loss_text), "%.17g", loss);
    grads_options.metadata["loss"] = loss_text;
    const auto& captured = rank.model->captured_gradients();
    ASSERT_EQ(captured.size(), size_t(gpt_group_count(model_options.config)));
    STRATA_ASSERT_OK(write_gpt2_safetensors(grads_path, model_options.config, [&](int g, std::span<float> out) -> Status {
      const auto& grad = captured.at(g);
      std::copy(grad.begin(), grad.begin() + static_cast<std::ptrdiff_t>(out.size()), out.begin());
      return {};
    }, grads_options));

    const std::string report_path = (dir.path() / "report.json").string();
    const std::string log_path = (dir.path() / "reference.log").string();
    const std::string command = "/usr/bin/python3 " + (testing::source_dir() / "tests/examples/gpt2_reference.py").string() + " --model " +
                                model_path + " --batch " + batch_path + " --grads " + grads_path + " --n-head 3 --out " + report_path +
                                " > " + log_path + " 2>&1";
    const int status = std::system(command.c_str());
    std::ifstream log_file(log_path);
    const std::string log((std::istreambuf_iterator<char>(log_file)), std::istreambuf_iterator<char>());
    ASSERT_TRUE(WIFEXITED(status)) << command;
    if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "PyTorch is not available to /usr/bin/python3: " << log;
    ASSERT_EQ(WEXITSTATUS(status), 0) << command << "\n" << log;
    std::cout << "gpt2_reference.py: " << log;
    std::ifstream report_file(report_path);
    const nlohmann::json report = nlohmann::json::parse(report_file);
    EXPECT_LT(report["loss_relative_error"].get<double>(), 1e-5) << report.dump(1);
    EXPECT_TRUE(report["missing"].empty()) << report.dump(1);
    ASSERT_EQ(report["gradients"].size(), size_t(4 + 12 * model_options.config.n_layer));
    for (const auto& [name, error] : report["gradients"].items()) EXPECT_LT(error.get<double>(), 1e-4) << name;
    // The loss starts near ln(vocab): GPT-2's initialization predicts nearly uniformly.
    EXPECT_NEAR(loss, std::log(double(model_options.config.vocab_size)), 0.1);
  }
}

TEST(GptModelTest, CheckpointingModesGiveBitIdenticalGradients) {
  std::map<int, std::vector<float>> reference;
  double reference_loss = 0.0;
  for (ActivationCheckpointing mode : {ActivationCheckpointing::kOff, ActivationCheckpointing::kDevice, ActivationCheckpointing::kPinnedHost}) {
    SCOPED_TRACE(std::string(activation_checkpointing_name(mode)));
    GptModelOptions model_options = odd_model_options(mode);
    model_options.config.n_layer = 4;  // pinned mode saves 3 inputs and restores 2 of them ahead
    SingleRank rank;
    STRATA_ASSERT_OK(rank.init(model_options, fp32_engine_options()));
    const Batch batch = make_batch(model_options.config, 3, 11, 5, false);
    STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses losses, rank.gradients(batch, 3));
    const auto& grads = rank.model->captured_gradients();
    if (reference.empty()) {
      reference = grads;
      reference_loss = losses.train_loss_sum;
      continue;
    }
    EXPECT_EQ(losses.train_loss_sum, reference_loss);
    for (const auto& [g, values] : reference) {
      ASSERT_EQ(grads.at(g).size(), values.size());
      EXPECT_EQ(std::memcmp(grads.at(g).data(), values.data(), values.size() * 4), 0) << "group " << g;
    }
  }
}

TEST(GptModelTest, EvaluationInTheSameForwardChangesNoGradientAndMatchesAnEvaluationPass) {
  const GptModelOptions model_options = odd_model_options(ActivationCheckpointing::kDevice);
  const Batch batch = make_batch(model_options.config, 3, 11, 9, false);
  const Batch eval = make_batch(model_options.config, 5, 11, 10, false);
  SingleRank plain, with_eval, eval_only;
  STRATA_ASSERT_OK(plain.init(model_options, fp32_engine_options()));
  STRATA_ASSERT_OK(with_eval.init(model_options, fp32_engine_options()));
  STRATA_ASSERT_OK(eval_only.init(model_options, fp32_engine_options()));
  STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses a, plain.gradients(batch, 3));
  STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses b, with_eval.gradients(batch, 3, &eval, 5));
  EXPECT_EQ(a.train_loss_sum, b.train_loss_sum);
  EXPECT_EQ(b.eval_tokens, 55);
  for (const auto& [g, values] : plain.model->captured_gradients())
    EXPECT_EQ(std::memcmp(with_eval.model->captured_gradients().at(g).data(), values.data(), values.size() * 4), 0) << "group " << g;
  // A forward-only pass over the same evaluation batch, on the same (initial) weights.
  STRATA_ASSERT_OK(eval_only.engine->begin_forward(gpt_forward_order(model_options.config)));
  const TokenBatch eval_batch{eval.inputs.data(), eval.targets.data(), 5};
  STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses c, eval_only.model->run_micro_batch(nullptr, &eval_batch, 0.0f));
  STRATA_ASSERT_OK(eval_only.engine->end_forward());
  STRATA_ASSERT_OK(eval_only.engine->finish());
  EXPECT_EQ(c.eval_loss_sum, b.eval_loss_sum);
  EXPECT_EQ(c.train_tokens, 0);
  // And it is the loss a training forward over those 5 sequences computes.
  GptModelOptions five = model_options;
  five.batch = 5;
  SingleRank trainer;
  STRATA_ASSERT_OK(trainer.init(five, fp32_engine_options()));
  STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses d, trainer.gradients(eval, 5));
  EXPECT_NEAR(d.train_loss_sum, b.eval_loss_sum, 1e-6 * std::abs(d.train_loss_sum));
}

// The trainer enqueues a step's micro-batches back to back and reads their losses after
// the last (no drain between them): the same losses and gradients as reading each at once,
// with pinned checkpoints (a copy stream) and an evaluation batch riding along.
TEST(GptModelTest, MicroBatchesQueuedBackToBackGiveTheLossesAndGradientsOfOneAtATime) {
  const GptModelOptions model_options = odd_model_options(ActivationCheckpointing::kPinnedHost);
  const Batch eval = make_batch(model_options.config, 5, 11, 30, false);
  const TokenBatch eval_batch{eval.inputs.data(), eval.targets.data(), 5};
  std::vector<Batch> batches;
  for (uint64_t m = 0; m < 3; ++m) batches.push_back(make_batch(model_options.config, 3, 11, 31 + m, /*with_ignored=*/m == 1));
  auto run = [&](SingleRank& rank, bool queue_all) -> StatusOr<std::vector<MicroBatchLosses>> {
    STRATA_RETURN_IF_ERROR(rank.engine->begin_step(0.0));
    std::vector<MicroBatchLosses> losses;
    std::vector<QueuedMicroBatch> queued;
    for (size_t m = 0; m < batches.size(); ++m) {
      if (m > 0) STRATA_RETURN_IF_ERROR(rank.engine->begin_micro_batch());
      const TokenBatch train{batches[m].inputs.data(), batches[m].targets.data(), 3};
      const TokenBatch* with_eval = m == 0 ? &eval_batch : nullptr;
      if (queue_all) {
        STRATA_ASSIGN_OR_RETURN(QueuedMicroBatch q, rank.model->queue_micro_batch(&train, with_eval, 1.0f / 99.0f));
        queued.push_back(q);
      } else {
        STRATA_ASSIGN_OR_RETURN(MicroBatchLosses l, rank.model->run_micro_batch(&train, with_eval, 1.0f / 99.0f));
        losses.push_back(l);
      }
    }
    for (const QueuedMicroBatch& q : queued) {
      STRATA_ASSIGN_OR_RETURN(MicroBatchLosses l, rank.model->collect(q));
      losses.push_back(l);
    }
    STRATA_RETURN_IF_ERROR(rank.engine->step(0.0).status());
    STRATA_RETURN_IF_ERROR(rank.engine->finish());
    return losses;
  };
  EngineOptions engine_options = fp32_engine_options();
  engine_options.gradient_accumulation_steps = 3;
  SingleRank one_at_a_time, back_to_back;
  STRATA_ASSERT_OK(one_at_a_time.init(model_options, engine_options));
  STRATA_ASSERT_OK(back_to_back.init(model_options, engine_options));
  STRATA_ASSERT_OK_AND_ASSIGN(const std::vector<MicroBatchLosses> a, run(one_at_a_time, false));
  STRATA_ASSERT_OK_AND_ASSIGN(const std::vector<MicroBatchLosses> b, run(back_to_back, true));
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t m = 0; m < 3; ++m) {
    EXPECT_EQ(a[m].train_loss_sum, b[m].train_loss_sum) << "micro-batch " << m;
    EXPECT_EQ(a[m].train_tokens, b[m].train_tokens) << "micro-batch " << m;
    EXPECT_EQ(a[m].eval_loss_sum, b[m].eval_loss_sum) << "micro-batch " << m;
  }
  EXPECT_GT(b[0].eval_tokens, 0);
  EXPECT_NE(b[0].train_loss_sum, b[2].train_loss_sum);  // each micro-batch read its own pieces
  for (const auto& [g, values] : one_at_a_time.model->captured_gradients())
    EXPECT_EQ(std::memcmp(back_to_back.model->captured_gradients().at(g).data(), values.data(), values.size() * 4), 0) << "group " << g;
}

TEST(GptModelTest, TheActivationPlanIsWhatTheDeviceIsCharged) {
  for (ActivationCheckpointing mode : {ActivationCheckpointing::kOff, ActivationCheckpointing::kDevice, ActivationCheckpointing::kPinnedHost}) {
    GptModelOptions options = odd_model_options(mode);
    options.capture_gradients = false;
    LocalClusterOptions cluster_options;
    cluster_options.device_budget_bytes = size_t{64} << 20;
    STRATA_ASSERT_OK_AND_ASSIGN(auto cluster, LocalCluster::create(cluster_options));
    STRATA_ASSERT_OK_AND_ASSIGN(GptActivationPlan plan, plan_gpt_activations(options, DeviceKind::kCpu));
    EngineOptions engine_options = fp32_engine_options();
    engine_options.activation_bytes = plan.device_bytes;
    STRATA_ASSERT_OK_AND_ASSIGN(auto engine, Engine::create(engine_options, cluster->device(0), cluster->gather_communicator(0),
                                                            cluster->reduce_communicator(0)));
    STRATA_ASSERT_OK_AND_ASSIGN(auto model, GptModel::create(*engine, options));
    STRATA_ASSERT_OK(engine->start());
    const size_t before = cluster->device(0).memory_stats().reserved_bytes;
    STRATA_ASSERT_OK(model->allocate());
    EXPECT_EQ(cluster->device(0).memory_stats().reserved_bytes - before, plan.device_bytes) << activation_checkpointing_name(mode);
    EXPECT_LE(cluster->device(0).memory_stats().high_water_bytes, engine->plan().device_bytes);
  }
  // Checkpointing bounds activations: 24 layers need far less than keeping everything.
  GptModelOptions deep = odd_model_options(ActivationCheckpointing::kDevice);
  deep.config.n_layer = 24;
  STRATA_ASSERT_OK_AND_ASSIGN(GptActivationPlan checkpointed, plan_gpt_activations(deep, DeviceKind::kCpu));
  deep.checkpointing = ActivationCheckpointing::kPinnedHost;
  STRATA_ASSERT_OK_AND_ASSIGN(GptActivationPlan pinned, plan_gpt_activations(deep, DeviceKind::kCpu));
  deep.checkpointing = ActivationCheckpointing::kOff;
  STRATA_ASSERT_OK_AND_ASSIGN(GptActivationPlan everything, plan_gpt_activations(deep, DeviceKind::kCpu));
  EXPECT_LT(checkpointed.device_bytes * 3, everything.device_bytes);
  EXPECT_LT(pinned.device_bytes, checkpointed.device_bytes);
  EXPECT_EQ(pinned.pinned_bytes, size_t(23) * 4096);  // 23 saved inputs of 3 x 11 x 18 fp32, 4 KiB each
}

TEST(GptModelTest, BF16ParametersOnTheCpuDeviceAreCastToFp32Scratch) {
  GptModelOptions options = odd_model_options(ActivationCheckpointing::kDevice);
  options.param_dtype = DType::kBFloat16;
  EngineOptions engine_options = fp32_engine_options();
  engine_options.param_dtype = DType::kBFloat16;
  engine_options.grad_transfer_dtype = DType::kBFloat16;
  engine_options.grad_wire_dtype = DType::kBFloat16;
  SingleRank rank;
  STRATA_ASSERT_OK(rank.init(options, engine_options));
  EXPECT_EQ(rank.model->compute_dtype(), DType::kFloat32);
  const Batch batch = make_batch(options.config, 3, 11, 3, false);
  STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses losses, rank.gradients(batch, 3));
  EXPECT_NEAR(losses.train_loss_sum / double(losses.train_tokens), std::log(37.0), 0.1);
  // A model planned for fp32 parameters refuses bf16 ones.
  SingleRank mismatched;
  GptModelOptions fp32_options = odd_model_options(ActivationCheckpointing::kDevice);
  STRATA_ASSERT_OK(mismatched.init(fp32_options, engine_options));
  STRATA_ASSERT_OK(mismatched.engine->begin_step(0.0));
  const TokenBatch train{batch.inputs.data(), batch.targets.data(), 3};
  auto refused = mismatched.model->run_micro_batch(&train, nullptr, 1.0f);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(contains(refused.status().message(), "bf16")) << refused.status().to_string();
}

TEST(GptModelTest, PresetsHaveGpt2sParameterCounts) {
  // Hugging Face's counts for the four GPT-2 checkpoints (wte shared with the head).
  const std::pair<const char*, int64_t> known[] = {
      {"gpt2", 124'439'808}, {"gpt2-medium", 354'823'168}, {"gpt2-large", 774'030'080}, {"gpt2-xl", 1'557'611'200}};
  for (const auto& [name, count] : known) {
    STRATA_ASSERT_OK_AND_ASSIGN(GptConfig config, gpt_preset(name));
    EXPECT_EQ(gpt_parameter_count(config), count) << name;
    int64_t from_groups = 0;
    for (const auto& spec : gpt_group_specs(config))
      for (const auto& t : spec.tensors) {
        int64_t n = t.init.rows > 0 ? t.init.rows : t.shape[0];  // wte's padding rows are not parameters
        for (size_t d = 1; d < t.shape.size(); ++d) n *= t.shape[d];
        from_groups += n;
      }
    EXPECT_EQ(from_groups, count) << name;
  }
  for (const std::string& name : gpt_preset_names()) {
    STRATA_ASSERT_OK_AND_ASSIGN(GptConfig config, gpt_preset(name));
    STRATA_EXPECT_OK(validate_gpt_config(config));
  }
  STRATA_ASSERT_OK_AND_ASSIGN(GptConfig big, gpt_preset("gpt-6.7b"));
  EXPECT_EQ(big.n_embd, 4096);
  auto missing = gpt_preset("gpt5");
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(contains(missing.status().message(), "gpt2-medium")) << missing.status().message();
  const Status bad = validate_gpt_config(GptConfig{2, 5, 64, 16, 100});
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(contains(bad.message(), "n_embd (64) must be a multiple of n_head (5)")) << bad.message();
}

TEST(GptModelTest, GroupsCarryHuggingFaceNamesShapesAndGpt2Init) {
  const GptConfig config{3, 2, 16, 8, 50};
  const auto specs = gpt_group_specs(config);
  ASSERT_EQ(specs.size(), 6u);  // wte.0 (one chunk), wpe, h.0 .. h.2, ln_f
  std::vector<NamedShape> ours;
  for (const auto& spec : specs)
    for (const auto& t : spec.tensors) {
      std::vector<int64_t> shape = t.shape;
      if (t.init.rows > 0) shape[0] = t.init.rows;  // the vocabulary padded to 128 rows: 50 of them are wte's
      ours.push_back({hf_tensor_name(spec.name, t.name), shape});
    }
  EXPECT_EQ(specs[0].tensors[0].shape, (std::vector<int64_t>{128, 16}));
  const auto theirs = gpt2_tensor_shapes(gpt2_dims(config));
  ASSERT_EQ(ours.size(), theirs.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_EQ(ours[i].name, theirs[i].name);
    EXPECT_EQ(ours[i].shape, theirs[i].shape) << ours[i].name;
  }
  // Residual projections get 0.02 / sqrt(2 n_layer); no decay on biases, LayerNorm, embeddings.
  for (const auto& spec : specs)
    for (const auto& t : spec.tensors) {
      const bool matrix = t.shape.size() == 2 && spec.name.rfind("h.", 0) == 0;
      EXPECT_EQ(t.weight_decay, matrix) << spec.name << "." << t.name;
      if (t.name == "attn.c_proj.weight" || t.name == "mlp.c_proj.weight") {
        EXPECT_FLOAT_EQ(t.init.scale, 0.02f / std::sqrt(6.0f));
      }
      if (t.name.find("ln_") != std::string::npos && t.name.ends_with(".weight")) {
        EXPECT_EQ(t.init.value, 1.0f);
      }
    }
  const std::vector<int> schedule = gpt_schedule(config);
  // wte, wpe, h.0 .. h.2, ln_f, the head's passes 1 and 2 (wte), h.2 .. h.0, pass 3 (wte).
  EXPECT_EQ(schedule, (std::vector<int>{0, 1, 2, 3, 4, 5, 0, 0, 4, 3, 2, 0}));
}

// Writes a GPT-2 file for `config` with values from `value(name, i)`, optionally
// leaving out or reshaping one tensor.
Status write_gpt2_file(const std::string& path, const GptConfig& config, const std::string& skip = "", const std::string& reshape = "") {
  std::vector<SafetensorsTensorSpec> specs;
  for (const auto& t : gpt2_tensor_shapes(gpt2_dims(config))) {
    if (t.name == skip) continue;
    std::vector<int64_t> shape = t.shape;
    if (t.name == reshape) shape.back() += 1;
    specs.push_back({"transformer." + t.name, SafetensorsDType::kF32, shape});
  }
  STRATA_ASSIGN_OR_RETURN(SafetensorsWriter writer, SafetensorsWriter::create(path, specs));
  for (const auto& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    std::vector<float> values(static_cast<size_t>(n));
    for (size_t i = 0; i < values.size(); ++i) values[i] = std::sin(float(i) * 0.1f + float(s.name.size()));
    STRATA_RETURN_IF_ERROR(writer.append_fp32(s.name, values));
  }
  return writer.finish();
}

TEST(GptModelTest, LoadsAHuggingFaceFileIntoEveryRanksShards) {
  testing::TempDir dir;
  const GptConfig config = odd_config();
  const std::string path = (dir.path() / "hf.safetensors").string();
  STRATA_ASSERT_OK(write_gpt2_file(path, config));
  STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsReader reader, SafetensorsReader::open(path));
  for (int world : {1, 3}) {
    LocalClusterOptions cluster_options;
    cluster_options.world_size = world;
    cluster_options.compute_threads = 1;
    cluster_options.device_budget_bytes = size_t{64} << 20;
    STRATA_ASSERT_OK_AND_ASSIGN(auto cluster, LocalCluster::create(cluster_options));
    std::mutex mutex;
    std::map<std::string, std::vector<float>> loaded;  // by HF name
    STRATA_ASSERT_OK(cluster->run([&](int rank) -> Status {
      GptModelOptions options = odd_model_options(ActivationCheckpointing::kDevice);
      EngineOptions engine_options = fp32_engine_options();
      engine_options.rank = rank;
      engine_options.world_size = world;
      STRATA_ASSIGN_OR_RETURN(GptActivationPlan plan, plan_gpt_activations(options, DeviceKind::kCpu));
      engine_options.activation_bytes = plan.device_bytes;
      STRATA_ASSIGN_OR_RETURN(auto engine, Engine::create(engine_options, cluster->device(rank), cluster->gather_communicator(rank),
                                                          cluster->reduce_communicator(rank)));
      STRATA_ASSIGN_OR_RETURN(auto model, GptModel::create(*engine, options));
      STRATA_RETURN_IF_ERROR(engine->start());
      STRATA_RETURN_IF_ERROR(load_gpt2_weights(*engine, rank, reader, config));
      for (int g = 0; g < engine->group_count(); ++g) {
        const GroupLayout& layout = engine->layout(g);
        std::vector<float> shard(layout.shard_numel);
        STRATA_RETURN_IF_ERROR(engine->read_state_shard(g, Engine::StateKind::kMaster, shard));
        std::lock_guard<std::mutex> lock(mutex);
        for (const auto& t : layout.tensors) {
          auto& values = loaded[hf_tensor_name(layout, t)];
          values.resize(t.numel);
          for (size_t i = 0; i < t.numel; ++i) {
            const size_t e = t.offset + i;
            if (e >= layout.shard_begin(rank) && e < layout.shard_begin(rank) + layout.shard_numel) values[i] = shard[e - layout.shard_begin(rank)];
          }
        }
      }
      return engine->finish();
    }));
    for (const auto& t : reader.tensors()) {
      std::vector<float> want(t.numel);
      STRATA_ASSERT_OK(reader.read_fp32(t, 0, want));
      const auto& got = loaded.at(std::string(strip_gpt2_prefix(t.name)));
      EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0) << t.name << " world " << world;
    }
  }
}

TEST(GptModelTest, AFileWithAMissingOrMisshapenTensorIsRefusedByName) {
  testing::TempDir dir;
  const GptConfig config = odd_config();
  const std::string missing = (dir.path() / "missing.safetensors").string();
  const std::string misshapen = (dir.path() / "misshapen.safetensors").string();
  STRATA_ASSERT_OK(write_gpt2_file(missing, config, "h.1.mlp.c_fc.bias"));
  STRATA_ASSERT_OK(write_gpt2_file(misshapen, config, "", "h.0.attn.c_attn.weight"));
  SingleRank rank;
  GptModelOptions options = odd_model_options(ActivationCheckpointing::kDevice);
  STRATA_ASSERT_OK(rank.init(options, fp32_engine_options()));
  {
    STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsReader reader, SafetensorsReader::open(missing));
    const Status status = load_gpt2_weights(*rank.engine, 0, reader, config);
    ASSERT_FALSE(status.ok());
    EXPECT_TRUE(contains(status.to_string(), "h.1.mlp.c_fc.bias")) << status.to_string();
    EXPECT_TRUE(contains(status.to_string(), "missing.safetensors")) << status.to_string();
  }
  {
    STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsReader reader, SafetensorsReader::open(misshapen));
    const Status status = load_gpt2_weights(*rank.engine, 0, reader, config);
    ASSERT_FALSE(status.ok());
    EXPECT_TRUE(contains(status.to_string(), "h.0.attn.c_attn.weight")) << status.to_string();
    EXPECT_TRUE(contains(status.to_string(), "[18, 55]")) << status.to_string();
  }
  // Nothing was loaded: the engine still holds its initial weights (shards untouched).
  const int block0 = rank.model->groups().block(0);
  std::vector<float> ln(rank.engine->layout(block0).numel);
  STRATA_ASSERT_OK(rank.master(block0, ln));
  EXPECT_EQ(ln[0], 1.0f);  // ln_1.weight initialized to ones
  STRATA_ASSERT_OK(rank.engine->finish());
}

TEST(GptModelTest, ConfigJsonNextToTheFileGivesTheHeadsAndMustAgree) {
  testing::TempDir dir;
  const GptConfig config = odd_config();
  const std::string path = (dir.path() / "model.safetensors").string();
  STRATA_ASSERT_OK(write_gpt2_file(path, config));
  STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsReader reader, SafetensorsReader::open(path));
  auto unknown = gpt_config_from_safetensors(reader, GptConfig{});
  ASSERT_FALSE(unknown.ok());
  EXPECT_TRUE(contains(unknown.status().message(), "n_head")) << unknown.status().message();
  STRATA_ASSERT_OK(write_gpt2_config_json((dir.path() / "config.json").string(), config));
  STRATA_ASSERT_OK_AND_ASSIGN(GptConfig read, gpt_config_from_safetensors(reader, GptConfig{}));
  EXPECT_EQ(read.n_head, 3);
  EXPECT_EQ(read.n_layer, 2);
  EXPECT_EQ(read.vocab_size, 37);
  EXPECT_EQ(read.n_ctx, 13);
  GptConfig other = config;
  other.n_layer = 5;
  STRATA_ASSERT_OK(write_gpt2_config_json((dir.path() / "config.json").string(), other));
  auto contradiction = gpt_config_from_safetensors(reader, GptConfig{});
  ASSERT_FALSE(contradiction.ok());
  EXPECT_TRUE(contains(contradiction.status().message(), "\"n_layer\" is 5")) << contradiction.status().message();
}

TEST(GptModelTest, ChecksumPartsAddUpTheSameForEveryWorldSize) {
  const GptConfig config = odd_config();
  const auto specs = gpt_group_specs(config);
  uint64_t totals[3] = {0, 0, 0};
  const int worlds[3] = {1, 2, 5};
  for (int w = 0; w < 3; ++w) {
    for (size_t g = 0; g < specs.size(); ++g) {
      STRATA_ASSERT_OK_AND_ASSIGN(GroupLayout layout, layout_group(specs[g], int(g), worlds[w]));
      for (int r = 0; r < worlds[w]; ++r) {
        std::vector<float> shard(layout.shard_numel);
        init_shard(layout, r, 7, shard.data());
        totals[w] += train::master_checksum_part(layout, r, shard);
      }
    }
  }
  EXPECT_EQ(totals[0], totals[1]);
  EXPECT_EQ(totals[0], totals[2]);
  // One flipped bit anywhere changes it.
  STRATA_ASSERT_OK_AND_ASSIGN(GroupLayout layout, layout_group(specs[1], 1, 1));
  std::vector<float> shard(layout.shard_numel);
  init_shard(layout, 0, 7, shard.data());
  const uint64_t before = train::master_checksum_part(layout, 0, shard);
  uint32_t bits;
  std::memcpy(&bits, &shard[100], 4);
  bits ^= 1u;
  std::memcpy(&shard[100], &bits, 4);
  EXPECT_NE(train::master_checksum_part(layout, 0, shard), before);
  EXPECT_EQ(train::checksum_hex(0x1234), "0000000000001234");
}

TEST(GptModelTest, ChecksumPartsOfAShardsChunksAddUpToTheShards) {
  const auto specs = gpt_group_specs(odd_config());
  STRATA_ASSERT_OK_AND_ASSIGN(GroupLayout layout, layout_group(specs[1], 1, 3));
  std::vector<float> shard(layout.shard_numel);
  init_shard(layout, 0, 7, shard.data());
  const std::span<const float> all(shard);
  const size_t cut = layout.numel / 3 + 1;  // among the weights, not the padding
  EXPECT_EQ(train::master_checksum_part(layout, 0, all.first(cut)) + train::master_checksum_part(layout, 0, all.subspan(cut), cut),
            train::master_checksum_part(layout, 0, all));
  EXPECT_NE(train::master_checksum_part(layout, 0, all.subspan(cut), cut), train::master_checksum_part(layout, 0, all.subspan(cut)));
}


// Vocabulary 301: padded to 384 rows inside the model; with 64-row chunks, wte is 5 groups
// (4 x 64 rows, then 45 real rows + 83 padding rows).
GptConfig vocab_301_config() { return GptConfig{2, 3, 18, 13, 301}; }

GptModelOptions vocab_301_options(size_t chunk_rows) {
  GptModelOptions options = odd_model_options(ActivationCheckpointing::kDevice);
  options.config = vocab_301_config();
  options.vocab_chunk_bytes = chunk_rows * size_t(options.config.n_embd) * 4;
  return options;
}

// Every group's captured gradient by group name, and wte's rows (real ones only) put
// together from its chunks; `padding_gradient` gets the largest |value| any padding row had.
std::map<std::string, std::vector<float>> gradients_by_name(const SingleRank& rank, float* padding_gradient) {
  std::map<std::string, std::vector<float>> out;
  const lm::VocabChunks& chunks = rank.model->activation_plan().chunks;
  const size_t C = size_t(rank.model->options().config.n_embd);
  for (const auto& [g, values] : rank.model->captured_gradients()) {
    const GroupLayout& layout = rank.engine->layout(g);
    const int64_t chunk = lm::vocab_chunk_of_group(layout.name, "wte");
    if (chunk < 0) {
      out[layout.name] = values;
      continue;
    }
    std::vector<float>& wte = out["wte"];
    wte.resize(size_t(chunks.vocab) * C);
    const size_t real = size_t(chunks.real_rows(chunk)) * C;
    std::copy_n(values.begin(), real, wte.begin() + std::ptrdiff_t(size_t(chunks.first_row(chunk)) * C));
    for (size_t i = real; i < size_t(chunks.rows(chunk)) * C; ++i) *padding_gradient = std::max(*padding_gradient, std::abs(values[i]));
  }
  return out;
}

TEST(GptModelTest, WteInChunksOf64RowsMatchesOneChunkToFp32RoundingAtVocabulary301) {
  testing::TempDir dir;
  const std::string path = (dir.path() / "model.safetensors").string();
  STRATA_ASSERT_OK(write_gpt2_file(path, vocab_301_config()));
  STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsReader reader, SafetensorsReader::open(path));
  const Batch batch = make_batch(vocab_301_config(), 3, 11, 23, /*with_ignored=*/true);
  const Batch eval = make_batch(vocab_301_config(), 2, 11, 24, /*with_ignored=*/false);
  SingleRank chunked, whole;
  STRATA_ASSERT_OK(chunked.init(vocab_301_options(64), fp32_engine_options()));
  STRATA_ASSERT_OK(whole.init(vocab_301_options(4096), fp32_engine_options()));
  ASSERT_EQ(chunked.model->groups().chunks, 5);
  ASSERT_EQ(whole.model->groups().chunks, 1);
  EXPECT_EQ(chunked.engine->layout(4).tensors[0].shape, (std::vector<int64_t>{128, 18}));
  EXPECT_EQ(whole.engine->layout(0).tensors[0].shape, (std::vector<int64_t>{384, 18}));
  // The same file fills the real rows of either chunking.
  STRATA_ASSERT_OK(load_gpt2_weights(*chunked.engine, 0, reader, vocab_301_config()));
  STRATA_ASSERT_OK(load_gpt2_weights(*whole.engine, 0, reader, vocab_301_config()));
  STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses a, chunked.gradients(batch, 3, &eval, 2));
  STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses b, whole.gradients(batch, 3, &eval, 2));
  EXPECT_EQ(a.train_tokens, b.train_tokens);
  EXPECT_NEAR(a.train_loss_sum, b.train_loss_sum, 2e-6 * std::abs(b.train_loss_sum));
  EXPECT_NEAR(a.eval_loss_sum, b.eval_loss_sum, 2e-6 * std::abs(b.eval_loss_sum));
  float padding_a = 0.0f, padding_b = 0.0f;
  const auto grads_a = gradients_by_name(chunked, &padding_a);
  const auto grads_b = gradients_by_name(whole, &padding_b);
  EXPECT_EQ(padding_a, 0.0f);
  EXPECT_EQ(padding_b, 0.0f);
  ASSERT_EQ(grads_a.size(), grads_b.size());
  for (const auto& [name, want] : grads_b) {
    const std::vector<float>& got = grads_a.at(name);
    ASSERT_EQ(got.size(), want.size()) << name;
    float scale = 0.0f, worst = 0.0f;
    for (size_t i = 0; i < want.size(); ++i) {
      scale = std::max(scale, std::abs(want[i]));
      worst = std::max(worst, std::abs(got[i] - want[i]));
    }
    EXPECT_LE(worst, 1e-5f * scale) << name;
  }
}

TEST(GptModelTest, PaddedVocabularyRowsStartZeroTakeNoSoftmaxMassAndStayZero) {
  const Batch batch = make_batch(vocab_301_config(), 3, 11, 31, /*with_ignored=*/false);
  SingleRank rank;
  STRATA_ASSERT_OK(rank.init(vocab_301_options(64), fp32_engine_options()));
  const int last = rank.model->groups().wte(4);
  const size_t C = 18, real = 45 * C, rows = 128 * C;
  std::vector<float> table(rank.engine->layout(last).numel);
  STRATA_ASSERT_OK(rank.master(last, table));
  for (size_t i = real; i < rows; ++i) ASSERT_EQ(table[i], 0.0f) << "padding element " << i - real << " initialized";
  EXPECT_NE(table[real - 1], 0.0f);
  STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses zero_padding, rank.gradients(batch, 3));
  // Large values in the padding rows: a softmax that saw them would put almost all its mass there.
  std::vector<float> shard(rank.engine->layout(last).shard_numel, 0.0f);
  std::copy(table.begin(), table.end(), shard.begin());
  for (size_t i = real; i < rows; ++i) shard[i] = 50.0f;
  STRATA_ASSERT_OK(rank.engine->write_state_shard(last, Engine::StateKind::kMaster, shard));
  STRATA_ASSERT_OK(rank.engine->refresh_parameters());
  STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses large_padding, rank.gradients(batch, 3));
  EXPECT_EQ(large_padding.train_loss_sum, zero_padding.train_loss_sum);
  const std::vector<float>& grad = rank.model->captured_gradients().at(last);
  for (size_t i = real; i < rows; ++i) ASSERT_EQ(grad[i], 0.0f) << "padding element " << i - real << " got a gradient";
  // Zero padding again, and real updates (AdamW, learning rate 0.1): the padding stays zero.
  for (size_t i = real; i < rows; ++i) shard[i] = 0.0f;
  STRATA_ASSERT_OK(rank.engine->write_state_shard(last, Engine::StateKind::kMaster, shard));
  STRATA_ASSERT_OK(rank.engine->refresh_parameters());
  for (int step = 0; step < 2; ++step) {
    STRATA_ASSERT_OK(rank.engine->begin_step(0.1));
    const TokenBatch train{batch.inputs.data(), batch.targets.data(), 3};
    STRATA_ASSERT_OK_AND_ASSIGN(MicroBatchLosses losses, rank.model->run_micro_batch(&train, nullptr, 1.0f / 33.0f));
    STRATA_ASSERT_OK(rank.engine->step(losses.train_loss_sum / 33.0).status());
  }
  STRATA_ASSERT_OK(rank.engine->finish());
  std::vector<float> after(rank.engine->layout(last).numel);
  STRATA_ASSERT_OK(rank.master(last, after));
  for (size_t i = real; i < rows; ++i) ASSERT_EQ(after[i], 0.0f) << "padding element " << i - real << " moved";
  EXPECT_NE(after[0], table[0]);  // the real rows did train
}

}  // namespace
}  // namespace strata::gpt
