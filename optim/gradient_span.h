// The SIMD span layer of the gradient path: one function per instruction set that
// accumulates a contiguous span of a gradient shard into fp32 on the calling thread.
// The parallel driver (optim/gradient_ops.h) cuts a shard into chunks and hands each to
// the span function of the ISA chosen at run time.
//
// The element function is accumulate_element: a widening of bf16/fp16 to fp32 (exact:
// every bf16 and fp16 value is an fp32 value) and at most one IEEE fp32 add. Every path
// computes exactly that, so the AVX2 and AVX-512 spans are bit-identical to the scalar
// reference for any split of the span, NaN payloads aside.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "optim/adam_span.h"
#include "optim/cpu_isa.h"

namespace strata {

// What accumulating a source into an fp32 accumulator does.
enum class AccumulateMode : uint8_t {
  kAssign,  // accum = src (the first micro-batch)
  kAdd,     // accum += src (the micro-batches after it)
};

// The element function: the new accumulator value from the old one and the source value
// already widened to fp32.
inline float accumulate_element(float accum, float src, AccumulateMode mode) {
  return mode == AccumulateMode::kAssign ? src : accum + src;
}

// Accumulates `count` elements of `src` (of `src_type`) into `accum`. The arrays must not
// overlap.
using AccumulateSpanFn = void (*)(float* accum, const void* src, DType src_type, size_t count, AccumulateMode mode);

struct GradientSpanKernels {
  CpuIsa isa = CpuIsa::kScalar;
  AccumulateSpanFn accumulate = nullptr;
  // The sum of squares of the CPU Adam's span layer (the same function, so the same bits).
  GradSumOfSquaresSpanFn grad_sum_of_squares = nullptr;
};

// The span functions of `isa`; Unavailable (naming the missing feature) where this build
// or this CPU cannot run them.
StatusOr<GradientSpanKernels> gradient_span_kernels(CpuIsa isa);

namespace internal {
// The per-ISA entry points (optim/gradient_span_<isa>.cpp).
void accumulate_span_scalar(float* accum, const void* src, DType src_type, size_t count, AccumulateMode mode);
#if defined(STRATA_OPTIM_X86_KERNELS)
void accumulate_span_avx2(float* accum, const void* src, DType src_type, size_t count, AccumulateMode mode);
void accumulate_span_avx512(float* accum, const void* src, DType src_type, size_t count, AccumulateMode mode);
#endif
}  // namespace internal

}  // namespace strata
