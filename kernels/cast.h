// Casts between fp32 and the 16-bit compute types, on any device.
//
// One host-callable entry point per op: it enqueues the CUDA kernel on a CudaDevice
// stream, or runs the CPU twin (fanned out through the device's executor) in stream
// order on a CpuDevice. The scalar conversions of engine/core/dtype.h are the reference.
#pragma once

#include <cstddef>

#include "engine/core/device.h"
#include "engine/core/dtype.h"

namespace strata::kernels {

// dst[i] = convert(src[i]) for i < count; src and dst are device memory of `stream`'s device.
Status cast(Stream& stream, const void* src, DType src_type, void* dst, DType dst_type, size_t count);

// The CPU twin, run on the calling thread for [begin, end). Exposed for tests and for
// callers that already are on a CPU worker.
void cast_cpu_range(const void* src, DType src_type, void* dst, DType dst_type, size_t begin, size_t end);

#if defined(STRATA_HAVE_CUDA)
// The CUDA kernel launcher (kernels/cast.cu); `cuda_stream` is a cudaStream_t.
Status cast_cuda(void* cuda_stream, const void* src, DType src_type, void* dst, DType dst_type, size_t count);
#endif

}  // namespace strata::kernels
