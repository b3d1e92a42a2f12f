// AVX-512 token scan span: 32 uint16 (AVX-512BW) or 16 uint32 lanes, four vectors folded
// with an unsigned max per iteration and one mask compare against the bound; a block
// that holds an offender is searched token by token. Compiled with -mavx512f -mavx512bw
// for this file alone (examples/data/CMakeLists.txt), run only after the CPUID probe; as
// in the AVX2 file, nothing here is an inline function another file could share.
// GCC 12's own AVX-512 headers start some intrinsics from _mm512_undefined_*(), which its
// -Wmaybe-uninitialized reports at -O3 (as in optim/gradient_span_avx512.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "examples/data/token_scan.h"

namespace strata::data::internal {
size_t token_scan_u16_avx512(const uint16_t* tokens, size_t count, uint64_t bound) {
  if (bound > 0xFFFF) return count;
  const __m512i limit = _mm512_set1_epi16(static_cast<int16_t>(static_cast<uint16_t>(bound)));
  constexpr size_t kBlock = 128;  // 4 vectors of 32
  size_t i = 0;
  for (; i + kBlock <= count; i += kBlock) {
    const uint16_t* p = tokens + i;
    const __m512i m = _mm512_max_epu16(_mm512_max_epu16(_mm512_loadu_si512(p), _mm512_loadu_si512(p + 32)),
                                       _mm512_max_epu16(_mm512_loadu_si512(p + 64), _mm512_loadu_si512(p + 96)));
    if (_mm512_cmpge_epu16_mask(m, limit) != 0) return i + token_scan_u16_scalar(tokens + i, kBlock, bound);
  }
  return i + token_scan_u16_scalar(tokens + i, count - i, bound);
}

size_t token_scan_u32_avx512(const uint32_t* tokens, size_t count, uint64_t bound) {
  if (bound > 0xFFFFFFFFu) return count;
  const __m512i limit = _mm512_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(bound)));
  constexpr size_t kBlock = 64;  // 4 vectors of 16
  size_t i = 0;
  for (; i + kBlock <= count; i += kBlock) {
    const uint32_t* p = tokens + i;
    const __m512i m = _mm512_max_epu32(_mm512_max_epu32(_mm512_loadu_si512(p), _mm512_loadu_si512(p + 16)),
                                       _mm512_max_epu32(_mm512_loadu_si512(p + 32), _mm512_loadu_si512(p + 48)));
    if (_mm512_cmpge_epu32_mask(m, limit) != 0) return i + token_scan_u32_scalar(tokens + i, kBlock, bound);
  }
  return i + token_scan_u32_scalar(tokens + i, count - i, bound);
}

}  // namespace strata::data::internal
