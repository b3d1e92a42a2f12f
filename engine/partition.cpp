#include "engine/partition.h"

#include <algorithm>
#include <set>

#include "engine/counter_rng.h"

namespace strata {
namespace {
size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }
}  // namespace

int GroupLayout::tensor_at(size_t element) const {
  // Tensors are sorted by offset.
  auto it = std::upper_bound(tensors.begin(), tensors.end(), element,
                             [](size_t e, const TensorLayout& t) { return e < t.offset; });
  if (it == tensors.begin()) return -1;
  --it;
  if (element >= it->offset + it->numel) return -1;
  return static_cast<int>(it - tensors.begin());
}

StatusOr<GroupLayout> layout_group(const GroupSpec& spec, int id, int world_size) {
  if (world_size < 1) return InvalidArgumentError("world size must be >= 1, got " + std::to_string(world_size));
  if (spec.tensors.empty()) return InvalidArgumentError("parameter group '" + spec.name + "' has no tensors");
  GroupLayout layout;
  layout.id = id;
  layout.name = spec.name;
  layout.world_size = world_size;
  layout.trainable = spec.trainable;
  std::set<std::string> names;
  size_t cursor = 0;
  for (const auto& tensor : spec.tensors) {
    if (!names.insert(tensor.name).second)
      return InvalidArgumentError("parameter group '" + spec.name + "' has two tensors named '" + tensor.name + "'");
    size_t numel = 1;
    for (int64_t dim : tensor.shape) {
      if (dim <= 0)
        return InvalidArgumentError("tensor '" + spec.name + "/" + tensor.name + "' has a non-positive dimension " + std::to_string(dim));
      numel *= static_cast<size_t>(dim);
    }
    if (tensor.shape.empty()) return InvalidArgumentError("tensor '" + spec.name + "/" + tensor.name + "' has no shape");
    cursor = round_up(cursor, kTensorAlignElements);
    layout.tensors.push_back({tensor.name, tensor.shape, tensor.init, tensor.weight_decay, cursor, numel});
    cursor += numel;
  }
  layout.numel = cursor;
  const size_t unit = kShardAlignElements * static_cast<size_t>(world_size);
  layout.padded_numel = round_up(cursor, unit);
  layout.shard_numel = layout.padded_numel / static_cast<size_t>(world_size);
  return layout;
}

void init_shard(const GroupLayout& layout, int rank, uint64_t seed, float* shard) {
  init_shard_range(layout, rank, seed, 0, {shard, layout.shard_numel});
}

void init_shard_range(const GroupLayout& layout, int rank, uint64_t seed, size_t first, std::span<float> out) {
  const size_t begin = layout.shard_begin(rank) + first;
  const size_t end = begin + out.size();
  float* shard = out.data();
  std::fill(out.begin(), out.end(), 0.0f);
  for (const auto& tensor : layout.tensors) {
    const size_t lo = std::max(begin, tensor.offset);
    size_t drawn = tensor.numel;
    if (tensor.init.rows > 0 && tensor.init.rows < tensor.shape[0])
      drawn = tensor.numel / static_cast<size_t>(tensor.shape[0]) * static_cast<size_t>(tensor.init.rows);
    const size_t hi = std::min(end, tensor.offset + drawn);
    for (size_t e = lo; e < hi; ++e) {
      float value = 0.0f;
      switch (tensor.init.kind) {
        case TensorInit::Kind::kNormal: value = tensor.init.scale * counter_normal(seed, static_cast<uint64_t>(layout.id), e); break;
        case TensorInit::Kind::kUniform:
          value = tensor.init.scale * (2.0f * counter_uniform(seed, static_cast<uint64_t>(layout.id), e) - 1.0f);
          break;
        case TensorInit::Kind::kConstant: value = tensor.init.value; break;
      }
      shard[e - begin] = value;
    }
  }
}

std::vector<DecayRun> decay_runs(const GroupLayout& layout, int rank) {
  const size_t begin = layout.shard_begin(rank);
  const size_t end = begin + layout.shard_numel;
  std::vector<DecayRun> runs;
  auto push = [&](size_t lo, size_t hi, bool decay) {
    if (lo >= hi) return;
    if (!runs.empty() && runs.back().decay == decay && runs.back().end == lo - begin) {
      runs.back().end = hi - begin;
    } else {
      runs.push_back({lo - begin, hi - begin, decay});
    }
  };
  size_t cursor = begin;
  for (const auto& tensor : layout.tensors) {
    const size_t lo = std::max(begin, tensor.offset);
    const size_t hi = std::min(end, tensor.offset + tensor.numel);
    if (lo >= hi) continue;
    push(cursor, lo, false);  // gap or padding before the tensor: never decayed (it is zero)
    push(lo, hi, tensor.weight_decay);
    cursor = hi;
  }
  push(cursor, end, false);
  return runs;
}

}  // namespace strata
