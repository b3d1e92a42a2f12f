// AVX-512 accumulate span (16 lanes). This file alone is compiled with -mavx512f/bw/vl/dq
// (optim/CMakeLists.txt) and runs only after the CPUID probe said so. bf16 widens by a
// shift and fp16 by VCVTPH2PS, both exact; the add is one VADDPS per lane, as the scalar
// element function's one fp32 add. The tail uses masked loads and stores.
//
// Everything here has internal linkage and calls no out-of-line inline function of
// another header (see adam_span_avx512.cpp for why).
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

// GCC 12's own AVX-512 headers build some casts from intentionally undefined vectors,
// which -W(maybe-)uninitialized reports inside them.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

#include "optim/gradient_span.h"

namespace strata::internal {
namespace {

constexpr size_t kLanes = 16;

// Loads 16 values of `kType` at element i, widened to fp32. kMasked: only the lanes of
// `mask` (the others read as zero and touch no memory).
template <DType kType, bool kMasked>
__m512 load16(const void* base, size_t i, __mmask16 mask) {
  if constexpr (kType == DType::kFloat32) {
    const float* p = static_cast<const float*>(base) + i;
    return kMasked ? _mm512_maskz_loadu_ps(mask, p) : _mm512_loadu_ps(p);
  } else {
    const auto* p = static_cast<const uint16_t*>(base) + i;
    const __m256i raw = kMasked ? _mm256_maskz_loadu_epi16(mask, p) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (kType == DType::kBFloat16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    return _mm512_cvtph_ps(raw);
  }
}

// accumulate_element on elements [i, i + 16), or on the lanes of `mask` only.
template <DType kType, AccumulateMode kMode, bool kMasked>
void accumulate16(float* accum, const void* src, size_t i, __mmask16 mask) {
  __m512 value = load16<kType, kMasked>(src, i, mask);
  if constexpr (kMode == AccumulateMode::kAdd) {
    const __m512 old = kMasked ? _mm512_maskz_loadu_ps(mask, accum + i) : _mm512_loadu_ps(accum + i);
    value = _mm512_add_ps(old, value);
  }
  if constexpr (kMasked) {
    _mm512_mask_storeu_ps(accum + i, mask, value);
  } else {
    _mm512_storeu_ps(accum + i, value);
  }
}

template <DType kType, AccumulateMode kMode>
void accumulate_typed(float* accum, const void* src, size_t count) {
  size_t i = 0;
  for (; i + 2 * kLanes <= count; i += 2 * kLanes) {
    accumulate16<kType, kMode, false>(accum, src, i, 0xffff);
    accumulate16<kType, kMode, false>(accum, src, i + kLanes, 0xffff);
  }
  for (; i < count; i += kLanes) {
    const size_t left = count - i;
    const __mmask16 mask = left >= kLanes ? __mmask16(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
    accumulate16<kType, kMode, true>(accum, src, i, mask);
  }
}

template <DType kType>
void accumulate_mode(float* accum, const void* src, size_t count, AccumulateMode mode) {
  if (mode == AccumulateMode::kAssign) return accumulate_typed<kType, AccumulateMode::kAssign>(accum, src, count);
  return accumulate_typed<kType, AccumulateMode::kAdd>(accum, src, count);
}

}  // namespace

void accumulate_span_avx512(float* accum, const void* src, DType src_type, size_t count, AccumulateMode mode) {
  switch (src_type) {
    case DType::kFloat32: return accumulate_mode<DType::kFloat32>(accum, src, count, mode);
    case DType::kBFloat16: return accumulate_mode<DType::kBFloat16>(accum, src, count, mode);
    case DType::kFloat16: return accumulate_mode<DType::kFloat16>(accum, src, count, mode);
  }
}

}  // namespace strata::internal
