#include "engine/checkpoint.h"

#include <cstring>
#include <utility>

#include "engine/checkpoint_format.h"

namespace strata {

using namespace checkpoint_format;

StatusOr<RankSnapshot> RankSnapshot::allocate(std::vector<GroupLayout> layouts, int rank, int64_t engine_steps,
                                               StaleParameters stale) {
  if (layouts.empty()) return InvalidArgumentError("checkpoint snapshot: no groups");
  const int kinds = stale == StaleParameters::kPresent ? kStaleKinds : kCheckpointStateKinds;
  const int world_size = layouts.front().world_size;
  if (rank < 0 || rank >= world_size) {
    return InvalidArgumentError("checkpoint snapshot: rank " + std::to_string(rank) + " is outside world size " +
                                std::to_string(world_size));
  }
  RankSnapshot snapshot;
  for (size_t g = 0; g < layouts.size(); ++g) {
    const GroupLayout& layout = layouts[g];
    if (layout.id != static_cast<int>(g)) {
      return InvalidArgumentError("checkpoint snapshot: group '" + layout.name + "' has id " + std::to_string(layout.id) +
                                  " at index " + std::to_string(g) + " (groups must be in id order)");
    }
    if (layout.world_size != world_size) {
      return InvalidArgumentError("checkpoint snapshot: group '" + layout.name + "' is laid out for " +
                                  std::to_string(layout.world_size) + " ranks, group 0 for " + std::to_string(world_size));
    }
    if (layout.shard_numel == 0 || (layout.shard_numel * sizeof(float)) % kDirectIoAlignment != 0) {
      return InvalidArgumentError("checkpoint snapshot: group '" + layout.name + "' has shard_numel " +
                                  std::to_string(layout.shard_numel) + ", not a positive multiple of 1024 elements");
    }
    if (!layout.trainable) {  // a frozen group has no state to save
      snapshot.blocks_.emplace_back();
      continue;
    }
    const size_t bytes = static_cast<size_t>(kinds) * layout.shard_numel * sizeof(float);
    StatusOr<AlignedBuffer> block = AlignedBuffer::allocate(bytes, kDirectIoAlignment);
    if (!block.ok()) {
      return std::move(block).status().with_context("checkpoint snapshot: cannot allocate " + std::to_string(bytes) +
                                                    " bytes for group '" + layout.name + "'");
    }
    std::memset(block->data(), 0, bytes);
    snapshot.blocks_.push_back(std::move(block).value());
  }
  snapshot.layouts_ = std::move(layouts);
  snapshot.kinds_ = kinds;
  snapshot.rank_ = rank;
  snapshot.engine_steps_ = engine_steps;
  return snapshot;
}

std::span<float> RankSnapshot::shard(int group, CheckpointStateKind kind) {
  if (static_cast<int>(kind) >= kinds_ || !layouts_[static_cast<size_t>(group)].trainable) return {};
  const size_t shard = layouts_[static_cast<size_t>(group)].shard_numel;
  return {blocks_[static_cast<size_t>(group)].as<float>() + static_cast<size_t>(kind) * shard, shard};
}

std::span<const float> RankSnapshot::shard(int group, CheckpointStateKind kind) const {
  if (static_cast<int>(kind) >= kinds_ || !layouts_[static_cast<size_t>(group)].trainable) return {};
  const size_t shard = layouts_[static_cast<size_t>(group)].shard_numel;
  return {blocks_[static_cast<size_t>(group)].as<float>() + static_cast<size_t>(kind) * shard, shard};
}

std::span<const float> RankSnapshot::group_block(int group) const {
  if (!layouts_[static_cast<size_t>(group)].trainable) return {};
  const size_t shard = layouts_[static_cast<size_t>(group)].shard_numel;
  return {blocks_[static_cast<size_t>(group)].as<float>(), static_cast<size_t>(kinds_) * shard};
}

size_t RankSnapshot::bytes() const {
  size_t total = 0;
  for (const GroupLayout& layout : layouts_)
    if (layout.trainable) total += static_cast<size_t>(kinds_) * layout.shard_numel * sizeof(float);
  return total;
}

}  // namespace strata
