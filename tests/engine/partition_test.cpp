#include "engine/partition.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "engine/counter_rng.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

GroupSpec block_spec() {
  return {"h.0",
          {{"ln.weight", {55}, TensorInit::ones(), false},
           {"attn.weight", {55, 165}, TensorInit::normal(0.02f), true},
           {"attn.bias", {165}, TensorInit::zeros(), false},
           {"proj.weight", {7, 3, 5}, TensorInit::uniform(0.1f), true}}};
}

TEST(PartitionTest, LayoutIsAlignedPaddedAndIndependentOfWorldSizeButForPadding) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto one, layout_group(block_spec(), 3, 1));
  for (int world : {2, 3, 4, 7}) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto many, layout_group(block_spec(), 3, world));
    ASSERT_EQ(many.tensors.size(), one.tensors.size());
    for (size_t t = 0; t < one.tensors.size(); ++t) EXPECT_EQ(many.tensors[t].offset, one.tensors[t].offset);
    EXPECT_EQ(many.numel, one.numel);
    EXPECT_EQ(many.padded_numel % (kShardAlignElements * world), 0u);
    EXPECT_EQ(many.shard_numel * world, many.padded_numel);
    EXPECT_GE(many.padded_numel, many.numel);
  }
  for (const auto& t : one.tensors) EXPECT_EQ(t.offset % kTensorAlignElements, 0u) << t.name;
  EXPECT_EQ(one.tensors[1].numel, 55u * 165u);
  EXPECT_EQ(one.tensor_at(one.tensors[1].offset), 1);
  EXPECT_EQ(one.tensor_at(one.tensors[0].offset + 55), -1);  // the gap after ln.weight
  EXPECT_EQ(one.tensor_at(one.numel), -1);                   // tail padding
}

TEST(PartitionTest, ShardsConcatenateToTheSameModelForEveryWorldSize) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto one, layout_group(block_spec(), 5, 1));
  std::vector<float> whole(one.shard_numel);
  init_shard(one, 0, 1234, whole.data());
  for (int world : {2, 4, 7}) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto many, layout_group(block_spec(), 5, world));
    std::vector<float> joined(many.padded_numel);
    for (int r = 0; r < world; ++r) init_shard(many, r, 1234, joined.data() + many.shard_begin(r));
    ASSERT_EQ(std::memcmp(joined.data(), whole.data(), one.numel * sizeof(float)), 0) << "world " << world;
    for (size_t e = one.numel; e < many.padded_numel; ++e) ASSERT_EQ(joined[e], 0.0f);
  }
  // The init specs are honoured.
  EXPECT_EQ(whole[one.tensors[0].offset], 1.0f);
  EXPECT_EQ(whole[one.tensors[2].offset + 17], 0.0f);
  double sum = 0, sum_sq = 0;
  const auto& w = one.tensors[1];
  for (size_t e = w.offset; e < w.offset + w.numel; ++e) {
    sum += whole[e];
    sum_sq += double(whole[e]) * whole[e];
  }
  const double mean = sum / w.numel, std = std::sqrt(sum_sq / w.numel - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.002);
  EXPECT_NEAR(std, 0.02, 0.001);
  for (size_t e = one.tensors[3].offset; e < one.tensors[3].offset + one.tensors[3].numel; ++e) {
    EXPECT_GE(whole[e], -0.1f);
    EXPECT_LT(whole[e], 0.1f);
  }
  // A different seed gives a different model.
  std::vector<float> other(one.shard_numel);
  init_shard(one, 0, 1235, other.data());
  EXPECT_NE(std::memcmp(other.data() + w.offset, whole.data() + w.offset, 64), 0);
}

// A shard drawn in ranges of odd lengths is the shard drawn whole, on every rank.
TEST(PartitionTest, AShardDrawnInRangesIsTheShardDrawnWhole) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto layout, layout_group(block_spec(), 5, 3));
  for (int r = 0; r < 3; ++r) {
    std::vector<float> whole(layout.shard_numel), parts(layout.shard_numel, -1.0f);
    init_shard(layout, r, 99, whole.data());
    for (size_t first = 0, length = 1; first < layout.shard_numel; first += length, length = length * 3 + 1)
      init_shard_range(layout, r, 99, first, std::span<float>(parts).subspan(first, std::min(length, layout.shard_numel - first)));
    ASSERT_EQ(parts, whole) << "rank " << r;
  }
}

// A vocabulary padded inside the model: only TensorInit::rows rows are drawn, the rest
// are zero, on every rank, whatever the world size; the drawn rows are those of the full init.
TEST(PartitionTest, RowsPastTheInitsRowsAreZero) {
  GroupSpec spec{"wte.4", {{"weight", {7, 5}, TensorInit::normal(0.02f).with_rows(3), false}}};
  GroupSpec full = spec;
  full.tensors[0].init.rows = 0;
  for (int world : {1, 2, 3}) {
    STRATA_ASSERT_OK_AND_ASSIGN(GroupLayout padded, layout_group(spec, 4, world));
    STRATA_ASSERT_OK_AND_ASSIGN(GroupLayout drawn, layout_group(full, 4, world));
    for (int rank = 0; rank < world; ++rank) {
      std::vector<float> a(padded.shard_numel), b(drawn.shard_numel);
      init_shard(padded, rank, 11, a.data());
      init_shard(drawn, rank, 11, b.data());
      for (size_t i = 0; i < a.size(); ++i) {
        const size_t e = padded.shard_begin(rank) + i;
        if (e < 15) EXPECT_EQ(a[i], b[i]) << "element " << e;
        else EXPECT_EQ(a[i], 0.0f) << "element " << e;
      }
    }
  }
}

TEST(PartitionTest, DecayRunsCoverTheShardAndFollowTheTensors) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto layout, layout_group(block_spec(), 0, 3));
  for (int r = 0; r < 3; ++r) {
    const auto runs = decay_runs(layout, r);
    ASSERT_FALSE(runs.empty());
    EXPECT_EQ(runs.front().begin, 0u);
    EXPECT_EQ(runs.back().end, layout.shard_numel);
    for (size_t i = 1; i < runs.size(); ++i) EXPECT_EQ(runs[i].begin, runs[i - 1].end);
    for (const auto& run : runs) {
      for (size_t s = run.begin; s < run.end; ++s) {
        const int t = layout.tensor_at(layout.shard_begin(r) + s);
        if (t >= 0) {
          ASSERT_EQ(layout.tensors[t].weight_decay, run.decay) << "rank " << r << " element " << s;
        }
      }
    }
  }
}

TEST(PartitionTest, BadSpecsNameTheProblem) {
  auto empty = layout_group({"g", {}}, 0, 1);
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("'g' has no tensors"), std::string::npos);
  auto dup = layout_group({"g", {{"w", {2}}, {"w", {3}}}}, 0, 1);
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find("two tensors named 'w'"), std::string::npos);
  auto zero = layout_group({"g", {{"w", {2, 0}}}}, 0, 1);
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.status().message().find("g/w"), std::string::npos);
}

TEST(CounterRngTest, PhiloxMatchesTheKnownAnswer) {
  // Known-answer vector of the Random123 distribution for philox4x32_10 (counter and key all ones bits).
  const auto out = philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu});
  EXPECT_EQ(out[0], 0x408f276du);
  EXPECT_EQ(out[1], 0x41c83b0eu);
  EXPECT_EQ(out[2], 0xa20bc7c6u);
  EXPECT_EQ(out[3], 0x6d5451fdu);
  const auto zero = philox4x32({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(zero[0], 0x6627e8d5u);
  EXPECT_EQ(zero[1], 0xe169c58du);
  EXPECT_EQ(zero[2], 0xbc57ac4cu);
  EXPECT_EQ(zero[3], 0x9b00dbd8u);
}

}  // namespace
}  // namespace strata
