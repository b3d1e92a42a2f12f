// Element types and the scalar conversions every floor shares.
//
// bf16 is the top half of an IEEE fp32 with round-to-nearest-even; fp16 is IEEE
// binary16. The scalar conversions here are the reference the SIMD and CUDA casts are
// tested against.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "engine/core/status.h"

namespace strata {

enum class DType : uint8_t { kFloat32, kBFloat16, kFloat16 };

constexpr size_t dtype_size(DType type) { return type == DType::kFloat32 ? 4 : 2; }
std::string_view dtype_name(DType type);  // "fp32" | "bf16" | "fp16"
// Accepts fp32/float32/float, bf16/bfloat16, fp16/float16/half.
StatusOr<DType> parse_dtype(std::string_view text);

// fp32 -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16_bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

inline float bf16_bits_to_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

// fp32 -> IEEE half bits, round to nearest even, with subnormals, infinities and NaN.
inline uint16_t float_to_fp16_bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);           // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);          // overflow to inf (incl. rounding)
  if (abs < 0x38800000u) {                                                       // result is subnormal or zero
    // Scale so the half subnormal LSB (2^-24) becomes 1.0, then round to nearest even.
    const float magnitude = std::bit_cast<float>(abs) * 16777216.0f;  // 2^24, exact
    const uint32_t integer = static_cast<uint32_t>(magnitude);
    const float remainder = magnitude - static_cast<float>(integer);
    uint32_t rounded = integer;
    if (remainder > 0.5f || (remainder == 0.5f && (integer & 1u))) ++rounded;
    return static_cast<uint16_t>(sign | rounded);
  }
  // Normal: rebias exponent (127 -> 15) and round the 13 dropped mantissa bits.
  const uint32_t rebased = abs - 0x38000000u;
  const uint32_t rounding = 0x0fffu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rebased + rounding) >> 13));
}

inline float fp16_bits_to_float(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24.
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(magnitude));
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Reads element `index` of a buffer of `type` as fp32.
inline float load_as_float(const void* data, DType type, size_t index) {
  switch (type) {
    case DType::kFloat32: return static_cast<const float*>(data)[index];
    case DType::kBFloat16: return bf16_bits_to_float(static_cast<const uint16_t*>(data)[index]);
    case DType::kFloat16: return fp16_bits_to_float(static_cast<const uint16_t*>(data)[index]);
  }
  return 0.0f;
}

// Writes fp32 `value` into element `index` of a buffer of `type` (rounding to nearest even).
inline void store_from_float(void* data, DType type, size_t index, float value) {
  switch (type) {
    case DType::kFloat32: static_cast<float*>(data)[index] = value; break;
    case DType::kBFloat16: static_cast<uint16_t*>(data)[index] = float_to_bf16_bits(value); break;
    case DType::kFloat16: static_cast<uint16_t*>(data)[index] = float_to_fp16_bits(value); break;
  }
}

}  // namespace strata
