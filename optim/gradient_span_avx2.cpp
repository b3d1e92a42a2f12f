// AVX2 + F16C accumulate span (8 lanes). This file alone is compiled with -mavx2 -mf16c
// (optim/CMakeLists.txt) and runs only after the CPUID probe said so. bf16 widens by a
// shift and fp16 by VCVTPH2PS, both exact; the add is one VADDPS per lane, as the scalar
// element function's one fp32 add.
//
// Everything here has internal linkage and calls no out-of-line inline function of
// another header (see adam_span_avx512.cpp for why).
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "optim/gradient_span.h"

namespace strata::internal {
namespace {

constexpr size_t kLanes = 8;

// Loads 8 values of `kType` at element i, widened to fp32.
template <DType kType>
__m256 load8(const void* base, size_t i) {
  if constexpr (kType == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (kType == DType::kBFloat16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    return _mm256_cvtph_ps(raw);
  }
}

// accumulate_element on elements [i, i + 8).
template <DType kType, AccumulateMode kMode>
void accumulate8(float* accum, const void* src, size_t i) {
  __m256 value = load8<kType>(src, i);
  if constexpr (kMode == AccumulateMode::kAdd) value = _mm256_add_ps(_mm256_loadu_ps(accum + i), value);
  _mm256_storeu_ps(accum + i, value);
}

template <DType kType, AccumulateMode kMode>
void accumulate_typed(float* accum, const void* src, size_t count) {
  constexpr size_t kWidth = dtype_size(kType);
  size_t i = 0;
  for (; i + 2 * kLanes <= count; i += 2 * kLanes) {
    accumulate8<kType, kMode>(accum, src, i);
    accumulate8<kType, kMode>(accum, src, i + kLanes);
  }
  // The last count % 16 elements: copied into zero-padded lanes, accumulated as full
  // vectors (so with the same operations), and copied back.
  for (; i < count; i += kLanes) {
    const size_t left = count - i < kLanes ? count - i : kLanes;
    alignas(32) float staged_accum[kLanes] = {};
    alignas(32) uint8_t staged_src[kLanes * 4] = {};
    std::memcpy(staged_src, static_cast<const char*>(src) + i * kWidth, left * kWidth);
    if constexpr (kMode == AccumulateMode::kAdd) std::memcpy(staged_accum, accum + i, left * sizeof(float));
    accumulate8<kType, kMode>(staged_accum, staged_src, 0);
    std::memcpy(accum + i, staged_accum, left * sizeof(float));
  }
}

template <DType kType>
void accumulate_mode(float* accum, const void* src, size_t count, AccumulateMode mode) {
  if (mode == AccumulateMode::kAssign) return accumulate_typed<kType, AccumulateMode::kAssign>(accum, src, count);
  return accumulate_typed<kType, AccumulateMode::kAdd>(accum, src, count);
}

}  // namespace

void accumulate_span_avx2(float* accum, const void* src, DType src_type, size_t count, AccumulateMode mode) {
  switch (src_type) {
    case DType::kFloat32: return accumulate_mode<DType::kFloat32>(accum, src, count, mode);
    case DType::kBFloat16: return accumulate_mode<DType::kBFloat16>(accum, src, count, mode);
    case DType::kFloat16: return accumulate_mode<DType::kFloat16>(accum, src, count, mode);
  }
}

}  // namespace strata::internal
