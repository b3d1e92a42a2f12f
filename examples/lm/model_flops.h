// Model FLOPs of a training step: what the model's mathematics needs, whatever the engine
// does to run it, so an achieved rate (model FLOPs / step wall time) compares with other
// tools' model FLOPs utilization.
//
// Counted, per token:
// - Matrix products: 2 FLOPs per weight in forward, 4 in backward (the weight gradient and
//   the input gradient), so 6 per weight in all; 2 + 2 for a weight whose input is the
//   data itself (no input gradient is needed). The vocabulary head counts, tied or not;
//   embedding lookups count nothing; the vocabulary is the model's own, not a padded one.
// - Attention's two products (scores Q K^T and the weighted values P V): forward
//   2 x seq_len x (heads x head_dim) FLOPs each per token per layer, backward twice that,
//   so 12 x layers x seq_len x (heads x head_dim) per token. The masked half of causal
//   attention is counted (PaLM's convention, Chowdhery et al. 2022, appendix B), so a
//   kernel that skips masked blocks still reports a rate comparable with published ones.
//   Grouped-query attention shares K/V heads but every query head still forms its own
//   scores: the width is the query heads'.
// Not counted: activation recomputation (a second forward of each block in backward when
// activation checkpointing is on) — that is hardware FLOPs, not model FLOPs — nor
// normalizations, activations, softmax, biases, the loss and the optimizer (elementwise,
// a small fraction), nor an evaluation forward riding along a step.
#pragma once

#include <cstdint>

namespace strata::lm {

// What a model's FLOPs per token depend on.
struct FlopShape {
  int64_t matmul_weights = 0;      // weights each token's activations are multiplied by (the head's included, lookups not)
  int64_t data_input_weights = 0;  // of matmul_weights, those whose input is the data (no input gradient)
  int64_t attention_layers = 0;    // layers with self-attention over the sequence
  int64_t attention_width = 0;     // query heads x head_dim: the width of the score and value products
};

// A decoder-only transformer (GPT-2, the Llama family): per block the query, key, value
// and output projections and an MLP of `mlp_matrices` matrices, then the vocabulary head.
struct DecoderShape {
  int64_t layers = 0;
  int64_t hidden = 0;        // d_model
  int64_t query_width = 0;   // query heads x head_dim (q_proj's outputs, o_proj's inputs)
  int64_t kv_width = 0;      // key/value heads x head_dim (k_proj's and v_proj's outputs each)
  int64_t mlp_width = 0;     // the MLP's inner width
  int64_t mlp_matrices = 0;  // 2 (GPT-2: c_fc, c_proj) or 3 (SwiGLU: gate, up, down)
  int64_t vocab = 0;         // the head's outputs (the model's vocabulary, unpadded)
};
FlopShape decoder_flop_shape(const DecoderShape& shape);

// Model FLOPs of forward and backward for one token of a sequence of `seq_len` tokens.
int64_t training_flops_per_token(const FlopShape& shape, int64_t seq_len);
// Model FLOPs of one training step over `tokens` tokens (all ranks, all micro-batches) in
// sequences of `seq_len`. A double: large models times large batches pass 2^63.
double training_step_flops(const FlopShape& shape, int64_t seq_len, int64_t tokens);
// FLOPs / seconds in TFLOPS (1e12 FLOP/s); 0 when seconds is not positive.
double tflops(double flops, double seconds);

}  // namespace strata::lm
