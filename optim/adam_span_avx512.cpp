// AVX-512 span kernels (16 lanes). This file alone is compiled with -mavx512f/bw/vl/dq
// and -mavx512bf16 (optim/CMakeLists.txt) and runs only after the CPUID probe said so.
//
// Everything here has internal linkage and calls no out-of-line inline function of
// another header: an inline function compiled with AVX-512 enabled could otherwise be
// the copy the linker keeps for the whole program.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

// GCC 12's own AVX-512 headers build some casts and extracts from `__m256d __Y = __Y;`
// (an intentionally undefined vector), which -W(maybe-)uninitialized reports inside them.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "optim/adam_span.h"

namespace strata::internal {
namespace {

using kernels::AdamBuffers;
using kernels::AdamStepScalars;
using kernels::AdamWeightDecay;

constexpr size_t kLanes = 16;
constexpr size_t kPrefetchElements = 512;  // how far ahead the main loop prefetches its inputs

// Prefetches the line `offset` bytes past `base` into L1. The address is formed as an
// integer: it may lie past the end of the array, which a prefetch may touch but pointer
// arithmetic may not.
inline void prefetch_line(const void* base, size_t offset) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + offset), _MM_HINT_T0);
}

// The parameter copy's form: none, or a dtype.
enum class ParamOut : uint8_t { kNone, kFloat32, kBFloat16, kFloat16 };

// Loads 16 values of `kType` at element i as fp32. kMasked: only the lanes of `mask`
// (the others read as zero and touch no memory).
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

// fp32 -> bf16 with integer arithmetic: round to nearest even, NaN kept quiet (the rule of
// float_to_bf16_bits in engine/core/dtype.h), subnormals rounded like any other value.
__m256i bf16_from_float_integer(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(rounded);
}

// fp32 -> bf16. With AVX512-BF16 one VCVTNEPS2BF16, which rounds to nearest even but
// flushes subnormal inputs to zero; lanes holding a subnormal (rare: |x| < 2^-126) are
// redone with the integer rule so both paths give the reference's bits.
template <bool kNativeBf16>
__m256i bf16_from_float(__m512 x) {
  if constexpr (kNativeBf16) {
    __m256i converted;
    const __m256bh native = _mm512_cvtneps_pbh(x);
    std::memcpy(&converted, &native, sizeof(converted));
    const __m512i bits = _mm512_castps_si512(x);
    const __mmask16 subnormal = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7f800000)) &
                                _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x007fffff));
    if (subnormal != 0) [[unlikely]]
      converted = _mm256_mask_mov_epi16(converted, subnormal, bf16_from_float_integer(x));
    return converted;
  } else {
    return bf16_from_float_integer(x);
  }
}

template <StoreKind kStore, bool kMasked>
void store_f32(float* p, __m512 x, __mmask16 mask) {
  if constexpr (kMasked) {
    _mm512_mask_storeu_ps(p, mask, x);
  } else if constexpr (kStore == StoreKind::kStreaming) {
    _mm512_stream_ps(p, x);
  } else {
    _mm512_storeu_ps(p, x);
  }
}

template <StoreKind kStore, bool kMasked>
void store_u16(uint16_t* p, __m256i x, __mmask16 mask) {
  if constexpr (kMasked) {
    _mm256_mask_storeu_epi16(p, mask, x);
  } else if constexpr (kStore == StoreKind::kStreaming) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
  }
}

// Stores 16 fp32 values as `kType` at element i.
template <DType kType, StoreKind kStore, bool kMasked, bool kNativeBf16>
void store16(void* base, size_t i, __m512 x, __mmask16 mask) {
  if constexpr (kType == DType::kFloat32) {
    store_f32<kStore, kMasked>(static_cast<float*>(base) + i, x, mask);
  } else if constexpr (kType == DType::kBFloat16) {
    store_u16<kStore, kMasked>(static_cast<uint16_t*>(base) + i, bf16_from_float<kNativeBf16>(x), mask);
  } else {
    store_u16<kStore, kMasked>(static_cast<uint16_t*>(base) + i, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                               mask);
  }
}

struct Scalars16 {
  __m512 grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_sqrt_bc2, eps, decay_factor, l2;
  explicit Scalars16(const AdamStepScalars& s)
      : grad_scale(_mm512_set1_ps(s.grad_scale)),
        beta1(_mm512_set1_ps(s.beta1)),
        one_minus_beta1(_mm512_set1_ps(s.one_minus_beta1)),
        beta2(_mm512_set1_ps(s.beta2)),
        one_minus_beta2(_mm512_set1_ps(s.one_minus_beta2)),
        step_size(_mm512_set1_ps(s.step_size)),
        inv_sqrt_bc2(_mm512_set1_ps(s.inv_sqrt_bias_correction2)),
        eps(_mm512_set1_ps(s.eps)),
        decay_factor(_mm512_set1_ps(s.decay_factor)),
        l2(_mm512_set1_ps(s.l2_weight_decay)) {}
};

// The static configuration of one instantiation.
template <DType kGrad, DType kMoment, ParamOut kParam, AdamWeightDecay kDecay, bool kNativeBf16>
struct Step16 {
  static constexpr DType param_dtype() {
    return kParam == ParamOut::kFloat16 ? DType::kFloat16 : kParam == ParamOut::kFloat32 ? DType::kFloat32 : DType::kBFloat16;
  }

  // The update of elements [i, i + 16) (the lanes of `mask` when kMasked); the same
  // operations, in the same order, as kernels::adam_update_element.
  template <StoreKind kParamStore, StoreKind kStateStore, bool kMasked>
  static void run(const AdamBuffers& b, const Scalars16& s, size_t i, __mmask16 mask) {
    const __m512 grad = load16<kGrad, kMasked>(b.grad, i, mask);
    __m512 p = load16<DType::kFloat32, kMasked>(b.master, i, mask);
    __m512 m = load16<kMoment, kMasked>(b.exp_avg, i, mask);
    __m512 v = load16<kMoment, kMasked>(b.exp_avg_sq, i, mask);
    __m512 g = _mm512_mul_ps(grad, s.grad_scale);
    if constexpr (kDecay == AdamWeightDecay::kL2) g = _mm512_add_ps(g, _mm512_mul_ps(s.l2, p));
    m = _mm512_add_ps(_mm512_mul_ps(s.beta1, m), _mm512_mul_ps(s.one_minus_beta1, g));
    v = _mm512_add_ps(_mm512_mul_ps(s.beta2, v), _mm512_mul_ps(s.one_minus_beta2, _mm512_mul_ps(g, g)));
    const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), s.inv_sqrt_bc2), s.eps);
    p = _mm512_sub_ps(_mm512_mul_ps(p, s.decay_factor), _mm512_mul_ps(s.step_size, _mm512_div_ps(m, denom)));
    store16<DType::kFloat32, kStateStore, kMasked, kNativeBf16>(b.master, i, p, mask);
    store16<kMoment, kStateStore, kMasked, kNativeBf16>(b.exp_avg, i, m, mask);
    store16<kMoment, kStateStore, kMasked, kNativeBf16>(b.exp_avg_sq, i, v, mask);
    if constexpr (kParam != ParamOut::kNone) store16<param_dtype(), kParamStore, kMasked, kNativeBf16>(b.param, i, p, mask);
  }

  // Software prefetch of the four input streams, kPrefetchElements ahead, on top of the
  // hardware prefetchers (measured on a 2-core Zen 5 with 64 M params: about +5%).
  // Prefetches never fault, so running past the span's end is harmless.
  static void prefetch(const AdamBuffers& b, size_t i) {
    prefetch_line(b.master, i * 4);
    prefetch_line(b.exp_avg, i * dtype_size(kMoment));
    prefetch_line(b.exp_avg_sq, i * dtype_size(kMoment));
    prefetch_line(b.grad, i * dtype_size(kGrad));
  }

  template <StoreKind kParamStore, StoreKind kStateStore>
  static void loop(const AdamBuffers& buffers, const AdamStepScalars& scalars) {
    // A local copy: stores through the float pointers cannot alias it, so the pointers and
    // the count stay in registers instead of being reloaded after every store.
    const AdamBuffers b = buffers;
    const Scalars16 s(scalars);
    size_t i = 0;
    for (; i + kLanes <= b.count; i += kLanes) {
      prefetch(b, i + kPrefetchElements);
      run<kParamStore, kStateStore, false>(b, s, i, 0xffff);
    }
    if (i < b.count) run<kParamStore, kStateStore, true>(b, s, i, static_cast<__mmask16>((1u << (b.count - i)) - 1u));
    if constexpr (kParamStore == StoreKind::kStreaming || kStateStore == StoreKind::kStreaming) _mm_sfence();
  }

  static bool aligned(const void* p, size_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

  static void span(const AdamBuffers& b, const AdamStepScalars& scalars, const AdamSpanStores& stores) {
    // Streaming stores need the vector's natural alignment; a span that lacks it stores normally.
    constexpr size_t kParamVectorBytes = kLanes * (param_dtype() == DType::kFloat32 ? 4 : 2);
    constexpr size_t kMomentVectorBytes = kLanes * (kMoment == DType::kFloat32 ? 4 : 2);
    const bool stream_param = kParam != ParamOut::kNone && stores.param == StoreKind::kStreaming && aligned(b.param, kParamVectorBytes);
    const bool stream_state = stores.state == StoreKind::kStreaming && aligned(b.master, kLanes * 4) &&
                              aligned(b.exp_avg, kMomentVectorBytes) && aligned(b.exp_avg_sq, kMomentVectorBytes);
    if (stream_param && stream_state) return loop<StoreKind::kStreaming, StoreKind::kStreaming>(b, scalars);
    if (stream_param) return loop<StoreKind::kStreaming, StoreKind::kCached>(b, scalars);
    if (stream_state) return loop<StoreKind::kCached, StoreKind::kStreaming>(b, scalars);
    return loop<StoreKind::kCached, StoreKind::kCached>(b, scalars);
  }
};

template <DType kGrad, DType kMoment, ParamOut kParam, bool kNativeBf16>
void dispatch_decay(const AdamBuffers& b, const AdamStepScalars& s, const AdamSpanStores& stores) {
  if (s.decay == AdamWeightDecay::kL2) return Step16<kGrad, kMoment, kParam, AdamWeightDecay::kL2, kNativeBf16>::span(b, s, stores);
  return Step16<kGrad, kMoment, kParam, AdamWeightDecay::kDecoupled, kNativeBf16>::span(b, s, stores);
}

template <DType kGrad, DType kMoment, bool kNativeBf16>
void dispatch_param(const AdamBuffers& b, const AdamStepScalars& s, const AdamSpanStores& stores) {
  if (b.param == nullptr) return dispatch_decay<kGrad, kMoment, ParamOut::kNone, kNativeBf16>(b, s, stores);
  switch (b.param_type) {
    case DType::kFloat32: return dispatch_decay<kGrad, kMoment, ParamOut::kFloat32, kNativeBf16>(b, s, stores);
    case DType::kBFloat16: return dispatch_decay<kGrad, kMoment, ParamOut::kBFloat16, kNativeBf16>(b, s, stores);
    case DType::kFloat16: return dispatch_decay<kGrad, kMoment, ParamOut::kFloat16, kNativeBf16>(b, s, stores);
  }
}

template <DType kGrad, bool kNativeBf16>
void dispatch_moment(const AdamBuffers& b, const AdamStepScalars& s, const AdamSpanStores& stores) {
  if (b.moment_type == DType::kBFloat16) return dispatch_param<kGrad, DType::kBFloat16, kNativeBf16>(b, s, stores);
  return dispatch_param<kGrad, DType::kFloat32, kNativeBf16>(b, s, stores);
}

template <bool kNativeBf16>
void dispatch_grad(const AdamBuffers& b, const AdamStepScalars& s, const AdamSpanStores& stores) {
  switch (b.grad_type) {
    case DType::kFloat32: return dispatch_moment<DType::kFloat32, kNativeBf16>(b, s, stores);
    case DType::kBFloat16: return dispatch_moment<DType::kBFloat16, kNativeBf16>(b, s, stores);
    case DType::kFloat16: return dispatch_moment<DType::kFloat16, kNativeBf16>(b, s, stores);
  }
}

// (double)x * x for the 16 lanes of x, added into two accumulators of 8.
inline void accumulate_squares(__m512 x, __m512d& low, __m512d& high) {
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  low = _mm512_add_pd(low, _mm512_mul_pd(lo, lo));
  high = _mm512_add_pd(high, _mm512_mul_pd(hi, hi));
}

template <DType kType>
double sum_of_squares(const void* grad, size_t count) {
  __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
  size_t i = 0;
  for (; i + 2 * kLanes <= count; i += 2 * kLanes) {
    accumulate_squares(load16<kType, false>(grad, i, 0xffff), acc[0], acc[1]);
    accumulate_squares(load16<kType, false>(grad, i + kLanes, 0xffff), acc[2], acc[3]);
  }
  for (; i < count; i += kLanes) {
    const size_t left = count - i;
    const __mmask16 mask = left >= kLanes ? __mmask16(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
    accumulate_squares(load16<kType, true>(grad, i, mask), acc[0], acc[1]);
  }
  const __m512d total = _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3]));
  // A fixed tree: 8 -> 4 -> 2 -> 1.
  const __m256d four = _mm256_add_pd(_mm512_castpd512_pd256(total), _mm512_extractf64x4_pd(total, 1));
  const __m128d two = _mm_add_pd(_mm256_castpd256_pd128(four), _mm256_extractf128_pd(four, 1));
  return _mm_cvtsd_f64(_mm_add_sd(two, _mm_unpackhi_pd(two, two)));
}

}  // namespace

void adam_step_span_avx512(const AdamBuffers& span, const AdamStepScalars& scalars, const AdamSpanStores& stores) {
  dispatch_grad<false>(span, scalars, stores);
}

void adam_step_span_avx512_bf16(const AdamBuffers& span, const AdamStepScalars& scalars, const AdamSpanStores& stores) {
  dispatch_grad<true>(span, scalars, stores);
}

double grad_sum_of_squares_avx512(const void* grad, DType grad_type, size_t count) {
  switch (grad_type) {
    case DType::kFloat32: return sum_of_squares<DType::kFloat32>(grad, count);
    case DType::kBFloat16: return sum_of_squares<DType::kBFloat16>(grad, count);
    case DType::kFloat16: return sum_of_squares<DType::kFloat16>(grad, count);
  }
  return 0.0;
}

}  // namespace strata::internal
