// AVX2 token scan span: 16 uint16 or 8 uint32 lanes, four vectors folded with an unsigned
// max per iteration and one compare against the bound, so the loop runs at load speed;
// only a block that holds an offender is searched token by token. This file alone is
// compiled with -mavx2 (examples/data/CMakeLists.txt) and runs only after the CPUID probe
// said so. Everything here has internal linkage and calls no inline function of another
// header, so no AVX2 copy of one can be picked by the linker for other code.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "examples/data/token_scan.h"

namespace strata::data::internal {
size_t token_scan_u16_avx2(const uint16_t* tokens, size_t count, uint64_t bound) {
  if (bound > 0xFFFF) return count;
  const __m256i limit = _mm256_set1_epi16(static_cast<int16_t>(static_cast<uint16_t>(bound)));
  constexpr size_t kBlock = 64;  // 4 vectors of 16
  size_t i = 0;
  for (; i + kBlock <= count; i += kBlock) {
    const auto* p = reinterpret_cast<const __m256i*>(tokens + i);
    const __m256i m = _mm256_max_epu16(_mm256_max_epu16(_mm256_loadu_si256(p), _mm256_loadu_si256(p + 1)),
                                       _mm256_max_epu16(_mm256_loadu_si256(p + 2), _mm256_loadu_si256(p + 3)));
    // m >= limit lane-wise exactly where max(m, limit) == m.
    const __m256i at_or_above = _mm256_cmpeq_epi16(_mm256_max_epu16(m, limit), m);
    if (!_mm256_testz_si256(at_or_above, at_or_above)) return i + token_scan_u16_scalar(tokens + i, kBlock, bound);
  }
  return i + token_scan_u16_scalar(tokens + i, count - i, bound);
}

size_t token_scan_u32_avx2(const uint32_t* tokens, size_t count, uint64_t bound) {
  if (bound > 0xFFFFFFFFu) return count;
  const __m256i limit = _mm256_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(bound)));
  constexpr size_t kBlock = 32;  // 4 vectors of 8
  size_t i = 0;
  for (; i + kBlock <= count; i += kBlock) {
    const auto* p = reinterpret_cast<const __m256i*>(tokens + i);
    const __m256i m = _mm256_max_epu32(_mm256_max_epu32(_mm256_loadu_si256(p), _mm256_loadu_si256(p + 1)),
                                       _mm256_max_epu32(_mm256_loadu_si256(p + 2), _mm256_loadu_si256(p + 3)));
    const __m256i at_or_above = _mm256_cmpeq_epi32(_mm256_max_epu32(m, limit), m);
    if (!_mm256_testz_si256(at_or_above, at_or_above)) return i + token_scan_u32_scalar(tokens + i, kBlock, bound);
  }
  return i + token_scan_u32_scalar(tokens + i, count - i, bound);
}

}  // namespace strata::data::internal
