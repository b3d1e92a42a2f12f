#include "engine/core/dtype.h"

#include <string>

namespace strata {

std::string_view dtype_name(DType type) {
  switch (type) {
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
  }
  return "?";
}

StatusOr<DType> parse_dtype(std::string_view text) {
  if (text == "fp32" || text == "float32" || text == "float") return DType::kFloat32;
  if (text == "bf16" || text == "bfloat16") return DType::kBFloat16;
  if (text == "fp16" || text == "float16" || text == "half") return DType::kFloat16;
  return InvalidArgumentError("unknown dtype '" + std::string(text) + "': expected fp32, bf16 or fp16");
}

}  // namespace strata
