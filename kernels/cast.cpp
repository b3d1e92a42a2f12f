// no-trapping-math before any include: kernels/cpu_elements.h's span functions need it
// (nothing here traps either way; the cast is integer work apart from fp16 subnormals).
#pragma GCC optimize("no-trapping-math")

#include "kernels/cast.h"

#include <cstring>

#include "kernels/cpu_elements.h"

namespace strata::kernels {

namespace {

// The element loop for one (source, destination) pair: with both dtypes known at compile
// time the per-element switches fold away (the same per-element conversion, so the same
// bits, as load_as_float / store_from_float).
template <DType Src, DType Dst>
[[gnu::always_inline]] inline void cast_typed(const void* src, void* dst, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) store_from_float(dst, Dst, i, load_as_float(src, Src, i));
}

// The bf16 pairs, which carry every gradient and parameter transfer, as span functions
// compiled per ISA (STRATA_SIMD_SPAN): their loops are branch-free and vectorize. Baseline
// x86-64 gets SSE2 only, half of AVX2's width and a quarter of AVX-512's: fp32 -> bf16 moved
// 4.4 GB/s there on one thread of an AVX-512 machine whose memcpy moves 25, and 9 with the
// AVX-512 clone (64 M elements, out of cache; 4 G elements/s at 4 M, in cache).
STRATA_SIMD_SPAN void fp32_to_bf16_span(const void* src, void* dst, size_t begin, size_t end) {
  cast_typed<DType::kFloat32, DType::kBFloat16>(src, dst, begin, end);
}

STRATA_SIMD_SPAN void bf16_to_fp32_span(const void* src, void* dst, size_t begin, size_t end) {
  cast_typed<DType::kBFloat16, DType::kFloat32>(src, dst, begin, end);
}

template <DType Src>
void cast_from(const void* src, void* dst, DType dst_type, size_t begin, size_t end) {
  switch (dst_type) {
    case DType::kFloat32:
      if constexpr (Src == DType::kBFloat16) {
        return bf16_to_fp32_span(src, dst, begin, end);
      } else {
        return cast_typed<Src, DType::kFloat32>(src, dst, begin, end);
      }
    case DType::kBFloat16:
      if constexpr (Src == DType::kFloat32) {
        return fp32_to_bf16_span(src, dst, begin, end);
      } else {
        return cast_typed<Src, DType::kBFloat16>(src, dst, begin, end);
      }
    case DType::kFloat16: return cast_typed<Src, DType::kFloat16>(src, dst, begin, end);
  }
}

}  // namespace

void cast_cpu_range(const void* src, DType src_type, void* dst, DType dst_type, size_t begin, size_t end) {
  if (src_type == dst_type) {
    const size_t width = dtype_size(src_type);
    std::memcpy(static_cast<char*>(dst) + begin * width, static_cast<const char*>(src) + begin * width, (end - begin) * width);
    return;
  }
  switch (src_type) {
    case DType::kFloat32: return cast_from<DType::kFloat32>(src, dst, dst_type, begin, end);
    case DType::kBFloat16: return cast_from<DType::kBFloat16>(src, dst, dst_type, begin, end);
    case DType::kFloat16: return cast_from<DType::kFloat16>(src, dst, dst_type, begin, end);
  }
}

Status cast(Stream& stream, const void* src, DType src_type, void* dst, DType dst_type, size_t count) {
  if (count == 0) return {};
  if (src == nullptr || dst == nullptr) return InvalidArgumentError("cast: null buffer");
  return stream.launch([=](const LaunchContext& ctx) -> Status {
    if (ctx.native_stream != nullptr) {
#if defined(STRATA_HAVE_CUDA)
      return cast_cuda(ctx.native_stream, src, src_type, dst, dst_type, count);
#else
      return InternalError("cast: a native stream in a build without CUDA");
#endif
    }
    constexpr size_t kGrain = size_t{1} << 16;
    ctx.executor->parallel_for(0, count, kGrain, [&](size_t lo, size_t hi) { cast_cpu_range(src, src_type, dst, dst_type, lo, hi); });
    return {};
  });
}

}  // namespace strata::kernels
