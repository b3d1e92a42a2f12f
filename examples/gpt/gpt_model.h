// A GPT-2-architecture language model on the engine.
//
//   x_0    = wte[tokens] + wpe[positions]                       group 0  "wte"   (wte.weight, wpe.weight)
//   x_l+1  = block_l(x_l), l = 0 .. n_layer-1                    group 1+l "h.<l>"
//            a = x + attn.c_proj(attention(attn.c_attn(ln_1(x))))
//            y = a + mlp.c_proj(gelu(mlp.c_fc(ln_2(a))))
//   logits = ln_f(x_L) . wte^T                                   group L+1 "ln_f"; the head is wte again (tied)
//   loss   = mean cross-entropy(logits, targets)
//
// Tensors carry Hugging Face's GPT-2 names and layouts: Conv1D weights are stored
// [in, out] (WeightLayout::kInOut), wte [vocab, n_embd], wpe [n_ctx, n_embd]. The full
// Hugging Face name of a tensor is "<group>.<tensor>" for blocks ("h.3.attn.c_attn.weight")
// and the tensor's own name for the other groups ("wte.weight", "ln_f.bias"); see
// hf_tensor_name().
//
// Initialization (GPT-2's): every weight matrix and both embeddings N(0, 0.02), the two
// residual projections (attn.c_proj.weight, mlp.c_proj.weight) N(0, 0.02 / sqrt(2 n_layer)),
// biases 0, LayerNorm gains 1 and shifts 0. Weight decay applies to the four weight
// matrices of each block only; biases, LayerNorm parameters and the embeddings (wte is
// also the output layer) are excluded, as GPT-2 recipes and DeepSpeed examples usually do.
//
// One micro-batch uses the groups in this order (declared to the engine):
//   forward  0, 1, ..., L, L+1, 0        (the last 0 is the LM head: forward and backward in one use)
//   backward L, L-1, ..., 1
// ln_f's backward reuses a device copy of its gain taken in the forward, and the
// embedding backward needs no parameters, so neither gathers again: each block and wte
// are gathered twice per micro-batch, ln_f once. wte's gradient buffer is held from the
// head to the embedding backward, where grads_ready(0) is called.
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
// The LM head runs over row chunks so the logits never exceed head_chunk_rows x vocab.
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

// Group ids.
constexpr int kEmbeddingGroup = 0;
inline int block_group(int layer) { return 1 + layer; }
inline int final_norm_group(const GptConfig& config) { return 1 + static_cast<int>(config.n_layer); }
inline int gpt_group_count(const GptConfig& config) { return 2 + static_cast<int>(config.n_layer); }

// The groups, in registration order (ids as above), and one micro-batch's group uses.
std::vector<GroupSpec> gpt_group_specs(const GptConfig& config);
std::vector<int> gpt_schedule(const GptConfig& config);
// The gathers of an evaluation-only pass (the schedule's forward half: embedding, blocks,
// ln_f, the tied LM head), for engine.begin_forward().
std::vector<int> gpt_forward_order(const GptConfig& config);

// Hugging Face's name for tensor `tensor` of group `group` ("h.0.ln_1.weight", "wte.weight").
std::string hf_tensor_name(const GroupLayout& group, const TensorLayout& tensor);
std::string hf_tensor_name(std::string_view group_name, std::string_view tensor_name);

// Where block inputs are kept between forward and backward.
enum class ActivationCheckpointing : uint8_t {
  kOff,         // keep every block's intermediates on the device (no recompute)
  kDevice,      // keep block inputs on the device, recompute each block in backward
  kPinnedHost,  // keep block inputs in pinned host memory, recompute each block in backward
};
std::string_view activation_checkpointing_name(ActivationCheckpointing mode);  // "off" | "device" | "pinned"

struct GptModelOptions {
  GptConfig config;
  DType param_dtype = DType::kFloat32;  // the engine's EngineOptions::param_dtype (checked at every gather)
  int64_t batch = 1;        // sequences per training micro-batch on this rank
  int64_t seq_len = 0;      // tokens per sequence (<= n_ctx); 0 = n_ctx
  int64_t eval_batch = 0;   // sequences per evaluation pass on this rank (0 = no evaluation)
  ActivationCheckpointing checkpointing = ActivationCheckpointing::kDevice;
  int64_t head_chunk_rows = 0;  // rows per LM-head chunk; 0 = as many as keep the logits under 32 MiB
  // Tests: copy every group's full fp32 gradient buffer to the host before grads_ready()
  // (see captured_gradients()). Synchronizes the compute stream per group.
  bool capture_gradients = false;
};

// Device (and pinned) memory the model needs: one device buffer of device_bytes (already
// rounded the way the device's allocator rounds it), plus the BLAS workspace on CUDA.
struct GptActivationPlan {
  size_t device_bytes = 0;   // everything the model allocates on the device (declare as activation_bytes)
  size_t pinned_bytes = 0;   // block inputs in pinned host memory (kPinnedHost)
  DType compute_dtype = DType::kFloat32;
  int64_t head_chunk_rows = 0;
  std::vector<std::pair<std::string, size_t>> lines;  // what the device bytes hold, for the log
  std::string text() const;
};
// `device`: where compute runs. Errors name bad shapes.
StatusOr<GptActivationPlan> plan_gpt_activations(const GptModelOptions& options, DeviceKind device);

// The dtype activations are computed in for these parameters on this device.
DType gpt_compute_dtype(DType param_dtype, DeviceKind device);

// One micro-batch of token ids on the host: inputs and targets, [batch, seq_len] each,
// row-major. Targets equal to -1 are ignored.
struct TokenBatch {
  const int32_t* inputs = nullptr;
  const int32_t* targets = nullptr;
  int64_t sequences = 0;
  // Each token's position id, [batch, seq_len] (packed sequences restart at 0); null =
  // 0..seq_len-1 in every sequence. Rotary models only (examples/llama); GptModel, whose
  // learned position table is indexed by place, refuses a non-null one.
  const int32_t* positions = nullptr;
};

struct MicroBatchLosses {
  double train_loss_sum = 0.0;  // sum of this rank's per-token training losses
  int64_t train_tokens = 0;     // tokens that contributed (targets not ignored)
  double eval_loss_sum = 0.0;
  int64_t eval_tokens = 0;
};

class GptModel {
 public:
  // Registers the groups with `engine` and declares the schedule (before engine.start()).
  static StatusOr<std::unique_ptr<GptModel>> create(Engine& engine, const GptModelOptions& options);
  ~GptModel();
  GptModel(const GptModel&) = delete;
  GptModel& operator=(const GptModel&) = delete;

  // After engine.start(): allocates the activations (and pinned checkpoints).
  Status allocate();

  const GptModelOptions& options() const { return options_; }
  const GptActivationPlan& activation_plan() const { return plan_; }
  DType compute_dtype() const { return plan_.compute_dtype; }

  // One micro-batch inside engine.begin_step()/begin_micro_batch() ... engine.step().
  // With `train`: forward and backward over its sequences (options.batch of them),
  // gradients scaled by `grad_scale` (d objective / d per-token loss: loss_scale / tokens
  // of the whole step over all ranks), grads_ready() for every group. With `eval` (up to
  // options.eval_batch sequences): its loss is measured in the same forward, with the
  // same gathered parameters (the weights before this step's update). Without `train`,
  // an evaluation-only pass (no gradients), run inside engine.begin_forward() ...
  // engine.end_forward() to see the weights after every step taken.
  // Waits for the micro-batch's compute to finish.
  StatusOr<MicroBatchLosses> run_micro_batch(const TokenBatch* train, const TokenBatch* eval, float grad_scale);

  // capture_gradients: the last captured full gradient (numel floats) per group id.
  const std::map<int, std::vector<float>>& captured_gradients() const { return captured_; }

 private:
  struct Buffers;
  struct BlockActs;
  GptModel(Engine& engine, const GptModelOptions& options);

  // Gathered parameters of a group as compute-dtype pointers (cast into scratch when needed).
  StatusOr<std::vector<const void*>> params_of(int group, const GroupView& view);
  Status embed(const std::vector<const void*>& wte_params, const void* device_tokens, void* out, int64_t sequences);
  Status block_forward(const std::vector<const void*>& params, const void* x, void* y, const BlockActs& acts,
                       int64_t sequences);
  Status block_backward(const std::vector<const void*>& params, const std::vector<float*>& grads, const void* x,
                        const BlockActs& acts);
  Status head(const std::vector<const void*>& wte_params, float* dwte, const void* x_final, int64_t sequences,
              const int32_t* targets, float grad_scale, bool backward, void* dx, float* losses);
  Status capture(int group, const GroupView& grads);

  Engine& engine_;
  GptModelOptions options_;
  GptActivationPlan plan_;
  std::unique_ptr<kernels::BlasContext> blas_;
  std::unique_ptr<Buffers> buffers_;
  std::map<int, std::vector<float>> captured_;
};

}  // namespace strata::gpt
