// The reductions of communicator.h on the CPU, shared by every communicator that reduces
// with the host (HostCommunicator for thread ranks, GlooCommunicator for process ranks),
// so that both give the same bits: each output element is the fp32 sum (or max) of the
// ranks' contributions in rank order, divided by N for mean, rounded once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include "engine/core/communicator.h"
#include "engine/core/dtype.h"
#include "engine/core/executor.h"

namespace strata {

// out[i] = reduce over r of w(inputs[r][i]), for i < count, in rank order in fp32, then
// rounded once to `out_dtype`. inputs[r] holds `input_dtype` elements: either the data
// itself (fp32 data whose wire is 16-bit is rounded to `wire` as it is loaded) or the
// contributions as they arrived on the wire (16-bit, loaded exactly). Fans out through
// `executor` (nullptr = serial); the chunking does not change the bits.
void reduce_in_rank_order(std::span<const std::byte* const> inputs, size_t count, DType input_dtype, DType wire,
                          ReduceOp op, DType out_dtype, std::byte* out, Executor* executor);

// dst[i] = src[i] rounded to nearest even in `wire` (kBFloat16 or kFloat16): fp32 data as
// it travels when the wire is 16-bit.
void cast_to_wire(const float* src, uint16_t* dst, size_t count, DType wire, Executor* executor);

// The all_reduce elements rank `rank` of `world_size` reduces, [begin, end):
// ceil(count / N) per rank, the last ones shorter or empty.
std::pair<size_t, size_t> all_reduce_slice(size_t count, int world_size, int rank);

}  // namespace strata
