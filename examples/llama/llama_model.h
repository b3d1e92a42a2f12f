// A Llama-family language model (Llama 2/3/3.1/3.2, Mistral, Qwen2) on the engine.
//
//   x_0    = embed_tokens[tokens]                                 groups "model.embed_tokens.<k>" (vocabulary chunks)
//   x_l+1  = layer_l(x_l), l = 0 .. L-1                           group  "model.layers.<l>"
//            a = x + o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n))),  n = input_layernorm(x)
//            y = a + down_proj(silu(gate_proj(m)) * up_proj(m)),                       m = post_attention_layernorm(a)
//   logits = norm(x_L) . W^T, W = lm_head (untied) or embed_tokens  group "model.norm"; groups "lm_head.<k>" (untied)
//   loss   = mean cross-entropy over the targets that are not -1
//
// Names and layouts are Hugging Face's (LlamaForCausalLM, MistralForCausalLM,
// Qwen2ForCausalLM): nn.Linear weights [out, in] (WeightLayout::kOutIn); a block's
// tensor's full name is "<group>.<tensor>" ("model.layers.3.self_attn.q_proj.weight").
// The token embedding and an untied lm_head are split into groups of whole vocabulary
// rows (examples/lm/vocab_chunks.h, shared with GPT-2), so no gather slot, gradient
// buffer or scratch is vocabulary-sized: chunk k holds rows [k*R, k*R + rows) of
// "model.embed_tokens.weight" (or "lm_head.weight") where R keeps a chunk within
// LlamaModelOptions::vocab_chunk_bytes of fp32; a vocabulary that is not a multiple of
// 128 is padded inside the model with zero rows at the end of the last chunk, which no
// load, export or softmax sees. See llama_tensor_source() for the mapping a checkpoint
// loader streams through.
//
// Initialization as transformers' LlamaPreTrainedModel._init_weights: every weight matrix
// and the embedding N(0, initializer_range), biases 0, RMSNorm gains 1. Weight decay on the
// block matrices only (not on biases, gains or the embeddings).
//
// One micro-batch uses the groups in this order:
//   forward   embed 0..E-1, layers 0..L-1, norm, head chunks 0..E-1 (pass 1: log-sum-exp),
//             head chunks 0..E-1 (pass 2: the input gradient; untied: lm_head's gradient)
//   backward  layers L-1..0, and when tied: embed 0..E-1 again (pass 3: the head's weight
//             gradient plus the embedding's, then grads_ready).
// The embedding's backward needs no parameters (untied: no gather). The schedule is
// declared for untied models; for tied ones the engine records it on the first step,
// because a declared schedule with four uses of each embedding chunk would make the engine
// plan a gradient buffer per chunk (it assumes a group used more than twice holds its
// gradient between uses). No gradient waits between uses here, which the model declares
// (Engine::declare_held_gradients(0)): the engine plans its two overlapping slots only.
//
// The embedding and the LM head over vocabulary chunks are lm::VocabHead's (see
// examples/lm/vocab_chunks.h for how the full-vocabulary cross-entropy is assembled from
// per-chunk pieces, exactly up to fp32 rounding).
//
// Activations: with checkpointing (default) each block's input is kept and the block is
// recomputed in backward; kOff keeps every block's intermediates; kPinnedHost keeps the
// block inputs in pinned host memory, as GptModel does (copied out on a copy stream while
// the next block computes, back one block ahead of its recompute). Everything the model allocates on the device is one buffer whose size
// plan_llama_activations() computes; declare it as EngineOptions::activation_bytes.
//
// Compute dtype: fp32, or bf16 on a CudaDevice when parameters are bf16; parameters in
// another dtype are cast into fp32 scratch after each gather: a group's vectors at once,
// its matrices one at a time as the kernels reach them (the scratch is one matrix).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/engine.h"
#include "examples/lm/causal_lm.h"
#include "examples/lm/transformer_layout.h"
#include "examples/lm/transformer_model.h"
#include "examples/llama/llama_config.h"
#include "examples/lm/vocab_chunks.h"
#include "kernels/blas_context.h"

namespace strata::llama {

using lm::ActivationCheckpointing;
using lm::MicroBatchLosses;
using lm::TokenBatch;
using lm::QueuedMicroBatch;

using lm::kDefaultVocabChunkBytes;
using lm::VocabChunks;
// The vocabulary's chunks: as many rows as fit `chunk_bytes` of fp32 (lm::make_vocab_chunks).
VocabChunks vocab_chunks(const LlamaConfig& config, size_t chunk_bytes);

// Group ids, with E = chunks.count embedding chunks.
struct LlamaGroups {
  int64_t layers = 0;
  int64_t chunks = 0;
  bool tied = false;
  int embed(int64_t chunk) const { return static_cast<int>(chunk); }
  int layer(int64_t l) const { return static_cast<int>(chunks + l); }
  int norm() const { return static_cast<int>(chunks + layers); }
  // The group holding the head's chunk k: the embedding's when tied.
  int head(int64_t chunk) const { return tied ? embed(chunk) : static_cast<int>(chunks + layers + 1 + chunk); }
  int count() const { return static_cast<int>(chunks * (tied ? 1 : 2) + layers + 1); }
};
LlamaGroups llama_groups(const LlamaConfig& config, const VocabChunks& chunks);

// The groups in registration order, one micro-batch's uses, and the gathers of an
// evaluation-only pass (embedding, layers, norm, head pass 1), for engine.begin_forward().
std::vector<GroupSpec> llama_group_specs(const LlamaConfig& config, const VocabChunks& chunks);
std::vector<int> llama_schedule(const LlamaConfig& config, const VocabChunks& chunks);
std::vector<int> llama_forward_order(const LlamaConfig& config, const VocabChunks& chunks);

// Where a group's tensor lives in a Hugging Face checkpoint: rows [row_offset, row_offset +
// rows) of tensor `hf_name` (whose shape is hf_shape); the group tensor is exactly those rows.
struct HfTensorSlice {
  std::string hf_name;            // "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", ...
  std::vector<int64_t> hf_shape;  // the whole tensor's shape in the checkpoint
  int64_t row_offset = 0;         // first row (dimension 0) the group tensor holds
  int64_t rows = 0;               // checkpoint rows it holds (hf_shape[0] unless chunked; 1 for a vector's single "row" of all of it);
                                  // a chunk's padding rows past them are the model's own
};
HfTensorSlice llama_tensor_source(const LlamaConfig& config, const VocabChunks& chunks, std::string_view group_name,
                                  std::string_view tensor_name);
// Every Hugging Face tensor the model has, in checkpoint order, with its full shape
// (lm_head.weight only when untied).
std::vector<std::pair<std::string, std::vector<int64_t>>> llama_hf_tensors(const LlamaConfig& config);

// The run's fields (lm::ModelRunOptions): param_dtype is the engine's (checked at every
// gather); seq_len <= max_position_embeddings, required; eval_batch: sequences of an
// evaluation-only pass, 0 = batch; head_chunk_rows 0 = as many token rows per LM-head
// block as keep the logits under 32 MiB.
struct LlamaModelOptions : lm::ModelRunOptions {
  LlamaConfig config;
  size_t vocab_chunk_bytes = kDefaultVocabChunkBytes;  // fp32 bytes per embedding / lm_head chunk
  // Tests: copy every group's full fp32 gradient to the host before grads_ready()
  // (see captured_gradients()). Synchronizes the compute stream per group.
  bool capture_gradients = false;
};

using LlamaActivationPlan = lm::TransformerActivationPlan;  // examples/lm/transformer_layout.h
StatusOr<LlamaActivationPlan> plan_llama_activations(const LlamaModelOptions& options, DeviceKind device);

// LlamaModel::create(engine, options) registers the groups with `engine` (first: ids
// from 0) and declares the schedule (untied), before engine.start(); allocate() follows
// engine.start() and also uploads the rotary frequencies (lm::TransformerModel).
class LlamaModel final : public lm::TransformerModel<LlamaModel, LlamaModelOptions, LlamaGroups> {
 public:
  // One micro-batch inside engine.begin_step()/begin_micro_batch() ... engine.step(), as
  // GptModel::run_micro_batch: `train` (options.batch sequences) runs forward and
  // backward with gradients scaled by grad_scale and grads_ready() for every group; an
  // evaluation-only pass (train null, eval up to eval_batch sequences) runs inside
  // engine.begin_forward() ... end_forward(). With both, the evaluation runs first as a
  // forward of its own (its own gathers, not riding along the training forward as
  // GptModel's does; the weights are the same within the step, and the engine re-plans
  // its prefetches around the extra gathers). TokenBatch::positions (null = 0..T-1 in
  // each sequence) gives each token's rotary position; targets of -1 carry no loss.
  // Returns once enqueued; the losses follow through collect() (CausalLm::run_micro_batch
  // does both).
  StatusOr<QueuedMicroBatch> queue_micro_batch(const TokenBatch* train, const TokenBatch* eval, float grad_scale) override;

 private:
  friend TransformerModel;
  // TransformerModel::create() for the Llama family: eval_batch 0 = batch; the schedule
  // declared when the head is untied.
  static const lm::ModelRecipe<LlamaModelOptions> kRecipe;
  LlamaModel(Engine& engine, const LlamaModelOptions& options, const LlamaActivationPlan& plan);
  Status allocate_buffers();  // allocate()'s part: activations, head, positions' staging, rotary frequencies

  struct Buffers;
  struct BlockActs;
  struct Rows;
  class Params;
  StatusOr<Params> params_of(int group, const GroupView& view);
  StatusOr<int64_t> stage_inputs(const TokenBatch& batch, float grad_scale, Rows& rows);
  Status embed_forward(const Rows& rows);
  Status block_forward(Params& p, const void* x, void* y, const BlockActs& a, const Rows& rows);
  Status block_backward(Params& p, const std::vector<float*>& g, const void* x, const BlockActs& a, const Rows& rows);
  size_t block_input_bytes(const Rows& rows) const;
  Status forward(const Rows& rows);
  Status backward(const Rows& rows);

  Buffers* buffers_ = nullptr;  // TransformerModel's activations, as the family's buffers
};

}  // namespace strata::llama
