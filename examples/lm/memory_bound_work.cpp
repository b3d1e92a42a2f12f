#include "examples/lm/memory_bound_work.h"

namespace strata::lm {

MemoryBoundWork decoder_memory_bound_work(const DecoderWidths& w, DecoderOps ops) {
  const double layers = static_cast<double>(w.layers), hidden = static_cast<double>(w.hidden);
  const double mlp = static_cast<double>(w.mlp_width);
  const bool llama = ops == DecoderOps::kLlama;
  const std::string norm = llama ? "rmsnorm" : "layernorm";
  const std::string activation = llama ? "swiglu" : "gelu";
  MemoryBoundWork work;
  work.block_forward = {{norm + " fwd", 2 * layers * hidden}, {activation + " fwd", layers * mlp}, {"residual add", 2 * layers * hidden}};
  work.block_backward = {{norm + " bwd", 2 * layers * hidden}, {activation + " bwd", layers * mlp}, {"residual add", 2 * layers * hidden}};
  if (llama) {
    const double rotated = layers * static_cast<double>(w.query_width + w.kv_width);
    work.block_forward.push_back({"rope fwd", rotated});
    work.block_backward.push_back({"rope bwd", rotated});
  }
  work.head_forward = {{norm + " fwd", hidden}, {"cross-entropy fwd", static_cast<double>(w.vocab)}};
  work.head_backward = {{norm + " bwd", hidden}, {"cross-entropy bwd", static_cast<double>(w.vocab)}};
  work.head_logits_recomputed = true;
  return work;
}

}  // namespace strata::lm
