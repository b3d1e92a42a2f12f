#include "engine/counter_rng.h"

#include <cmath>

namespace strata {
namespace {
std::array<uint32_t, 4> draw(uint64_t seed, uint64_t stream_id, uint64_t index) {
  return philox4x32({static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32), static_cast<uint32_t>(stream_id),
                     static_cast<uint32_t>(stream_id >> 32)},
                    {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
}
// 24 random bits -> (0, 1].
inline float unit_open_closed(uint32_t bits) { return (static_cast<float>(bits >> 8) + 1.0f) * (1.0f / 16777216.0f); }
}  // namespace

float counter_normal(uint64_t seed, uint64_t stream_id, uint64_t index) {
  const auto bits = draw(seed, stream_id, index);
  // Box-Muller in double so the result does not depend on float contraction choices.
  const double u1 = unit_open_closed(bits[0]);
  const double u2 = unit_open_closed(bits[1]);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

float counter_uniform(uint64_t seed, uint64_t stream_id, uint64_t index) {
  const auto bits = draw(seed, stream_id, index);
  return static_cast<float>(bits[0] >> 8) * (1.0f / 16777216.0f);
}

}  // namespace strata
