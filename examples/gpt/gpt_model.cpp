#include "examples/gpt/gpt_model.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <iomanip>
#include <sstream>

#include "examples/lm/config_problems.h"
#include "examples/lm/model_memory.h"
#include "examples/lm/presets.h"
#include "examples/lm/pinned_block_inputs.h"
#include "examples/lm/transformer_layout.h"
#include "examples/lm/vocab_chunks.h"
#include "kernels/cast.h"
#include "kernels/transformer_ops.h"

namespace strata::gpt {
namespace {

using lm::bytes_text;
using lm::device_reservation;
using lm::kSubBufferAlignment;
using lm::round_up;

// Block tensor indices, in registration order.
enum BlockTensor : int {
  kLn1Weight, kLn1Bias, kAttnWeight, kAttnBias, kAttnProjWeight, kAttnProjBias,
  kLn2Weight, kLn2Bias, kFcWeight, kFcBias, kMlpProjWeight, kMlpProjBias, kBlockTensorCount
};

constexpr lm::Preset<GptConfig> kPresets[] = {
    {"tiny", {2, 2, 64, 64, 256}},
    {"small-demo", {4, 4, 128, 128, 256}},
    {"gpt2", {12, 12, 768, 1024, 50257}},
    {"gpt2-medium", {24, 16, 1024, 1024, 50257}},
    {"gpt2-large", {36, 20, 1280, 1024, 50257}},
    {"gpt2-xl", {48, 25, 1600, 1024, 50257}},
    {"gpt-2.7b", {32, 32, 2560, 2048, 50257}},
    {"gpt-6.7b", {32, 32, 4096, 2048, 50257}},
    {"gpt-13b", {40, 40, 5120, 2048, 50257}},
};

}  // namespace

// =====================================================================================
// Shapes, groups, names
// =====================================================================================

StatusOr<GptConfig> gpt_preset(std::string_view name) {
  return lm::find_preset<GptConfig>(kPresets, name, "model");
}

std::vector<std::string> gpt_preset_names() { return lm::preset_names<GptConfig>(kPresets); }

Status validate_gpt_config(const GptConfig& c) {
  lm::ConfigProblems problems;
  problems.all_positive({{"n_layer", c.n_layer}, {"n_head", c.n_head}, {"n_embd", c.n_embd}, {"n_ctx", c.n_ctx},
                         {"vocab_size", c.vocab_size}});
  if (c.n_head > 0 && c.n_embd > 0 && c.n_embd % c.n_head != 0)
    problems.add("n_embd (" + std::to_string(c.n_embd) + ") must be a multiple of n_head (" + std::to_string(c.n_head) + ")");
  problems.vocab_fits_token_ids(c.vocab_size);
  return problems.status("GPT config");
}

int64_t gpt_parameter_count(const GptConfig& c) {
  const int64_t C = c.n_embd;
  const int64_t block = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * 4 * C + 4 * C) + (4 * C * C + C);
  return c.vocab_size * C + c.n_ctx * C + c.n_layer * block + 2 * C;
}

std::string describe_gpt_config(const GptConfig& c) {
  std::ostringstream out;
  out << c.n_layer << " layers, " << c.n_head << " heads, " << c.n_embd << " wide, context " << c.n_ctx << ", vocabulary "
      << c.vocab_size << " (" << std::fixed << std::setprecision(2) << double(gpt_parameter_count(c)) / 1e6 << "M parameters)";
  return out.str();
}

lm::VocabChunks gpt_vocab_chunks(const GptConfig& c, size_t chunk_bytes) { return lm::make_vocab_chunks(c.vocab_size, c.n_embd, chunk_bytes); }

GptGroups gpt_groups(const GptConfig& c, size_t vocab_chunk_bytes) { return GptGroups{c.n_layer, gpt_vocab_chunks(c, vocab_chunk_bytes).count}; }

int gpt_group_count(const GptConfig& c, size_t vocab_chunk_bytes) { return gpt_groups(c, vocab_chunk_bytes).count(); }

std::vector<GroupSpec> gpt_group_specs(const GptConfig& c, size_t vocab_chunk_bytes) {
  const int64_t C = c.n_embd;
  const float std_dev = 0.02f;
  const float projection_std = 0.02f / std::sqrt(2.0f * static_cast<float>(c.n_layer));
  const lm::VocabChunks chunks = gpt_vocab_chunks(c, vocab_chunk_bytes);
  std::vector<GroupSpec> groups;
  for (int64_t k = 0; k < chunks.count; ++k)
    groups.push_back({"wte." + std::to_string(k), {lm::vocab_chunk_tensor(chunks, k, "weight", C, TensorInit::normal(std_dev))}});
  groups.push_back({"wpe", {{"wpe.weight", {c.n_ctx, C}, TensorInit::normal(std_dev), false}}});
  for (int64_t l = 0; l < c.n_layer; ++l) {
    GroupSpec block;
    block.name = "h." + std::to_string(l);
    block.tensors = {
        {"ln_1.weight", {C}, TensorInit::ones(), false},
        {"ln_1.bias", {C}, TensorInit::zeros(), false},
        {"attn.c_attn.weight", {C, 3 * C}, TensorInit::normal(std_dev), true},
        {"attn.c_attn.bias", {3 * C}, TensorInit::zeros(), false},
        {"attn.c_proj.weight", {C, C}, TensorInit::normal(projection_std), true},
        {"attn.c_proj.bias", {C}, TensorInit::zeros(), false},
        {"ln_2.weight", {C}, TensorInit::ones(), false},
        {"ln_2.bias", {C}, TensorInit::zeros(), false},
        {"mlp.c_fc.weight", {C, 4 * C}, TensorInit::normal(std_dev), true},
        {"mlp.c_fc.bias", {4 * C}, TensorInit::zeros(), false},
        {"mlp.c_proj.weight", {4 * C, C}, TensorInit::normal(projection_std), true},
        {"mlp.c_proj.bias", {C}, TensorInit::zeros(), false},
    };
    groups.push_back(std::move(block));
  }
  groups.push_back({"ln_f", {{"ln_f.weight", {C}, TensorInit::ones(), false}, {"ln_f.bias", {C}, TensorInit::zeros(), false}}});
  return groups;
}

std::vector<int> gpt_forward_order(const GptConfig& c, size_t vocab_chunk_bytes) {
  const GptGroups g = gpt_groups(c, vocab_chunk_bytes);
  std::vector<int> uses;
  for (int64_t k = 0; k < g.chunks; ++k) uses.push_back(g.wte(k));
  uses.push_back(g.wpe());
  for (int64_t l = 0; l < g.layers; ++l) uses.push_back(g.block(l));
  uses.push_back(g.final_norm());
  for (int64_t k = 0; k < g.chunks; ++k) uses.push_back(g.wte(k));  // head pass 1: the loss
  return uses;
}

std::vector<int> gpt_schedule(const GptConfig& c, size_t vocab_chunk_bytes) {
  const GptGroups g = gpt_groups(c, vocab_chunk_bytes);
  std::vector<int> uses = gpt_forward_order(c, vocab_chunk_bytes);
  for (int64_t k = 0; k < g.chunks; ++k) uses.push_back(g.wte(k));  // pass 2: the input gradient
  for (int64_t l = g.layers - 1; l >= 0; --l) uses.push_back(g.block(l));
  for (int64_t k = 0; k < g.chunks; ++k) uses.push_back(g.wte(k));  // pass 3: the weight gradient
  return uses;
}

std::string hf_tensor_name(std::string_view group_name, std::string_view tensor_name) {
  if (group_name.rfind("h.", 0) == 0) return std::string(group_name) + "." + std::string(tensor_name);
  if (lm::vocab_chunk_of_group(group_name, "wte") >= 0) return "wte.weight";
  return std::string(tensor_name);
}

std::string hf_tensor_name(const GroupLayout& group, const TensorLayout& tensor) { return hf_tensor_name(group.name, tensor.name); }

DType gpt_compute_dtype(DType param_dtype, DeviceKind device) { return lm::compute_dtype_for(param_dtype, device); }

// =====================================================================================
// The activation layout: one device buffer, carved into aligned sub-buffers
// =====================================================================================

namespace {

// Offsets (bytes) of one block's working activations.
struct ActsLayout {
  size_t ln1, mean1, rstd1, qkv, att, lse, x2, ln2, mean2, rstd2, fc, gelu;
};

// GPT-2's sub-buffers beyond the skeleton's (lm::TransformerLayout).
struct DeviceLayout : lm::TransformerLayout {
  int64_t rows = 0, eval_rows = 0, act_rows = 0;
  std::vector<ActsLayout> acts;     // per block (kOff; + one for evaluation) or one shared set
  size_t eval_resid = 0, eval_lnf = 0;
  size_t dresid = 0, grad_wide = 0, grad_narrow = 0;
  size_t lnf_out = 0, lnf_mean = 0, lnf_rstd = 0, lnf_gamma = 0;
  size_t param_scratch = 0, param_scratch_bytes = 0;
};

Status check_options(const GptModelOptions& options) {
  const GptConfig& c = options.config;
  STRATA_RETURN_IF_ERROR(validate_gpt_config(c));
  const int64_t T = options.seq_len > 0 ? options.seq_len : c.n_ctx;
  if (T > c.n_ctx) return InvalidArgumentError("seq_len (" + std::to_string(T) + ") is longer than n_ctx (" + std::to_string(c.n_ctx) + ")");
  return lm::check_transformer_run({"GPT model", "wte row", c.n_embd, options.batch, options.eval_batch, options.head_chunk_rows,
                                    options.vocab_chunk_bytes});
}

// One block's working activations for `rows` token rows of `seqs` sequences.
ActsLayout add_block_acts(DeviceLayout& d, size_t* line, size_t r, size_t seqs, size_t T, size_t C, size_t H, size_t cs) {
  ActsLayout a{};
  a.ln1 = d.add(r * C * cs, line);
  a.mean1 = d.add(r * 4, line);
  a.rstd1 = d.add(r * 4, line);
  a.qkv = d.add(r * 3 * C * cs, line);
  a.att = d.add(r * C * cs, line);
  a.lse = d.add(seqs * H * T * 4, line);
  a.x2 = d.add(r * C * cs, line);
  a.ln2 = d.add(r * C * cs, line);
  a.mean2 = d.add(r * 4, line);
  a.rstd2 = d.add(r * 4, line);
  a.fc = d.add(r * 4 * C * cs, line);
  a.gelu = d.add(r * 4 * C * cs, line);
  return a;
}

// One slot: a wte chunk with a zero row (the embedding's table, or the head's weight cast
// to the compute dtype) and, for parameters in another dtype, a gathered group cast to it.
Status add_param_scratch(DeviceLayout& d, const GptModelOptions& options, DType compute) {
  const size_t cs = dtype_size(compute);
  d.param_scratch_bytes = d.head.slot_bytes;
  if (options.param_dtype != compute) {
    for (const auto& spec : gpt_group_specs(options.config, options.vocab_chunk_bytes)) {
      STRATA_ASSIGN_OR_RETURN(GroupLayout layout, layout_group(spec, 0, 1));
      d.param_scratch_bytes = std::max(d.param_scratch_bytes, layout.numel * cs);
    }
  }
  d.param_scratch = d.add(d.param_scratch_bytes, d.line(options.param_dtype != compute
                                                            ? "one slot: a wte chunk + a zero row, or a gathered group cast to " +
                                                                  std::string(dtype_name(compute))
                                                            : "one slot: a wte chunk + a zero row"));
  return {};
}

StatusOr<DeviceLayout> make_layout(const GptModelOptions& options, DeviceKind kind) {
  STRATA_RETURN_IF_ERROR(check_options(options));
  const GptConfig& c = options.config;
  const int64_t T = options.seq_len > 0 ? options.seq_len : c.n_ctx;
  const DType compute = gpt_compute_dtype(options.param_dtype, kind);
  const size_t cs = dtype_size(compute);
  const size_t C = static_cast<size_t>(c.n_embd);
  const size_t L = static_cast<size_t>(c.n_layer), H = static_cast<size_t>(c.n_head);

  DeviceLayout d;
  d.rows = options.batch * T;
  d.eval_rows = options.eval_batch * T;
  // Evaluation runs in chunks of at most `batch` sequences, so it needs no larger
  // activations than training: only its own residual stream.
  d.act_rows = d.rows;
  const size_t rows = static_cast<size_t>(d.rows), erows = static_cast<size_t>(d.eval_rows), arows = static_cast<size_t>(d.act_rows);
  d.chunks = gpt_vocab_chunks(c, options.vocab_chunk_bytes);
  STRATA_RETURN_IF_ERROR(d.plan_head({c.n_embd, d.chunks, {d.rows, d.eval_rows}, options.head_chunk_rows, options.param_dtype, compute}));

  d.positions = d.add(std::max(rows, erows) * 4, d.line("position ids"));
  d.add_residual_stream(options.checkpointing, L, rows * C * cs, rows * C * cs);
  size_t* l_acts = nullptr;
  const size_t act_sets = d.block_activation_sets(options.checkpointing, L + (erows > 0 ? 1 : 0), &l_acts);
  const size_t T_size = static_cast<size_t>(T);
  for (size_t s = 0; s < act_sets; ++s) d.acts.push_back(add_block_acts(d, l_acts, arows, arows / T_size, T_size, C, H, cs));
  if (erows > 0) {
    size_t* l_eval = d.line("evaluation residual stream and its ln_f");
    d.eval_resid = d.add(erows * C * cs, l_eval);
    d.eval_lnf = d.add(erows * C * cs, l_eval);
  }
  size_t* l_grads = d.line("activation gradients");
  d.dresid = d.add(rows * C * cs, l_grads);
  d.grad_wide = d.add(rows * 4 * C * cs, l_grads);
  d.grad_narrow = d.add(rows * C * cs, l_grads);
  size_t* l_lnf = d.line("ln_f");
  d.lnf_out = d.add(rows * C * cs, l_lnf);
  d.lnf_mean = d.add(rows * 4, l_lnf);
  d.lnf_rstd = d.add(rows * 4, l_lnf);
  d.lnf_gamma = d.add(2 * C * cs, l_lnf);
  const kernels::AttentionShape train{static_cast<size_t>(options.batch), T_size, H, C / H};
  d.add_head_and_attention(kernels::attention_workspace_bytes(train, compute, kind));
  STRATA_RETURN_IF_ERROR(add_param_scratch(d, options, compute));
  return d;
}

}  // namespace

StatusOr<GptActivationPlan> plan_gpt_activations(const GptModelOptions& options, DeviceKind device) {
  return lm::plan_of_layout("GPT", make_layout(options, device), device);
}

// =====================================================================================
// The model
// =====================================================================================

struct GptModel::BlockActs {
  void *ln1, *qkv, *att, *x2, *ln2, *fc, *gelu;
  float *mean1, *rstd1, *lse, *mean2, *rstd2;
};

struct GptModel::Buffers : lm::ActivationArena {
  DeviceLayout layout;

  BlockActs acts(size_t set) const {
    const ActsLayout& a = layout.acts[set];
    return {at(a.ln1), at(a.qkv), at(a.att), at(a.x2), at(a.ln2), at(a.fc), at(a.gelu),
            static_cast<float*>(at(a.mean1)), static_cast<float*>(at(a.rstd1)), static_cast<float*>(at(a.lse)),
            static_cast<float*>(at(a.mean2)), static_cast<float*>(at(a.rstd2))};
  }
};

namespace {

GptModelOptions resolve_gpt_options(const GptModelOptions& options) {
  GptModelOptions resolved = options;
  if (resolved.seq_len == 0) resolved.seq_len = resolved.config.n_ctx;
  return resolved;
}

std::vector<GroupSpec> gpt_specs_of(const GptModelOptions& options, const lm::VocabChunks&) {
  return gpt_group_specs(options.config, options.vocab_chunk_bytes);
}

// The schedule is recorded on the first step (see the header).
std::vector<int> gpt_recorded_schedule(const GptModelOptions&, const lm::VocabChunks&) { return {}; }

}  // namespace

const lm::ModelRecipe<GptModelOptions> GptModel::kRecipe{"GPT model", resolve_gpt_options, plan_gpt_activations, gpt_specs_of,
                                                         gpt_recorded_schedule};

GptModel::GptModel(Engine& engine, const GptModelOptions& options, const GptActivationPlan& plan)
    : TransformerModel(engine, options, plan, GptGroups{options.config.n_layer, plan.chunks.count}, "GptModel") {}

Status GptModel::allocate_buffers() {
  Device& device = engine_.device();
  auto buffers = std::make_unique<Buffers>();
  STRATA_ASSIGN_OR_RETURN(buffers->layout, make_layout(options_, device.kind()));
  if (Status status = allocate_activations(buffers->layout, "GPT", *buffers); !status.ok()) return status;
  const DeviceLayout& d = buffers->layout;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<lm::VocabHead> vocab,
                          lm::VocabHead::create(engine_, *head_blas_, d.head_shape, buffers->at(d.vocab_head), buffers->at(d.param_scratch)));
  // wpe's rows: each token's place in its sequence.
  const size_t position_rows = static_cast<size_t>(std::max(d.rows, d.eval_rows)), T = static_cast<size_t>(options_.seq_len);
  std::vector<int32_t> positions(position_rows);
  for (size_t r = 0; r < position_rows; ++r) positions[r] = static_cast<int32_t>(r % T);
  STRATA_RETURN_IF_ERROR(device.copy_async(buffers->at(d.positions), positions.data(), position_rows * 4, CopyKind::kHostToDevice, engine_.compute_stream()));
  STRATA_RETURN_IF_ERROR(engine_.compute_stream().synchronize());
  buffers_ = keep_buffers(std::move(buffers), std::move(vocab));
  return {};
}

StatusOr<std::vector<const void*>> GptModel::params_of(int group, const GroupView& view) {
  if (view.dtype != options_.param_dtype)
    return FailedPreconditionError("GPT model: the engine gathers " + std::string(dtype_name(view.dtype)) +
                                   " parameters but the model was planned for " + std::string(dtype_name(options_.param_dtype)) +
                                   " (set GptModelOptions::param_dtype to EngineOptions::param_dtype)");
  const GroupLayout& layout = engine_.layout(group);
  std::vector<const void*> params;
  params.reserve(layout.tensors.size());
  const DType compute = plan_.compute_dtype;
  if (view.dtype == compute) {
    for (void* p : view.tensors) params.push_back(p);
    return params;
  }
  const DeviceLayout& d = buffers_->layout;
  if (layout.numel * dtype_size(compute) > d.param_scratch_bytes)
    return InternalError("GPT model: parameter scratch too small for group " + layout.name);
  void* scratch = buffers_->at(d.param_scratch);
  STRATA_RETURN_IF_ERROR(kernels::cast(engine_.compute_stream(), view.flat, view.dtype, scratch, compute, layout.numel));
  for (const auto& t : layout.tensors) params.push_back(static_cast<const char*>(scratch) + t.offset * dtype_size(compute));
  return params;
}

Status GptModel::block_forward(const std::vector<const void*>& p, const void* x, void* y, const BlockActs& a,
                               int64_t sequences) {
  Stream& stream = engine_.compute_stream();
  const DType dt = plan_.compute_dtype;
  const size_t C = static_cast<size_t>(options_.config.n_embd);
  const size_t T = static_cast<size_t>(options_.seq_len);
  const size_t rows = static_cast<size_t>(sequences) * T;
  const size_t H = static_cast<size_t>(options_.config.n_head);
  const kernels::LayerNormShape ln{rows, C, 1e-5f};
  const DeviceLayout& d = buffers_->layout;
  void* workspace = d.attention_workspace_bytes > 0 ? buffers_->at(d.attention_workspace) : nullptr;
  STRATA_RETURN_IF_ERROR(kernels::layernorm_forward(stream, ln, dt, x, p[kLn1Weight], p[kLn1Bias], a.ln1, a.mean1, a.rstd1));
  STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, *blas_, {rows, C, 3 * C, kernels::WeightLayout::kInOut}, dt, a.ln1,
                                                 p[kAttnWeight], p[kAttnBias], a.qkv));
  STRATA_RETURN_IF_ERROR(kernels::attention_forward(stream, *blas_, {static_cast<size_t>(sequences), T, H, C / H}, dt, a.qkv, a.att,
                                                    a.lse, workspace, d.attention_workspace_bytes));
  // The attention projection goes through x2 (free until the residual add).
  STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, *blas_, {rows, C, C, kernels::WeightLayout::kInOut}, dt, a.att,
                                                 p[kAttnProjWeight], p[kAttnProjBias], a.x2));
  STRATA_RETURN_IF_ERROR(kernels::residual_forward(stream, dt, x, a.x2, a.x2, rows * C));
  STRATA_RETURN_IF_ERROR(kernels::layernorm_forward(stream, ln, dt, a.x2, p[kLn2Weight], p[kLn2Bias], a.ln2, a.mean2, a.rstd2));
  // mlp.c_fc and its GELU in one op (one GEMM with a GELU epilogue where cuBLASLt has it).
  STRATA_RETURN_IF_ERROR(kernels::matmul_bias_gelu_forward(stream, *blas_, {rows, C, 4 * C, kernels::WeightLayout::kInOut}, dt,
                                                           a.ln2, p[kFcWeight], p[kFcBias], a.fc, a.gelu));
  if (y == nullptr) return {};  // a recompute: the block's output is not needed again
  // mlp.c_proj into y, then y += x2. y may be x (evaluation runs in place): x is dead here.
  STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, *blas_, {rows, 4 * C, C, kernels::WeightLayout::kInOut}, dt, a.gelu,
                                                 p[kMlpProjWeight], p[kMlpProjBias], y));
  return kernels::residual_forward(stream, dt, y, a.x2, y, rows * C);
}

Status GptModel::block_backward(const std::vector<const void*>& p, const std::vector<float*>& g, const void* x,
                                const BlockActs& a) {
  Stream& stream = engine_.compute_stream();
  const DType dt = plan_.compute_dtype;
  const size_t C = static_cast<size_t>(options_.config.n_embd);
  const size_t T = static_cast<size_t>(options_.seq_len);
  const size_t B = static_cast<size_t>(options_.batch);
  const size_t rows = B * T;
  const size_t H = static_cast<size_t>(options_.config.n_head);
  const kernels::LayerNormShape ln{rows, C, 1e-5f};
  const DeviceLayout& d = buffers_->layout;
  void* workspace = d.attention_workspace_bytes > 0 ? buffers_->at(d.attention_workspace) : nullptr;
  void* dresid = buffers_->at(d.dresid);      // in: d loss / d block output; out: d loss / d block input
  void* wide = buffers_->at(d.grad_wide);     // rows x 4C
  void* narrow = buffers_->at(d.grad_narrow); // rows x C
  const kernels::GradOptions fresh_dx{kernels::GradWrite::kOverwrite, kernels::GradWrite::kAccumulate};
  const kernels::GradOptions add_dx{kernels::GradWrite::kAccumulate, kernels::GradWrite::kAccumulate};
  // MLP.
  // mlp.c_proj's weight and bias gradients; its input gradient goes through the GELU in one
  // op (a GEMM with a GELU-gradient epilogue where cuBLASLt has it), which also gives
  // c_fc's bias gradient, the column sums of d(c_fc's output).
  const kernels::MatmulShape mlp_proj{rows, 4 * C, C, kernels::WeightLayout::kInOut};
  STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, *blas_, mlp_proj, dt, dresid, a.gelu, p[kMlpProjWeight], nullptr,
                                                  g[kMlpProjWeight], g[kMlpProjBias], fresh_dx));
  STRATA_RETURN_IF_ERROR(kernels::gelu_matmul_backward(stream, *blas_, mlp_proj, dt, dresid, p[kMlpProjWeight], a.fc, wide,
                                                       g[kFcBias], kernels::GradWrite::kAccumulate));
  STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, *blas_, {rows, C, 4 * C, kernels::WeightLayout::kInOut}, dt, wide, a.ln2,
                                                  p[kFcWeight], narrow, g[kFcWeight], nullptr, fresh_dx));
  // dresid += ln_2's input gradient: now d loss / d x2.
  STRATA_RETURN_IF_ERROR(kernels::layernorm_backward(stream, ln, dt, narrow, a.x2, p[kLn2Weight], a.mean2, a.rstd2, dresid,
                                                     g[kLn2Weight], g[kLn2Bias], add_dx));
  // Attention.
  STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, *blas_, {rows, C, C, kernels::WeightLayout::kInOut}, dt, dresid, a.att,
                                                  p[kAttnProjWeight], narrow, g[kAttnProjWeight], g[kAttnProjBias], fresh_dx));
  STRATA_RETURN_IF_ERROR(kernels::attention_backward(stream, *blas_, {B, T, H, C / H}, dt, narrow, a.qkv, a.lse, wide, workspace,
                                                     d.attention_workspace_bytes, kernels::GradWrite::kOverwrite));
  STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, *blas_, {rows, C, 3 * C, kernels::WeightLayout::kInOut}, dt, wide, a.ln1,
                                                  p[kAttnWeight], narrow, g[kAttnWeight], g[kAttnBias], fresh_dx));
  // dresid += ln_1's input gradient: d loss / d x.
  return kernels::layernorm_backward(stream, ln, dt, narrow, x, p[kLn1Weight], a.mean1, a.rstd1, dresid, g[kLn1Weight], g[kLn1Bias],
                                     add_dx);
}

// x_0 = wte's rows, chunk by chunk (lm::VocabHead::embed_chunk), plus wpe's rows (a
// lookup with the positions as tokens, added: the sum GPT-2's fused lookup makes, bit for
// bit). The evaluation pass (lm::VocabHead pass 1) builds its x_0 in eval_resid through
// eval_lnf, the training pass (pass 0) in resid[0] through grad_narrow.
Status GptModel::embed_forward(int64_t train_sequences, int64_t eval_sequences) {
  Buffers& b = *buffers_;
  const DeviceLayout& d = b.layout;
  Stream& stream = engine_.compute_stream();
  const GptConfig& c = options_.config;
  const size_t C = static_cast<size_t>(c.n_embd), T = static_cast<size_t>(options_.seq_len);
  struct PassTarget {
    int pass;
    int64_t sequences;
    void* x0;
    void* scratch;
  };
  const PassTarget targets[] = {{1, eval_sequences, eval_sequences > 0 ? b.at(d.eval_resid) : nullptr, eval_sequences > 0 ? b.at(d.eval_lnf) : nullptr},
                                {0, train_sequences, b.at(d.resid[0]), b.at(d.grad_narrow)}};
  for (int64_t k = 0; k < groups_.chunks; ++k) {
    STRATA_ASSIGN_OR_RETURN(GroupView view, engine_.gather(groups_.wte(k)));
    for (const PassTarget& t : targets)
      if (t.sequences > 0) STRATA_RETURN_IF_ERROR(vocab_->embed_chunk(t.pass, k, view, t.x0, t.scratch));
    STRATA_RETURN_IF_ERROR(engine_.release(groups_.wte(k)));
  }
  const int wpe = groups_.wpe();
  STRATA_ASSIGN_OR_RETURN(GroupView view, engine_.gather(wpe));
  STRATA_ASSIGN_OR_RETURN(std::vector<const void*> p, params_of(wpe, view));
  for (const PassTarget& t : targets) {
    if (t.sequences <= 0) continue;
    const kernels::EmbeddingShape shape{static_cast<size_t>(t.sequences), T, C, static_cast<size_t>(c.n_ctx), 0};
    STRATA_RETURN_IF_ERROR(kernels::embedding_forward(stream, shape, plan_.compute_dtype, static_cast<const int32_t*>(b.at(d.positions)), p[0],
                                                      nullptr, t.scratch));
    STRATA_RETURN_IF_ERROR(kernels::residual_forward(stream, plan_.compute_dtype, t.x0, t.scratch, t.x0, static_cast<size_t>(t.sequences) * T * C));
  }
  return engine_.release(wpe);
}

// The tied head: pass 1 over every chunk for both passes (eval_lnf, lnf_out), the full
// log-sum-exps, then (training) pass 2 for the input gradient into grad_narrow.
Status GptModel::head_forward(int64_t train_sequences, int64_t eval_sequences) {
  const DeviceLayout& d = buffers_->layout;
  for (int64_t k = 0; k < groups_.chunks; ++k) {
    STRATA_ASSIGN_OR_RETURN(GroupView view, engine_.gather(groups_.wte(k)));
    if (eval_sequences > 0) STRATA_RETURN_IF_ERROR(vocab_->head_loss_chunk(1, k, view, buffers_->at(d.eval_lnf)));
    if (train_sequences > 0) STRATA_RETURN_IF_ERROR(vocab_->head_loss_chunk(0, k, view, buffers_->at(d.lnf_out)));
    STRATA_RETURN_IF_ERROR(engine_.release(groups_.wte(k)));
  }
  if (eval_sequences > 0) STRATA_RETURN_IF_ERROR(vocab_->head_combine(1));
  if (train_sequences <= 0) return {};
  STRATA_RETURN_IF_ERROR(vocab_->head_combine(0));
  for (int64_t k = 0; k < groups_.chunks; ++k) {
    STRATA_ASSIGN_OR_RETURN(GroupView view, engine_.gather(groups_.wte(k)));
    STRATA_RETURN_IF_ERROR(vocab_->head_backward_chunk(k, view, buffers_->at(d.lnf_out), nullptr, buffers_->at(d.grad_narrow)));
    STRATA_RETURN_IF_ERROR(engine_.release(groups_.wte(k)));
  }
  return {};
}

// dresid is d loss / d x_0: each wte chunk's gradient is the head's (pass 3, gathered
// again) plus the embedding's; wpe's is the lookup's with the positions as tokens.
Status GptModel::embed_backward() {
  Buffers& b = *buffers_;
  const DeviceLayout& d = b.layout;
  // wte is tied to the head: each chunk's gradient also takes the head's.
  const auto wte = [this](int64_t k) { return groups_.wte(k); };
  if (Status status = vocab_chunks_backward(groups_.chunks, wte, b.at(d.lnf_out), b.at(d.dresid)); !status.ok())
    return status;
  const int wpe = groups_.wpe();
  STRATA_ASSIGN_OR_RETURN(GroupView grads, engine_.gradient_buffer(wpe));
  const GptConfig& c = options_.config;
  const kernels::EmbeddingShape shape{static_cast<size_t>(options_.batch), static_cast<size_t>(options_.seq_len), static_cast<size_t>(c.n_embd),
                                      static_cast<size_t>(c.n_ctx), 0};
  STRATA_RETURN_IF_ERROR(kernels::embedding_backward(engine_.compute_stream(), shape, plan_.compute_dtype, static_cast<const int32_t*>(b.at(d.positions)),
                                                     b.at(d.dresid), static_cast<float*>(grads.tensors[0]), nullptr,
                                                     kernels::GradWrite::kAccumulate));
  STRATA_RETURN_IF_ERROR(capture(wpe, grads));
  return engine_.grads_ready(wpe);
}

namespace {

// GPT-2's positions are places in the sequence: its learned table has no use for
// position ids that restart (packed documents), so a batch carrying such ids is refused
// rather than trained on positions it does not have.
Status check_default_positions(const TokenBatch* batch, size_t seq_len) {
  if (batch == nullptr || batch->positions == nullptr) return {};
  const size_t count = static_cast<size_t>(batch->sequences) * seq_len;
  for (size_t i = 0; i < count; ++i) {
    if (batch->positions[i] != static_cast<int32_t>(i % seq_len))
      return InvalidArgumentError("GPT model: token " + std::to_string(i % seq_len) + " of sequence " + std::to_string(i / seq_len) +
                                  " has position id " + std::to_string(batch->positions[i]) +
                                  "; GPT-2 takes positions 0 .. seq_len-1 only (use unpacked data, or a family with position ids)");
  }
  return {};
}

}  // namespace

// What one micro-batch's passes share: their shapes, and where each block's input lives.
struct GptModel::Pass {
  Buffers* b = nullptr;
  bool train = false;          // a training batch: forward and backward
  int64_t eval_sequences = 0;  // 0 = no evaluation batch
  int layers = 0;
  size_t seq_len = 0, width = 0, dtype_bytes = 0;  // T, C and the compute dtype's size
  size_t rows = 0;                                 // the training batch's rows (batch x T)
  size_t eval_rows = 0;
  bool pinned = false;    // block inputs saved to pinned host memory and brought back for backward
  bool keep_all = false;  // every block's activations kept (no checkpointing)

  size_t row_bytes() const { return width * dtype_bytes; }
  // Where block l's input (l = layers: the final residual) lives during forward.
  void* resid(int l) const { return b->at(b->layout.resid[static_cast<size_t>(pinned ? l % 2 : l)]); }
  BlockActs train_acts(int l) const { return b->acts(keep_all ? static_cast<size_t>(l) : 0); }
  BlockActs eval_acts() const { return b->acts(keep_all ? static_cast<size_t>(layers) : 0); }
  // The evaluation batch's residual rows, from sequence `sequence` on.
  void* eval_rows_at(int64_t sequence) const {
    return static_cast<char*>(b->at(b->layout.eval_resid)) + static_cast<size_t>(sequence) * seq_len * row_bytes();
  }
};

Status GptModel::check_batches(const TokenBatch* train, const TokenBatch* eval) const {
  if (train != nullptr && train->sequences != options_.batch)
    return InvalidArgumentError("GPT model: a training micro-batch has " + std::to_string(train->sequences) + " sequences, the model was planned for " +
                                std::to_string(options_.batch));
  if (eval != nullptr && (eval->sequences < 1 || eval->sequences > options_.eval_batch))
    return InvalidArgumentError("GPT model: an evaluation batch has " + std::to_string(eval->sequences) +
                                " sequences, the model was planned for 1 to " + std::to_string(options_.eval_batch));
  const size_t T = static_cast<size_t>(options_.seq_len);
  STRATA_RETURN_IF_ERROR(check_default_positions(train, T));
  return check_default_positions(eval, T);
}

StatusOr<QueuedMicroBatch> GptModel::queue_micro_batch(const TokenBatch* train, const TokenBatch* eval, float grad_scale) {
  if (!buffers_) return FailedPreconditionError("GptModel::queue_micro_batch() before allocate()");
  if (train == nullptr && eval == nullptr) return InvalidArgumentError("GptModel::queue_micro_batch(): neither a training nor an evaluation batch");
  STRATA_RETURN_IF_ERROR(check_batches(train, eval));
  Pass pass;
  pass.b = buffers_;
  pass.train = train != nullptr;
  pass.eval_sequences = eval ? eval->sequences : 0;
  pass.layers = static_cast<int>(options_.config.n_layer);
  pass.seq_len = static_cast<size_t>(options_.seq_len);
  pass.width = static_cast<size_t>(options_.config.n_embd);
  pass.dtype_bytes = dtype_size(plan_.compute_dtype);
  pass.rows = static_cast<size_t>(buffers_->layout.rows);
  pass.eval_rows = static_cast<size_t>(pass.eval_sequences) * pass.seq_len;
  pass.pinned = options_.checkpointing == ActivationCheckpointing::kPinnedHost;
  pass.keep_all = options_.checkpointing == ActivationCheckpointing::kOff;

  // Inputs: checked and staged per vocabulary chunk by the vocabulary head (pass 0:
  // training, pass 1: evaluation), from its own host staging.
  QueuedMicroBatch result;
  if (train) {
    STRATA_ASSIGN_OR_RETURN(result.train_tokens, vocab_->stage(0, *train, options_.seq_len, grad_scale, "GPT"));
  }
  if (eval) {
    STRATA_ASSIGN_OR_RETURN(result.eval_tokens, vocab_->stage(1, *eval, options_.seq_len, 0.0f, "GPT"));
  }
  const int64_t train_sequences = train ? options_.batch : 0;
  STRATA_RETURN_IF_ERROR(embed_forward(train_sequences, pass.eval_sequences));
  STRATA_RETURN_IF_ERROR(forward_blocks(pass));
  STRATA_RETURN_IF_ERROR(final_norm_forward(pass));
  // The head's input gradient goes to grad_narrow, ln_f's backward reads it from there.
  STRATA_RETURN_IF_ERROR(head_forward(train_sequences, pass.eval_sequences));
  // The losses are final here: their copies to the host go behind the head, so collect()
  // waits for the head only, not for the backward still to come.
  if (train) {
    STRATA_ASSIGN_OR_RETURN(result.train_loss, vocab_->queue_loss(0));
  }
  if (eval) {
    STRATA_ASSIGN_OR_RETURN(result.eval_loss, vocab_->queue_loss(1));
  }
  if (!train) return result;
  STRATA_RETURN_IF_ERROR(final_norm_backward(pass));
  STRATA_RETURN_IF_ERROR(backward_blocks(pass));
  STRATA_RETURN_IF_ERROR(embed_backward());
  return result;
}

Status GptModel::forward_blocks(const Pass& pass) {
  Buffers& b = *buffers_;
  Stream& stream = engine_.compute_stream();
  const int L = pass.layers;
  const BlockActs eval_acts = pass.eval_acts();
  for (int l = 0; l < L; ++l) {
    STRATA_ASSIGN_OR_RETURN(GroupView view, engine_.gather(groups_.block(l)));
    STRATA_ASSIGN_OR_RETURN(std::vector<const void*> p, params_of(groups_.block(l), view));
    // Evaluation runs in chunks of at most `batch` sequences through the shared activations.
    for (int64_t first = 0; first < pass.eval_sequences; first += options_.batch) {
      const int64_t count = std::min<int64_t>(options_.batch, pass.eval_sequences - first);
      STRATA_RETURN_IF_ERROR(block_forward(p, pass.eval_rows_at(first), pass.eval_rows_at(first), eval_acts, count));
    }
    if (pass.train) {
      if (pass.pinned) STRATA_RETURN_IF_ERROR(b.pinned.save(stream, l, L, pass.resid(l), pass.rows * pass.row_bytes()));
      STRATA_RETURN_IF_ERROR(block_forward(p, pass.resid(l), pass.resid(l + 1), pass.train_acts(l), options_.batch));
    }
    STRATA_RETURN_IF_ERROR(engine_.release(groups_.block(l)));
  }
  return {};
}

Status GptModel::final_norm_forward(const Pass& pass) {
  Buffers& b = *buffers_;
  const DeviceLayout& d = b.layout;
  Device& device = engine_.device();
  Stream& stream = engine_.compute_stream();
  const DType dt = plan_.compute_dtype;
  const int lnf = groups_.final_norm();
  STRATA_ASSIGN_OR_RETURN(GroupView view, engine_.gather(lnf));
  STRATA_ASSIGN_OR_RETURN(std::vector<const void*> p, params_of(lnf, view));
  if (pass.train) {
    const kernels::LayerNormShape shape{pass.rows, pass.width, 1e-5f};
    STRATA_RETURN_IF_ERROR(kernels::layernorm_forward(stream, shape, dt, pass.resid(pass.layers), p[0], p[1], b.at(d.lnf_out),
                                                      static_cast<float*>(b.at(d.lnf_mean)), static_cast<float*>(b.at(d.lnf_rstd))));
  }
  if (pass.eval_sequences > 0) {
    const kernels::LayerNormShape shape{pass.eval_rows, pass.width, 1e-5f};
    STRATA_RETURN_IF_ERROR(kernels::layernorm_forward(stream, shape, dt, pass.eval_rows_at(0), p[0], p[1], b.at(d.eval_lnf), nullptr, nullptr));
  }
  // ln_f's backward runs without gathering the group again: keep its gain and shift.
  const size_t row_bytes = pass.row_bytes();
  STRATA_RETURN_IF_ERROR(device.copy_async(b.at(d.lnf_gamma), p[0], row_bytes, CopyKind::kDeviceToDevice, stream));
  STRATA_RETURN_IF_ERROR(device.copy_async(static_cast<char*>(b.at(d.lnf_gamma)) + row_bytes, p[1], row_bytes, CopyKind::kDeviceToDevice, stream));
  return engine_.release(lnf);
}

Status GptModel::final_norm_backward(const Pass& pass) {
  Buffers& b = *buffers_;
  const DeviceLayout& d = b.layout;
  const int lnf = groups_.final_norm();
  STRATA_ASSIGN_OR_RETURN(GroupView grads, engine_.gradient_buffer(lnf));
  const kernels::GradOptions options{kernels::GradWrite::kOverwrite, kernels::GradWrite::kAccumulate};
  const kernels::LayerNormShape shape{pass.rows, pass.width, 1e-5f};
  STRATA_RETURN_IF_ERROR(kernels::layernorm_backward(engine_.compute_stream(), shape, plan_.compute_dtype, b.at(d.grad_narrow),
                                                     pass.resid(pass.layers), b.at(d.lnf_gamma), static_cast<const float*>(b.at(d.lnf_mean)),
                                                     static_cast<const float*>(b.at(d.lnf_rstd)), b.at(d.dresid),
                                                     static_cast<float*>(grads.tensors[0]), static_cast<float*>(grads.tensors[1]), options));
  STRATA_RETURN_IF_ERROR(capture(lnf, grads));
  return engine_.grads_ready(lnf);
}

// Pinned: after the buffer that held block m's input (or the final residual, m = layers) is
// no longer read, brings back block m-2's input into it, ahead of its recompute.
Status GptModel::restore_block_input(const Pass& pass, int m) {
  if (!pass.pinned || m - 2 < 0) return {};
  return buffers_->pinned.restore(engine_.compute_stream(), m, pass.resid(m - 2), pass.rows * pass.row_bytes());
}

Status GptModel::backward_blocks(const Pass& pass) {
  Buffers& b = *buffers_;
  Stream& stream = engine_.compute_stream();
  const int L = pass.layers;
  STRATA_RETURN_IF_ERROR(restore_block_input(pass, L));
  for (int l = L - 1; l >= 0; --l) {
    const int g = groups_.block(l);
    STRATA_ASSIGN_OR_RETURN(GroupView view, engine_.gather(g));
    STRATA_ASSIGN_OR_RETURN(std::vector<const void*> p, params_of(g, view));
    STRATA_ASSIGN_OR_RETURN(GroupView grads, engine_.gradient_buffer(g));
    std::vector<float*> gp;
    for (void* t : grads.tensors) gp.push_back(static_cast<float*>(t));
    if (pass.pinned) STRATA_RETURN_IF_ERROR(b.pinned.wait_restored(stream, l, L));
    const BlockActs acts = pass.train_acts(l);
    if (!pass.keep_all) STRATA_RETURN_IF_ERROR(block_forward(p, pass.resid(l), nullptr, acts, options_.batch));
    STRATA_RETURN_IF_ERROR(block_backward(p, gp, pass.resid(l), acts));
    STRATA_RETURN_IF_ERROR(engine_.release(g));
    STRATA_RETURN_IF_ERROR(capture(g, grads));
    STRATA_RETURN_IF_ERROR(engine_.grads_ready(g));
    STRATA_RETURN_IF_ERROR(restore_block_input(pass, l));
  }
  return {};
}

}  // namespace strata::gpt
