// Model FLOPs (examples/lm/model_flops.h) against sums written out from each GEMM's shape:
// a forward product of [m, k] by [k, n] is 2 m n k FLOPs and backward twice that (the
// input and the weight gradients), attention's scores and values 2 T T head_dim each per
// head forward. Odd sizes, so a swapped or dropped dimension changes the total.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>

#include "examples/gpt/gpt_architecture.h"
#include "examples/llama/llama_architecture.h"
#include "examples/lm/model_flops.h"
#include "examples/models/linear_stack.h"

namespace strata::lm {
namespace {

// 2 m n k: one forward product.
int64_t gemm(int64_t m, int64_t n, int64_t k) { return 2 * m * n * k; }

TEST(ModelFlopsTest, Gpt2CountsEveryProjectionTheTiedHeadAndFullCausalAttention) {
  const int64_t L = 2, C = 24, heads = 3, hd = 8, V = 301, T = 7;
  auto arch = gpt::GptArchitecture::create({.n_layer = L, .n_head = heads, .n_embd = C, .n_ctx = T, .vocab_size = V});
  ASSERT_TRUE(arch.ok()) << arch.status().to_string();

  // One sequence of T tokens, forward.
  const int64_t block = gemm(T, 3 * C, C)          // c_attn
                        + gemm(T, C, C)            // attn.c_proj
                        + gemm(T, 4 * C, C)        // c_fc
                        + gemm(T, C, 4 * C)        // mlp.c_proj
                        + heads * gemm(T, T, hd)   // scores Q K^T, masked half included
                        + heads * gemm(T, hd, T);  // P V
  const int64_t forward = L * block + gemm(T, V, C);  // the head reads wte (tied): still a product
  const int64_t per_sequence = 3 * forward;           // backward: 2x forward
  ASSERT_EQ(per_sequence % T, 0);

  const FlopShape shape = (*arch)->flop_shape();
  EXPECT_EQ(training_flops_per_token(shape, T), per_sequence / T);
  EXPECT_EQ(training_step_flops(shape, T, 5 * T), double(5 * per_sequence));
}

TEST(ModelFlopsTest, LlamaCountsSwiGluGroupedKeyValueHeadsAndTheUntiedHead) {
  StatusOr<llama::LlamaConfig> preset = llama::llama_preset("llama-tiny");
  ASSERT_TRUE(preset.ok());
  llama::LlamaConfig config = *preset;
  const int64_t L = 2, H = 24, heads = 4, kv_heads = 2, hd = 8, I = 40, V = 301, T = 7;  // heads x hd = 32, not H
  config.num_hidden_layers = L;
  config.hidden_size = H;
  config.num_attention_heads = heads;
  config.num_key_value_heads = kv_heads;
  config.head_dim = hd;
  config.intermediate_size = I;
  config.vocab_size = V;
  config.tie_word_embeddings = false;
  auto arch = llama::LlamaArchitecture::create(config);
  ASSERT_TRUE(arch.ok()) << arch.status().to_string();

  const int64_t block = gemm(T, heads * hd, H)       // q_proj
                        + gemm(T, kv_heads * hd, H)  // k_proj
                        + gemm(T, kv_heads * hd, H)  // v_proj
                        + gemm(T, H, heads * hd)     // o_proj
                        + gemm(T, I, H)              // gate_proj
                        + gemm(T, I, H)              // up_proj
                        + gemm(T, H, I)              // down_proj
                        + heads * gemm(T, T, hd)     // every query head forms its scores, shared K or not
                        + heads * gemm(T, hd, T);
  const int64_t per_sequence = 3 * (L * block + gemm(T, V, H));  // lm_head; embed_tokens is a lookup
  ASSERT_EQ(per_sequence % T, 0);
  EXPECT_EQ(training_flops_per_token((*arch)->flop_shape(), T), per_sequence / T);

  config.tie_word_embeddings = true;  // fewer parameters, the same products
  auto tied = llama::LlamaArchitecture::create(config);
  ASSERT_TRUE(tied.ok()) << tied.status().to_string();
  EXPECT_EQ(training_flops_per_token((*tied)->flop_shape(), T), per_sequence / T);
}

TEST(ModelFlopsTest, TheLinearStacksInputProjectionHasNoInputGradient) {
  const models::LinearStackConfig config{.features = 5, .width = 11, .layers = 3};
  const int64_t f = 5, w = 11, rows = 13;
  const int64_t forward = gemm(rows, w, f) + 3 * gemm(rows, w, w) + gemm(rows, f, w);
  const int64_t backward = gemm(rows, w, f)                      // dE of the input projection only
                           + 2 * (3 * gemm(rows, w, w) + gemm(rows, f, w));  // dx and dweight
  EXPECT_EQ(training_step_flops(models::linear_stack_flop_shape(config), 1, rows), double(forward + backward));
}

TEST(ModelFlopsTest, TflopsIsFlopsPerSecondOverATrillionAndZeroWithoutTime) {
  EXPECT_DOUBLE_EQ(tflops(3e12, 2.0), 1.5);
  EXPECT_EQ(tflops(3e12, 0.0), 0.0);
}

}  // namespace
}  // namespace strata::lm
