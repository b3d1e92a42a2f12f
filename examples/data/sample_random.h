// The synthetic language's and the file datasets' random draws (internal to examples/data):
// splitmix64 for the language's construction, Philox for each sample's draws, so a sample
// depends only on (seed, split, index) and is the same on every platform and rank.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "engine/counter_rng.h"
#include "examples/data/token_data.h"

namespace strata::data::internal {

// splitmix64: the language's construction (permutations, offsets) draws from this; it is
// fully specified, unlike std::uniform_int_distribution, so the language is the same on
// every platform.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound), without modulo bias (rejection).
  uint64_t below(uint64_t bound) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    uint64_t value;
    do {
      value = next();
    } while (value >= limit);
    return value % bound;
  }

 private:
  uint64_t state_;
};

inline std::vector<int32_t> random_permutation(int64_t size, SplitMix64& rng) {
  std::vector<int32_t> permutation(static_cast<size_t>(size));
  std::iota(permutation.begin(), permutation.end(), 0);
  for (int64_t i = size - 1; i > 0; --i) {
    std::swap(permutation[static_cast<size_t>(i)], permutation[rng.below(static_cast<uint64_t>(i) + 1)]);
  }
  return permutation;
}

__extension__ using Uint128 = unsigned __int128;

// A stream of counter-based random 32-bit words for one sample: Philox keyed by the data
// seed, counter (sample index, split and stream tag, block).
class SampleRandom {
 public:
  SampleRandom(uint64_t seed, DataSplit split, uint64_t index, uint32_t tag)
      : key_{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)},
        counter_{static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                 (static_cast<uint32_t>(split) << 16) | tag, 0} {}
  uint32_t next() {
    if (used_ == 4) {
      block_ = philox4x32(counter_, key_);
      ++counter_[3];
      used_ = 0;
    }
    return block_[used_++];
  }
  // Uniform in [0, bound) for bound <= 2^32 (multiply-shift on 64 random bits; the bias is
  // below bound / 2^64).
  uint64_t below(uint64_t bound) {
    const uint64_t bits = (static_cast<uint64_t>(next()) << 32) | next();
    return static_cast<uint64_t>((static_cast<Uint128>(bits) * bound) >> 64);
  }

 private:
  std::array<uint32_t, 2> key_;
  std::array<uint32_t, 4> counter_;
  std::array<uint32_t, 4> block_{};
  int used_ = 4;
};

constexpr uint32_t kTagSynthetic = 0x5359;
constexpr uint32_t kTagWindow = 0x5749;

}  // namespace strata::data::internal
