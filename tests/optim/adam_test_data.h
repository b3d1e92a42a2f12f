// Shared helpers of the Adam tests: a shard of random state in every dtype, and
// bit-level comparisons that count units in the last place.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "engine/core/dtype.h"
#include "kernels/adam.h"

namespace strata::testing {

// Host storage for one shard; buffers() points an AdamBuffers at it, starting `offset`
// elements in (an offset of 1 makes every array misaligned for vector stores).
struct AdamShardData {
  DType grad_type = DType::kBFloat16;
  DType moment_type = DType::kFloat32;
  bool write_param = true;
  DType param_type = DType::kBFloat16;
  size_t count = 0;
  size_t offset = 0;
  std::vector<uint8_t> grad, exp_avg, exp_avg_sq, param;
  std::vector<float> master;

  static AdamShardData random(size_t count, DType grad_type, DType moment_type, bool write_param, DType param_type, uint32_t seed,
                              size_t offset = 0) {
    AdamShardData d;
    d.grad_type = grad_type;
    d.moment_type = moment_type;
    d.write_param = write_param;
    d.param_type = param_type;
    d.count = count;
    d.offset = offset;
    const size_t n = count + offset;
    d.grad.assign(n * dtype_size(grad_type), 0);
    d.exp_avg.assign(n * dtype_size(moment_type), 0);
    d.exp_avg_sq.assign(n * dtype_size(moment_type), 0);
    d.param.assign(n * dtype_size(param_type), 0xAB);
    d.master.assign(n, 0.0f);
    // A counter-based generator (fast enough for shards of millions): values of either
    // sign spread over five decades.
    auto uniform = [seed](uint64_t i, uint64_t stream) {
      uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ (static_cast<uint64_t>(seed) << 32 | stream) * 0xbf58476d1ce4e5b9ull;
      x ^= x >> 31;
      x *= 0x94d049bb133111ebull;
      x ^= x >> 29;
      return static_cast<float>(static_cast<double>(x >> 11) * 0x1.0p-53 * 2.0 - 1.0);  // [-1, 1)
    };
    static constexpr float kDecades[] = {1e-4f, 1e-3f, 1e-2f, 1e-1f, 1.0f, 10.0f};
    for (size_t i = 0; i < n; ++i) {
      const float scale = kDecades[static_cast<size_t>((uniform(i, 5) + 1.0f) * 3.0f) % 6];
      store_from_float(d.grad.data(), grad_type, i, uniform(i, 1) * scale);
      d.master[i] = uniform(i, 2) * 2.0f;
      store_from_float(d.exp_avg.data(), moment_type, i, uniform(i, 3) * 1e-2f);
      store_from_float(d.exp_avg_sq.data(), moment_type, i, std::abs(uniform(i, 4)) * 1e-4f);
    }
    // Edge values where the shard is long enough: a subnormal master (bf16 rounding of
    // subnormals), a zero gradient and moments, a negative zero, a large gradient.
    auto at = [&](size_t i) { return offset + i; };
    if (count > 3) d.master[at(3)] = 1e-40f;
    if (count > 5) {
      store_from_float(d.grad.data(), grad_type, at(5), 0.0f);
      store_from_float(d.exp_avg.data(), moment_type, at(5), 0.0f);
      store_from_float(d.exp_avg_sq.data(), moment_type, at(5), 0.0f);
    }
    if (count > 6) d.master[at(6)] = -0.0f;
    if (count > 9) store_from_float(d.grad.data(), grad_type, at(9), grad_type == DType::kFloat16 ? 60000.0f : 3e4f);
    if (count > 12) d.master[at(12)] = -3e-39f;
    return d;
  }

  kernels::AdamBuffers buffers() {
    kernels::AdamBuffers b;
    b.grad = grad.data() + offset * dtype_size(grad_type);
    b.grad_type = grad_type;
    b.master = master.data() + offset;
    b.exp_avg = exp_avg.data() + offset * dtype_size(moment_type);
    b.exp_avg_sq = exp_avg_sq.data() + offset * dtype_size(moment_type);
    b.moment_type = moment_type;
    b.param = write_param ? param.data() + offset * dtype_size(param_type) : nullptr;
    b.param_type = param_type;
    b.count = count;
    return b;
  }
};

// Distance in units in the last place between two fp32 values; NaN equals NaN, and
// +0/-0 are one apart (the sign of zero is part of the result).
inline uint64_t ulp_distance(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return 0;
  if (std::isnan(a) || std::isnan(b)) return UINT64_MAX;
  auto ordered = [](float x) {
    const int64_t bits = std::bit_cast<int32_t>(x);
    return bits < 0 ? -(bits & 0x7fffffff) - 1 : bits;
  };
  const int64_t d = ordered(a) - ordered(b);
  return static_cast<uint64_t>(d < 0 ? -d : d);
}

// As ulp_distance, for element i of two arrays of `type` (distances in that type's ulps).
inline uint64_t element_ulp_distance(const void* a, const void* b, DType type, size_t i) {
  if (type == DType::kFloat32) return ulp_distance(static_cast<const float*>(a)[i], static_cast<const float*>(b)[i]);
  const uint16_t x = static_cast<const uint16_t*>(a)[i], y = static_cast<const uint16_t*>(b)[i];
  const float fx = load_as_float(a, type, i), fy = load_as_float(b, type, i);
  if (std::isnan(fx) && std::isnan(fy)) return 0;
  auto ordered = [](uint16_t bits) { return (bits & 0x8000) ? -static_cast<int32_t>(bits & 0x7fff) - 1 : static_cast<int32_t>(bits); };
  const int32_t d = ordered(x) - ordered(y);
  return static_cast<uint64_t>(d < 0 ? -d : d);
}

struct ShardDiff {
  uint64_t max_ulps = 0;
  std::string where;  // the first element at the maximum
};

// The largest element-wise distance between two shards' state and parameter copies.
inline ShardDiff compare_shards(AdamShardData& got, AdamShardData& want) {
  ShardDiff diff;
  if (got.master == want.master && got.exp_avg == want.exp_avg && got.exp_avg_sq == want.exp_avg_sq && got.param == want.param)
    return diff;  // identical bytes: the common case, checked fast
  const kernels::AdamBuffers g = got.buffers(), w = want.buffers();
  auto consider = [&](uint64_t ulps, const char* array, size_t i) {
    if (ulps > diff.max_ulps) {
      diff.max_ulps = ulps;
      diff.where = std::string(array) + "[" + std::to_string(i) + "]";
    }
  };
  for (size_t i = 0; i < got.count; ++i) {
    consider(ulp_distance(g.master[i], w.master[i]), "master", i);
    consider(element_ulp_distance(g.exp_avg, w.exp_avg, got.moment_type, i), "exp_avg", i);
    consider(element_ulp_distance(g.exp_avg_sq, w.exp_avg_sq, got.moment_type, i), "exp_avg_sq", i);
    if (got.write_param) consider(element_ulp_distance(g.param, w.param, got.param_type, i), "param", i);
  }
  return diff;
}

}  // namespace strata::testing
