// Partitioning: how a parameter group is flattened, padded and split across ranks.
//
// A group's tensors are laid end to end in registration order, each starting at a
// multiple of kTensorAlignElements (so every tensor of a gathered group is aligned for
// vector loads), and the whole is padded to world_size x shard alignment. Rank r owns
// the contiguous shard [r * shard_numel, (r + 1) * shard_numel). Tensor offsets do not
// depend on the world size; only the tail padding does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "engine/core/status.h"

namespace strata {

// How a tensor's initial values are drawn.
struct TensorInit {
  enum class Kind : uint8_t { kNormal, kUniform, kConstant };
  Kind kind = Kind::kNormal;
  float scale = 0.02f;  // kNormal: standard deviation; kUniform: values in [-scale, scale)
  float value = 0.0f;   // kConstant: the value (zeros for biases, ones for LayerNorm gains)
  // Rows (dimension 0) drawn from the above; the rows after them are zero (a vocabulary
  // padded to a multiple of 128: its padding rows start and stay zero). 0 = every row.
  int64_t rows = 0;

  TensorInit with_rows(int64_t drawn_rows) const {
    TensorInit init = *this;
    init.rows = drawn_rows;
    return init;
  }

  static TensorInit normal(float std) { return {Kind::kNormal, std, 0.0f, 0}; }
  static TensorInit uniform(float bound) { return {Kind::kUniform, bound, 0.0f, 0}; }
  static TensorInit constant(float value) { return {Kind::kConstant, 0.0f, value, 0}; }
  static TensorInit zeros() { return constant(0.0f); }
  static TensorInit ones() { return constant(1.0f); }
};

struct TensorSpec {
  std::string name;            // unique within the group, e.g. "attn.c_attn.weight"
  std::vector<int64_t> shape;  // row-major
  TensorInit init;
  // When false the tensor is excluded from weight decay (biases, LayerNorm gains).
  bool weight_decay = true;
};

struct GroupSpec {
  std::string name;  // e.g. "h.3" or "wte"
  std::vector<TensorSpec> tensors;
  // false: a frozen group (PEFT base weights): parameters only, never updated; no
  // gradients, master weights or optimizer moments anywhere.
  bool trainable = true;
};

// Tensors start at multiples of this many elements within a group.
inline constexpr size_t kTensorAlignElements = 64;
// Shards are multiples of this many elements: 4 KiB of bf16, what O_DIRECT needs.
inline constexpr size_t kShardAlignElements = 2048;

struct TensorLayout {
  std::string name;
  std::vector<int64_t> shape;
  TensorInit init;
  bool weight_decay = true;
  size_t offset = 0;  // first element within the flat group
  size_t numel = 0;
};

struct GroupLayout {
  int id = 0;
  std::string name;
  std::vector<TensorLayout> tensors;
  size_t numel = 0;         // end of the last tensor (before tail padding)
  size_t padded_numel = 0;  // world_size * shard_numel
  size_t shard_numel = 0;   // elements each rank owns
  int world_size = 1;
  bool trainable = true;    // GroupSpec::trainable

  size_t shard_begin(int rank) const { return static_cast<size_t>(rank) * shard_numel; }
  // Index of the tensor that holds flat element `element`, or -1 for padding.
  int tensor_at(size_t element) const;
};

// Lays out `spec` as group `id` for `world_size` ranks. Errors name the group and tensor
// for an empty group, a duplicate name or a non-positive dimension.
StatusOr<GroupLayout> layout_group(const GroupSpec& spec, int id, int world_size);

// Writes rank `rank`'s shard of the group's initial fp32 values into `shard`
// (shard_numel elements): element e of the group gets the value its tensor's init draws
// for (seed, group id, e); padding, gaps and a tensor's rows past TensorInit::rows are zero.
void init_shard(const GroupLayout& layout, int rank, uint64_t seed, float* shard);
// Elements [first, first + out.size()) of that shard: the values init_shard writes there.
void init_shard_range(const GroupLayout& layout, int rank, uint64_t seed, size_t first, std::span<float> out);

// Writes the weight-decay mask of rank `rank`'s shard: 1 where the element belongs to a
// tensor with weight_decay, 0 elsewhere (including padding). Used to split a shard into
// decayed and non-decayed runs.
struct DecayRun {
  size_t begin;   // within the shard
  size_t end;
  bool decay;
};
std::vector<DecayRun> decay_runs(const GroupLayout& layout, int rank);

}  // namespace strata
