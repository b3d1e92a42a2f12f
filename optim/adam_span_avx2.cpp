// AVX2 + F16C span kernels (8 lanes). This file alone is compiled with -mavx2 -mf16c
// (optim/CMakeLists.txt) and runs only after the CPUID probe said so. No FMA: the update
// is separately rounded multiplies and adds, as the reference defines it.
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

#include "optim/adam_span.h"

namespace strata::internal {
namespace {

using kernels::AdamBuffers;
using kernels::AdamStepScalars;
using kernels::AdamWeightDecay;

constexpr size_t kLanes = 8;
constexpr size_t kPrefetchElements = 512;  // how far ahead the main loop prefetches its inputs

// Prefetches the line `offset` bytes past `base` into L1 (an integer address: it may lie
// past the end of the array, which a prefetch may touch but pointer arithmetic may not).
inline void prefetch_line(const void* base, size_t offset) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + offset), _MM_HINT_T0);
}

enum class ParamOut : uint8_t { kNone, kFloat32, kBFloat16, kFloat16 };

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

// fp32 -> bf16, round to nearest even, NaN kept quiet: the rule of float_to_bf16_bits.
__m128i bf16_from_float(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i result = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
  // Values fit 16 bits, so the unsigned-saturating pack is exact; it packs within 128-bit
  // halves, and the permute gathers the two useful quarters.
  const __m256i packed = _mm256_packus_epi32(result, result);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

template <StoreKind kStore>
void store_u16x8(uint16_t* p, __m128i x) {
  if constexpr (kStore == StoreKind::kStreaming) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), x);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x);
  }
}

template <DType kType, StoreKind kStore>
void store8(void* base, size_t i, __m256 x) {
  if constexpr (kType == DType::kFloat32) {
    float* p = static_cast<float*>(base) + i;
    if constexpr (kStore == StoreKind::kStreaming) {
      _mm256_stream_ps(p, x);
    } else {
      _mm256_storeu_ps(p, x);
    }
  } else if constexpr (kType == DType::kBFloat16) {
    store_u16x8<kStore>(static_cast<uint16_t*>(base) + i, bf16_from_float(x));
  } else {
    store_u16x8<kStore>(static_cast<uint16_t*>(base) + i, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

struct Scalars8 {
  __m256 grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_sqrt_bc2, eps, decay_factor, l2;
  explicit Scalars8(const AdamStepScalars& s)
      : grad_scale(_mm256_set1_ps(s.grad_scale)),
        beta1(_mm256_set1_ps(s.beta1)),
        one_minus_beta1(_mm256_set1_ps(s.one_minus_beta1)),
        beta2(_mm256_set1_ps(s.beta2)),
        one_minus_beta2(_mm256_set1_ps(s.one_minus_beta2)),
        step_size(_mm256_set1_ps(s.step_size)),
        inv_sqrt_bc2(_mm256_set1_ps(s.inv_sqrt_bias_correction2)),
        eps(_mm256_set1_ps(s.eps)),
        decay_factor(_mm256_set1_ps(s.decay_factor)),
        l2(_mm256_set1_ps(s.l2_weight_decay)) {}
};

template <DType kGrad, DType kMoment, ParamOut kParam, AdamWeightDecay kDecay>
struct Step8 {
  static constexpr DType param_dtype() {
    return kParam == ParamOut::kFloat16 ? DType::kFloat16 : kParam == ParamOut::kFloat32 ? DType::kFloat32 : DType::kBFloat16;
  }

  // Elements [i, i + 8): the operations of kernels::adam_update_element, in its order.
  template <StoreKind kParamStore, StoreKind kStateStore>
  static void run(const AdamBuffers& b, const Scalars8& s, size_t i) {
    const __m256 grad = load8<kGrad>(b.grad, i);
    __m256 p = load8<DType::kFloat32>(b.master, i);
    __m256 m = load8<kMoment>(b.exp_avg, i);
    __m256 v = load8<kMoment>(b.exp_avg_sq, i);
    __m256 g = _mm256_mul_ps(grad, s.grad_scale);
    if constexpr (kDecay == AdamWeightDecay::kL2) g = _mm256_add_ps(g, _mm256_mul_ps(s.l2, p));
    m = _mm256_add_ps(_mm256_mul_ps(s.beta1, m), _mm256_mul_ps(s.one_minus_beta1, g));
    v = _mm256_add_ps(_mm256_mul_ps(s.beta2, v), _mm256_mul_ps(s.one_minus_beta2, _mm256_mul_ps(g, g)));
    const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), s.inv_sqrt_bc2), s.eps);
    p = _mm256_sub_ps(_mm256_mul_ps(p, s.decay_factor), _mm256_mul_ps(s.step_size, _mm256_div_ps(m, denom)));
    store8<DType::kFloat32, kStateStore>(b.master, i, p);
    store8<kMoment, kStateStore>(b.exp_avg, i, m);
    store8<kMoment, kStateStore>(b.exp_avg_sq, i, v);
    if constexpr (kParam != ParamOut::kNone) store8<param_dtype(), kParamStore>(b.param, i, p);
  }

  // The last count % 8 elements: copied into zero-padded lanes, updated as one full
  // vector (so with exactly the same operations), and copied back.
  static void tail(const AdamBuffers& b, const Scalars8& s, size_t begin) {
    const size_t left = b.count - begin;
    alignas(32) float grad[kLanes] = {}, master[kLanes] = {}, exp_avg[kLanes] = {}, exp_avg_sq[kLanes] = {}, param[kLanes] = {};
    constexpr size_t grad_width = dtype_size(kGrad), moment_width = dtype_size(kMoment), param_width = dtype_size(param_dtype());
    std::memcpy(grad, static_cast<const char*>(b.grad) + begin * grad_width, left * grad_width);
    std::memcpy(master, b.master + begin, left * 4);
    std::memcpy(exp_avg, static_cast<const char*>(b.exp_avg) + begin * moment_width, left * moment_width);
    std::memcpy(exp_avg_sq, static_cast<const char*>(b.exp_avg_sq) + begin * moment_width, left * moment_width);
    AdamBuffers local = b;
    local.grad = grad;
    local.master = master;
    local.exp_avg = exp_avg;
    local.exp_avg_sq = exp_avg_sq;
    local.param = param;
    local.count = kLanes;
    run<StoreKind::kCached, StoreKind::kCached>(local, s, 0);
    std::memcpy(b.master + begin, master, left * 4);
    std::memcpy(static_cast<char*>(b.exp_avg) + begin * moment_width, exp_avg, left * moment_width);
    std::memcpy(static_cast<char*>(b.exp_avg_sq) + begin * moment_width, exp_avg_sq, left * moment_width);
    if constexpr (kParam != ParamOut::kNone) std::memcpy(static_cast<char*>(b.param) + begin * param_width, param, left * param_width);
  }

  // Software prefetch of the four input streams, on top of the hardware prefetchers. One
  // call per 8 elements: every other one lands on a line already asked for (cheap).
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
    const Scalars8 s(scalars);
    size_t i = 0;
    for (; i + kLanes <= b.count; i += kLanes) {
      prefetch(b, i + kPrefetchElements);
      run<kParamStore, kStateStore>(b, s, i);
    }
    if (i < b.count) tail(b, s, i);
    if constexpr (kParamStore == StoreKind::kStreaming || kStateStore == StoreKind::kStreaming) _mm_sfence();
  }

  static bool aligned(const void* p, size_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

  static void span(const AdamBuffers& b, const AdamStepScalars& scalars, const AdamSpanStores& stores) {
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

template <DType kGrad, DType kMoment, ParamOut kParam>
void dispatch_decay(const AdamBuffers& b, const AdamStepScalars& s, const AdamSpanStores& stores) {
  if (s.decay == AdamWeightDecay::kL2) return Step8<kGrad, kMoment, kParam, AdamWeightDecay::kL2>::span(b, s, stores);
  return Step8<kGrad, kMoment, kParam, AdamWeightDecay::kDecoupled>::span(b, s, stores);
}

template <DType kGrad, DType kMoment>
void dispatch_param(const AdamBuffers& b, const AdamStepScalars& s, const AdamSpanStores& stores) {
  if (b.param == nullptr) return dispatch_decay<kGrad, kMoment, ParamOut::kNone>(b, s, stores);
  switch (b.param_type) {
    case DType::kFloat32: return dispatch_decay<kGrad, kMoment, ParamOut::kFloat32>(b, s, stores);
    case DType::kBFloat16: return dispatch_decay<kGrad, kMoment, ParamOut::kBFloat16>(b, s, stores);
    case DType::kFloat16: return dispatch_decay<kGrad, kMoment, ParamOut::kFloat16>(b, s, stores);
  }
}

template <DType kGrad>
void dispatch_moment(const AdamBuffers& b, const AdamStepScalars& s, const AdamSpanStores& stores) {
  if (b.moment_type == DType::kBFloat16) return dispatch_param<kGrad, DType::kBFloat16>(b, s, stores);
  return dispatch_param<kGrad, DType::kFloat32>(b, s, stores);
}

inline void accumulate_squares(__m256 x, __m256d& low, __m256d& high) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  low = _mm256_add_pd(low, _mm256_mul_pd(lo, lo));
  high = _mm256_add_pd(high, _mm256_mul_pd(hi, hi));
}

template <DType kType>
double sum_of_squares(const void* grad, size_t count) {
  constexpr size_t kWidth = dtype_size(kType);
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  size_t i = 0;
  for (; i + 2 * kLanes <= count; i += 2 * kLanes) {
    accumulate_squares(load8<kType>(grad, i), acc[0], acc[1]);
    accumulate_squares(load8<kType>(grad, i + kLanes), acc[2], acc[3]);
  }
  for (; i < count; i += kLanes) {
    const size_t left = count - i < kLanes ? count - i : kLanes;
    alignas(32) uint8_t staged[kLanes * 4] = {};  // zero-padded lanes add nothing
    std::memcpy(staged, static_cast<const char*>(grad) + i * kWidth, left * kWidth);
    accumulate_squares(load8<kType>(staged, 0), acc[0], acc[1]);
  }
  const __m256d total = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
  const __m128d two = _mm_add_pd(_mm256_castpd256_pd128(total), _mm256_extractf128_pd(total, 1));
  return _mm_cvtsd_f64(_mm_add_sd(two, _mm_unpackhi_pd(two, two)));
}

}  // namespace

void adam_step_span_avx2(const AdamBuffers& span, const AdamStepScalars& scalars, const AdamSpanStores& stores) {
  switch (span.grad_type) {
    case DType::kFloat32: return dispatch_moment<DType::kFloat32>(span, scalars, stores);
    case DType::kBFloat16: return dispatch_moment<DType::kBFloat16>(span, scalars, stores);
    case DType::kFloat16: return dispatch_moment<DType::kFloat16>(span, scalars, stores);
  }
}

double grad_sum_of_squares_avx2(const void* grad, DType grad_type, size_t count) {
  switch (grad_type) {
    case DType::kFloat32: return sum_of_squares<DType::kFloat32>(grad, count);
    case DType::kBFloat16: return sum_of_squares<DType::kBFloat16>(grad, count);
    case DType::kFloat16: return sum_of_squares<DType::kFloat16>(grad, count);
  }
  return 0.0;
}

}  // namespace strata::internal
