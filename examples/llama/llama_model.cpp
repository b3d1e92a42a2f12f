#include "examples/llama/llama_model.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <deque>
#include <iomanip>
#include <sstream>

#include "engine/core/log.h"
#include "examples/lm/model_memory.h"
#include "examples/lm/pinned_block_inputs.h"
#include "examples/lm/vocab_chunks.h"
#include "kernels/cast.h"
#include "kernels/gqa_attention.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "kernels/transformer_ops.h"

namespace strata::llama {
namespace {

using lm::bytes_text;
using lm::device_reservation;
using lm::kSubBufferAlignment;
using lm::round_up;

using lm::compute_dtype_for;

// Where each tensor of a block sits in its group (registration order); -1 = absent.
struct BlockIndex {
  int q = -1, q_bias = -1, k = -1, k_bias = -1, v = -1, v_bias = -1, o = -1, o_bias = -1;
  int gate = -1, gate_bias = -1, up = -1, up_bias = -1, down = -1, down_bias = -1;
  int input_norm = -1, post_norm = -1;
};

// The block's tensors in Hugging Face's module order (self_attn, mlp, the two norms).
std::vector<TensorSpec> block_tensors(const LlamaConfig& c, BlockIndex* index) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  const float std_dev = static_cast<float>(c.initializer_range);
  std::vector<TensorSpec> t;
  BlockIndex ix;
  auto add = [&](int* slot, std::string name, std::vector<int64_t> shape, TensorInit init, bool decay) {
    *slot = static_cast<int>(t.size());
    t.push_back({std::move(name), std::move(shape), init, decay});
  };
  auto linear = [&](int* weight, int* bias, const std::string& name, int64_t out, int64_t in, bool with_bias) {
    add(weight, name + ".weight", {out, in}, TensorInit::normal(std_dev), true);
    if (with_bias) add(bias, name + ".bias", {out}, TensorInit::zeros(), false);
  };
  linear(&ix.q, &ix.q_bias, "self_attn.q_proj", q, H, c.qkv_bias);
  linear(&ix.k, &ix.k_bias, "self_attn.k_proj", kv, H, c.qkv_bias);
  linear(&ix.v, &ix.v_bias, "self_attn.v_proj", kv, H, c.qkv_bias);
  linear(&ix.o, &ix.o_bias, "self_attn.o_proj", H, q, c.o_proj_bias);
  linear(&ix.gate, &ix.gate_bias, "mlp.gate_proj", I, H, c.mlp_bias);
  linear(&ix.up, &ix.up_bias, "mlp.up_proj", I, H, c.mlp_bias);
  linear(&ix.down, &ix.down_bias, "mlp.down_proj", H, I, c.mlp_bias);
  add(&ix.input_norm, "input_layernorm.weight", {H}, TensorInit::ones(), false);
  add(&ix.post_norm, "post_attention_layernorm.weight", {H}, TensorInit::ones(), false);
  if (index != nullptr) *index = ix;
  return t;
}

std::string embed_group_name(int64_t chunk) { return "model.embed_tokens." + std::to_string(chunk); }
std::string head_group_name(int64_t chunk) { return "lm_head." + std::to_string(chunk); }
std::string layer_group_name(int64_t layer) { return "model.layers." + std::to_string(layer); }
constexpr const char* kNormGroupName = "model.norm";

}  // namespace

// =====================================================================================
// Chunks, groups, names
// =====================================================================================

VocabChunks vocab_chunks(const LlamaConfig& c, size_t chunk_bytes) { return lm::make_vocab_chunks(c.vocab_size, c.hidden_size, chunk_bytes); }

LlamaGroups llama_groups(const LlamaConfig& c, const VocabChunks& chunks) {
  return LlamaGroups{c.num_hidden_layers, chunks.count, c.tie_word_embeddings};
}

std::vector<GroupSpec> llama_group_specs(const LlamaConfig& c, const VocabChunks& chunks) {
  const float std_dev = static_cast<float>(c.initializer_range);
  std::vector<GroupSpec> groups;
  for (int64_t k = 0; k < chunks.count; ++k)
    groups.push_back({embed_group_name(k), {lm::vocab_chunk_tensor(chunks, k, "weight", c.hidden_size, TensorInit::normal(std_dev))}});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) groups.push_back({layer_group_name(l), block_tensors(c, nullptr)});
  groups.push_back({kNormGroupName, {{"weight", {c.hidden_size}, TensorInit::ones(), false}}});
  if (!c.tie_word_embeddings)
    for (int64_t k = 0; k < chunks.count; ++k)
      groups.push_back({head_group_name(k), {lm::vocab_chunk_tensor(chunks, k, "weight", c.hidden_size, TensorInit::normal(std_dev))}});
  return groups;
}

std::vector<int> llama_forward_order(const LlamaConfig& c, const VocabChunks& chunks) {
  const LlamaGroups g = llama_groups(c, chunks);
  std::vector<int> uses;
  for (int64_t k = 0; k < g.chunks; ++k) uses.push_back(g.embed(k));
  for (int64_t l = 0; l < g.layers; ++l) uses.push_back(g.layer(l));
  uses.push_back(g.norm());
  for (int64_t k = 0; k < g.chunks; ++k) uses.push_back(g.head(k));  // pass 1: the loss
  return uses;
}

std::vector<int> llama_schedule(const LlamaConfig& c, const VocabChunks& chunks) {
  const LlamaGroups g = llama_groups(c, chunks);
  std::vector<int> uses = llama_forward_order(c, chunks);
  for (int64_t k = 0; k < g.chunks; ++k) uses.push_back(g.head(k));  // pass 2: the input gradient
  for (int64_t l = g.layers - 1; l >= 0; --l) uses.push_back(g.layer(l));
  if (g.tied)
    for (int64_t k = 0; k < g.chunks; ++k) uses.push_back(g.embed(k));  // pass 3: the weight gradient
  return uses;
}

HfTensorSlice llama_tensor_source(const LlamaConfig& c, const VocabChunks& chunks, std::string_view group, std::string_view tensor) {
  HfTensorSlice slice;
  const std::vector<int64_t> table_shape{c.vocab_size, c.hidden_size};
  for (const auto& [prefix, hf_name] : {std::pair<std::string_view, const char*>{"model.embed_tokens", "model.embed_tokens.weight"},
                                        std::pair<std::string_view, const char*>{"lm_head", "lm_head.weight"}}) {
    const int64_t chunk = lm::vocab_chunk_of_group(group, prefix);
    if (chunk >= 0) {
      slice.hf_name = hf_name;
      slice.hf_shape = table_shape;
      slice.row_offset = chunks.first_row(chunk);
      slice.rows = chunks.real_rows(chunk);
      return slice;
    }
  }
  slice.hf_name = std::string(group) + "." + std::string(tensor);
  if (group == kNormGroupName) {
    slice.hf_shape = {c.hidden_size};
  } else {
    for (const TensorSpec& t : block_tensors(c, nullptr))
      if (t.name == tensor) slice.hf_shape = t.shape;
  }
  slice.rows = slice.hf_shape.empty() ? 0 : slice.hf_shape[0];
  return slice;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> llama_hf_tensors(const LlamaConfig& c) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  out.push_back({"model.embed_tokens.weight", {c.vocab_size, c.hidden_size}});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    for (const TensorSpec& t : block_tensors(c, nullptr)) out.push_back({layer_group_name(l) + "." + t.name, t.shape});
  out.push_back({"model.norm.weight", {c.hidden_size}});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", {c.vocab_size, c.hidden_size}});
  return out;
}

// =====================================================================================
// The activation layout: one device buffer, carved into aligned sub-buffers
// =====================================================================================

namespace {

// Offsets (bytes) of one block's working activations.
struct ActsLayout {
  size_t norm1, rstd1, q, k, v, att, lse, x2, norm2, rstd2, gate, up, act;
};

// The Llama family's sub-buffers beyond the skeleton's (lm::TransformerLayout); rows are
// those of the largest pass (training or evaluation).
struct DeviceLayout : lm::TransformerLayout {
  int64_t rows = 0;
  std::vector<ActsLayout> acts;  // per block (kOff) or one shared set
  size_t dresid = 0, narrow = 0, datt = 0, dq = 0, dk = 0, dv = 0, wide = 0, wide2 = 0;
  size_t norm_out = 0, norm_rstd = 0, norm_gamma = 0;
  size_t inv_freq = 0;
  size_t vector_scratch = 0, vector_scratch_bytes = 0, matrix_scratch = 0, matrix_scratch_bytes = 0;
};

Status check_options(const LlamaModelOptions& o) {
  STRATA_RETURN_IF_ERROR(validate_llama_config(o.config));
  if (o.seq_len < 1) return InvalidArgumentError("Llama model: seq_len must be set (>= 1), got " + std::to_string(o.seq_len));
  STRATA_RETURN_IF_ERROR(check_sequence_length(o.config, o.seq_len));
  return lm::check_transformer_run({"Llama model", "embedding row", o.config.hidden_size, o.batch, o.eval_batch, o.head_chunk_rows,
                                    o.vocab_chunk_bytes});
}

struct BlockDims {
  size_t H, I, QD, KVD, NH, cs;
};

ActsLayout add_block_acts(DeviceLayout& d, size_t* line, size_t rows, const BlockDims& k) {
  ActsLayout a{};
  a.norm1 = d.add(rows * k.H * k.cs, line);
  a.rstd1 = d.add(rows * 4, line);
  a.q = d.add(rows * k.QD * k.cs, line);
  a.k = d.add(rows * k.KVD * k.cs, line);
  a.v = d.add(rows * k.KVD * k.cs, line);
  a.att = d.add(rows * k.QD * k.cs, line);
  a.lse = d.add(rows * k.NH * 4, line);
  a.x2 = d.add(rows * k.H * k.cs, line);
  a.norm2 = d.add(rows * k.H * k.cs, line);
  a.rstd2 = d.add(rows * 4, line);
  a.gate = d.add(rows * k.I * k.cs, line);
  a.up = d.add(rows * k.I * k.cs, line);
  a.act = d.add(rows * k.I * k.cs, line);
  return a;
}

void add_gradients_and_norm(DeviceLayout& d, size_t rows, const BlockDims& k) {
  size_t* l_grads = d.line("activation gradients");
  d.dresid = d.add(rows * k.H * k.cs, l_grads);
  d.narrow = d.add(rows * k.H * k.cs, l_grads);
  d.datt = d.add(rows * k.QD * k.cs, l_grads);
  d.dq = d.add(rows * k.QD * k.cs, l_grads);
  d.dk = d.add(rows * k.KVD * k.cs, l_grads);
  d.dv = d.add(rows * k.KVD * k.cs, l_grads);
  d.wide = d.add(rows * k.I * k.cs, l_grads);
  d.wide2 = d.add(rows * k.I * k.cs, l_grads);
  size_t* l_norm = d.line("final norm");
  d.norm_out = d.add(rows * k.H * k.cs, l_norm);
  d.norm_rstd = d.add(rows * 4, l_norm);
  d.norm_gamma = d.add(k.H * k.cs, l_norm);
}

// One matrix-sized slot: the embedding chunk with its zero row, and (bf16 parameters
// on an fp32 device) each matrix as it is cast; the stream runs them one after another.
void add_param_scratch(DeviceLayout& d, const LlamaModelOptions& o, DType compute) {
  const size_t cs = dtype_size(compute);
  size_t max_matrix = d.head.slot_bytes / cs;
  if (o.param_dtype != compute) {
    size_t max_vectors = 0;
    for (const auto& spec : llama_group_specs(o.config, d.chunks)) {
      size_t vectors = 0;
      for (const TensorSpec& t : spec.tensors) {
        size_t numel = 1;
        for (int64_t dim : t.shape) numel *= static_cast<size_t>(dim);
        if (t.shape.size() >= 2) max_matrix = std::max(max_matrix, numel);
        else vectors += round_up(numel, kTensorAlignElements);
      }
      max_vectors = std::max(max_vectors, vectors);
    }
    d.vector_scratch_bytes = std::max<size_t>(max_vectors, 1) * cs;
    d.vector_scratch = d.add(d.vector_scratch_bytes, d.line(std::string(dtype_name(compute)) + " copy of a gathered group's vectors (parameters are " +
                                                            std::string(dtype_name(o.param_dtype)) + ")"));
  }
  d.matrix_scratch_bytes = max_matrix * cs;
  d.matrix_scratch = d.add(d.matrix_scratch_bytes, d.line(o.param_dtype != compute ? "one matrix slot: an embedding chunk + a zero row, or a matrix cast to " +
                                                                                       std::string(dtype_name(compute))
                                                                                 : "one matrix slot: an embedding chunk + a zero row"));
}

StatusOr<DeviceLayout> make_layout(const LlamaModelOptions& o, DeviceKind kind) {
  STRATA_RETURN_IF_ERROR(check_options(o));
  const LlamaConfig& c = o.config;
  const DType compute = compute_dtype_for(o.param_dtype, kind);
  const size_t cs = dtype_size(compute);
  const size_t D = static_cast<size_t>(c.head_dim), NH = static_cast<size_t>(c.num_attention_heads);
  const BlockDims dims{static_cast<size_t>(c.hidden_size), static_cast<size_t>(c.intermediate_size), NH * D,
                       static_cast<size_t>(c.num_key_value_heads) * D, NH, cs};
  const size_t L = static_cast<size_t>(c.num_hidden_layers), T = static_cast<size_t>(o.seq_len);

  DeviceLayout d;
  d.chunks = vocab_chunks(c, o.vocab_chunk_bytes);
  const int64_t sequences = std::max(o.batch, o.eval_batch);
  d.rows = sequences * o.seq_len;
  const size_t rows = static_cast<size_t>(d.rows);
  STRATA_RETURN_IF_ERROR(d.plan_head({c.hidden_size, d.chunks, {d.rows}, o.head_chunk_rows, o.param_dtype, compute}));

  size_t* l_inputs = d.line("positions and rotary frequencies");
  d.positions = d.add(rows * 4, l_inputs);
  d.inv_freq = d.add(D / 2 * 4, l_inputs);
  d.add_residual_stream(o.checkpointing, L, rows * dims.H * cs, static_cast<size_t>(o.batch * o.seq_len) * dims.H * cs);
  size_t* l_acts = nullptr;
  const size_t act_sets = d.block_activation_sets(o.checkpointing, L, &l_acts);
  for (size_t s = 0; s < act_sets; ++s) d.acts.push_back(add_block_acts(d, l_acts, rows, dims));
  add_gradients_and_norm(d, rows, dims);
  const kernels::GqaAttentionShape shape{static_cast<size_t>(sequences), T, NH, static_cast<size_t>(c.num_key_value_heads), D, 0, 0, 0};
  d.add_head_and_attention(kernels::gqa_attention_workspace_bytes(shape, compute, kind));
  add_param_scratch(d, o, compute);
  return d;
}

}  // namespace

StatusOr<LlamaActivationPlan> plan_llama_activations(const LlamaModelOptions& options, DeviceKind device) {
  return lm::plan_of_layout("Llama", make_layout(options, device), device);
}

// =====================================================================================
// The model
// =====================================================================================

struct LlamaModel::BlockActs {
  void *norm1, *q, *k, *v, *att, *x2, *norm2, *gate, *up, *act;
  float *rstd1, *lse, *rstd2;
};

// One pass's rows: how many sequences, and the loss scale.
struct LlamaModel::Rows {
  int64_t sequences = 0;
  size_t count = 0;   // sequences * seq_len
  bool training = false;  // a backward follows (kPinnedHost saves the block inputs)
};

struct LlamaModel::Buffers : lm::ActivationArena {
  DeviceLayout layout;
  BlockIndex index;
  // Pinned staging of each pass's positions (copied from after stage_inputs returns).
  lm::UploadStaging positions;

  template <class T>
  T* as(size_t offset) const { return static_cast<T*>(at(offset)); }
  void* resid(int64_t layer) const { return at(layout.resid[static_cast<size_t>(layer) % layout.resid.size()]); }
  // Block l's activations: its own set when every block's are kept, else the shared one.
  BlockActs block_acts(int64_t layer) const { return acts(layout.acts.size() > 1 ? static_cast<size_t>(layer) : 0); }
  BlockActs acts(size_t set) const {
    const ActsLayout& a = layout.acts[set];
    return {at(a.norm1), at(a.q), at(a.k), at(a.v), at(a.att), at(a.x2), at(a.norm2), at(a.gate), at(a.up), at(a.act),
            as<float>(a.rstd1), as<float>(a.lse), as<float>(a.rstd2)};
  }
};

namespace {

LlamaModelOptions resolve_llama_options(const LlamaModelOptions& options) {
  LlamaModelOptions resolved = options;
  if (resolved.eval_batch == 0) resolved.eval_batch = resolved.batch;
  return resolved;
}

std::vector<GroupSpec> llama_specs_of(const LlamaModelOptions& options, const VocabChunks& chunks) {
  return llama_group_specs(options.config, chunks);
}

// Tied: recorded on the first step (see the header: the engine would plan a gradient
// buffer per embedding chunk).
std::vector<int> llama_declared_schedule(const LlamaModelOptions& options, const VocabChunks& chunks) {
  if (options.config.tie_word_embeddings) return {};
  return llama_schedule(options.config, chunks);
}

}  // namespace

const lm::ModelRecipe<LlamaModelOptions> LlamaModel::kRecipe{"Llama model", resolve_llama_options, plan_llama_activations,
                                                             llama_specs_of, llama_declared_schedule};

LlamaModel::LlamaModel(Engine& engine, const LlamaModelOptions& options, const LlamaActivationPlan& plan)
    : TransformerModel(engine, options, plan, llama_groups(options.config, plan.chunks), "LlamaModel") {}

Status LlamaModel::allocate_buffers() {
  Device& device = engine_.device();
  auto b = std::make_unique<Buffers>();
  STRATA_ASSIGN_OR_RETURN(b->layout, make_layout(options_, device.kind()));
  block_tensors(options_.config, &b->index);
  if (Status status = allocate_activations(b->layout, "Llama", *b); !status.ok()) return status;
  const DeviceLayout& d = b->layout;
  STRATA_ASSIGN_OR_RETURN(b->positions, lm::UploadStaging::create(device, static_cast<size_t>(d.rows) * 4, "Llama position ids"));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<lm::VocabHead> vocab,
                          lm::VocabHead::create(engine_, *head_blas_, d.head_shape, b->at(d.vocab_head), b->at(d.matrix_scratch)));

  // The rotary inverse frequencies.
  Stream& stream = engine_.compute_stream();
  const LlamaConfig& c = options_.config;
  STRATA_ASSIGN_OR_RETURN(std::vector<float> inv_freq,
                          kernels::rope_inverse_frequencies(static_cast<size_t>(c.head_dim), c.rope_theta, c.rope_scaling));
  STRATA_RETURN_IF_ERROR(device.copy_async(b->at(d.inv_freq), inv_freq.data(), inv_freq.size() * 4, CopyKind::kHostToDevice, stream));
  STRATA_RETURN_IF_ERROR(stream.synchronize());
  buffers_ = keep_buffers(std::move(b), std::move(vocab));
  return {};
}

// A gathered group's tensors in the compute dtype. Parameters already in it are the
// gathered buffer's own. Otherwise the vectors (norm gains, biases) are cast into a small
// scratch when the group is opened, and each matrix into one matrix-sized slot when it is
// asked for, valid until the next matrix is: kernels run in order on the one compute
// stream, so a cast never overwrites a matrix that an earlier kernel still reads, and the
// fp32 copy of a bf16 block costs its largest matrix, not the block.
class LlamaModel::Params {
 public:
  const void* vector(int index) const { return index < 0 ? nullptr : pointers_[static_cast<size_t>(index)]; }
  StatusOr<const void*> matrix(int index) {
    const size_t i = static_cast<size_t>(index);
    if (slot_ == nullptr) return pointers_[i];
    if (in_slot_ != index) {
      STRATA_RETURN_IF_ERROR(kernels::cast(*stream_, sources_[i], from_, slot_, to_, numel_[i]));
      in_slot_ = index;
    }
    return static_cast<const void*>(slot_);
  }

 private:
  friend class LlamaModel;
  std::vector<const void*> pointers_;  // compute-dtype tensors (matrices: null when cast on demand)
  std::vector<const void*> sources_;   // the gathered tensors
  std::vector<size_t> numel_;
  Stream* stream_ = nullptr;
  DType from_ = DType::kFloat32, to_ = DType::kFloat32;
  void* slot_ = nullptr;               // the matrix slot; null when nothing is cast
  int in_slot_ = -1;
};

StatusOr<LlamaModel::Params> LlamaModel::params_of(int group, const GroupView& view) {
  if (view.dtype != options_.param_dtype)
    return FailedPreconditionError("Llama model: the engine gathers " + std::string(dtype_name(view.dtype)) +
                                   " parameters but the model was planned for " + std::string(dtype_name(options_.param_dtype)) +
                                   " (set LlamaModelOptions::param_dtype to EngineOptions::param_dtype)");
  const GroupLayout& layout = engine_.layout(group);
  Params params;
  const DType compute = plan_.compute_dtype;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    params.sources_.push_back(view.tensors[i]);
    params.numel_.push_back(layout.tensors[i].numel);
  }
  if (view.dtype == compute) {
    params.pointers_ = params.sources_;
    return params;
  }
  const DeviceLayout& d = buffers_->layout;
  params.stream_ = &engine_.compute_stream();
  params.from_ = view.dtype;
  params.to_ = compute;
  params.slot_ = buffers_->at(d.matrix_scratch);
  char* vectors = static_cast<char*>(buffers_->at(d.vector_scratch));
  size_t used = 0;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const TensorLayout& t = layout.tensors[i];
    if (t.shape.size() >= 2) {
      if (t.numel * dtype_size(compute) > d.matrix_scratch_bytes) return InternalError("Llama model: matrix scratch too small for " + layout.name + "." + t.name);
      params.pointers_.push_back(nullptr);
      continue;
    }
    if ((used + t.numel) * dtype_size(compute) > d.vector_scratch_bytes) return InternalError("Llama model: vector scratch too small for " + layout.name);
    STRATA_RETURN_IF_ERROR(kernels::cast(engine_.compute_stream(), view.tensors[i], view.dtype, vectors + used * dtype_size(compute), compute, t.numel));
    params.pointers_.push_back(vectors + used * dtype_size(compute));
    used += round_up(t.numel, kTensorAlignElements);
  }
  return params;
}

// Checks the batch and fills the device's per-pass inputs: positions here, tokens and
// targets per vocabulary chunk in the vocabulary head. Returns the targets with a loss.
StatusOr<int64_t> LlamaModel::stage_inputs(const TokenBatch& batch, float grad_scale, Rows& rows) {
  Buffers& b = *buffers_;
  const size_t T = static_cast<size_t>(options_.seq_len);
  const size_t n = static_cast<size_t>(batch.sequences) * T;
  rows.sequences = batch.sequences;
  rows.count = n;
  STRATA_ASSIGN_OR_RETURN(int64_t counted, vocab_->stage(0, batch, options_.seq_len, grad_scale, "Llama"));
  STRATA_ASSIGN_OR_RETURN(std::byte* staging, b.positions.begin_fill());
  auto* positions = reinterpret_cast<int32_t*>(staging);
  for (size_t r = 0; r < n; ++r) {
    const int32_t position = batch.positions ? batch.positions[r] : static_cast<int32_t>(r % T);
    if (position < 0)
      return InvalidArgumentError("Llama model: position id " + std::to_string(position) + " at sequence " + std::to_string(r / T) + ", position " +
                                  std::to_string(r % T) + " is negative");
    positions[r] = position;
  }
  STRATA_RETURN_IF_ERROR(engine_.device().copy_async(b.at(b.layout.positions), positions, n * 4, CopyKind::kHostToDevice,
                                                     engine_.compute_stream()));
  STRATA_RETURN_IF_ERROR(b.positions.end_fill(engine_.compute_stream()));
  return counted;
}

// x_0 = the sum over chunks of each chunk's rows (zero for tokens of other chunks: each
// token is in exactly one chunk, so the sum is exact).
Status LlamaModel::embed_forward(const Rows& rows) {
  Buffers& b = *buffers_;
  for (int64_t k = 0; k < b.layout.chunks.count; ++k) {
    const int g = groups_.embed(k);
    STRATA_ASSIGN_OR_RETURN(GroupView view, engine_.gather(g));
    STRATA_RETURN_IF_ERROR(vocab_->embed_chunk(0, k, view, b.at(b.layout.resid[0]), b.at(b.layout.narrow)));
    STRATA_RETURN_IF_ERROR(engine_.release(g));
  }
  (void)rows;
  return {};
}

Status LlamaModel::block_forward(Params& p, const void* x, void* y, const BlockActs& a, const Rows& rows) {
  Stream& stream = engine_.compute_stream();
  kernels::BlasContext& blas = *blas_;
  const DeviceLayout& d = buffers_->layout;
  const BlockIndex& ix = buffers_->index;
  const LlamaConfig& c = options_.config;
  const DType dt = plan_.compute_dtype;
  const size_t n = rows.count, H = static_cast<size_t>(c.hidden_size), I = static_cast<size_t>(c.intermediate_size);
  const size_t D = static_cast<size_t>(c.head_dim), NH = static_cast<size_t>(c.num_attention_heads), NKV = static_cast<size_t>(c.num_key_value_heads);
  const size_t QD = NH * D, KVD = NKV * D;
  const kernels::RmsNormShape norm{n, H, static_cast<float>(c.rms_norm_eps)};
  const int32_t* positions = buffers_->as<int32_t>(d.positions);
  const float* inv_freq = buffers_->as<float>(d.inv_freq);
  void* workspace = d.attention_workspace_bytes > 0 ? buffers_->at(d.attention_workspace) : nullptr;
  using kernels::WeightLayout;
  STRATA_RETURN_IF_ERROR(kernels::rmsnorm_forward(stream, norm, dt, x, p.vector(ix.input_norm), a.norm1, a.rstd1));
  STRATA_ASSIGN_OR_RETURN(const void* q_weight, p.matrix(ix.q));
  STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, blas, {n, H, QD, WeightLayout::kOutIn}, dt, a.norm1, q_weight, p.vector(ix.q_bias), a.q));
  STRATA_ASSIGN_OR_RETURN(const void* k_weight, p.matrix(ix.k));
  STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, blas, {n, H, KVD, WeightLayout::kOutIn}, dt, a.norm1, k_weight, p.vector(ix.k_bias), a.k));
  STRATA_ASSIGN_OR_RETURN(const void* v_weight, p.matrix(ix.v));
  STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, blas, {n, H, KVD, WeightLayout::kOutIn}, dt, a.norm1, v_weight, p.vector(ix.v_bias), a.v));
  STRATA_RETURN_IF_ERROR(kernels::rope_forward(stream, {n, NH, D, 0}, dt, positions, inv_freq, a.q, a.q));
  STRATA_RETURN_IF_ERROR(kernels::rope_forward(stream, {n, NKV, D, 0}, dt, positions, inv_freq, a.k, a.k));
  const kernels::GqaAttentionShape attention{static_cast<size_t>(rows.sequences), static_cast<size_t>(options_.seq_len), NH, NKV, D, 0, 0, 0};
  STRATA_RETURN_IF_ERROR(
      kernels::gqa_attention_forward(stream, blas, attention, dt, a.q, a.k, a.v, a.att, a.lse, workspace, d.attention_workspace_bytes));
  // o_proj through x2 (free until the residual add).
  STRATA_ASSIGN_OR_RETURN(const void* o_weight, p.matrix(ix.o));
  STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, blas, {n, QD, H, WeightLayout::kOutIn}, dt, a.att, o_weight, p.vector(ix.o_bias), a.x2));
  STRATA_RETURN_IF_ERROR(kernels::residual_forward(stream, dt, x, a.x2, a.x2, n * H));
  STRATA_RETURN_IF_ERROR(kernels::rmsnorm_forward(stream, norm, dt, a.x2, p.vector(ix.post_norm), a.norm2, a.rstd2));
  STRATA_ASSIGN_OR_RETURN(const void* gate_weight, p.matrix(ix.gate));
  STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, blas, {n, H, I, WeightLayout::kOutIn}, dt, a.norm2, gate_weight, p.vector(ix.gate_bias), a.gate));
  STRATA_ASSIGN_OR_RETURN(const void* up_weight, p.matrix(ix.up));
  STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, blas, {n, H, I, WeightLayout::kOutIn}, dt, a.norm2, up_weight, p.vector(ix.up_bias), a.up));
  STRATA_RETURN_IF_ERROR(kernels::swiglu_forward(stream, dt, a.gate, a.up, a.act, n * I));
  if (y == nullptr) return {};  // a recompute: the block's output is not needed again
  STRATA_ASSIGN_OR_RETURN(const void* down_weight, p.matrix(ix.down));
  STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, blas, {n, I, H, WeightLayout::kOutIn}, dt, a.act, down_weight, p.vector(ix.down_bias), y));
  return kernels::residual_forward(stream, dt, y, a.x2, y, n * H);
}

Status LlamaModel::block_backward(Params& p, const std::vector<float*>& g, const void* x, const BlockActs& a,
                                  const Rows& rows) {
  Stream& stream = engine_.compute_stream();
  kernels::BlasContext& blas = *blas_;
  Buffers& b = *buffers_;
  const DeviceLayout& d = b.layout;
  const BlockIndex& ix = b.index;
  const LlamaConfig& c = options_.config;
  const DType dt = plan_.compute_dtype;
  const size_t n = rows.count, H = static_cast<size_t>(c.hidden_size), I = static_cast<size_t>(c.intermediate_size);
  const size_t D = static_cast<size_t>(c.head_dim), NH = static_cast<size_t>(c.num_attention_heads), NKV = static_cast<size_t>(c.num_key_value_heads);
  const size_t QD = NH * D, KVD = NKV * D;
  auto grad = [&](int i) { return i < 0 ? nullptr : g[static_cast<size_t>(i)]; };
  const kernels::RmsNormShape norm{n, H, static_cast<float>(c.rms_norm_eps)};
  const int32_t* positions = b.as<int32_t>(d.positions);
  const float* inv_freq = b.as<float>(d.inv_freq);
  void* workspace = d.attention_workspace_bytes > 0 ? b.at(d.attention_workspace) : nullptr;
  void* dresid = b.at(d.dresid);  // in: d loss / d block output; out: d loss / d block input
  void* narrow = b.at(d.narrow);
  void* wide = b.at(d.wide);
  void* wide2 = b.at(d.wide2);
  using kernels::WeightLayout;
  const kernels::GradOptions fresh{kernels::GradWrite::kOverwrite, kernels::GradWrite::kAccumulate};
  const kernels::GradOptions add{kernels::GradWrite::kAccumulate, kernels::GradWrite::kAccumulate};
  // MLP: d act, then the gate's and up's gradients (dup into act, free once down_proj's
  // weight gradient has read it).
  STRATA_ASSIGN_OR_RETURN(const void* down_weight, p.matrix(ix.down));
  STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, blas, {n, I, H, WeightLayout::kOutIn}, dt, dresid, a.act, down_weight, wide, g[ix.down],
                                                  grad(ix.down_bias), fresh));
  STRATA_RETURN_IF_ERROR(kernels::swiglu_backward(stream, dt, wide, a.gate, a.up, wide2, a.act, n * I, kernels::GradWrite::kOverwrite));
  STRATA_ASSIGN_OR_RETURN(const void* gate_weight, p.matrix(ix.gate));
  STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, blas, {n, H, I, WeightLayout::kOutIn}, dt, wide2, a.norm2, gate_weight, narrow, g[ix.gate],
                                                  grad(ix.gate_bias), fresh));
  STRATA_ASSIGN_OR_RETURN(const void* up_weight, p.matrix(ix.up));
  STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, blas, {n, H, I, WeightLayout::kOutIn}, dt, a.act, a.norm2, up_weight, narrow, g[ix.up],
                                                  grad(ix.up_bias), add));
  // dresid += the post-attention norm's input gradient: now d loss / d x2.
  STRATA_RETURN_IF_ERROR(kernels::rmsnorm_backward(stream, norm, dt, narrow, a.x2, p.vector(ix.post_norm), a.rstd2, dresid, g[ix.post_norm], add));
  // Attention.
  void* datt = b.at(d.datt);
  void* dq = b.at(d.dq);
  void* dk = b.at(d.dk);
  void* dv = b.at(d.dv);
  STRATA_ASSIGN_OR_RETURN(const void* o_weight, p.matrix(ix.o));
  STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, blas, {n, QD, H, WeightLayout::kOutIn}, dt, dresid, a.att, o_weight, datt, g[ix.o],
                                                  grad(ix.o_bias), fresh));
  const kernels::GqaAttentionShape attention{static_cast<size_t>(rows.sequences), static_cast<size_t>(options_.seq_len), NH, NKV, D, 0, 0, 0};
  STRATA_RETURN_IF_ERROR(kernels::gqa_attention_backward(stream, blas, attention, dt, datt, a.q, a.k, a.v, a.lse, dq, dk, dv, workspace,
                                                         d.attention_workspace_bytes, kernels::GradWrite::kOverwrite));
  STRATA_RETURN_IF_ERROR(kernels::rope_backward(stream, {n, NH, D, 0}, dt, positions, inv_freq, dq, dq, kernels::GradWrite::kOverwrite));
  STRATA_RETURN_IF_ERROR(kernels::rope_backward(stream, {n, NKV, D, 0}, dt, positions, inv_freq, dk, dk, kernels::GradWrite::kOverwrite));
  STRATA_ASSIGN_OR_RETURN(const void* q_weight, p.matrix(ix.q));
  STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, blas, {n, H, QD, WeightLayout::kOutIn}, dt, dq, a.norm1, q_weight, narrow, g[ix.q],
                                                  grad(ix.q_bias), fresh));
  STRATA_ASSIGN_OR_RETURN(const void* k_weight, p.matrix(ix.k));
  STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, blas, {n, H, KVD, WeightLayout::kOutIn}, dt, dk, a.norm1, k_weight, narrow, g[ix.k],
                                                  grad(ix.k_bias), add));
  STRATA_ASSIGN_OR_RETURN(const void* v_weight, p.matrix(ix.v));
  STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, blas, {n, H, KVD, WeightLayout::kOutIn}, dt, dv, a.norm1, v_weight, narrow, g[ix.v],
                                                  grad(ix.v_bias), add));
  // dresid += the input norm's input gradient: d loss / d x.
  return kernels::rmsnorm_backward(stream, norm, dt, narrow, x, p.vector(ix.input_norm), a.rstd1, dresid, g[ix.input_norm], add);
}

// kPinnedHost: the bytes of one pass's block input (lm::PinnedBlockInputs saves and restores them).
size_t LlamaModel::block_input_bytes(const Rows& rows) const {
  return rows.count * static_cast<size_t>(options_.config.hidden_size) * dtype_size(plan_.compute_dtype);
}

// Embedding, blocks (their inputs kept for the backward), the final norm and the head's
// pass 1: each row's full log-sum-exp and its loss pieces.
Status LlamaModel::forward(const Rows& rows) {
  Buffers& b = *buffers_;
  const DeviceLayout& d = b.layout;
  Stream& stream = engine_.compute_stream();
  const LlamaConfig& c = options_.config;
  const size_t H = static_cast<size_t>(c.hidden_size);
  const DType dt = plan_.compute_dtype;
  STRATA_RETURN_IF_ERROR(embed_forward(rows));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const int g = groups_.layer(l);
    STRATA_ASSIGN_OR_RETURN(GroupView view, engine_.gather(g));
    STRATA_ASSIGN_OR_RETURN(Params p, params_of(g, view));
    if (rows.training && b.pinned.active())
      STRATA_RETURN_IF_ERROR(b.pinned.save(stream, l, c.num_hidden_layers, b.resid(l), block_input_bytes(rows)));
    STRATA_RETURN_IF_ERROR(block_forward(p, b.resid(l), b.resid(l + 1), b.block_acts(l), rows));
    STRATA_RETURN_IF_ERROR(engine_.release(g));
  }
  {
    STRATA_ASSIGN_OR_RETURN(GroupView view, engine_.gather(groups_.norm()));
    STRATA_ASSIGN_OR_RETURN(Params p, params_of(groups_.norm(), view));
    STRATA_RETURN_IF_ERROR(kernels::rmsnorm_forward(stream, {rows.count, H, static_cast<float>(c.rms_norm_eps)}, dt, b.resid(c.num_hidden_layers), p.vector(0),
                                                    b.at(d.norm_out), b.as<float>(d.norm_rstd)));
    // The norm's backward runs without gathering it again: keep its gain.
    STRATA_RETURN_IF_ERROR(engine_.device().copy_async(b.at(d.norm_gamma), p.vector(0), H * dtype_size(dt), CopyKind::kDeviceToDevice, stream));
    STRATA_RETURN_IF_ERROR(engine_.release(groups_.norm()));
  }
  for (int64_t k = 0; k < d.chunks.count; ++k) {
    const int g = groups_.head(k);
    STRATA_ASSIGN_OR_RETURN(GroupView view, engine_.gather(g));
    STRATA_RETURN_IF_ERROR(vocab_->head_loss_chunk(0, k, view, b.at(d.norm_out)));
    STRATA_RETURN_IF_ERROR(engine_.release(g));
  }
  return vocab_->head_combine(0);
}

// The head's pass 2, the final norm, the blocks in reverse (recomputed from their inputs
// when checkpointing), then the embedding chunks (tied: with the head's pass 3), each
// group's grads_ready() after its last use.
Status LlamaModel::backward(const Rows& rows) {
  Buffers& b = *buffers_;
  const DeviceLayout& d = b.layout;
  Stream& stream = engine_.compute_stream();
  const LlamaConfig& c = options_.config;
  const DType dt = plan_.compute_dtype;
  const bool keep_all = options_.checkpointing == ActivationCheckpointing::kOff;
  for (int64_t k = 0; k < d.chunks.count; ++k) {
    const int g = groups_.head(k);
    STRATA_ASSIGN_OR_RETURN(GroupView view, engine_.gather(g));
    GroupView grads;
    if (!groups_.tied) {
      STRATA_ASSIGN_OR_RETURN(grads, engine_.gradient_buffer(g));
    }
    // The head's input gradient goes to `narrow`, the final norm's backward reads it there.
    STRATA_RETURN_IF_ERROR(
        vocab_->head_backward_chunk(k, view, b.at(d.norm_out), groups_.tied ? nullptr : static_cast<float*>(grads.tensors[0]), b.at(d.narrow)));
    STRATA_RETURN_IF_ERROR(engine_.release(g));
    if (!groups_.tied) {
      STRATA_RETURN_IF_ERROR(capture(g, grads));
      STRATA_RETURN_IF_ERROR(engine_.grads_ready(g));
    }
  }
  {
    const int g = groups_.norm();
    STRATA_ASSIGN_OR_RETURN(GroupView grads, engine_.gradient_buffer(g));
    const kernels::GradOptions options{kernels::GradWrite::kOverwrite, kernels::GradWrite::kAccumulate};
    STRATA_RETURN_IF_ERROR(kernels::rmsnorm_backward(stream, {rows.count, static_cast<size_t>(c.hidden_size), static_cast<float>(c.rms_norm_eps)}, dt,
                                                     b.at(d.narrow), b.resid(c.num_hidden_layers), b.at(d.norm_gamma), b.as<float>(d.norm_rstd),
                                                     b.at(d.dresid), static_cast<float*>(grads.tensors[0]), options));
    STRATA_RETURN_IF_ERROR(capture(g, grads));
    STRATA_RETURN_IF_ERROR(engine_.grads_ready(g));
  }
  STRATA_RETURN_IF_ERROR(b.pinned.restore(stream, c.num_hidden_layers, b.resid(c.num_hidden_layers - 2), block_input_bytes(rows)));
  for (int64_t l = c.num_hidden_layers - 1; l >= 0; --l) {
    const int g = groups_.layer(l);
    STRATA_ASSIGN_OR_RETURN(GroupView view, engine_.gather(g));
    STRATA_ASSIGN_OR_RETURN(Params p, params_of(g, view));
    STRATA_ASSIGN_OR_RETURN(GroupView grads, engine_.gradient_buffer(g));
    std::vector<float*> gp;
    for (void* t : grads.tensors) gp.push_back(static_cast<float*>(t));
    const BlockActs a = b.block_acts(l);
    STRATA_RETURN_IF_ERROR(b.pinned.wait_restored(stream, l, c.num_hidden_layers));
    if (!keep_all) STRATA_RETURN_IF_ERROR(block_forward(p, b.resid(l), nullptr, a, rows));
    STRATA_RETURN_IF_ERROR(block_backward(p, gp, b.resid(l), a, rows));
    STRATA_RETURN_IF_ERROR(engine_.release(g));
    STRATA_RETURN_IF_ERROR(capture(g, grads));
    STRATA_RETURN_IF_ERROR(engine_.grads_ready(g));
    STRATA_RETURN_IF_ERROR(b.pinned.restore(stream, l, b.resid(l - 2), block_input_bytes(rows)));
  }
  // dresid is d loss / d x_0: the embedding chunks' gradients (tied: plus the head's).
  const auto embed = [this](int64_t k) { return groups_.embed(k); };
  return vocab_chunks_backward(d.chunks.count, embed, groups_.tied ? b.at(d.norm_out) : nullptr, b.at(d.dresid));
}

StatusOr<QueuedMicroBatch> LlamaModel::queue_micro_batch(const TokenBatch* train, const TokenBatch* eval, float grad_scale) {
  if (!buffers_) return FailedPreconditionError("LlamaModel::queue_micro_batch() before allocate()");
  if (train == nullptr && eval == nullptr) return InvalidArgumentError("LlamaModel::queue_micro_batch(): neither a training nor an evaluation batch");
  if (train != nullptr && train->sequences != options_.batch)
    return InvalidArgumentError("Llama model: a training micro-batch has " + std::to_string(train->sequences) +
                                " sequences, the model was planned for " + std::to_string(options_.batch));
  if (eval != nullptr && (eval->sequences < 1 || eval->sequences > options_.eval_batch))
    return InvalidArgumentError("Llama model: an evaluation batch has " + std::to_string(eval->sequences) + " sequences, the model was planned for 1 to " +
                                std::to_string(options_.eval_batch));
  QueuedMicroBatch result;
  // Evaluation first, through the same buffers; its losses are copied out behind its
  // forward, before the training pass's work reuses them (stream order).
  if (eval != nullptr) {
    Rows rows;
    STRATA_ASSIGN_OR_RETURN(result.eval_tokens, stage_inputs(*eval, 0.0f, rows));
    STRATA_RETURN_IF_ERROR(forward(rows));
    STRATA_ASSIGN_OR_RETURN(result.eval_loss, vocab_->queue_loss(0));
  }
  if (train != nullptr) {
    Rows rows;
    STRATA_ASSIGN_OR_RETURN(result.train_tokens, stage_inputs(*train, grad_scale, rows));
    rows.training = true;
    STRATA_RETURN_IF_ERROR(forward(rows));
    // The losses are final after the forward: collect() waits for the head, not the backward.
    STRATA_ASSIGN_OR_RETURN(result.train_loss, vocab_->queue_loss(0));
    STRATA_RETURN_IF_ERROR(backward(rows));
  }
  return result;
}

}  // namespace strata::llama
