#include "python/src/packing.h"

#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <vector>

namespace strata::python {
namespace {

TEST(PackFactor, IsTwoForSixteenBitElementsInFp32WordsAndOneOtherwise) {
  EXPECT_EQ(pack_factor(DType::kBFloat16, DType::kFloat32), 2u);
  EXPECT_EQ(pack_factor(DType::kFloat16, DType::kFloat32), 2u);
  EXPECT_EQ(pack_factor(DType::kFloat32, DType::kFloat32), 1u);
  EXPECT_EQ(pack_factor(DType::kFloat32, DType::kBFloat16), 1u);
  EXPECT_EQ(pack_factor(DType::kBFloat16, DType::kBFloat16), 1u);
  EXPECT_EQ(packed_words(7, 2), 4);
  EXPECT_EQ(packed_words(8, 2), 4);
  EXPECT_EQ(packed_words(1, 2), 1);
}

// Values every 16-bit dtype holds exactly, some negative, some tiny.
std::vector<float> representable(size_t n, DType dtype) {
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) {
    const float raw = (static_cast<float>(i % 97) - 48.0f) * 0.0625f + static_cast<float>(i) * 1e-3f;
    values[i] = dtype == DType::kBFloat16 ? bf16_bits_to_float(float_to_bf16_bits(raw)) : fp16_bits_to_float(float_to_fp16_bits(raw));
  }
  return values;
}

TEST(PackElements, RoundTripsBitForBitAtOddSizesForBothSixteenBitDtypes) {
  for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (const size_t words : {size_t{1}, size_t{3}, size_t{501}}) {
      const std::vector<float> values = representable(2 * words, dtype);
      std::vector<float> packed(words, -1.0f), back(2 * words, -1.0f);
      pack_elements(values, dtype, packed);
      unpack_elements(packed, dtype, back);
      for (size_t i = 0; i < values.size(); ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(back[i]), std::bit_cast<uint32_t>(values[i])) << dtype_name(dtype) << " " << words << " " << i;
    }
  }
}

TEST(PackElements, PutsElementIAtTheIthSixteenBitsOfTheWords) {
  const std::vector<float> values = {1.0f, -2.0f, 0.5f};
  std::vector<float> words(2, 0.0f);
  pack_elements(values, DType::kBFloat16, words);
  uint16_t halves[4];
  std::memcpy(halves, words.data(), sizeof(halves));
  EXPECT_EQ(halves[0], float_to_bf16_bits(1.0f));
  EXPECT_EQ(halves[1], float_to_bf16_bits(-2.0f));
  EXPECT_EQ(halves[2], float_to_bf16_bits(0.5f));
}

TEST(LogicalLayout, CountsEveryOffsetAndSizeInElements) {
  GroupLayout words;
  words.id = 3;
  words.name = "frozen";
  words.trainable = false;
  words.tensors = {TensorLayout{"a", {11}, {}, true, 0, 11}, TensorLayout{"b", {2}, {}, true, 16, 2}};
  words.numel = 18;
  words.shard_numel = 24;
  words.padded_numel = 48;
  words.world_size = 2;
  const GroupLayout logical = logical_layout(words, {{7, 3}, {3}}, 2);
  ASSERT_EQ(logical.tensors.size(), 2u);
  EXPECT_EQ(logical.tensors[0].shape, (std::vector<int64_t>{7, 3}));
  EXPECT_EQ(logical.tensors[0].numel, 21u);
  EXPECT_EQ(logical.tensors[0].offset, 0u);
  EXPECT_EQ(logical.tensors[1].offset, 32u);
  EXPECT_EQ(logical.tensors[1].numel, 3u);
  EXPECT_EQ(logical.numel, 35u);
  EXPECT_EQ(logical.shard_numel, 48u);
  EXPECT_EQ(logical.padded_numel, 96u);
  EXPECT_EQ(logical.shard_begin(1), 48u);
  EXPECT_EQ(logical.id, 3);
  EXPECT_FALSE(logical.trainable);
}

}  // namespace
}  // namespace strata::python
