#include "python/src/packing.h"

namespace strata::python {

size_t pack_factor(DType element, DType word) {
  const size_t e = dtype_size(element), w = dtype_size(word);
  return e < w ? w / e : 1;
}

GroupLayout logical_layout(const GroupLayout& words, const std::vector<std::vector<int64_t>>& shapes, size_t factor) {
  GroupLayout logical = words;
  logical.numel = 0;
  for (size_t t = 0; t < logical.tensors.size(); ++t) {
    TensorLayout& tensor = logical.tensors[t];
    tensor.shape = shapes[t];
    tensor.numel = 1;
    for (const int64_t d : tensor.shape) tensor.numel *= static_cast<size_t>(d);
    tensor.offset = words.tensors[t].offset * factor;
    logical.numel = tensor.offset + tensor.numel;
  }
  logical.padded_numel = words.padded_numel * factor;
  logical.shard_numel = words.shard_numel * factor;
  return logical;
}

void pack_elements(std::span<const float> elements, DType dtype, std::span<float> words) {
  for (size_t e = 0; e < elements.size(); ++e) store_from_float(words.data(), dtype, e, elements[e]);
}

void unpack_elements(std::span<const float> words, DType dtype, std::span<float> elements) {
  for (size_t e = 0; e < elements.size(); ++e) elements[e] = load_as_float(words.data(), dtype, e);
}

}  // namespace strata::python
