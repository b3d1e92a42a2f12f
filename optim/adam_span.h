// The SIMD span layer of the CPU Adam: one function per instruction set that updates a
// contiguous span of one shard on the calling thread, and one that sums the squares of
// a gradient span. The parallel driver (optim/cpu_adam.h) cuts a shard into chunks and
// hands each to the span function of the ISA chosen at run time.
//
// Every path computes kernels::adam_update_element (kernels/adam.h) with separately
// rounded IEEE operations, so the AVX2 and AVX-512 spans are bit-identical to the
// scalar reference (kernels::adam_step_cpu_range), NaN payloads aside.
#pragma once

#include <cstddef>

#include "engine/core/dtype.h"
#include "kernels/adam.h"
#include "optim/cpu_isa.h"

namespace strata {

// How a span writes an array back.
enum class StoreKind : uint8_t {
  kCached,     // ordinary stores
  kStreaming,  // non-temporal stores, where the address is aligned for them: no read for
               // ownership and no cache pollution for data nobody on this core reads again soon
};

struct AdamSpanStores {
  StoreKind param = StoreKind::kStreaming;  // the compute-dtype copy: write-only here, read next by a DMA
  StoreKind state = StoreKind::kCached;     // master and moments: read just before, in cache already
};

// Updates every element of `span` (pointers at the span's first element, count its length).
using AdamStepSpanFn = void (*)(const kernels::AdamBuffers& span, const kernels::AdamStepScalars& scalars,
                                const AdamSpanStores& stores);
// Sum over the span of (double)g * g, g the gradient values as stored (loss-scaled). The
// order of additions is fixed by the ISA and `count` alone. Inf or NaN values make it
// non-finite.
using GradSumOfSquaresSpanFn = double (*)(const void* grad, DType grad_type, size_t count);

struct AdamSpanKernels {
  CpuIsa isa = CpuIsa::kScalar;
  bool native_bf16 = false;  // AVX512-BF16 conversions in use
  AdamStepSpanFn step = nullptr;
  GradSumOfSquaresSpanFn grad_sum_of_squares = nullptr;
};

struct AdamSpanKernelOptions {
  // Use VCVTNEPS2BF16 for fp32 -> bf16 where the CPU has AVX512-BF16 (same bits as the
  // integer rounding; off only to test or compare the integer path).
  bool use_avx512_bf16 = true;
};

// The span functions of `isa`; Unavailable (naming the missing feature) where this build
// or this CPU cannot run them.
StatusOr<AdamSpanKernels> adam_span_kernels(CpuIsa isa, const AdamSpanKernelOptions& options = {});

// `buffers` narrowed to elements [begin, end).
kernels::AdamBuffers adam_buffers_slice(const kernels::AdamBuffers& buffers, size_t begin, size_t end);

namespace internal {
// The per-ISA entry points (optim/adam_span_<isa>.cpp).
void adam_step_span_scalar(const kernels::AdamBuffers& span, const kernels::AdamStepScalars& scalars, const AdamSpanStores& stores);
double grad_sum_of_squares_scalar(const void* grad, DType grad_type, size_t count);
#if defined(STRATA_OPTIM_X86_KERNELS)
void adam_step_span_avx2(const kernels::AdamBuffers& span, const kernels::AdamStepScalars& scalars, const AdamSpanStores& stores);
double grad_sum_of_squares_avx2(const void* grad, DType grad_type, size_t count);
void adam_step_span_avx512(const kernels::AdamBuffers& span, const kernels::AdamStepScalars& scalars, const AdamSpanStores& stores);
void adam_step_span_avx512_bf16(const kernels::AdamBuffers& span, const kernels::AdamStepScalars& scalars, const AdamSpanStores& stores);
double grad_sum_of_squares_avx512(const void* grad, DType grad_type, size_t count);
#endif
}  // namespace internal

}  // namespace strata
