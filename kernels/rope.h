// Rotary position embeddings, forward and backward, on any device, and their inverse
// frequencies (config.json's rope_theta and rope_scaling).
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

// Rotary position embedding in Hugging Face's rotate_half convention (each head's first
// half rotates against its second half, NOT interleaved pairs). For i < head_dim / 2,
// with angle = positions[row] * inv_freq[i] and cos, sin evaluated in fp32:
//   y[i]                = x[i] * cos - x[i + head_dim/2] * sin
//   y[i + head_dim / 2] = x[i + head_dim/2] * cos + x[i] * sin
// x, y: [rows, heads * head_dim], row r starting at r * row_stride elements (row_stride
// >= heads * head_dim, or 0 for dense), so q or k can be rotated inside a fused buffer;
// the other elements of a row are not touched. y may alias x. positions: int32 [rows]
// (device memory), the position id of each row (token), so packed sequences restart at 0.
// inv_freq: fp32 [head_dim / 2] (device memory), from rope_inverse_frequencies().
// head_dim must be even.
struct RopeShape {
  size_t rows = 0;        // batch * seq_len
  size_t heads = 0;       // heads rotated per row (num_attention_heads for q, num_key_value_heads for k)
  size_t head_dim = 0;    // even
  size_t row_stride = 0;  // elements from one row to the next; 0 = heads * head_dim
};
Status rope_forward(Stream& stream, const RopeShape& shape, DType dtype, const int32_t* positions, const float* inv_freq,
                    const void* x, void* y);
// The inverse rotation (the transpose): dx (+)= R(-angle) dy per input_grad. dx may
// alias dy when input_grad is kOverwrite. Needs only the positions.
Status rope_backward(Stream& stream, const RopeShape& shape, DType dtype, const int32_t* positions, const float* inv_freq,
                     const void* dy, void* dx, GradWrite input_grad);

// How config.json's rope_scaling changes the inverse frequencies.
struct RopeScaling {
  enum class Kind : uint8_t {
    kNone,    // no rope_scaling, or rope_type "default"
    kLinear,  // rope_type "linear": every inverse frequency divided by factor
    kLlama3,  // rope_type "llama3" (Llama 3.1 / 3.2): wavelength-dependent, see below
  };
  Kind kind = Kind::kNone;
  double factor = 1.0;                               // linear and llama3
  double low_freq_factor = 1.0;                      // llama3
  double high_freq_factor = 4.0;                     // llama3
  int64_t original_max_position_embeddings = 8192;   // llama3
};
// Host: the head_dim / 2 inverse frequencies transformers (4.44, modeling_rope_utils)
// computes: 1 / theta^(2i / head_dim); kLinear divides them by factor; kLlama3 as
// _compute_llama3_parameters: wavelengths longer than original / low_freq_factor are
// divided by factor, shorter than original / high_freq_factor kept, and those between
// blended smoothly. Computed as transformers does (float32 powers, then the llama3
// blend in float32), so the result matches its tensor to within an ulp or two.
// InvalidArgument for an odd or zero head_dim, theta <= 0, factor <= 0 or (llama3)
// high_freq_factor <= low_freq_factor.
StatusOr<std::vector<float>> rope_inverse_frequencies(size_t head_dim, double theta, const RopeScaling& scaling);

}  // namespace strata::kernels
