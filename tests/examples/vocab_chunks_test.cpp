// The vocabulary's chunks (examples/lm/vocab_chunks.h): the row layout, the padding to a
// multiple of 128 at the end of the last chunk, and the chunk tensors' init. The compute
// (lm::VocabHead) is tested through the models: gpt_model_test and llama_model_test
// compare chunked and one-chunk runs and the models against PyTorch.
#include "examples/lm/vocab_chunks.h"

#include <gtest/gtest.h>

namespace strata::lm {
namespace {

TEST(VocabChunksTest, Gpt2sVocabularyIsPaddedTo50304InTwentyChunksOf2560Rows) {
  const VocabChunks c = make_vocab_chunks(50257, 1600, size_t{16} << 20);  // 2621 rows fit: 2560, a multiple of 128
  EXPECT_EQ(c.padded_vocab, 50304);
  EXPECT_EQ(c.rows_per_chunk, 2560);
  EXPECT_EQ(c.count, 20);
  EXPECT_EQ(c.rows(18), 2560);
  EXPECT_EQ(c.rows(19), 50304 - 19 * 2560);
  EXPECT_EQ(c.real_rows(19), 50257 - 19 * 2560);
  EXPECT_EQ(c.max_rows(), 2560);
  EXPECT_EQ(c.chunk_of(50256), 19);
  EXPECT_EQ(c.chunk_of(2559), 0);
  EXPECT_EQ(c.chunk_of(2560), 1);
}

TEST(VocabChunksTest, AVocabularyThatIsAMultipleOf128GetsNoPadding) {
  for (int64_t vocab : {128256, 32000, 151936}) {
    const VocabChunks c = make_vocab_chunks(vocab, 2048, size_t{64} << 20);
    EXPECT_EQ(c.padded_vocab, vocab);
    int64_t rows = 0;
    for (int64_t k = 0; k < c.count; ++k) {
      EXPECT_EQ(c.rows(k), c.real_rows(k)) << vocab << " chunk " << k;
      rows += c.rows(k);
    }
    EXPECT_EQ(rows, vocab);
  }
}

TEST(VocabChunksTest, ChunksSmallerThan128RowsPutThePaddingInTheLastChunkWhichIsNeverAllPadding) {
  const VocabChunks c = make_vocab_chunks(301, 18, 64 * 18 * 4);
  EXPECT_EQ(c.padded_vocab, 384);
  EXPECT_EQ(c.rows_per_chunk, 64);
  EXPECT_EQ(c.count, 5);
  EXPECT_EQ(c.rows(4), 128);
  EXPECT_EQ(c.real_rows(4), 45);
  EXPECT_EQ(c.max_rows(), 128);
  const TensorSpec last = vocab_chunk_tensor(c, 4, "weight", 18, TensorInit::normal(0.02f));
  EXPECT_EQ(last.shape, (std::vector<int64_t>{128, 18}));
  EXPECT_EQ(last.init.rows, 45);
  EXPECT_FALSE(last.weight_decay);
  // A budget under one row still gives one-row chunks (the models refuse such an option).
  EXPECT_EQ(make_vocab_chunks(301, 18, 1).rows_per_chunk, 1);
  EXPECT_EQ(vocab_chunk_of_group("wte.12", "wte"), 12);
  EXPECT_EQ(vocab_chunk_of_group("wtex.1", "wte"), -1);
  EXPECT_EQ(vocab_chunk_of_group("wpe", "wte"), -1);
}

}  // namespace
}  // namespace strata::lm
