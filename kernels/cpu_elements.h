// Internal to kernels/: the element functions and parallel-split helpers the CPU
// twins share (kernels/transformer_ops_cpu.cpp, kernels/rmsnorm_rope_swiglu_cpu.cpp). A .cpp
// that includes this must start with `#pragma GCC optimize("no-trapping-math")` before
// any include (see transformer_ops_cpu.cpp), so that exp_approx's clamps vectorize and
// GCC inlines these functions into the span functions it compiles per ISA.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>

#include "engine/core/executor.h"
#include "kernels/transformer_ops.h"

// Kernels in three layers: inline element functions, span functions over
// contiguous runs, parallel drivers. The span functions are compiled for AVX-512, AVX2
// and baseline x86-64 and the CPU picks one at load time (GCC target_clones, an ifunc).
// Their loops are branch-free so they vectorize; no-trapping-math (the pragma at the top)
// lets GCC turn the clamps of exp_approx into blends (nothing enables FP traps).
// Not under ThreadSanitizer: the loader runs the ifunc resolvers before the TSan runtime
// is up, and their instrumented code crashes there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(STRATA_SANITIZER_THREAD)
#define STRATA_SIMD_SPAN __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define STRATA_SIMD_SPAN
#endif

namespace strata::kernels::cpu::elements {

// Rows per parallel chunk so that a chunk holds roughly this many elements.
constexpr size_t kElementsPerChunk = size_t{1} << 14;
// Columns per chunk of a column sum: 64 floats = 4 cache lines per row visited.
constexpr size_t kColumnsPerChunk = 64;

inline size_t row_grain(size_t columns) { return std::max<size_t>(1, kElementsPerChunk / std::max<size_t>(1, columns)); }

// Element functions ------------------------------------------------------------------
// Always inlined, so each span function compiles them for its own instruction set.

// y += alpha * x
[[gnu::always_inline]] inline void axpy(float alpha, const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// e^x without branches, so loops over it vectorize (glibc's expf does not). Cody-Waite
// reduction x = n ln2 + r with |r| <= ln2 / 2, then a degree-7 Taylor polynomial of e^r
// (truncation error < 6e-9) and 2^n from the exponent bits: within a few ulp of expf.
// x is clamped to [-87, 88], so results stay normal and finite: e^-87 ~ 1.6e-38 stands
// in for anything smaller (softmax tails), e^88 ~ 1.7e38 for anything larger.
[[gnu::always_inline]] inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRoundShift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits
  constexpr float kLn2High = 0.693145751953125f;  // ln 2 split so n * kLn2High is exact
  constexpr float kLn2Low = 1.428606765330187045e-06f;
  const float shifted = x * kLog2e + kRoundShift;
  const float n = shifted - kRoundShift;
  const float r = (x - n * kLn2High) - n * kLn2Low;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t exponent = std::bit_cast<int32_t>(shifted) - std::bit_cast<int32_t>(kRoundShift);  // n, in [-126, 127]
  return p * std::bit_cast<float>(static_cast<int32_t>(static_cast<uint32_t>(exponent + 127) << 23));
}

inline void write_grad(float* dst, float value, GradWrite mode) {
  if (mode == GradWrite::kAccumulate) {
    *dst += value;
  } else {
    *dst = value;
  }
}

// Sums `columns` values per row over `rows` rows in row order, split by column chunks:
// out[c] (+)= sum_r value(r, c). `value(r, c0, c1, acc)` adds row r's columns [c0, c1)
// into acc[0 .. c1-c0).
template <class RowTerms>
void column_sums(Executor& executor, size_t rows, size_t columns, float* out, GradWrite mode, const RowTerms& row_terms) {
  executor.parallel_for(0, columns, kColumnsPerChunk, [&](size_t lo, size_t hi) {
    for (size_t c0 = lo; c0 < hi; c0 += kColumnsPerChunk) {
      const size_t c1 = std::min(hi, c0 + kColumnsPerChunk);
      float acc[kColumnsPerChunk] = {};
      for (size_t r = 0; r < rows; ++r) row_terms(r, c0, c1, acc);
      for (size_t c = c0; c < c1; ++c) write_grad(&out[c], acc[c - c0], mode);
    }
  });
}

}  // namespace strata::kernels::cpu::elements
