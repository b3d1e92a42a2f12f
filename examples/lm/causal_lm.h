// What the trainer needs from a causal language model family, whatever its architecture
// (GPT-2 in examples/gpt, the Llama family in examples/llama): the architecture itself
// (groups, schedule, activation plan, weights in and out), and one rank's model on its
// engine, which runs micro-batches.
//
// The trainer (examples/train/trainer.h) holds an Architecture and asks it for
// everything shape-dependent, so a family plugs in by implementing these two classes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "engine/engine.h"
#include "examples/lm/host_staging.h"
#include "examples/lm/memory_bound_work.h"
#include "examples/lm/model_flops.h"

namespace strata::lm {

// Where block inputs are kept between forward and backward.
enum class ActivationCheckpointing : uint8_t {
  kOff,         // keep every block's intermediates on the device (no recompute)
  kDevice,      // keep block inputs on the device, recompute each block in backward
  kPinnedHost,  // keep block inputs in pinned host memory, recompute each block in backward
};
std::string_view activation_checkpointing_name(ActivationCheckpointing mode);  // "off" | "device" | "pinned"

// One micro-batch of token ids on the host: inputs and targets, [sequences, seq_len] each,
// row-major. Targets equal to -1 are ignored (masked out of the loss). positions, when
// set, holds each input token's position id (packed documents restart at 0); null means
// 0 .. seq_len-1 in every sequence. A family without position ids of its own (GPT-2's
// learned table is indexed by place) rejects positions that differ from the default.
struct TokenBatch {
  const int32_t* inputs = nullptr;
  const int32_t* targets = nullptr;
  int64_t sequences = 0;
  const int32_t* positions = nullptr;
};

struct MicroBatchLosses {
  double train_loss_sum = 0.0;  // sum of this rank's per-token training losses
  int64_t train_tokens = 0;     // tokens that contributed (targets not ignored)
  double eval_loss_sum = 0.0;
  int64_t eval_tokens = 0;
};

// A micro-batch enqueued on the device whose loss sums are still on their way to the host
// (examples/lm/host_staging.h); the token counts are known at once.
struct QueuedMicroBatch {
  int64_t train_tokens = 0;
  int64_t eval_tokens = 0;
  LossTicket train_loss;  // serial 0: no training batch
  LossTicket eval_loss;   // serial 0: no evaluation batch
};

// How one rank runs the model.
struct ModelRunOptions {
  DType param_dtype = DType::kFloat32;  // the engine's EngineOptions::param_dtype
  int64_t batch = 1;                    // sequences per training micro-batch on this rank
  int64_t seq_len = 0;                  // tokens per sequence
  int64_t eval_batch = 0;               // sequences per evaluation pass on this rank (0 = none)
  ActivationCheckpointing checkpointing = ActivationCheckpointing::kDevice;
  int64_t head_chunk_rows = 0;          // rows per LM-head chunk; 0 = the family's default
};

// Device (and pinned) memory one rank's model needs beyond the engine's.
struct ActivationPlan {
  size_t device_bytes = 0;  // declare as EngineOptions::activation_bytes
  size_t pinned_bytes = 0;  // block inputs in pinned host memory (kPinnedHost)
  DType compute_dtype = DType::kFloat32;
  std::string text;         // what the bytes hold, one line per item, for the start-up plan
};

// One rank's model, registered with its engine. Created before engine.start().
class CausalLm {
 public:
  virtual ~CausalLm() = default;
  // After engine.start(): allocates the activations.
  virtual Status allocate() = 0;
  // One micro-batch inside engine.begin_step()/begin_micro_batch() ... engine.step():
  // with `train`, forward and backward, gradients scaled by grad_scale (d objective / d
  // per-token loss), grads_ready() for every group; with `eval`, its loss from the same
  // forward. Without `train`: an evaluation-only pass inside begin_forward()/end_forward().
  // Returns once the work is enqueued: the device is not drained, and the losses come
  // from collect(). Queue a step's micro-batches, then collect them (before step()).
  virtual StatusOr<QueuedMicroBatch> queue_micro_batch(const TokenBatch* train, const TokenBatch* eval, float grad_scale) = 0;
  // A queued micro-batch's loss sums: waits for their copies (not for its backward), once.
  virtual StatusOr<MicroBatchLosses> collect(const QueuedMicroBatch& queued) = 0;
  // queue_micro_batch, then collect.
  StatusOr<MicroBatchLosses> run_micro_batch(const TokenBatch* train, const TokenBatch* eval, float grad_scale);
};

// Weights opened once (checked, shared read-only by every rank's load).
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual std::string describe() const = 0;  // the path(s), for logs
  // The dtype the weights are stored in (the export's default): fp32, bf16 or fp16.
  virtual DType stored_dtype() const = 0;
};

// Fills `out` (layout(group).numel floats) with the full, unpadded fp32 group.
using FullGroupSource = std::function<Status(int group, std::span<float> out)>;

struct ExportSettings {
  DType dtype = DType::kFloat32;                // the tensors' dtype in the export (fp32, bf16, fp16)
  uint64_t shard_bytes = 0;                     // split the weights into files of at most this (0 = the family's default)
  std::map<std::string, std::string> metadata;  // stored with the weights
  std::string source_dir;                       // the directory the run started from (tokenizer files are copied along), or empty
};

class Architecture {
 public:
  virtual ~Architecture() = default;

  virtual std::string family() const = 0;      // "GPT-2", "Llama", ...
  virtual std::string describe() const = 0;    // shapes and parameter count, one line
  virtual std::string model_json() const = 0;  // the shape as JSON: checkpoints refuse to resume into another
  virtual int64_t parameter_count() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t context_length() const = 0;  // the longest sequence it takes
  virtual int64_t hidden_size() const = 0;     // the width of a block's input (activation traffic)
  virtual int64_t layers() const = 0;
  // What its model FLOPs per token depend on (examples/lm/model_flops.h).
  virtual FlopShape flop_shape() const = 0;
  // Its memory-bound kernels per token, for the step's cost model (examples/lm/memory_bound_work.h).
  virtual MemoryBoundWork memory_bound_work() const = 0;
  // True when TokenBatch::positions other than 0 .. seq_len-1 are honoured.
  virtual bool takes_position_ids() const = 0;
  // True when one forward can also measure an evaluation batch (CausalLm::run_micro_batch
  // with both `train` and `eval`); otherwise the trainer evaluates only in forward-only
  // passes (after the last step, or --eval-only).
  virtual bool evaluates_while_training() const = 0;

  // The engine groups in registration order, one micro-batch's group uses (training), and
  // the gathers of an evaluation-only pass.
  virtual std::vector<GroupSpec> group_specs() const = 0;
  virtual std::vector<int> schedule() const = 0;
  virtual std::vector<int> forward_order() const = 0;

  virtual StatusOr<ActivationPlan> plan_activations(const ModelRunOptions& options, DeviceKind device) const = 0;
  // Registers the groups with `engine` and declares the schedule.
  virtual StatusOr<std::unique_ptr<CausalLm>> create(Engine& engine, const ModelRunOptions& options) const = 0;

  // Weights in: open and check `path` once (every tensor present with its shape), then
  // each rank loads its master shards from it (after engine.start(), between steps).
  virtual StatusOr<std::unique_ptr<WeightSource>> open_weights(const std::string& path) const = 0;
  virtual Status load_weights(Engine& engine, int rank, const WeightSource& source) const = 0;
  // Weights out: writes `dir` in the family's Hugging Face form, asking `source` for one
  // full group at a time in export_group_order()'s order (each group once), which the
  // other ranks follow when they contribute their shards.
  virtual Status export_weights(const std::string& dir, const FullGroupSource& source, const ExportSettings& settings) const = 0;
  virtual StatusOr<std::vector<int>> export_group_order() const = 0;
};

}  // namespace strata::lm
