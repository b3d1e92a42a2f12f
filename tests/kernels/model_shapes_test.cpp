// The CUDA ops against their CPU twins at the shapes of real models, forward and
// backward: GPT-2 XL (T = 1024, C = 1600, 25 heads of 64, MLP 6400, V = 50257) and
// Llama-3.2-1B (T = 1024, C = 2048, 32 query / 8 KV heads of 64, MLP 8192,
// V = 128256), plus attention with head_dim 128 (32 / 8 heads, Llama-3-8B's). The tiny,
// odd shapes of transformer_ops_test.cpp and rmsnorm_rope_swiglu_gqa_test.cpp check edges; these check
// the tiling, grid and workspace sizes a model really uses (the attention kernels' 32
// query tiles, cuBLASLt's algorithms for the LM head).
//
// Each op runs on a CudaDevice (fp32 and bf16) and on a CpuDevice in fp32 (the twin) on
// the same inputs: random, rounded to the CUDA run's dtype first, so only the ops' own
// arithmetic differs. Judged by the relative error ||got - want|| / ||want|| over each
// output tensor:
// - fp32 runs, 5e-5: both sides sum products of fp32 values in different orders
//   (cuBLAS vs OpenBLAS blockings, tiles vs rows); the relative rounding error of a sum
//   of n random terms is about u sqrt(n) (u = 6e-8), 5e-6 for the longest reductions
//   here (6400, 8192 terms), so 5e-5 leaves a factor of ten and still catches any
//   indexing or masking error (those give errors of order 1).
// - bf16 runs: outputs stored in bf16 are rounded once more (relative error up to 2^-9
//   per element, about 2.3e-3 in the norm), gradients of bf16 activations pass through
//   several such roundings: 2e-2, as the tiny-shape tests; fp32 outputs of bf16 runs
//   (dweight, dbias, lse, statistics) 1e-2.
// The GPU side runs twice and must give the same bits. All tests skip with the reason
// where no GPU is visible. Label gpu_only: they allocate
// gigabytes and run seconds of CPU twins, which a sanitizer would make minutes.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/core/gpu.h"
#include "kernels/gqa_attention.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "kernels/transformer_ops.h"
#include "tests/kernels/op_test_harness.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

using kernels::GradOptions;
using kernels::GradWrite;
using test_ops::Harness;
using test_ops::HarnessOptions;
using test_ops::random_vector;
using test_ops::relative_error;
using test_ops::rounded;
using test_ops::Target;

using Outputs = std::vector<std::vector<double>>;
// Runs an op on a harness's device from host inputs and returns its outputs.
using OpRun = std::function<Outputs(Harness&)>;

constexpr double kFp32Tolerance = 5e-5;

// Which tolerance an output is judged by.
enum class OutputKind : uint8_t {
  kActivation,  // stored in the run's dtype
  kFp32,        // fp32 whatever the dtype (parameter gradients, statistics)
};

class ModelShapesTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no GPU: " << discover_gpus().reason;
    const HarnessOptions options{
        .cpu_budget_bytes = size_t{8} << 30, .cpu_threads = 0, .cuda_budget_bytes = size_t{8} << 30};
    gpu_ = std::make_unique<Harness>(Target{DeviceKind::kCuda, GetParam()}, options);
    cpu_ = std::make_unique<Harness>(Target{DeviceKind::kCpu, DType::kFloat32}, options);
  }

  DType dtype() const { return GetParam(); }
  // Random inputs as both devices will see them.
  std::vector<double> input(size_t count, double scale = 1.0) { return rounded(random_vector(count, rng_, scale), dtype()); }

  double tolerance(OutputKind kind) const {
    if (dtype() == DType::kFloat32) return kFp32Tolerance;
    return kind == OutputKind::kActivation ? 2e-2 : 1e-2;
  }

  // Also runs the GPU side twice: every op promises bit-identical results run to run
  // (no float atomics; the attention's dk/dv summed per KV tile in a fixed order).
  void expect_twins_agree(const std::string& what, const OpRun& run, const std::vector<OutputKind>& kinds) {
    const Outputs got = run(*gpu_);
    EXPECT_TRUE(run(*gpu_) == got) << what << ": a second GPU run differs";
    const Outputs want = run(*cpu_);
    ASSERT_EQ(got.size(), kinds.size());
    for (size_t i = 0; i < kinds.size(); ++i) {
      EXPECT_LE(relative_error(got[i], want[i]), tolerance(kinds[i])) << what << ", output " << i;
    }
  }

  static DeviceBuffer workspace(Harness& h, size_t bytes) {
    if (bytes == 0) return {};
    auto buffer = h.device().allocate(bytes, "workspace");
    STRATA_CHECK_OK(buffer);
    return std::move(buffer).value();
  }

  std::mt19937 rng_{1024};
  std::unique_ptr<Harness> gpu_;
  std::unique_ptr<Harness> cpu_;
};

// Attention ---------------------------------------------------------------------------

struct AttentionModel {
  const char* name;
  size_t heads;
  size_t kv_heads;
  size_t head_dim;
};

TEST_P(ModelShapesTest, GroupedQueryAttentionAtLlamaShapes) {
  constexpr size_t kSeq = 1024;
  for (const AttentionModel& model : {AttentionModel{"Llama-3.2-1B", 32, 8, 64}, AttentionModel{"head_dim 128", 32, 8, 128}}) {
    const kernels::GqaAttentionShape shape{
        .batch = 1, .seq_len = kSeq, .heads = model.heads, .kv_heads = model.kv_heads, .head_dim = model.head_dim};
    const size_t q_count = kSeq * model.heads * model.head_dim;
    const size_t kv_count = kSeq * model.kv_heads * model.head_dim;
    const auto q = input(q_count);
    const auto k = input(kv_count);
    const auto v = input(kv_count);
    const auto dout = input(q_count);
    expect_twins_agree(
        std::string("gqa attention, ") + model.name,
        [&](Harness& h) -> Outputs {
          const size_t bytes = kernels::gqa_attention_workspace_bytes(shape, h.dtype(), h.device().kind());
          auto scratch = workspace(h, bytes);
          auto d_q = h.put(q);
          auto d_k = h.put(k);
          auto d_v = h.put(v);
          auto d_dout = h.put(dout);
          auto out = h.nans(q_count);
          auto lse = h.nans(kSeq * model.heads, DType::kFloat32);
          auto dq = h.nans(q_count);
          auto dk = h.nans(kv_count);
          auto dv = h.nans(kv_count);
          STRATA_CHECK_OK(kernels::gqa_attention_forward(h.stream(), h.blas(), shape, h.dtype(), d_q.data(), d_k.data(),
                                                         d_v.data(), out.data(), lse.as<float>(), scratch.data(), bytes));
          STRATA_CHECK_OK(kernels::gqa_attention_backward(h.stream(), h.blas(), shape, h.dtype(), d_dout.data(),
                                                          d_q.data(), d_k.data(), d_v.data(), lse.as<float>(), dq.data(),
                                                          dk.data(), dv.data(), scratch.data(), bytes,
                                                          GradWrite::kOverwrite));
          return {h.get(out, q_count), h.get(lse, kSeq * model.heads, DType::kFloat32), h.get(dq, q_count),
                  h.get(dk, kv_count), h.get(dv, kv_count)};
        },
        {OutputKind::kActivation, OutputKind::kFp32, OutputKind::kActivation, OutputKind::kActivation,
         OutputKind::kActivation});
  }
}

TEST_P(ModelShapesTest, FusedQkvAttentionAtGpt2XlShape) {
  const kernels::AttentionShape shape{.batch = 1, .seq_len = 1024, .heads = 25, .head_dim = 64};
  const size_t channels = shape.heads * shape.head_dim;
  const size_t rows = shape.batch * shape.seq_len;
  const auto qkv = input(rows * 3 * channels);
  const auto dout = input(rows * channels);
  expect_twins_agree(
      "attention, GPT-2 XL",
      [&](Harness& h) -> Outputs {
        const size_t bytes = kernels::attention_workspace_bytes(shape, h.dtype(), h.device().kind());
        auto scratch = workspace(h, bytes);
        auto d_qkv = h.put(qkv);
        auto d_dout = h.put(dout);
        auto out = h.nans(rows * channels);
        auto lse = h.nans(rows * shape.heads, DType::kFloat32);
        auto dqkv = h.nans(rows * 3 * channels);
        STRATA_CHECK_OK(kernels::attention_forward(h.stream(), h.blas(), shape, h.dtype(), d_qkv.data(), out.data(),
                                                   lse.as<float>(), scratch.data(), bytes));
        STRATA_CHECK_OK(kernels::attention_backward(h.stream(), h.blas(), shape, h.dtype(), d_dout.data(), d_qkv.data(),
                                                    lse.as<float>(), dqkv.data(), scratch.data(), bytes,
                                                    GradWrite::kOverwrite));
        return {h.get(out, rows * channels), h.get(dqkv, rows * 3 * channels)};
      },
      {OutputKind::kActivation, OutputKind::kActivation});
}

// Matrix products ---------------------------------------------------------------------

struct MatmulCase {
  const char* name;
  kernels::MatmulShape shape;
  bool bias;
  GradWrite param_grad;  // kOverwrite takes the bias-gradient epilogue, kAccumulate the column sums
};

TEST_P(ModelShapesTest, MatmulAtModelShapes) {
  using kernels::WeightLayout;
  const MatmulCase cases[] = {
      {"GPT-2 XL c_fc", {1024, 1600, 6400, WeightLayout::kInOut}, true, GradWrite::kOverwrite},
      {"GPT-2 XL c_proj", {1024, 6400, 1600, WeightLayout::kInOut}, true, GradWrite::kAccumulate},
      {"GPT-2 XL lm_head (128 rows)", {128, 1600, 50257, WeightLayout::kOutIn}, false, GradWrite::kOverwrite},
      {"Llama-1B q_proj", {1024, 2048, 2048, WeightLayout::kOutIn}, false, GradWrite::kOverwrite},
      {"Llama-1B down_proj", {1024, 8192, 2048, WeightLayout::kOutIn}, false, GradWrite::kOverwrite},
      {"Qwen2-style biased k_proj", {1024, 2048, 512, WeightLayout::kOutIn}, true, GradWrite::kOverwrite},
      {"Llama-1B lm_head (64 rows)", {64, 2048, 128256, WeightLayout::kOutIn}, false, GradWrite::kOverwrite},
  };
  for (const MatmulCase& c : cases) {
    const auto& s = c.shape;
    const auto x = input(s.rows * s.in_features);
    const auto weight = input(s.in_features * s.out_features, 0.02);
    const auto bias = c.bias ? input(s.out_features) : std::vector<double>{};
    const auto dy = input(s.rows * s.out_features);
    const auto start = rounded(random_vector(s.in_features * s.out_features, rng_), DType::kFloat32);
    const auto start_bias = rounded(random_vector(s.out_features, rng_), DType::kFloat32);
    const bool accumulate = c.param_grad == GradWrite::kAccumulate;
    expect_twins_agree(
        c.name,
        [&](Harness& h) -> Outputs {
          auto d_x = h.put(x);
          auto d_w = h.put(weight);
          DeviceBuffer d_b = c.bias ? h.put(bias) : DeviceBuffer{};
          auto d_dy = h.put(dy);
          auto y = h.nans(s.rows * s.out_features);
          auto dx = h.nans(s.rows * s.in_features);
          auto dw = accumulate ? h.put(start, DType::kFloat32) : h.nans(start.size(), DType::kFloat32);
          DeviceBuffer db;
          if (c.bias) db = accumulate ? h.put(start_bias, DType::kFloat32) : h.nans(s.out_features, DType::kFloat32);
          STRATA_CHECK_OK(kernels::matmul_forward(h.stream(), h.blas(), s, h.dtype(), d_x.data(), d_w.data(),
                                                  c.bias ? d_b.data() : nullptr, y.data()));
          STRATA_CHECK_OK(kernels::matmul_backward(h.stream(), h.blas(), s, h.dtype(), d_dy.data(), d_x.data(),
                                                   d_w.data(), dx.data(), dw.as<float>(),
                                                   c.bias ? db.as<float>() : nullptr,
                                                   GradOptions{.input_grad = GradWrite::kOverwrite,
                                                               .param_grad = c.param_grad}));
          Outputs outputs{h.get(y, s.rows * s.out_features), h.get(dx, s.rows * s.in_features),
                          h.get(dw, start.size(), DType::kFloat32)};
          outputs.push_back(c.bias ? h.get(db, s.out_features, DType::kFloat32) : std::vector<double>{});
          return outputs;
        },
        {OutputKind::kActivation, OutputKind::kActivation, OutputKind::kFp32, OutputKind::kFp32});
  }
}

// GPT-2 XL's MLP: c_fc with its GELU, and c_proj's input gradient through the GELU. In bf16
// both must take cuBLASLt's GELU epilogues (the fused path this shape exists for); in
// fp32 neither may (kernels/transformer_ops.h says why). The CPU twin is the composition
// of matmul, gelu and column sums.
TEST_P(ModelShapesTest, FusedMatmulGeluAtGpt2XlMlpShape) {
  const kernels::MatmulShape fc{1024, 1600, 6400, kernels::WeightLayout::kInOut};
  const kernels::MatmulShape proj{1024, 6400, 1600, kernels::WeightLayout::kInOut};
  const auto x = input(fc.rows * fc.in_features);
  const auto fc_weight = input(fc.in_features * fc.out_features, 0.02);
  const auto fc_bias = input(fc.out_features, 0.1);
  const auto dy = input(proj.rows * proj.out_features);
  const auto proj_weight = input(proj.in_features * proj.out_features, 0.02);
  const auto pre = input(proj.rows * proj.in_features, 2.0);
  const size_t wide = fc.rows * fc.out_features;
  const uint64_t expected_fused = dtype() == DType::kBFloat16 ? 2 : 0;
  expect_twins_agree(
      "matmul + bias + gelu and its backward, GPT-2 XL MLP",
      [&](Harness& h) -> Outputs {
        auto d_x = h.put(x), d_fc_w = h.put(fc_weight), d_fc_b = h.put(fc_bias);
        auto d_dy = h.put(dy), d_proj_w = h.put(proj_weight), d_pre = h.put(pre);
        auto pre_out = h.nans(wide), y = h.nans(wide), dpre = h.nans(wide);
        auto dbias = h.nans(fc.out_features, DType::kFloat32);
        const kernels::EpilogueCounts before = h.blas().epilogue_counts();
        STRATA_CHECK_OK(kernels::matmul_bias_gelu_forward(h.stream(), h.blas(), fc, h.dtype(), d_x.data(), d_fc_w.data(),
                                                          d_fc_b.data(), pre_out.data(), y.data()));
        STRATA_CHECK_OK(kernels::gelu_matmul_backward(h.stream(), h.blas(), proj, h.dtype(), d_dy.data(), d_proj_w.data(),
                                                      d_pre.data(), dpre.data(), dbias.as<float>(),
                                                      GradWrite::kOverwrite));
        Outputs outputs{h.get(pre_out, wide), h.get(y, wide), h.get(dpre, wide),
                        h.get(dbias, fc.out_features, DType::kFloat32)};
        if (h.device().kind() == DeviceKind::kCuda) {
          EXPECT_EQ(h.blas().epilogue_counts().gelu_fused - before.gelu_fused, expected_fused)
              << "GELU epilogue GEMMs that ran fused (forward + backward) in " << dtype_name(dtype());
        }
        return outputs;
      },
      {OutputKind::kActivation, OutputKind::kActivation, OutputKind::kActivation, OutputKind::kFp32});
}

// Norms, activations, rotary embeddings -------------------------------------------------

TEST_P(ModelShapesTest, LayerNormAndRmsNormAtModelShapes) {
  const kernels::LayerNormShape ln{.rows = 1024, .channels = 1600, .epsilon = 1e-5f};
  const auto x = input(ln.rows * ln.channels, 2.0);
  const auto gamma = input(ln.channels);
  const auto beta = input(ln.channels);
  const auto dy = input(ln.rows * ln.channels);
  expect_twins_agree(
      "layernorm, GPT-2 XL",
      [&](Harness& h) -> Outputs {
        auto d_x = h.put(x), d_g = h.put(gamma), d_b = h.put(beta), d_dy = h.put(dy);
        auto y = h.nans(x.size()), dx = h.nans(x.size());
        auto mean = h.nans(ln.rows, DType::kFloat32), rstd = h.nans(ln.rows, DType::kFloat32);
        auto dg = h.nans(ln.channels, DType::kFloat32), db = h.nans(ln.channels, DType::kFloat32);
        STRATA_CHECK_OK(kernels::layernorm_forward(h.stream(), ln, h.dtype(), d_x.data(), d_g.data(), d_b.data(), y.data(),
                                                   mean.as<float>(), rstd.as<float>()));
        STRATA_CHECK_OK(kernels::layernorm_backward(h.stream(), ln, h.dtype(), d_dy.data(), d_x.data(), d_g.data(),
                                                    mean.as<float>(), rstd.as<float>(), dx.data(), dg.as<float>(),
                                                    db.as<float>(), GradOptions{}));
        return {h.get(y, x.size()), h.get(dx, x.size()), h.get(dg, ln.channels, DType::kFloat32),
                h.get(db, ln.channels, DType::kFloat32)};
      },
      {OutputKind::kActivation, OutputKind::kActivation, OutputKind::kFp32, OutputKind::kFp32});

  const kernels::RmsNormShape rms{.rows = 1024, .channels = 2048, .epsilon = 1e-5f};
  const auto rx = input(rms.rows * rms.channels, 2.0);
  const auto rgamma = input(rms.channels);
  const auto rdy = input(rms.rows * rms.channels);
  expect_twins_agree(
      "rmsnorm, Llama-3.2-1B",
      [&](Harness& h) -> Outputs {
        auto d_x = h.put(rx), d_g = h.put(rgamma), d_dy = h.put(rdy);
        auto y = h.nans(rx.size()), dx = h.nans(rx.size());
        auto rstd = h.nans(rms.rows, DType::kFloat32), dg = h.nans(rms.channels, DType::kFloat32);
        STRATA_CHECK_OK(
            kernels::rmsnorm_forward(h.stream(), rms, h.dtype(), d_x.data(), d_g.data(), y.data(), rstd.as<float>()));
        STRATA_CHECK_OK(kernels::rmsnorm_backward(h.stream(), rms, h.dtype(), d_dy.data(), d_x.data(), d_g.data(),
                                                  rstd.as<float>(), dx.data(), dg.as<float>(), GradOptions{}));
        return {h.get(y, rx.size()), h.get(dx, rx.size()), h.get(dg, rms.channels, DType::kFloat32)};
      },
      {OutputKind::kActivation, OutputKind::kActivation, OutputKind::kFp32});
}

TEST_P(ModelShapesTest, GeluSwigluAndRopeAtModelShapes) {
  const size_t gelu_count = 1024 * 6400;  // GPT-2 XL's MLP
  const auto gx = input(gelu_count, 2.0);
  const auto gdy = input(gelu_count);
  expect_twins_agree(
      "gelu, GPT-2 XL",
      [&](Harness& h) -> Outputs {
        auto d_x = h.put(gx), d_dy = h.put(gdy), y = h.nans(gelu_count), dx = h.nans(gelu_count);
        STRATA_CHECK_OK(kernels::gelu_forward(h.stream(), h.dtype(), d_x.data(), y.data(), gelu_count));
        STRATA_CHECK_OK(
            kernels::gelu_backward(h.stream(), h.dtype(), d_dy.data(), d_x.data(), dx.data(), gelu_count, GradWrite::kOverwrite));
        return {h.get(y, gelu_count), h.get(dx, gelu_count)};
      },
      {OutputKind::kActivation, OutputKind::kActivation});

  const size_t swiglu_count = 1024 * 8192;  // Llama-3.2-1B's MLP
  const auto gate = input(swiglu_count, 2.0);
  const auto up = input(swiglu_count);
  const auto sdy = input(swiglu_count);
  expect_twins_agree(
      "swiglu, Llama-3.2-1B",
      [&](Harness& h) -> Outputs {
        auto d_gate = h.put(gate), d_up = h.put(up), d_dy = h.put(sdy);
        auto out = h.nans(swiglu_count), dgate = h.nans(swiglu_count), dup = h.nans(swiglu_count);
        STRATA_CHECK_OK(kernels::swiglu_forward(h.stream(), h.dtype(), d_gate.data(), d_up.data(), out.data(), swiglu_count));
        STRATA_CHECK_OK(kernels::swiglu_backward(h.stream(), h.dtype(), d_dy.data(), d_gate.data(), d_up.data(),
                                                 dgate.data(), dup.data(), swiglu_count, GradWrite::kOverwrite));
        return {h.get(out, swiglu_count), h.get(dgate, swiglu_count), h.get(dup, swiglu_count)};
      },
      {OutputKind::kActivation, OutputKind::kActivation, OutputKind::kActivation});

  // RoPE on q of Llama-3.2-1B: 32 heads of 64, llama3 scaling, positions 0..1023.
  const kernels::RopeShape rope{.rows = 1024, .heads = 32, .head_dim = 64};
  auto inv_freq = kernels::rope_inverse_frequencies(
      rope.head_dim, 500000.0,
      kernels::RopeScaling{.kind = kernels::RopeScaling::Kind::kLlama3, .factor = 32.0, .low_freq_factor = 1.0,
                           .high_freq_factor = 4.0, .original_max_position_embeddings = 8192});
  STRATA_ASSERT_OK(inv_freq.status());
  std::vector<int32_t> positions(rope.rows);
  for (size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int32_t>(i);
  const std::vector<double> freqs(inv_freq->begin(), inv_freq->end());
  const size_t rope_count = rope.rows * rope.heads * rope.head_dim;
  const auto rx = input(rope_count);
  const auto rdy = input(rope_count);
  expect_twins_agree(
      "rope, Llama-3.2-1B",
      [&](Harness& h) -> Outputs {
        auto d_pos = h.put_ints(positions), d_freq = h.put(freqs, DType::kFloat32);
        auto d_x = h.put(rx), d_dy = h.put(rdy), y = h.nans(rope_count), dx = h.nans(rope_count);
        STRATA_CHECK_OK(kernels::rope_forward(h.stream(), rope, h.dtype(), d_pos.as<int32_t>(), d_freq.as<float>(),
                                              d_x.data(), y.data()));
        STRATA_CHECK_OK(kernels::rope_backward(h.stream(), rope, h.dtype(), d_pos.as<int32_t>(), d_freq.as<float>(),
                                               d_dy.data(), dx.data(), GradWrite::kOverwrite));
        return {h.get(y, rope_count), h.get(dx, rope_count)};
      },
      {OutputKind::kActivation, OutputKind::kActivation});
}

// Cross-entropy over the vocabularies -----------------------------------------------------

TEST_P(ModelShapesTest, CrossEntropyOverModelVocabularies) {
  struct Case {
    const char* name;
    size_t rows;
    size_t vocab;
  };
  for (const Case& c : {Case{"GPT-2", 1024, 50257}, Case{"Llama 3", 256, 128256}}) {
    const kernels::CrossEntropyShape shape{.rows = c.rows, .vocab_size = c.vocab, .ignore_index = -100};
    const auto logits = input(c.rows * c.vocab, 3.0);
    std::vector<int32_t> targets(c.rows);
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(c.vocab) - 1);
    for (auto& t : targets) t = token(rng_);
    targets[1] = -100;  // one ignored row
    const float grad_scale = 1.0f / static_cast<float>(c.rows - 1);
    expect_twins_agree(
        std::string("cross-entropy, ") + c.name,
        [&](Harness& h) -> Outputs {
          auto d_logits = h.put(logits), d_targets = h.put_ints(targets);
          auto losses = h.nans(c.rows, DType::kFloat32), lse = h.nans(c.rows, DType::kFloat32);
          auto mean = h.nans(1, DType::kFloat32), dlogits = h.nans(logits.size());
          STRATA_CHECK_OK(kernels::cross_entropy_forward(h.stream(), shape, h.dtype(), d_logits.data(),
                                                         d_targets.as<int32_t>(), losses.as<float>(), lse.as<float>(),
                                                         mean.as<float>()));
          STRATA_CHECK_OK(kernels::cross_entropy_backward(h.stream(), shape, h.dtype(), d_logits.data(),
                                                          d_targets.as<int32_t>(), lse.as<float>(), grad_scale,
                                                          dlogits.data(), GradWrite::kOverwrite));
          return {h.get(losses, c.rows, DType::kFloat32), h.get(mean, 1, DType::kFloat32),
                  h.get(dlogits, logits.size())};
        },
        {OutputKind::kFp32, OutputKind::kFp32, OutputKind::kActivation});
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ModelShapesTest, ::testing::Values(DType::kFloat32, DType::kBFloat16),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace strata
