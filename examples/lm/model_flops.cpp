#include "examples/lm/model_flops.h"

namespace strata::lm {

FlopShape decoder_flop_shape(const DecoderShape& s) {
  const int64_t attention = s.hidden * s.query_width + 2 * s.hidden * s.kv_width + s.query_width * s.hidden;  // q, k, v, o
  const int64_t mlp = s.mlp_matrices * s.hidden * s.mlp_width;
  FlopShape out;
  out.matmul_weights = s.layers * (attention + mlp) + s.hidden * s.vocab;  // the head: a product even when tied
  out.attention_layers = s.layers;
  out.attention_width = s.query_width;
  return out;
}

int64_t training_flops_per_token(const FlopShape& s, int64_t seq_len) {
  const int64_t matmuls = 6 * s.matmul_weights - 2 * s.data_input_weights;
  // Two products (scores, values) x 2 FLOPs x seq_len keys x width, x3 for fwd + bwd.
  const int64_t attention = 12 * s.attention_layers * seq_len * s.attention_width;
  return matmuls + attention;
}

double training_step_flops(const FlopShape& shape, int64_t seq_len, int64_t tokens) {
  return double(training_flops_per_token(shape, seq_len)) * double(tokens);
}

double tflops(double flops, double seconds) { return seconds > 0 ? flops / seconds / 1e12 : 0.0; }

}  // namespace strata::lm
