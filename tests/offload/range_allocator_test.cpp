#include "offload/range_allocator.h"

#include <gtest/gtest.h>

#include <set>
#include <vector>

namespace strata::internal {
namespace {

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * 1024;
constexpr RangeColouring kArenaColouring{.gap_bytes = 4 * kKiB, .min_bytes = kMiB};

// The residues modulo `modulus` of the offsets of `count` back-to-back allocations of `bytes`.
std::set<size_t> start_residues(RangeAllocator& allocator, size_t bytes, int count, size_t modulus) {
  std::set<size_t> residues;
  for (int i = 0; i < count; ++i) {
    const std::optional<size_t> offset = allocator.allocate(bytes);
    EXPECT_TRUE(offset.has_value()) << "allocation " << i << " of " << bytes << " bytes";
    if (!offset) break;
    EXPECT_EQ(*offset % 4096, 0u);  // colouring keeps the O_DIRECT alignment
    residues.insert(*offset % modulus);
  }
  return residues;
}

TEST(RangeAllocatorTest, UncolouredEqualPowerOfTwoAllocationsAlias) {
  // The layout colouring exists to avoid: packed 4 MiB buffers all start at 0 mod 2 MiB.
  RangeAllocator allocator(64 * kMiB, 4 * kKiB);
  EXPECT_EQ(start_residues(allocator, 4 * kMiB, 8, 2 * kMiB).size(), 1u);
}

TEST(RangeAllocatorTest, ColouredEqualPowerOfTwoAllocationsStartAtDistinctAddressesModuloTwoMiB) {
  for (const size_t bytes : {kMiB, 4 * kMiB, 16 * kMiB}) {
    RangeAllocator allocator(8 * (bytes + 4 * kKiB), 4 * kKiB, kArenaColouring);
    EXPECT_EQ(start_residues(allocator, bytes, 8, 2 * kMiB).size(), 8u) << bytes << " bytes";
  }
}

TEST(RangeAllocatorTest, ColouredAllocationsStayDistinctModuloTwoMiBAcrossAFullPeriod) {
  // 512 = 2 MiB / 4 KiB buffers in a row: every residue modulo 2 MiB is used once.
  RangeAllocator allocator(512 * (kMiB + 4 * kKiB), 4 * kKiB, kArenaColouring);
  EXPECT_EQ(start_residues(allocator, kMiB, 512, 2 * kMiB).size(), 512u);
}

TEST(RangeAllocatorTest, FootprintAddsTheGapFromTheThresholdOn) {
  const RangeAllocator coloured(16 * kMiB, 4 * kKiB, kArenaColouring);
  EXPECT_EQ(coloured.footprint(4 * kKiB), 4 * kKiB);
  EXPECT_EQ(coloured.footprint(kMiB - 4 * kKiB), kMiB - 4 * kKiB);
  EXPECT_EQ(coloured.footprint(kMiB), kMiB + 4 * kKiB);
  EXPECT_EQ(coloured.footprint(3 * kMiB + 8 * kKiB), 3 * kMiB + 12 * kKiB);
  const RangeAllocator packed(16 * kMiB, 4 * kKiB);
  EXPECT_EQ(packed.footprint(kMiB), kMiB);
}

TEST(RangeAllocatorTest, ColouredAllocationsTakeTheirGapAndGiveItBack) {
  RangeAllocator allocator(4 * kMiB, 4 * kKiB, kArenaColouring);
  const std::optional<size_t> big = allocator.allocate(2 * kMiB);
  const std::optional<size_t> small = allocator.allocate(64 * kKiB);
  ASSERT_TRUE(big && small);
  EXPECT_EQ(*big, 0u);
  EXPECT_EQ(*small, 2 * kMiB + 4 * kKiB);  // after the gap
  EXPECT_EQ(allocator.free_bytes(), 4 * kMiB - 2 * kMiB - 4 * kKiB - 64 * kKiB);
  // A request whose footprint does not fit is refused even though its bytes would.
  const size_t left = allocator.largest_free();
  ASSERT_GE(left, kMiB);
  EXPECT_FALSE(allocator.allocate(left).has_value());
  const std::optional<size_t> rest = allocator.allocate(left - 4 * kKiB);
  ASSERT_TRUE(rest.has_value());
  EXPECT_EQ(allocator.free_bytes(), 0u);
  allocator.free(*rest, left - 4 * kKiB);
  allocator.free(*big, 2 * kMiB);
  allocator.free(*small, 64 * kKiB);
  // Everything coalesced back into one range.
  EXPECT_EQ(allocator.free_bytes(), 4 * kMiB);
  EXPECT_EQ(allocator.largest_free(), 4 * kMiB);
}

TEST(RangeAllocatorTest, BestFitReusesAFreedColouredHoleForTheSameSize) {
  RangeAllocator allocator(16 * kMiB, 4 * kKiB, kArenaColouring);
  std::vector<size_t> offsets;
  for (int i = 0; i < 3; ++i) offsets.push_back(*allocator.allocate(4 * kMiB));
  allocator.free(offsets[1], 4 * kMiB);
  EXPECT_EQ(allocator.allocate(4 * kMiB), offsets[1]);
}

}  // namespace
}  // namespace strata::internal
