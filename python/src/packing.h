// Frozen groups stored in their own, narrower dtype.
//
// The engine stores every group's parameters in one dtype (EngineOptions::param_dtype). A
// frozen group needs no master copy, no gradient and no optimizer, so nothing forces its
// values into that dtype: a bf16 base model under fp32 LoRA adapters should take bf16's
// bytes in every tier, not fp32's. A PackedGroup is such a group: its 16-bit elements are
// packed two to an engine word (fp32), so the engine stores, fetches, gathers and writes to
// NVMe the packed words as it would any group, and the front end sees the group in its
// elements — its logical layout: every offset and count in elements of `dtype`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/partition.h"

namespace strata::python {

struct PackedGroup {
  DType dtype = DType::kBFloat16;  // the elements'
  size_t factor = 1;               // elements per engine word
  GroupLayout logical;             // the group in elements
};

// Elements of `element` per word of `word`: 2 for a 16-bit element in fp32 words; 1 when
// the element is as wide as the word or wider (such a group is stored in the engine's dtype).
size_t pack_factor(DType element, DType word);

// The engine words a tensor of `numel` packed elements takes.
inline int64_t packed_words(int64_t numel, size_t factor) {
  return (numel + static_cast<int64_t>(factor) - 1) / static_cast<int64_t>(factor);
}

// The logical layout of a group registered as packed words (`words`, each tensor one flat
// run of packed_words()), whose tensors have the element shapes `shapes`.
GroupLayout logical_layout(const GroupLayout& words, const std::vector<std::vector<int64_t>>& shapes, size_t factor);

// Elements as fp32 values <-> the packed words that hold them (elements.size() ==
// words.size() * factor). Packing rounds each value to the element dtype (exact for values
// that came from it).
void pack_elements(std::span<const float> elements, DType dtype, std::span<float> words);
void unpack_elements(std::span<const float> words, DType dtype, std::span<float> elements);

}  // namespace strata::python
