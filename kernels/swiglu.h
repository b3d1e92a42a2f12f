// SwiGLU, the gated MLP's activation, forward and backward, on any device.
//
// Same conventions as kernels/transformer_ops.h (read its header comment): one host entry
// point per direction; CUDA kernels enqueued at once on a CudaDevice, the CPU twin run in
// stream order on a CpuDevice; `dtype` fp32 everywhere, bf16 too on a CudaDevice;
// parameter gradients and saved statistics fp32; GradWrite / GradOptions; bad arguments
// reported at once, before anything is enqueued; bit-identical results run to run and, on
// the CPU, whatever the thread count. Scalar references: kernels/reference.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "kernels/transformer_ops.h"

namespace strata::kernels {

// SwiGLU, the Llama MLP's gate: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
// gate, up, out: count elements each (dense). out may alias gate or up.
Status swiglu_forward(Stream& stream, DType dtype, const void* gate, const void* up, void* out, size_t count);
// Needs gate and up. dgate = dout * up * silu'(gate), dup = dout * silu(gate), each
// (+)= per input_grad; either may be null (not wanted). Neither may alias gate, up, dout
// or the other (InvalidArgument).
Status swiglu_backward(Stream& stream, DType dtype, const void* dout, const void* gate, const void* up, void* dgate,
                       void* dup, size_t count, GradWrite input_grad);

}  // namespace strata::kernels
