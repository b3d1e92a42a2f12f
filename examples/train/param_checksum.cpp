#include "examples/train/param_checksum.h"

#include <bit>
#include <cstdio>

namespace strata::train {
namespace {

// splitmix64's finalizer: a bijective 64-bit mixer.
uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

}  // namespace

uint64_t master_checksum_part(const GroupLayout& layout, int rank, std::span<const float> shard, size_t first) {
  uint64_t sum = 0;
  const size_t begin = layout.shard_begin(rank) + first;
  const uint64_t group_key = mix64(0x5354524154410000ull + static_cast<uint64_t>(layout.id));
  for (size_t i = 0; i < shard.size() && begin + i < layout.numel; ++i) {
    const uint64_t bits = std::bit_cast<uint32_t>(shard[i]);
    sum += mix64(group_key ^ mix64(static_cast<uint64_t>(begin + i)) ^ (bits * 0x9e3779b97f4a7c15ull));
  }
  return sum;
}

std::string checksum_hex(uint64_t checksum) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(checksum));
  return text;
}

}  // namespace strata::train
