#include "engine/core/rank_order_reduction.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace strata {
namespace {

// Loaders give w(x), the fp32 value of an element as it travels (communicator.h).
struct LoadFloat {
  static float load(const std::byte* data, size_t i) { return reinterpret_cast<const float*>(data)[i]; }
};
struct LoadFloatViaBf16 {
  static float load(const std::byte* data, size_t i) {
    return bf16_bits_to_float(float_to_bf16_bits(reinterpret_cast<const float*>(data)[i]));
  }
};
struct LoadFloatViaFp16 {
  static float load(const std::byte* data, size_t i) {
    return fp16_bits_to_float(float_to_fp16_bits(reinterpret_cast<const float*>(data)[i]));
  }
};
struct LoadBf16 {
  static float load(const std::byte* data, size_t i) { return bf16_bits_to_float(reinterpret_cast<const uint16_t*>(data)[i]); }
};
struct LoadFp16 {
  static float load(const std::byte* data, size_t i) { return fp16_bits_to_float(reinterpret_cast<const uint16_t*>(data)[i]); }
};

inline float max_propagating_nan(float accumulated, float value) {
  if (std::isnan(accumulated)) return accumulated;
  if (std::isnan(value) || value > accumulated) return value;
  return accumulated;
}

// Reduces elements [begin, end): out[i] = combine over ranks in rank order.
template <class Loader>
void reduce_range(std::span<const std::byte* const> inputs, size_t begin, size_t end, ReduceOp op, DType out_type,
                  std::byte* out) {
  constexpr size_t kBlock = 512;
  float accumulator[kBlock];
  const size_t ranks = inputs.size();
  const float divisor = static_cast<float>(ranks);
  for (size_t block = begin; block < end; block += kBlock) {
    const size_t length = std::min(kBlock, end - block);
    for (size_t i = 0; i < length; ++i) accumulator[i] = Loader::load(inputs[0], block + i);
    for (size_t rank = 1; rank < ranks; ++rank) {
      const std::byte* input = inputs[rank];
      if (op == ReduceOp::kMax) {
        for (size_t i = 0; i < length; ++i) accumulator[i] = max_propagating_nan(accumulator[i], Loader::load(input, block + i));
      } else {
        for (size_t i = 0; i < length; ++i) accumulator[i] += Loader::load(input, block + i);
      }
    }
    if (op == ReduceOp::kMean)
      for (size_t i = 0; i < length; ++i) accumulator[i] /= divisor;
    switch (out_type) {
      case DType::kFloat32: std::memcpy(out + block * 4, accumulator, length * 4); break;
      case DType::kBFloat16: {
        uint16_t* target = reinterpret_cast<uint16_t*>(out) + block;
        for (size_t i = 0; i < length; ++i) target[i] = float_to_bf16_bits(accumulator[i]);
        break;
      }
      case DType::kFloat16: {
        uint16_t* target = reinterpret_cast<uint16_t*>(out) + block;
        for (size_t i = 0; i < length; ++i) target[i] = float_to_fp16_bits(accumulator[i]);
        break;
      }
    }
  }
}

void reduce_serial(std::span<const std::byte* const> inputs, size_t begin, size_t end, DType input_dtype, DType wire,
                   ReduceOp op, DType out_dtype, std::byte* out) {
  if (input_dtype == DType::kBFloat16) return reduce_range<LoadBf16>(inputs, begin, end, op, out_dtype, out);
  if (input_dtype == DType::kFloat16) return reduce_range<LoadFp16>(inputs, begin, end, op, out_dtype, out);
  if (wire == DType::kBFloat16) return reduce_range<LoadFloatViaBf16>(inputs, begin, end, op, out_dtype, out);
  if (wire == DType::kFloat16) return reduce_range<LoadFloatViaFp16>(inputs, begin, end, op, out_dtype, out);
  return reduce_range<LoadFloat>(inputs, begin, end, op, out_dtype, out);
}

constexpr size_t kGrain = size_t{1} << 14;

bool fans_out(Executor* executor, size_t count) {
  return executor != nullptr && count >= 2 * kGrain && executor->concurrency() > 1;
}

}  // namespace

void reduce_in_rank_order(std::span<const std::byte* const> inputs, size_t count, DType input_dtype, DType wire,
                          ReduceOp op, DType out_dtype, std::byte* out, Executor* executor) {
  if (!fans_out(executor, count)) {
    reduce_serial(inputs, 0, count, input_dtype, wire, op, out_dtype, out);
    return;
  }
  // Each element's sum has the same order whatever the chunking.
  executor->parallel_for(0, count, kGrain, [&](size_t begin, size_t end) {
    reduce_serial(inputs, begin, end, input_dtype, wire, op, out_dtype, out);
  });
}

void cast_to_wire(const float* src, uint16_t* dst, size_t count, DType wire, Executor* executor) {
  const auto cast = [&](size_t begin, size_t end) {
    if (wire == DType::kBFloat16) {
      for (size_t i = begin; i < end; ++i) dst[i] = float_to_bf16_bits(src[i]);
    } else {
      for (size_t i = begin; i < end; ++i) dst[i] = float_to_fp16_bits(src[i]);
    }
  };
  if (!fans_out(executor, count)) {
    cast(0, count);
    return;
  }
  executor->parallel_for(0, count, kGrain, cast);
}

std::pair<size_t, size_t> all_reduce_slice(size_t count, int world_size, int rank) {
  const size_t per_rank = (count + static_cast<size_t>(world_size) - 1) / static_cast<size_t>(world_size);
  const size_t begin = std::min(count, per_rank * static_cast<size_t>(rank));
  const size_t end = std::min(count, begin + per_rank);
  return {begin, end};
}

}  // namespace strata
