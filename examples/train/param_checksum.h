// The run's parameter checksum (the summary's param_checksum): one value for the fp32 master
// weights that does not depend on the world size, so runs can be compared bit for bit.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "engine/engine.h"

namespace strata::train {

// A 64-bit checksum of every fp32 master weight: the sum over groups g and unpadded
// elements i of mix(g, i, bits of the value), so each rank can add up its own shards in
// any order and the total is the same for every world size and bit-identical weights
// give the same value. `shard` is rank `rank`'s master shard of `layout`, or the elements
// from `first` on of it (the parts of a shard add up to the shard's part).
uint64_t master_checksum_part(const GroupLayout& layout, int rank, std::span<const float> shard, size_t first = 0);
std::string checksum_hex(uint64_t checksum);  // 16 lowercase hex digits

}  // namespace strata::train
