// Counter-based random numbers for initialization.
//
// Every element's initial value is a pure function of (seed, group, element index), so
// rank r can write just its own shard, the initial model is the same for every world
// size, and the whole model never has to exist in one memory. The generator is
// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"), the
// same family cuRAND and PyTorch use for counter-based streams.
#pragma once

#include <array>
#include <cstdint>

namespace strata {

// Philox4x32 with 10 rounds: 128-bit counter, 64-bit key -> 4 x 32 random bits.
inline std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t product0 = static_cast<uint64_t>(kMul0) * counter[0];
    const uint64_t product1 = static_cast<uint64_t>(kMul1) * counter[2];
    counter = {static_cast<uint32_t>(product1 >> 32) ^ counter[1] ^ key[0], static_cast<uint32_t>(product1),
               static_cast<uint32_t>(product0 >> 32) ^ counter[3] ^ key[1], static_cast<uint32_t>(product0)};
    key[0] += kWeyl0;
    key[1] += kWeyl1;
  }
  return counter;
}

// A standard normal value for element `index` of stream (seed, stream_id), by Box-Muller
// on two uniforms in (0, 1]. Deterministic and independent of how elements are split.
float counter_normal(uint64_t seed, uint64_t stream_id, uint64_t index);
// A uniform value in [0, 1) for the same key.
float counter_uniform(uint64_t seed, uint64_t stream_id, uint64_t index);

}  // namespace strata
