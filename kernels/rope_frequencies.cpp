// rope_inverse_frequencies (kernels/rope.h): host code, in float32 step by step in
// the order transformers evaluates its tensors, so the result matches Hugging Face's
// inv_freq to within an ulp or two. Compiled without floating-point contraction: each
// operation is rounded on its own, as torch's element-wise kernels round it.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <cmath>
#include <numbers>
#include <string>

#include "kernels/rope.h"

namespace strata::kernels {
namespace {

Status check_rope_arguments(size_t head_dim, double theta, const RopeScaling& scaling) {
  const std::string op = "rope_inverse_frequencies: ";
  if (head_dim == 0 || head_dim % 2 != 0) {
    return InvalidArgumentError(op + "head_dim must be even and positive, got " + std::to_string(head_dim));
  }
  if (!(theta > 0.0) || !std::isfinite(theta)) {
    return InvalidArgumentError(op + "rope_theta must be positive and finite, got " + std::to_string(theta));
  }
  if (scaling.kind == RopeScaling::Kind::kNone) return {};
  if (!(scaling.factor > 0.0) || !std::isfinite(scaling.factor)) {
    return InvalidArgumentError(op + "rope_scaling.factor must be positive and finite, got " + std::to_string(scaling.factor));
  }
  if (scaling.kind == RopeScaling::Kind::kLlama3) {
    if (!(scaling.low_freq_factor > 0.0) || !(scaling.high_freq_factor > scaling.low_freq_factor)) {
      return InvalidArgumentError(op + "llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor, got " +
                                  std::to_string(scaling.low_freq_factor) + " and " +
                                  std::to_string(scaling.high_freq_factor));
    }
    if (scaling.original_max_position_embeddings <= 0) {
      return InvalidArgumentError(op + "llama3 rope_scaling needs original_max_position_embeddings > 0, got " +
                                  std::to_string(scaling.original_max_position_embeddings));
    }
  }
  return {};
}

// _compute_llama3_parameters for one frequency. Python scalars meet float32 tensors
// here, so torch rounds each scalar to float32 and divides a scalar by a tensor as
// reciprocal-then-multiply (Tensor.__rtruediv__).
float llama3_inverse_frequency(float inv_freq, const RopeScaling& scaling) {
  const float factor = static_cast<float>(scaling.factor);
  const float low = static_cast<float>(scaling.low_freq_factor);
  const float high = static_cast<float>(scaling.high_freq_factor);
  const double old_context = static_cast<double>(scaling.original_max_position_embeddings);
  const float low_freq_wavelen = static_cast<float>(old_context / scaling.low_freq_factor);
  const float high_freq_wavelen = static_cast<float>(old_context / scaling.high_freq_factor);

  const float wavelen = (1.0f / inv_freq) * static_cast<float>(2.0 * std::numbers::pi);
  if (wavelen < high_freq_wavelen) return inv_freq;           // high frequencies: unchanged
  if (wavelen > low_freq_wavelen) return inv_freq / factor;   // low frequencies: interpolated by factor
  const float smooth = ((1.0f / wavelen) * static_cast<float>(old_context) - low) / (high - low);
  return (1.0f - smooth) * inv_freq / factor + smooth * inv_freq;
}

}  // namespace

StatusOr<std::vector<float>> rope_inverse_frequencies(size_t head_dim, double theta, const RopeScaling& scaling) {
  STRATA_RETURN_IF_ERROR(check_rope_arguments(head_dim, theta, scaling));
  std::vector<float> inv_freq(head_dim / 2);
  // _compute_default_rope_parameters: 1 / theta ** (arange(0, dim, 2).float() / dim), in float32.
  const float base = static_cast<float>(theta);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv_freq[i] = 1.0f / std::pow(base, exponent);
  }
  switch (scaling.kind) {
    case RopeScaling::Kind::kNone:
      break;
    case RopeScaling::Kind::kLinear:  // _compute_linear_scaling_rope_parameters
      for (float& f : inv_freq) f /= static_cast<float>(scaling.factor);
      break;
    case RopeScaling::Kind::kLlama3:
      for (float& f : inv_freq) f = llama3_inverse_frequency(f, scaling);
      break;
  }
  return inv_freq;
}

}  // namespace strata::kernels
