// The memory-bound kernels of a training step, per token: the normalizations, activations,
// rotary embeddings, residual adds and the loss that sit between the matrix products. Each
// is named as `strata-bench kernels` names it (and so as the machine profile keeps its rate:
// "gelu fwd", "rmsnorm bwd", "cross-entropy fwd", ...), with the elements it is timed over;
// the cost model (examples/profile/step_cost.h) turns elements into the bytes the bench
// counts and prices each at its own measured rate. Ops the bench does not time ("residual
// add") are priced as plain streams through memory (examples/profile/kernel_ops.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::lm {

struct MemoryOp {
  std::string op;                 // the bench's name, e.g. "layernorm fwd"
  double elements_per_token = 0;  // the elements the kernel runs over, per token
};

struct MemoryBoundWork {
  std::vector<MemoryOp> block_forward;   // all blocks' forward (again in backward with activation checkpointing)
  std::vector<MemoryOp> block_backward;  // all blocks' backward
  std::vector<MemoryOp> head_forward;    // the final norm and the loss (forward)
  std::vector<MemoryOp> head_backward;
  // The head's logits are made again in backward (a chunked cross-entropy keeps none), a
  // second forward product of the head whatever activation checkpointing does.
  bool head_logits_recomputed = false;
};

enum class DecoderOps {
  kGpt2,   // layer norm, GELU MLP, learned positions
  kLlama,  // RMSNorm, SwiGLU MLP, rotary positions on queries and keys
};

struct DecoderWidths {
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t query_width = 0;  // query heads x head_dim
  int64_t kv_width = 0;     // key/value heads x head_dim
  int64_t mlp_width = 0;
  int64_t vocab = 0;
};

// The native decoders' kernels (examples/gpt, examples/llama): per block two norms, the MLP's
// activation, two residual adds (and rotary on queries and keys for Llama); after the blocks
// the final norm and the vocabulary's cross-entropy, whose logits are recomputed in backward.
MemoryBoundWork decoder_memory_bound_work(const DecoderWidths& widths, DecoderOps ops);

}  // namespace strata::lm
