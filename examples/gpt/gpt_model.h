// A GPT-2-architecture language model on the engine.
//
//   x_0    = wte[tokens] + wpe[positions]     groups "wte.<k>" (vocabulary chunks of wte.weight), "wpe" (wpe.weight)
//   x_l+1  = block_l(x_l), l = 0 .. n_layer-1  group "h.<l>"
//            a = x + attn.c_proj(attention(attn.c_attn(ln_1(x))))
//            y = a + mlp.c_proj(gelu(mlp.c_fc(ln_2(a))))
//   logits = ln_f(x_L) . wte^T                 group "ln_f"; the head is wte's chunks again (tied)
//   loss   = mean cross-entropy(logits, targets)
//
// Tensors carry Hugging Face's GPT-2 names and layouts: Conv1D weights are stored
// [in, out] (WeightLayout::kInOut), wte [vocab, n_embd], wpe [n_ctx, n_embd]. The full
// Hugging Face name of a tensor is "<group>.<tensor>" for blocks ("h.3.attn.c_attn.weight"),
// "wte.weight" for the rows a chunk group "wte.<k>" holds, and the tensor's own name for
// the other groups ("wpe.weight", "ln_f.bias"); see hf_tensor_name() and gpt2_name_map().
//
// wte is split into groups of whole vocabulary rows, so no gather slot, gradient buffer
// or scratch is vocabulary-sized (GPT-2 XL's 50257 x 1600 wte was one 307 MiB group, the
// device floor's largest part), and padded inside the model to a multiple of 128 rows
// (50257 -> 50304) with zero rows that no load, export or softmax sees: the embedding and
// the tied head are lm::VocabHead's (examples/lm/vocab_chunks.h), shared with the Llama
// family. wpe is added by a second embedding lookup (positions as tokens), bit for bit
// the sum GPT-2's fused lookup makes.
//
// Initialization (GPT-2's): every weight matrix and both embeddings N(0, 0.02), the two
// residual projections (attn.c_proj.weight, mlp.c_proj.weight) N(0, 0.02 / sqrt(2 n_layer)),
// biases 0, LayerNorm gains 1 and shifts 0. Weight decay applies to the four weight
// matrices of each block only; biases, LayerNorm parameters and the embeddings (wte is
// also the output layer) are excluded, as GPT-2 recipes and DeepSpeed examples usually do.
//
// One micro-batch uses the groups in this order (recorded by the engine on the first step:
// a declared schedule with four uses of each wte chunk would make it plan a gradient
// buffer per chunk):
//   forward   wte 0..E-1, wpe, h.0 .. h.L-1, ln_f, wte 0..E-1 (head pass 1: the loss),
//             wte 0..E-1 (head pass 2: the input gradient)
//   backward  h.L-1 .. h.0, wte 0..E-1 (pass 3: the head's weight gradient plus the
//             embedding's, then grads_ready), wpe's gradient (no gather).
// ln_f's backward reuses a device copy of its gain taken in the forward, and the
// embeddings' backward needs no parameters. No gradient is held between uses
// (Engine::declare_held_gradients(0)). An evaluation batch rides along the training
// forward through the same gathers.
//
// Activations. With activation checkpointing (the default) only each block's input is
// kept through the forward; backward recomputes the block from it. The inputs live on
// the device, or (ActivationCheckpointing::kPinnedHost) in pinned host memory: each is
// copied out on a copy stream while the next block computes, and copied back one block
// ahead of its recompute. Without checkpointing every block's intermediates are kept.
// Everything the model allocates on the device is one buffer whose size
// plan_gpt_activations() computes from the shapes; declare it to the engine through
// EngineOptions::activation_bytes.
//
// The LM head runs over blocks of head_chunk_rows token rows, so the logits never exceed
// head_chunk_rows x one vocabulary chunk.
//
// Compute dtype: fp32, or bf16 on a CudaDevice when the parameters are bf16. Parameters
// stored in another dtype (bf16 on the CPU device, fp16) are cast into fp32 scratch
// after each gather (that scratch is part of the plan).
#pragma once

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
#include "examples/lm/vocab_chunks.h"
#include "kernels/blas_context.h"
#include "offload/pinned_arena.h"

namespace strata::gpt {

// The architecture.
struct GptConfig {
  int64_t n_layer = 0;
  int64_t n_head = 0;
  int64_t n_embd = 0;
  int64_t n_ctx = 0;       // positions (wpe rows)
  int64_t vocab_size = 0;  // wte rows
};

// Named shapes: "tiny" (2 layers, 2 heads, 64 wide, 64 positions, vocabulary 256),
// "small-demo", "gpt2" (124M), "gpt2-medium" (350M), "gpt2-large" (774M), "gpt2-xl"
// (1.5B), "gpt-2.7b", "gpt-6.7b", "gpt-13b". The GPT-2 ones use vocabulary 50257 and
// context 1024; the larger ones context 2048 (GPT-3's table). NotFound lists the names.
StatusOr<GptConfig> gpt_preset(std::string_view name);
std::vector<std::string> gpt_preset_names();
// Positive sizes, n_embd a multiple of n_head; errors name the field.
Status validate_gpt_config(const GptConfig& config);
// Parameters of the model (wte counted once).
int64_t gpt_parameter_count(const GptConfig& config);
std::string describe_gpt_config(const GptConfig& config);  // "12 layers, 12 heads, 768 wide, ... (124.4M parameters)"

// fp32 bytes of a wte chunk by default: smaller than the Llama family's, because a chunk's
// slot and its gradient scratch are activations (2 x 16 MiB, not 2 x 64 MiB) and GPT-2's
// blocks (GPT-2 XL's 117 MiB) are already the largest groups.
inline constexpr size_t kGptVocabChunkBytes = size_t{16} << 20;

// wte's vocabulary chunks: as many rows as fit `chunk_bytes` of fp32 (lm::make_vocab_chunks).
lm::VocabChunks gpt_vocab_chunks(const GptConfig& config, size_t chunk_bytes = kGptVocabChunkBytes);

// Group ids, with E = chunks.count chunks of wte.
struct GptGroups {
  int64_t layers = 0;
  int64_t chunks = 0;
  int wte(int64_t chunk) const { return static_cast<int>(chunk); }
  int wpe() const { return static_cast<int>(chunks); }
  int block(int64_t layer) const { return static_cast<int>(chunks + 1 + layer); }
  int final_norm() const { return static_cast<int>(chunks + 1 + layers); }
  int count() const { return static_cast<int>(chunks + 2 + layers); }
};
GptGroups gpt_groups(const GptConfig& config, size_t vocab_chunk_bytes = kGptVocabChunkBytes);
int gpt_group_count(const GptConfig& config, size_t vocab_chunk_bytes = kGptVocabChunkBytes);

// The groups, in registration order (ids as above), one micro-batch's group uses, and the
// gathers of an evaluation-only pass (embedding, blocks, ln_f, the tied head's pass 1),
// for engine.begin_forward().
std::vector<GroupSpec> gpt_group_specs(const GptConfig& config, size_t vocab_chunk_bytes = kGptVocabChunkBytes);
std::vector<int> gpt_schedule(const GptConfig& config, size_t vocab_chunk_bytes = kGptVocabChunkBytes);
std::vector<int> gpt_forward_order(const GptConfig& config, size_t vocab_chunk_bytes = kGptVocabChunkBytes);

// Hugging Face's name for tensor `tensor` of group `group` ("h.0.ln_1.weight", "wte.weight").
std::string hf_tensor_name(const GroupLayout& group, const TensorLayout& tensor);
std::string hf_tensor_name(std::string_view group_name, std::string_view tensor_name);

// Where block inputs are kept, the batches and the losses: the family-neutral types.
using lm::ActivationCheckpointing;
using lm::activation_checkpointing_name;
using lm::MicroBatchLosses;
using lm::QueuedMicroBatch;
using lm::TokenBatch;

// The run's fields (lm::ModelRunOptions): param_dtype is the engine's (checked at every
// gather); seq_len <= n_ctx, 0 = n_ctx; eval_batch 0 = no evaluation; head_chunk_rows 0 =
// as many token rows per LM-head block as keep the logits under 32 MiB.
struct GptModelOptions : lm::ModelRunOptions {
  GptConfig config;
  size_t vocab_chunk_bytes = kGptVocabChunkBytes;  // fp32 bytes per wte chunk group
  // Tests: copy every group's full fp32 gradient buffer to the host before grads_ready()
  // (see captured_gradients()). Synchronizes the compute stream per group.
  bool capture_gradients = false;
};

// Device (and pinned) memory the model needs (the skeleton's plan, examples/lm/transformer_layout.h).
using GptActivationPlan = lm::TransformerActivationPlan;
// `device`: where compute runs. Errors name bad shapes.
StatusOr<GptActivationPlan> plan_gpt_activations(const GptModelOptions& options, DeviceKind device);

// The dtype activations are computed in for these parameters on this device.
DType gpt_compute_dtype(DType param_dtype, DeviceKind device);

// GptModel::create(engine, options) registers the groups with `engine` and records the
// schedule on the first step (see above); allocate() follows engine.start()
// (lm::TransformerModel).
class GptModel : public lm::TransformerModel<GptModel, GptModelOptions, GptGroups> {
 public:
  // One micro-batch inside engine.begin_step()/begin_micro_batch() ... engine.step().
  // With `train`: forward and backward over its sequences (options.batch of them),
  // gradients scaled by `grad_scale` (d objective / d per-token loss: loss_scale / tokens
  // of the whole step over all ranks), grads_ready() for every group. With `eval` (up to
  // options.eval_batch sequences): its loss is measured in the same forward, with the
  // same gathered parameters (the weights before this step's update). Without `train`,
  // an evaluation-only pass (no gradients), run inside engine.begin_forward() ...
  // engine.end_forward() to see the weights after every step taken.
  // Returns once enqueued (the losses follow through collect(); CausalLm::run_micro_batch
  // does both).
  // TokenBatch::positions must be null or 0 .. seq_len-1 (GPT-2's position table is indexed by place).
  StatusOr<QueuedMicroBatch> queue_micro_batch(const TokenBatch* train, const TokenBatch* eval, float grad_scale) override;

 private:
  friend TransformerModel;
  struct Buffers;
  struct BlockActs;
  // What TransformerModel::create() does for GPT-2: seq_len 0 = n_ctx, no declared schedule.
  static const lm::ModelRecipe<GptModelOptions> kRecipe;
  GptModel(Engine& engine, const GptModelOptions& options, const GptActivationPlan& plan);
  // allocate()'s part: the activations, the vocabulary head and the position ids.
  Status allocate_buffers();

  // Gathered parameters of a group as compute-dtype pointers (cast into scratch when needed).
  StatusOr<std::vector<const void*>> params_of(int group, const GroupView& view);
  // Sequences 0 = no such pass.
  Status embed_forward(int64_t train_sequences, int64_t eval_sequences);
  Status block_forward(const std::vector<const void*>& params, const void* x, void* y, const BlockActs& acts,
                       int64_t sequences);
  Status block_backward(const std::vector<const void*>& params, const std::vector<float*>& grads, const void* x,
                        const BlockActs& acts);
  Status head_forward(int64_t train_sequences, int64_t eval_sequences);
  Status embed_backward();

  // queue_micro_batch's passes, in order (Pass: the micro-batch's shapes and buffers).
  struct Pass;
  Status check_batches(const TokenBatch* train, const TokenBatch* eval) const;
  Status forward_blocks(const Pass& pass);
  Status final_norm_forward(const Pass& pass);
  Status final_norm_backward(const Pass& pass);
  Status backward_blocks(const Pass& pass);
  Status restore_block_input(const Pass& pass, int m);

  Buffers* buffers_ = nullptr;  // TransformerModel's activations, as GPT-2's buffers
};

}  // namespace strata::gpt
